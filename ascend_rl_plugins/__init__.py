"""ascend-rl-plugins: Atlas A3 RL optimizations for stock vLLM(-Ascend), verl, Megatron
and MindSpeed, delivered as runtime patches instead of source diffs.

``import ascend_rl_plugins`` activates the same patch set as the vLLM / verl entry points
(unless ``ASCEND_RL_AUTOLOAD=0``). Importing it never imports torch, vLLM or verl.
"""

from __future__ import annotations

import os as _os
import sys as _sys

__version__ = "0.1.0"

from .plugin import activate, status  # noqa: E402


def _invoked_as_cli() -> bool:
    prog = _os.path.basename(_sys.argv[0]) if _sys.argv and _sys.argv[0] else ""
    return prog in ("ascend-rl", "ascend-rl.exe") or _os.environ.get("_ASCEND_RL_CLI") == "1"


if _os.environ.get("ASCEND_RL_AUTOLOAD", "1").strip().lower() not in ("0", "false", "no", "off") \
        and not _invoked_as_cli():
    activate("import ascend_rl_plugins")

__all__ = ["activate", "status", "__version__"]
