"""``ascend-rl doctor --import``: run in a fresh interpreter of the stack being checked.

Activates every enabled patch, imports the module of each one still waiting for its
import, and prints every patch's outcome as JSON behind a marker line, so doctor can show
what really happens in a process of that stack, not only what reading the source predicts.
"""

from __future__ import annotations

import importlib
import json

MARK = "@@ASCEND_RL_STATUS@@"


def main() -> None:
    import ascend_rl_plugins as arp
    from ascend_rl_plugins.patching.core import REGISTRY

    arp.activate("doctor --import")
    errors = {}
    for p in REGISTRY.patches.values():
        if p.outcome.state == "pending":
            try:
                importlib.import_module(p.module)
            except BaseException as exc:  # report it: this is what the user needs to know
                errors[p.name] = f"import of {p.module} failed: {type(exc).__name__}: {str(exc)[:200]}"
    out = []
    for s in arp.status():
        if s["state"] == "pending" and s["patch"] in errors:
            s["reason"] = errors[s["patch"]]
        out.append(s)
    print(MARK + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
