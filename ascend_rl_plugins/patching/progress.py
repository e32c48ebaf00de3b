"""Say so when a step turns out slow, instead of seconds of silence.

Some steps are fast when warm and slow when cold (a JIT compile on a fresh machine, imports
on a cold file cache). :func:`slow_step` logs one WARNING line -- ``<what> ...`` -- only if
the step is still running after ``after`` seconds, then ``<what>: done in N s`` when it ends,
so a warm start stays silent and a cold one explains the wait while it happens.

This module knows nothing about the features; they say what the step is.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Iterator

log = logging.getLogger("ascend_rl_plugins")


@contextlib.contextmanager
def slow_step(what: str, after: float = 2.0) -> Iterator[None]:
    """Run the body; if it takes longer than ``after`` seconds, say ``what`` while it runs
    and how long it took when it is done."""
    started = time.perf_counter()
    said = threading.Event()

    def say() -> None:
        said.set()
        log.warning("%s ...", what)

    timer = threading.Timer(after, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if said.is_set():
            log.warning("%s: done in %.0f s", what, time.perf_counter() - started)
