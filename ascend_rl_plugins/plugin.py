"""Entry points: vLLM general plugin, verl plugin, and ``import ascend_rl_plugins``.

vLLM loads general plugins in process 0, in the engine core and in every worker, and may
call them more than once per process; verl imports external modules in every Ray worker.
All of them end here, and activation happens once per process. Nothing heavy is imported:
patches on modules that are not imported yet wait for their import.
"""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import sys
import threading

from . import flags
from .patching.core import REGISTRY

log = logging.getLogger("ascend_rl_plugins")
_lock = threading.Lock()
_activated_by: list[str] = []


def load_features() -> list[str]:
    """Import every module of ``ascend_rl_plugins.features`` (each declares its patches)."""
    from . import features
    names = []
    for info in sorted(pkgutil.iter_modules(features.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        importlib.import_module(f"{features.__name__}.{info.name}")
        names.append(info.name)
    return names


def _configure_logging() -> None:
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(flags.LOG_LEVEL.value.upper())


def activate(origin: str = "api") -> None:
    """Declare all features, validate every flag, and apply (or arm) enabled patches.

    Raises :class:`ascend_rl_plugins.flags.FlagError` when a flag is invalid, or when an
    unknown ``ASCEND_RL_*`` variable misspells a flag (``ASCEND_RL_SAMM``), or when an
    ``ASCEND_RL_DISABLE`` item names no patch or feature (``gc-off``): at plugin load, never
    later inside a step. The entry points turn it into :func:`exit_on_bad_flags`.
    """
    with _lock:
        _activated_by.append(origin)
        if len(_activated_by) > 1:
            return
        try:
            load_features()  # features declare their flags: validate all of them at once
            flags.validate_all(misspellings=True)
            _configure_logging()
            misspelled = flags.near_misses()
            for name in flags.unknown_variables():
                if name not in misspelled:
                    log.warning("ascend-rl: %s", flags.unknown_message(name))
            REGISTRY.activate()
        except BaseException:
            _activated_by.clear()
            raise
        log.debug("ascend-rl: activated by %s in pid %d", origin, os.getpid())


def activated_by() -> list[str]:
    return list(_activated_by)


def activate_or_exit(origin: str) -> None:
    """:func:`activate` for the entry points: a bad flag stops this process.

    vLLM's general-plugin loader and verl 0.9's ``verl.plugins`` loader both catch
    ``Exception`` from a plugin, log it and run on *without* the plugin, so a FlagError
    would turn every feature off for a multi-hour job while the log scrolls past.
    ``SystemExit`` is a ``BaseException``, which neither catches."""
    try:
        activate(origin)
    except flags.FlagError as exc:
        exit_on_bad_flags(exc)


def exit_on_bad_flags(exc: flags.FlagError) -> None:
    """Print ``exc`` once to stderr and stop the process with exit status 2.

    No traceback: the message names the variable, the value and what is accepted, which is
    all a user can act on; ``ASCEND_RL_LOG_LEVEL=debug`` adds the traceback. The level is
    read raw, because that flag itself may be the bad one."""
    if os.environ.get(flags.LOG_LEVEL.name, "").strip().lower() == "debug":
        import traceback
        traceback.print_exception(exc, file=sys.stderr)
    print(f"ascend-rl: {exc}\nascend-rl: stopping this process (pid {os.getpid()}); fix the "
          f"variable(s) above, or see `ascend-rl env`.", file=sys.stderr, flush=True)
    raise SystemExit(2) from None


def vllm_general_plugin() -> None:
    """``vllm.general_plugins`` entry point."""
    activate_or_exit("vllm.general_plugins")


def status() -> list[dict]:
    """What happened to every patch in this process."""
    return REGISTRY.status()
