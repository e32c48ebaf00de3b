"""gc-off decode: no automatic garbage collection inside a vLLM engine step.

The collector's threshold is 0 from entry to exit of every engine step (restored also when the
step raises), so collections happen between steps; optionally one full collection when the
engine drains and when it goes to sleep. Hook points (same in vLLM 0.13 and 0.23):
``LLMEngine.step`` (offline ``LLM``) and ``EngineCore.step`` / ``step_with_batch_queue``
(engine-core process of the server path). ``EngineCore.__init__`` loads the general plugins
before it binds ``self.step_fn``, so the class attribute is already wrapped when it is bound.
README.md beside this file: why, flags, figures, verified where.

Remove when: vLLM disables the collector inside engine steps itself (as of 0.23 it only
freezes the start-up heap).
"""

from __future__ import annotations

import gc
import threading

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_GC_OFF", "bool", False,
    "Disable automatic (young-generation) garbage collection inside vLLM engine steps; "
    "the threshold is restored after every step.", feature="gc_off")
IDLE_COLLECT = flags.define(
    "ASCEND_RL_GC_OFF_IDLE_COLLECT", "bool", False,
    "With ASCEND_RL_GC_OFF: run one full gc.collect() when the engine drains (no "
    "unfinished requests left) and when it is put to sleep.", feature="gc_off")

FEATURE = Feature(
    "gc_off", "No automatic garbage collection inside vLLM engine steps (restored after).",
    flag=ENABLE, replaces="Qwen3 RL recipe vLLM patch 0001-vllm-feature-disable_gc",
    verified=Verified(cpu_runtime="real vLLM engines (0.13 and 0.23): in-process (offline and engine-core "
                                  "paths) and a spawned engine-core process, each against its "
                                  "unpatched baseline"),
    stacks="recipe, current")

VLLM_RANGE = ">=0.13,<0.24"
REMOVE_WHEN = "vLLM itself disables automatic GC inside engine steps"


class _GcGuard:
    """Process-wide "inside an engine step" state.

    The collector's threshold is process-global, and in the in-process engine the offline
    wrapper (``LLMEngine.step``) encloses the engine-core one (``EngineCore.step``), so
    entries nest: the outermost entry saves and zeroes the threshold, the outermost exit
    restores it. ``busy`` remembers that work ran since the last idle collection."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.saved: tuple[int, ...] | None = None
        self.busy = False
        self.idle_collections = 0  # full collections this feature ran (for tests/benchmarks)

    def enter(self) -> None:
        with self.lock:
            if self.depth == 0:
                self.saved = gc.get_threshold()
                gc.set_threshold(0, *self.saved[1:])
            self.depth += 1

    def exit(self) -> bool:
        """Leave a step; True when this was the outermost one."""
        with self.lock:
            self.depth -= 1
            if self.depth == 0 and self.saved is not None:
                gc.set_threshold(*self.saved)
                self.saved = None
                return True
            return False

    def collect_if_drained(self, drained: bool) -> None:
        if not drained:
            self.busy = True
            return
        if self.busy:
            self.busy = False
            self.full_collect()

    def full_collect(self) -> None:
        gc.collect()
        self.idle_collections += 1


GUARD = _GcGuard()


def _run_without_gc(wrapped, args, kwargs, drained_check):
    GUARD.enter()
    try:
        result = wrapped(*args, **kwargs)
    finally:
        outermost = GUARD.exit()
    if outermost and IDLE_COLLECT.value:
        try:
            drained = drained_check()
        except Exception:  # a bookkeeping probe must never break a step
            drained = False
        GUARD.collect_if_drained(drained)
    return result


@FEATURE.wrap("vllm.v1.engine.llm_engine:LLMEngine.step", dist="vllm", versions=VLLM_RANGE,
              order=90, params=("self",), name="gc_off.llm_engine_step",
              reason="offline LLM path: no automatic GC inside LLMEngine.step (step-time jitter)",
              replaces="recipe vLLM patch 0001 (LLM._run_engine loop)", remove_when=REMOVE_WHEN)
def _llm_engine_step(wrapped, instance, args, kwargs):
    # output_processor, not LLMEngine.has_unfinished_requests: under data parallelism the
    # latter runs a collective and flags a dummy batch.
    return _run_without_gc(wrapped, args, kwargs,
                           lambda: not instance.output_processor.has_unfinished_requests())


def _engine_core_step(wrapped, instance, args, kwargs):
    return _run_without_gc(wrapped, args, kwargs, lambda: not instance.scheduler.has_unfinished_requests())


for _method in ("step", "step_with_batch_queue"):
    FEATURE.wrap(f"vllm.v1.engine.core:EngineCore.{_method}", _engine_core_step, dist="vllm",
                 versions=VLLM_RANGE, order=90, params=("self",), name=f"gc_off.engine_core_{_method}",
                 reason="engine-core process (AsyncLLM/server path, verl 0.9.x): no automatic GC "
                        "inside a step; wrapped before EngineCore.__init__ binds step_fn",
                 replaces="recipe vLLM patch 0001 (offline path only there)", remove_when=REMOVE_WHEN)


_sleep_depth = [0]  # LLMEngine.sleep encloses EngineCore.sleep in-process: collect once


def _collect_after_sleep(wrapped, instance, args, kwargs):
    _sleep_depth[0] += 1
    try:
        result = wrapped(*args, **kwargs)
    finally:
        _sleep_depth[0] -= 1
    if _sleep_depth[0] == 0 and GUARD.depth == 0:
        GUARD.busy = False
        GUARD.full_collect()
    return result


def _idle_collect_enabled() -> bool:
    return bool(ENABLE.value and IDLE_COLLECT.value)


for _target in ("vllm.v1.engine.core:EngineCore.sleep", "vllm.v1.engine.llm_engine:LLMEngine.sleep"):
    FEATURE.wrap(_target, _collect_after_sleep, dist="vllm", versions=VLLM_RANGE, order=91,
                 enabled_by=_idle_collect_enabled, params=("self",),
                 name=f"gc_off.collect_after_{_target.split(':')[1].replace('.', '_').lower()}",
                 reason="one full collection when the engine goes to sleep for training, so "
                        "rollout garbage does not pile up across RL steps",
                 remove_when=REMOVE_WHEN)
