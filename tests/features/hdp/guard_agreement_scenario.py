"""Two data-parallel replicas replaying the same training steps through the measured guard's
schedule wrapper over a real gloo group (the world is the two replicas).

Each replica notes the plan of its own rows, as ``microbatch.py`` does: its modelled times are
its own. The replay is one where HDP is 10 % faster than plain CP on every step, and where
the long rows are not always on the same replica: in the regrouped steps replica 1 holds
them (modelled CP 3 s on replica 0, 5 s on replica 1), in the CP probe replica 0 does (5 s
and 4 s). The clock gives the step's real time on both ranks: the step waits for its slowest
replica, and CP runs at 2 s per modelled second, so a CP step takes 2 x 5 = 10 s and a
regrouped one 0.9 x 2 x 5 = 9 s (the first step of the run, warm-up, 30 s).

Run by ``test_guard_agreement.py`` through ``tests.support.child.run_group``: each rank
returns what it recorded and decided step by step, so a failure shows both ranks side by
side. Needs ``ASCEND_RL_HDP=1`` (the process's guard and ``hdp.enabled`` are the real ones).
"""

from __future__ import annotations

from dataclasses import dataclass

STEPS = 6
MICRO_BATCHES = 4
CP_SECONDS_PER_MODELLED_SECOND = 2.0
HDP_SPEEDUP = 0.9  # a regrouped step takes 90 % of what plain CP would
WARM_UP_SECONDS = 30.0
# modelled plain-CP seconds of each replica's own rows (the long rows move between replicas)
REGROUPED_MODELLED_CP = {0: 3.0, 1: 5.0}
PROBE_MODELLED_CP = {0: 5.0, 1: 4.0}
MODELLED_HDP_FRACTION = 0.8  # what the planner modelled for its regrouping, of the CP time


@dataclass
class StepSeen:
    """One step as a rank saw it: whether it was planned (HDP still on), what the guard
    recorded for it (None: not timed), and this rank's verdict after it."""

    planned: bool
    probe: bool
    recorded_measured_s: float | None
    recorded_modelled_cp_s: float | None
    recorded_regrouped: bool | None
    hdp_slower: bool | None


@dataclass
class RankOutcome:
    rank: int
    steps: list[StepSeen]
    fell_back: bool
    hdp_enabled: bool
    all_reduces: int  # torch.distributed.all_reduce calls made by the timed steps
    timed_steps: int


class StepClock:
    """Each timed step reads 0 at its start and ``duration`` at its end."""

    def __init__(self) -> None:
        self._readings: list[float] = []

    def set(self, duration: float) -> None:
        self._readings = [0.0, duration]

    def __call__(self) -> float:
        return self._readings.pop(0)


def _real_step_seconds(step: int, probe: bool) -> float:
    """The step's wall-clock time, the same for every rank (it waits for the slowest replica)."""
    if step == 0:
        return WARM_UP_SECONDS
    if probe:
        return CP_SECONDS_PER_MODELLED_SECOND * max(PROBE_MODELLED_CP.values())
    return HDP_SPEEDUP * CP_SECONDS_PER_MODELLED_SECOND * max(REGROUPED_MODELLED_CP.values())


def run() -> RankOutcome:
    import torch.distributed as dist

    from ascend_rl_plugins.features import hdp
    from ascend_rl_plugins.features.hdp.guard import GUARD, StepPlan, timed_schedule

    rank = dist.get_rank()
    stock_all_reduce = dist.all_reduce
    calls = [0]

    def counting_all_reduce(*args, **kwargs):
        calls[0] += 1
        return stock_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    GUARD.reset()
    clock = StepClock()
    wrapper = timed_schedule(hdp.enabled, GUARD, clock=clock)
    steps = []
    try:
        for step in range(STEPS):
            planned = hdp.enabled()  # the micro-batch wrapper plans (and notes) only while HDP is on
            probe = planned and GUARD.wants_cp_probe()
            records_before = len(GUARD.records)
            if planned:
                cp = (PROBE_MODELLED_CP if probe else REGROUPED_MODELLED_CP)[rank]
                GUARD.note_plan(StepPlan(MICRO_BATCHES, modelled_s=cp if probe else MODELLED_HDP_FRACTION * cp,
                                         modelled_cp_s=cp, regrouped=not probe))
            clock.set(_real_step_seconds(step, probe))
            wrapper(lambda **kw: "losses", None, (), {"num_microbatches": MICRO_BATCHES, "forward_only": False})
            recorded = GUARD.records[-1] if len(GUARD.records) > records_before else None  # not warm-up
            steps.append(StepSeen(planned, probe,
                                  None if recorded is None else recorded.measured_s,
                                  None if recorded is None else recorded.modelled_cp_s,
                                  None if recorded is None else recorded.regrouped,
                                  GUARD.verdict().hdp_slower))
    finally:
        dist.all_reduce = stock_all_reduce
    timed = GUARD.warmup_seen + len(GUARD.records)
    return RankOutcome(rank, steps, GUARD.fell_back, hdp.enabled(), calls[0], timed)
