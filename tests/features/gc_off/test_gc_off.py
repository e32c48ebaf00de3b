"""gc_off: no automatic collection inside a vLLM engine step, threshold restored after.

The step guard itself runs here (no vLLM needed); the real engines run in the shared
engine scenarios (tests/features/shared_engine.py, gc_off/engine_checks.py): an in-process
engine measured with every patch, with the engine-core one alone and unpatched, and a
multiprocess engine measured in its spawned engine-core process, patched then unpatched.
Young collections are counted with gc.callbacks while a step runs, and the collector
threshold is sampled inside each step (in Scheduler.schedule).
"""

from __future__ import annotations

import gc

import pytest

from ascend_rl_plugins.features import gc_off
from tests.features.gc_off.step_probe import PROBE_THRESHOLD
from tests.features.shared_engine import part

STEP_PATCHES = ("gc_off.llm_engine_step", "gc_off.engine_core_step", "gc_off.engine_core_step_with_batch_queue")


# -- the guard, on plain functions --------------------------------------------------------

@pytest.fixture
def threshold():
    saved = gc.get_threshold()
    gc.set_threshold(*PROBE_THRESHOLD)
    yield PROBE_THRESHOLD
    gc.set_threshold(*saved)


def _step(seen, inner=None, drained=False):
    """What a wrapped step does: run ``inner`` (a nested step) and record the threshold."""
    def body():
        seen.append(gc.get_threshold()[0])
        if inner:
            inner()
        seen.append(gc.get_threshold()[0])
    return lambda: gc_off._run_without_gc(body, (), {}, lambda: drained)


def test_nested_steps_keep_gc_off_until_the_outermost_exit(threshold):
    seen = []
    _step(seen, inner=_step(seen))()
    assert seen == [0, 0, 0, 0]
    assert gc.get_threshold() == threshold
    assert gc_off.GUARD.depth == 0


def test_threshold_restored_when_a_step_raises(threshold):
    def boom():
        assert gc.get_threshold()[0] == 0
        raise KeyError("step failed")
    with pytest.raises(KeyError):
        gc_off._run_without_gc(boom, (), {}, lambda: True)
    assert gc.get_threshold() == threshold and gc_off.GUARD.depth == 0


@pytest.mark.parametrize("idle_collect", [False, True])
def test_one_full_collection_when_the_engine_drains_after_work(threshold, flag_env, idle_collect):
    flag_env(ASCEND_RL_GC_OFF_IDLE_COLLECT=int(idle_collect))
    _step([], drained=True)()  # settles whatever earlier steps left
    before = gc_off.GUARD.idle_collections
    _step([], drained=True)()  # nothing ran since the last idle collection: none
    _step([], drained=False)()
    _step([], drained=False)()
    _step([], drained=True)()  # drained after work: one
    _step([], drained=True)()
    assert gc_off.GUARD.idle_collections - before == (1 if idle_collect else 0)


# -- the real in-process engine -------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(shared_engine):
    return part(shared_engine, "gc_off")


def test_patches_apply_and_engine_core_binds_the_patched_step(engine):
    for name in STEP_PATCHES + ("gc_off.collect_after_enginecore_sleep",):
        assert engine["states"][name] == "applied", engine["states"]
    assert engine["step_fn_is_patched"], "EngineCore bound step_fn before the patch"


def test_engine_core_init_loads_the_plugin_before_binding_step_fn(engine):
    """Nothing activated the plugin in that process before EngineCore.__init__ did."""
    assert engine["load_before_bind"]
    assert engine["wrapped_before"] is False
    assert engine["activated_by"] == ["vllm.general_plugins"]
    assert engine["wrapped_after"] is True


@pytest.mark.parametrize("measurement", ["full", "core_only"])
def test_no_young_collection_inside_steps(engine, measurement):
    got = engine[measurement]
    assert got["steps"] > 5
    assert got["young"] == 0, got
    assert got["thresholds"] == [0], got


def test_baseline_without_the_patches_collects_inside_steps(engine):
    """The same probe sees collections once the patches are gone: the checks have teeth."""
    baseline = engine["baseline"]
    assert baseline["young"] > 0, baseline
    assert baseline["thresholds"] == [engine["threshold_before"][0]], baseline


def test_threshold_restored_after_steps_and_after_an_exception(engine):
    before = engine["threshold_before"]
    assert before == list(PROBE_THRESHOLD)
    assert engine["raised"] and engine["threshold_in_raising_step"] == 0
    assert engine["threshold_after_exception"] == engine["threshold_before_exception"]
    for measurement in ("full", "core_only", "baseline"):
        assert engine[measurement]["threshold_after"] == before, measurement


def test_idle_collection_runs_once_when_the_engine_drains(engine):
    assert engine["full"]["idle_collections"] == 1
    assert engine["core_only"]["idle_collections"] == 1
    assert engine["baseline"]["idle_collections"] == 0


def test_sleep_triggers_one_full_collection(engine):
    assert engine["sleep_calls"] == [["sleep", 1]]
    assert engine["sleep_collections"] == 1


# -- the real multiprocess engine (server path: verl 0.9.x, vllm serve) -----------------------

def test_spawned_engine_core_runs_its_steps_without_gc(multiprocess_engine):
    """The engine core is a separate *spawned* process, where only vLLM's own plugin loading
    (in EngineCore.__init__) can have applied the patch."""
    got = part(multiprocess_engine, "gc_off")
    patched, baseline = got["patched"], got["baseline"]
    assert patched["pid"] == baseline["pid"] != multiprocess_engine["pid"]
    assert got["front_end"]["steps"] == 0  # the front end never schedules
    assert "vllm.general_plugins" in patched["activated_by"]
    assert patched["states"]["gc_off.engine_core_step"] == "applied"
    assert patched["steps"] > 5 and baseline["steps"] > 5
    assert patched["young"] == 0 and patched["thresholds"] == [0], patched
    # the same probe in the same process after reverting the patch: the test has teeth
    assert baseline["young"] > 0 and baseline["thresholds"] == [PROBE_THRESHOLD[0]], baseline
