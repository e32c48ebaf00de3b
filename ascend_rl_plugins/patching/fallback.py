"""Falling back with a reason, the same way in every feature.

A feature that cannot do its job for some configuration or input and runs the stock path
instead must not do so silently (an INFO line is invisible at the default
``ASCEND_RL_LOG_LEVEL=warning``), nor flood the log once per step: :func:`fall_back` logs a
WARNING once per (feature, cause) per process, in one format::

    ascend-rl <feature>: falling back to <what runs instead>: <why>

This module knows nothing about the features; they pass their name.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("ascend_rl_plugins")

_lock = threading.Lock()
_said: set[tuple[str, str]] = set()


def fall_back(feature: str, to: str, why: str, *, cause: str | None = None) -> bool:
    """Say that ``feature`` runs ``to`` instead, because ``why``. ``cause`` (default ``why``)
    is what counts as "the same reason": pass a fixed text when ``why`` carries numbers that
    change from call to call. Returns True when the line was logged now (first time)."""
    key = (feature, cause if cause is not None else why)
    with _lock:
        if key in _said:
            return False
        _said.add(key)
    log.warning("ascend-rl %s: falling back to %s: %s", feature, to, why)
    return True


def forget() -> None:
    """Forget what was said (tests run several cases in one process)."""
    with _lock:
        _said.clear()
