"""Diagnostics: prove, from inside a real engine, that the plugin loaded and patched it.

With ``ASCEND_RL_DIAGNOSTICS=<file>`` every process that runs engine-core steps appends one
JSON line (pid, who activated ascend-rl, the state of every patch) on its first step.
README.md beside this file: why, flags, verified where. Remove when: never (it is a tool).
"""

from __future__ import annotations

import json
import os
import threading

from ... import flags
from ...patching import Feature, Verified

REPORT_FILE = flags.define(
    "ASCEND_RL_DIAGNOSTICS", "path", "",
    "File to which every engine-core process appends a JSON line (pid, activation origin, "
    "patch states) on its first engine step; empty disables.", feature="diagnostics")

FEATURE = Feature(
    "diagnostics", "Report from inside the engine which patches are active in which process.",
    flag=None, verified=Verified(cpu_runtime="real vLLM engines (0.13 and 0.23), in-process and "
                                            "multiprocess engine core"),
    stacks="recipe, current")

_reported: set[int] = set()
_lock = threading.Lock()


def _report_once() -> None:
    pid = os.getpid()
    with _lock:
        if pid in _reported:
            return
        _reported.add(pid)
    from ...plugin import activated_by, status
    record = {"pid": pid, "activated_by": activated_by(), "patches": status()}
    with open(REPORT_FILE.value, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")


def diagnostics_file_set() -> bool:
    return bool(REPORT_FILE.value)


def _record(instance, args, kwargs):
    _report_once()


for _method in ("step", "step_with_batch_queue"):
    FEATURE.before(f"vllm.v1.engine.core:EngineCore.{_method}", _record, dist="vllm",
                   versions=">=0.13,<0.24", order=10, enabled_by=diagnostics_file_set,
                   params=("self",), name=f"diagnostics.report_on_first_{_method}",
                   reason="record, in the engine-core process itself, that ascend-rl is active",
                   remove_when="never: diagnostic tool")
