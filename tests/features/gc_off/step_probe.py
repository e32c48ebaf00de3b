"""Counts automatic young-generation collections while an engine step runs, and samples the
collector threshold inside each step, in whatever process runs the steps.

A step is marked from ``Scheduler.schedule()`` entry to the exit of the last call of the step
being measured: ``Scheduler.update_from_output`` for ``EngineCore.step`` (the engine core),
``OutputProcessor.process_outputs`` for the offline ``LLMEngine.step`` (which encloses it), so
nothing of the probe's own bookkeeping between steps counts. Only *automatic* collections
count: explicit ``gc.collect()`` calls (torch.compile's dynamo makes some when it compiles for a
new batch shape) are not what the patch is about. ``install()`` arms it through
post-import hooks, so it also works in a spawned engine-core process (sitecustomize), where
the test reads it through the engine-core utility ``arp_test_gc_probe``.
"""

from __future__ import annotations

import gc
import os

import wrapt

PROBE_THRESHOLD = (100, 10, 10)  # frequent collections whenever the collector is on


class StepProbe:
    def __init__(self) -> None:
        self.in_step = False
        self.explicit = 0  # inside an explicit gc.collect() call
        self.end_at = "update_from_output"
        self.reset()

    def reset(self, end_at: str | None = None) -> None:
        self.end_at = end_at or self.end_at
        self.young = 0
        self.explicit_in_steps = 0  # not counted as young; reported for diagnosis
        self.steps = 0
        self.thresholds: set[int] = set()

    def snapshot(self) -> dict:
        return {"pid": os.getpid(), "young": self.young, "explicit_in_steps": self.explicit_in_steps,
                "steps": self.steps,
                "thresholds": sorted(self.thresholds)}

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start" and self.in_step and not self.explicit and info["generation"] < 2:
            self.young += 1

    def start(self) -> None:
        self.in_step = True
        self.steps += 1
        self.thresholds.add(gc.get_threshold()[0])

    def end(self, label: str) -> None:
        if label == self.end_at:
            self.in_step = False


PROBE = StepProbe()


def _mark(cls, name: str, on_enter=None, on_exit=None) -> None:
    pristine = getattr(cls, name)

    def marked(*args, **kwargs):
        if on_enter:
            on_enter()
        try:
            return pristine(*args, **kwargs)
        finally:
            if on_exit:
                on_exit()
    setattr(cls, name, marked)


def _instrument_scheduler(module) -> None:
    _mark(module.Scheduler, "schedule", on_enter=PROBE.start)
    _mark(module.Scheduler, "update_from_output", on_exit=lambda: PROBE.end("update_from_output"))


def _instrument_output_processor(module) -> None:
    _mark(module.OutputProcessor, "process_outputs", on_exit=lambda: PROBE.end("process_outputs"))


def gc_off_states() -> dict:
    from ascend_rl_plugins.patching.core import REGISTRY
    return {n: p.outcome.state for n, p in REGISTRY.patches.items() if n.startswith("gc_off.")}


def revert_gc_off(core=None) -> None:
    """Revert every gc_off step patch; rebind ``core.step_fn`` as a fresh EngineCore would."""
    from ascend_rl_plugins.patching.core import REGISTRY
    for name in ("gc_off.llm_engine_step", "gc_off.engine_core_step", "gc_off.engine_core_step_with_batch_queue"):
        REGISTRY.revert(REGISTRY.patches[name])
    if core is not None:
        core.step_fn = core.step


def arp_test_gc_probe(self, revert: bool = False) -> dict:
    """Engine-core utility (test only): this process's reading since the last call, then a
    fresh measurement with :data:`PROBE_THRESHOLD`; ``revert`` removes gc_off first.
    Utilities run between steps, never inside one."""
    from ascend_rl_plugins.plugin import activated_by
    reading = dict(PROBE.snapshot(), activated_by=activated_by(), states=gc_off_states())
    if revert:
        revert_gc_off(self)
    PROBE.reset()
    gc.set_threshold(*PROBE_THRESHOLD)
    return reading


def _add_utility(module) -> None:
    module.EngineCore.arp_test_gc_probe = arp_test_gc_probe


def _counting_explicit(collect):
    def explicit_collect(*args, **kwargs):
        PROBE.explicit += 1
        PROBE.explicit_in_steps += PROBE.in_step
        try:
            return collect(*args, **kwargs)
        finally:
            PROBE.explicit -= 1
    return explicit_collect


_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    gc.callbacks.append(PROBE.on_gc)
    gc.collect = _counting_explicit(gc.collect)
    wrapt.register_post_import_hook(_instrument_scheduler, "vllm.v1.core.sched.scheduler")
    wrapt.register_post_import_hook(_instrument_output_processor, "vllm.v1.engine.output_processor")
    wrapt.register_post_import_hook(_add_utility, "vllm.v1.engine.core")
