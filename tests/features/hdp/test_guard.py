"""The measured guard, fed recorded timings: it falls back to CP when HDP is measured slower than
CP would be for the same micro-batches, and stays with HDP when it is faster."""

from __future__ import annotations

import logging

import pytest

from ascend_rl_plugins.features import hdp
from ascend_rl_plugins.features.hdp.guard import HdpGuard, StepPlan, StepRecord, timed_schedule
from ascend_rl_plugins.patching.fallback import forget


def cp_step(measured, modelled_cp):
    return StepRecord(measured, modelled_cp, modelled_cp, regrouped=False)


def hdp_step(measured, modelled, modelled_cp):
    return StepRecord(measured, modelled, modelled_cp, regrouped=True)


def test_undecided_until_both_kinds_of_steps_are_timed():
    guard = HdpGuard(min_hdp_steps=2, min_cp_steps=1, warmup_steps=0, tolerance=0.0)
    assert guard.record(hdp_step(9.0, 4.0, 5.0)).hdp_slower is None
    assert guard.record(hdp_step(9.0, 4.0, 5.0)).hdp_slower is None  # no CP step yet
    assert guard.record(cp_step(10.0, 5.0)).hdp_slower is not None


@pytest.mark.parametrize("hdp_measured, slower", [(8.0, False), (9.9, False), (10.1, True),
                                                  (12.0, True)])
def test_hdp_is_compared_with_cp_corrected_by_what_cp_measured(hdp_measured, slower):
    # CP: modelled 5 s, measured 10 s -> the model is off by x2; the regrouped steps'
    # micro-batches would take 2 * 5 = 10 s under CP, whatever the model said of HDP (4 s)
    guard = HdpGuard(min_hdp_steps=2, min_cp_steps=1, warmup_steps=0, tolerance=0.0)
    guard.record(cp_step(10.0, 5.0))
    guard.record(hdp_step(hdp_measured, 4.0, 5.0))
    verdict = guard.record(hdp_step(hdp_measured, 4.0, 5.0))
    assert verdict.scale == 2.0 and verdict.cp_would_take_s == 20.0
    assert verdict.hdp_measured_s == 2 * hdp_measured
    assert verdict.hdp_slower is slower


def test_the_cp_probe_comes_after_the_first_regrouped_step_and_every_probe_every():
    guard = HdpGuard(probe_every=3, warmup_steps=0)
    assert not guard.wants_cp_probe()  # nothing timed: plan HDP first
    guard.record(hdp_step(1.0, 1.0, 2.0))
    assert guard.wants_cp_probe()  # a regrouped step and no CP scale yet
    guard.record(cp_step(2.0, 2.0))
    assert not guard.wants_cp_probe()
    for _ in range(2):
        guard.record(hdp_step(1.0, 1.0, 2.0))
        assert not guard.wants_cp_probe()
    guard.record(hdp_step(1.0, 1.0, 2.0))
    assert guard.wants_cp_probe()  # 3 regrouped steps since the last CP one


def test_the_first_step_of_the_run_is_warm_up_not_evidence():
    # the first step (always regrouped) paid for allocator growth and compilation: 30 s
    guard = HdpGuard()
    assert guard.record(hdp_step(30.0, 4.0, 5.0)).hdp_slower is None
    assert not guard.records and not guard.wants_cp_probe()  # nothing timed yet: plan HDP again
    guard.record(hdp_step(4.5, 4.0, 5.0))
    guard.record(cp_step(5.0, 5.0))
    assert guard.record(hdp_step(4.5, 4.0, 5.0)).hdp_slower is False  # 9 s vs CP's 10 s
    guard.reset()
    assert guard.record(hdp_step(4.5, 4.0, 5.0)).hdp_slower is None and not guard.records


