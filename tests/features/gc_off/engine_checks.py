"""gc_off's checks on the shared engines (see tests/features/shared_engine.py).

In-process engine, three measurements on the same engine:
  full      - every gc_off patch active; a step ends with the offline output processing;
  core_only - the LLMEngine.step patch reverted: only the engine-core one (bound into
              EngineCore.step_fn at construction) keeps GC off, as on the server path;
  baseline  - every gc_off patch reverted and step_fn rebound to the pristine method.
Multiprocess engine: the same probe in the spawned engine-core process, patched then
baseline (reverted there through a test-only engine-core utility).
"""

from __future__ import annotations

import gc
import inspect

from tests.features.gc_off import step_probe
from tests.features.gc_off.step_probe import PROBE, PROBE_THRESHOLD

ENV = {"ASCEND_RL_GC_OFF": "1", "ASCEND_RL_GC_OFF_IDLE_COLLECT": "1"}
MULTIPROCESS_ENV = {"ASCEND_RL_GC_OFF": "1"}

PROMPTS = [{"prompt_token_ids": [1 + (7 * i + j) % 400 for j in range(24)]} for i in range(16)]


def _params():
    from vllm import SamplingParams
    return SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0)


class _StopHere(Exception):
    pass


class _RaisingConfig:
    """Stops EngineCore.__init__ at its first use of the config (after the plugin loading)."""

    def __getattr__(self, name):
        raise _StopHere(name)


def before_engine(ctx) -> dict:
    """Runs before anything in this process activated ascend-rl."""
    step_probe.install()
    from vllm.v1.engine.core import EngineCore
    out = {}
    # statically: EngineCore.__init__ loads the general plugins before it binds step_fn
    lines = inspect.getsource(EngineCore.__init__).splitlines()
    load = next(i for i, line in enumerate(lines) if "load_general_plugins()" in line)
    bind = next(i for i, line in enumerate(lines) if "self.step_fn" in line and "=" in line)
    out["load_before_bind"] = load < bind
    # at run time: the plugin loading done by EngineCore.__init__ itself wraps EngineCore.step
    out["wrapped_before"] = hasattr(EngineCore.step, "__wrapped__")
    try:
        EngineCore(_RaisingConfig(), None, False)
    except _StopHere:
        pass
    from ascend_rl_plugins.plugin import activated_by
    out["wrapped_after"] = hasattr(EngineCore.step, "__wrapped__")
    out["activated_by"] = activated_by()
    out.update(_sleep_collects_once(EngineCore))
    out.update(_threshold_restored_after_an_exception(EngineCore))
    return out


def _sleep_collects_once(EngineCore) -> dict:
    """The real patched EngineCore.sleep on an instance with a recording executor."""
    from ascend_rl_plugins.features import gc_off
    calls = []

    class _Executor:
        is_sleeping = False

        def sleep(self, level):
            calls.append(["sleep", level])
    core = EngineCore.__new__(EngineCore)
    core.model_executor = _Executor()
    core.pause_scheduler = lambda **kw: None  # vLLM 0.23 pauses scheduling first
    before = gc_off.GUARD.idle_collections
    EngineCore.sleep(core, 1)
    return {"sleep_calls": calls, "sleep_collections": gc_off.GUARD.idle_collections - before}


def _threshold_restored_after_an_exception(EngineCore) -> dict:
    """The real patched EngineCore.step on an instance whose scheduler raises."""
    out = {"threshold_before_exception": list(gc.get_threshold())}

    class _Boom(Exception):
        pass

    class _RaisingScheduler:
        def has_requests(self):
            out["threshold_in_raising_step"] = gc.get_threshold()[0]
            raise _Boom()
    core = EngineCore.__new__(EngineCore)
    core.scheduler = _RaisingScheduler()
    try:
        EngineCore.step(core)
    except _Boom:
        out["raised"] = True
    out["threshold_after_exception"] = list(gc.get_threshold())
    return out


def in_process(ctx) -> dict:
    from ascend_rl_plugins.features import gc_off
    llm = ctx.llm
    core = llm.llm_engine.engine_core.engine_core
    out = {"states": step_probe.gc_off_states(),
           "step_fn_is_patched": hasattr(type(core).step, "__wrapped__")
           and getattr(core.step_fn, "__wrapped__", None) is not None}
    # warm-up: the first sampling compiles a kernel with torch.compile, and dynamo calls
    # gc.collect(1) explicitly; explicit collections are not what the patch is about.
    llm.generate(PROMPTS[:2], _params(), use_tqdm=False)
    gc.set_threshold(*PROBE_THRESHOLD)  # the patch must restore exactly this value
    out["threshold_before"] = list(gc.get_threshold())

    def measure(name, end_at):
        PROBE.reset(end_at)
        idle_before = gc_off.GUARD.idle_collections
        llm.generate(PROMPTS, _params(), use_tqdm=False)
        out[name] = dict(PROBE.snapshot(), threshold_after=list(gc.get_threshold()),
                         idle_collections=gc_off.GUARD.idle_collections - idle_before)

    measure("full", "process_outputs")
    from ascend_rl_plugins.patching.core import REGISTRY
    REGISTRY.revert(REGISTRY.patches["gc_off.llm_engine_step"])
    measure("core_only", "update_from_output")
    step_probe.revert_gc_off(core)
    measure("baseline", "update_from_output")
    return out


def multiprocess(ctx) -> dict:
    llm = ctx.llm
    client = llm.llm_engine.engine_core  # the engine-core client: utilities run in the engine core
    llm.generate(PROMPTS[:2], _params(), use_tqdm=False)  # warm-up (see in_process)
    client.call_utility("arp_test_gc_probe", False)
    llm.generate(PROMPTS, _params(), use_tqdm=False)
    patched = client.call_utility("arp_test_gc_probe", True)
    llm.generate(PROMPTS, _params(), use_tqdm=False)
    baseline = client.call_utility("arp_test_gc_probe", False)
    return {"patched": patched, "baseline": baseline, "front_end": PROBE.snapshot()}
