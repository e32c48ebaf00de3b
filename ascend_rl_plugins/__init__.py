"""ascend-rl-plugins: Atlas A3 RL optimizations for stock vLLM(-Ascend), verl, Megatron
and MindSpeed, delivered as runtime patches instead of source diffs.

``import ascend_rl_plugins`` activates the same patch set as the vLLM / verl entry points
(unless ``ASCEND_RL_AUTOLOAD=0``). Importing it never imports torch, vLLM or verl.
"""

from __future__ import annotations

import os as _os
import sys as _sys

__version__ = "0.1.0"

from .plugin import activate, activate_or_exit, status  # noqa: E402


def _invoked_as_cli() -> bool:
    """Is this interpreter running the ``ascend-rl`` command (console script, or
    ``python -m ascend_rl_plugins``)? Its commands inspect patches and never apply them.

    Decided from how the interpreter was started, never from an environment variable
    (which would leak into child processes and silently turn activation off there)."""
    prog = _os.path.basename(_sys.argv[0]) if _sys.argv and _sys.argv[0] else ""
    if prog in ("ascend-rl", "ascend-rl.exe"):
        return True
    argv = list(getattr(_sys, "orig_argv", ()))
    return any(a == "-m" and b in ("ascend_rl_plugins", "ascend_rl_plugins.cli")
               for a, b in zip(argv, argv[1:])) or "-mascend_rl_plugins" in argv


if _os.environ.get("ASCEND_RL_AUTOLOAD", "1").strip().lower() not in ("0", "false", "no", "off") \
        and not _invoked_as_cli():
    # a bad flag stops the process with one message: this import is also what vLLM's and
    # verl's loaders run first, and they would swallow an exception (see activate_or_exit)
    activate_or_exit("import ascend_rl_plugins")

__all__ = ["activate", "status", "__version__"]