@pytest.mark.parametrize("hdp_measured, slower", [(5.2, False), (5.3, True)])
def test_a_tie_within_the_tolerance_keeps_hdp(hdp_measured, slower):
    guard = HdpGuard(warmup_steps=0)  # default tolerance: 5 %
    guard.record(cp_step(5.0, 5.0))
    guard.record(hdp_step(hdp_measured, 4.0, 5.0))
    verdict = guard.record(hdp_step(hdp_measured, 4.0, 5.0))
    assert verdict.cp_would_take_s == 10.0 and verdict.hdp_slower is slower, verdict.why
    assert "tolerance 5%" in verdict.why


class RecordedClock:
    """Returns recorded wall-clock readings: each step starts at 0 and ends at its duration."""

    def __init__(self, durations):
        self.readings = [x for d in durations for x in (0.0, d)]

    def __call__(self):
        return self.readings.pop(0)


def run_steps(guard, steps, durations, enabled):
    """The schedule wrapper over a stand-in for Megatron's schedule function, per step noting
    the plan first as the micro-batch wrapper does."""
    wrapper = timed_schedule(enabled, guard, clock=RecordedClock(durations))
    calls = []
    for plan in steps:
        guard.note_plan(plan)
        wrapper(lambda **kw: calls.append(kw) or "losses", None, (),
                {"num_microbatches": plan.num_micro_batches, "forward_only": False})
    return calls


@pytest.fixture
def clean_guard(flag_env):
    flag_env(ASCEND_RL_HDP="1")
    forget()
    hdp.GUARD.reset()
    yield hdp.GUARD
    hdp.GUARD.reset()
    forget()


def test_measured_slower_falls_back_for_the_rest_of_the_run(clean_guard, caplog):
    regrouped = StepPlan(4, modelled_s=4.0, modelled_cp_s=5.0, regrouped=True)
    plain = StepPlan(4, modelled_s=5.0, modelled_cp_s=5.0, regrouped=False)
    with caplog.at_level(logging.WARNING, logger="ascend_rl_plugins"):
        calls = run_steps(clean_guard, [regrouped, regrouped, plain, regrouped],
                          [30.0, 6.0, 5.0, 6.0], hdp.enabled)
    assert len(calls) == 4  # every step ran (the first: warm-up, not counted)
    assert clean_guard.fell_back and not hdp.enabled()
    lines = [r.getMessage() for r in caplog.records if "measured slower than CP" in r.getMessage()]
    assert len(lines) == 1 and "falling back to fixed context parallelism" in lines[0], lines


def test_measured_faster_keeps_hdp(clean_guard, caplog):
    regrouped = StepPlan(4, modelled_s=4.0, modelled_cp_s=5.0, regrouped=True)
    plain = StepPlan(4, modelled_s=5.0, modelled_cp_s=5.0, regrouped=False)
    with caplog.at_level(logging.WARNING, logger="ascend_rl_plugins"):
        run_steps(clean_guard, [regrouped, regrouped, plain, regrouped, regrouped],
                  [30.0, 4.2, 5.0, 4.1, 4.3], hdp.enabled)
    assert clean_guard.verdict().hdp_slower is False
    assert not clean_guard.fell_back and hdp.enabled()
    assert not [r for r in caplog.records if "measured slower" in r.getMessage()]


def test_forward_only_and_unplanned_calls_are_not_timed(clean_guard):
    wrapper = timed_schedule(hdp.enabled, clean_guard, clock=RecordedClock([]))
    clean_guard.note_plan(StepPlan(4, 4.0, 5.0, True))
    wrapper(lambda **kw: None, None, (), {"num_microbatches": 4, "forward_only": True})
    assert clean_guard.pending is None and not clean_guard.records  # log-probs: not a step
    clean_guard.note_plan(StepPlan(4, 4.0, 5.0, True))
    wrapper(lambda **kw: None, None, (), {"num_microbatches": 3, "forward_only": False})
    assert not clean_guard.records  # not the micro-batches the plan formed
    wrapper(lambda **kw: None, None, (), {"num_microbatches": 4, "forward_only": False})
    assert not clean_guard.records  # no plan noted
