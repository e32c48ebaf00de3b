"""Child-process scenario of ``tests/test_verl_entry.py``: a real ``import verl`` in a fresh
interpreter, and what it did to ascend-rl.

Run through ``tests.support.child.run_scenario`` (never imported by the pytest process).
The environment chooses verl's mechanism (``VERL_USE_EXTERNAL_MODULES``,
``VERL_USE_EXTERNAL_PLUGINS``) and the ascend-rl flags; the scenario only unsets
``ASCEND_RL_AUTOLOAD`` (tests/conftest.py sets it to 0 for the pytest process), so the
child sees the environment of a user who never heard of that variable.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback


class _ImportWitness:
    """A meta-path finder that finds nothing and records who imports ``ascend_rl_plugins``
    first: the stack of that import statement (verl's loader, if verl loaded us)."""

    def __init__(self) -> None:
        self.stack: list[tuple[str, str]] | None = None

    def find_spec(self, fullname, path=None, target=None):  # noqa: ARG002 - finder protocol
        if fullname == "ascend_rl_plugins" and self.stack is None:
            self.stack = [(_tail(f.filename), f.name) for f in traceback.extract_stack()]
        return None


def _tail(filename: str) -> str:
    """``.../site-packages/verl/utils/import_utils.py`` -> ``verl/utils/import_utils.py``."""
    parts = filename.replace(os.sep, "/").split("/")
    for anchor in ("verl", "importlib"):
        if anchor in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor):])
    return parts[-1]


def import_verl(target_module: str | None, patch: str | None) -> dict:
    """``import verl``; then, when ascend-rl was activated, import ``target_module`` and
    report the state of ``patch`` (a patch on that module enabled by the environment)."""
    os.environ.pop("ASCEND_RL_AUTOLOAD", None)
    assert "ascend_rl_plugins" not in sys.modules and "verl" not in sys.modules
    witness = _ImportWitness()
    sys.meta_path.insert(0, witness)
    import verl
    sys.meta_path.remove(witness)
    result = {
        "verl": verl.__version__,
        "imported_by_import_verl": "ascend_rl_plugins" in sys.modules,
        "importer": [frame for frame in (witness.stack or [])
                     if frame[0].startswith(("verl/", "importlib/"))],
    }
    if not result["imported_by_import_verl"]:
        return result
    import ascend_rl_plugins
    result["activated_by"] = ascend_rl_plugins.plugin.activated_by()
    if target_module and patch:
        module = importlib.import_module(target_module)  # the post-import hook patches it now
        entry = next(s for s in ascend_rl_plugins.status() if s["patch"] == patch)
        assert entry["target"].split(":", 1)[0] == target_module, entry
        owner, _, attr = entry["target"].split(":", 1)[1].rpartition(".")
        result["patch_state"] = entry["state"]
        result["target_wrapped"] = hasattr(getattr(getattr(module, owner) if owner else module, attr),
                                           "__wrapped__")
    return result
