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

    Raises :class:`ascend_rl_plugins.flags.FlagError` when a flag is invalid: at plugin
    load, never later inside a step.
    """
    with _lock:
        _activated_by.append(origin)
        if len(_activated_by) > 1:
            return
        try:
            flags.validate_all()
            _configure_logging()
            load_features()
            flags.validate_all()  # features add flags
            for name in flags.unknown_variables():
                log.warning("ascend-rl: %s is set but no ascend-rl flag has that name "
                            "(see `ascend-rl env`)", name)
            REGISTRY.activate()
        except flags.FlagError as exc:
            _activated_by.clear()
            log.error("ascend-rl: %s", exc)  # verl swallows plugin exceptions; say it loudly
            raise
        except BaseException:
            _activated_by.clear()
            raise
        log.debug("ascend-rl: activated by %s in pid %d", origin, os.getpid())


def activated_by() -> list[str]:
    return list(_activated_by)


def vllm_general_plugin() -> None:
    """``vllm.general_plugins`` entry point."""
    activate("vllm.general_plugins")


def status() -> list[dict]:
    """What happened to every patch in this process."""
    return REGISTRY.status()
