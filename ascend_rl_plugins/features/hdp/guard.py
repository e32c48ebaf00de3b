"""The measured guard: HDP stays on only while it is measured faster than fixed CP.

Why: the planner regroups where its cost model says HDP is faster, and the model is only as
good as its calibration (the shipped default is not calibrated at all). So the promise "never
slower than CP" is checked against the clock: every training step's forward/backward (the
Megatron-Core schedule call verl already makes) is timed and recorded with what the plan of
that step modelled. Each data-parallel replica plans its own rows, so its modelled times are
its own; the measured time, the modelled times and whether the step regrouped are
synchronized over the ranks together, in one all-reduce (MAX: the step waits for the slowest
replica, and it counts as regrouped where any replica regrouped), and every rank records the
same numbers:

- steps that ran plain CP everywhere measure how the model's CP times map to reality:
  ``scale = sum(measured) / sum(modelled CP)`` over those steps;
- steps with regrouped micro-batches are compared with what CP would take for the same
  tokens: ``scale * modelled CP time`` of the same micro-batches (the calibrated model,
  corrected by what was measured).

The first ``warmup_steps`` timed steps of the run are not evidence: they pay for allocator
growth, kernel compilation and communicator set-up whichever layout they ran, and the first
step is always a regrouped one, so counting it would bias the verdict against HDP. Once at
least ``min_hdp_steps`` regrouped and ``min_cp_steps`` CP steps are recorded (within the last
``window`` steps), if the regrouped steps took longer in total than CP would have by more than
``tolerance`` (a fraction: step-time noise on a real cluster is a few per cent, and a verdict
taken on three steps must not turn HDP off for a tie), HDP falls back to fixed CP for the rest
of the run, with one WARNING line. When no CP step is
known (the planner regrouped everything), the guard asks for a *probe*: the next planned
mini-batch keeps plain CP, and again after every ``probe_every`` regrouped steps, so the
scale stays current.

Every rank of the world therefore holds the same records and takes the same verdict at the
same step, without a second collective: a rank that stopped planning while others still plan
would leave the planner's data-parallel collectives waiting (and pipeline stages must agree on
the layout of every micro-batch). Comparing the synchronized measured time with a rank's own
modelled CP time instead gave different verdicts on different ranks (a replica holding short
rows models CP fast and reads HDP as slower) and, agreed by MAX, turned a faster HDP off.

:class:`HdpGuard` is the decision alone (pure Python, unit-tested with recorded timings);
:func:`timed_schedule` is the wrapper around Megatron-Core's forward/backward schedules.
``GUARD`` is the process's one guard (``reset()`` for a new run or a test).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from ...patching.fallback import fall_back


@dataclass(frozen=True)
class StepRecord:
    """One timed forward/backward step and what its plans modelled, the same on every rank
    (each field synchronized over the ranks: the largest, or any for ``regrouped``)."""

    measured_s: float  # wall-clock seconds, the largest over the ranks
    modelled_s: float  # the plan's modelled seconds (sum over its micro-batches), largest over the ranks
    modelled_cp_s: float  # the same micro-batches under plain CP, modelled, largest over the ranks
    regrouped: bool  # some micro-batch of some replica ran regrouped (not plain CP)


@dataclass(frozen=True)
class StepPlan:
    """What the guard needs to know of a planned step, noted when its micro-batches are formed
    and used when its forward/backward is timed. This replica's own plan (its own rows):
    synchronized with the measured time before it is recorded."""

    num_micro_batches: int
    modelled_s: float
    modelled_cp_s: float
    regrouped: bool

    @classmethod
    def of(cls, plan) -> "StepPlan":
        """From an ``HdpPlan`` (``planner.py``)."""
        return cls(plan.num_micro_batches, float(plan.cost), float(plan.fixed_cp_cost),
                   any(not m.fixed_cp for m in plan.micro_batches))


@dataclass
class Verdict:
    """The guard's reading of the records: ``hdp_slower`` is None while undecided."""

    hdp_slower: bool | None
    hdp_measured_s: float = 0.0
    cp_would_take_s: float = 0.0
    scale: float = 0.0
    why: str = ""


@dataclass
class HdpGuard:
    """Records timed steps and decides whether HDP is measured slower than CP would be."""

    min_hdp_steps: int = 2
    min_cp_steps: int = 1
    probe_every: int = 20
    window: int = 200
    warmup_steps: int = 1
    tolerance: float = 0.05
    records: list[StepRecord] = field(default_factory=list)
    warmup_seen: int = 0
    fell_back: bool = False
    pending: StepPlan | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def reset(self) -> None:
        with self._lock:
            self.records.clear()
            self.warmup_seen = 0
            self.fell_back = False
            self.pending = None

    # -- what the planner asks ---------------------------------------------------------------

    def wants_cp_probe(self) -> bool:
        """Plan the next mini-batch as plain CP: no CP step is recorded in the window yet
        (after the first regrouped step), or ``probe_every`` regrouped steps ran since the
        last one."""
        since_cp = 0
        for r in reversed(self.records[-self.window:]):
            if not r.regrouped:
                return since_cp >= self.probe_every
            since_cp += 1
        return since_cp > 0

    def note_plan(self, plan: StepPlan) -> None:
        """The micro-batches of the next forward/backward were just formed with this plan."""
        self.pending = plan

    # -- what the timer reports --------------------------------------------------------------

    def record(self, step: StepRecord) -> Verdict:
        """Add a timed step (the first ``warmup_steps`` of the run are dropped); the verdict
        over the window."""
        with self._lock:
            if self.warmup_seen < self.warmup_steps:
                self.warmup_seen += 1
                return self.verdict()
            self.records.append(step)
            del self.records[:-self.window]
        return self.verdict()

    def verdict(self) -> Verdict:
        recent = self.records[-self.window:]
        cp = [r for r in recent if not r.regrouped]
        hdp = [r for r in recent if r.regrouped]
        if len(cp) < self.min_cp_steps or len(hdp) < self.min_hdp_steps:
            return Verdict(None, why=f"{len(hdp)} regrouped and {len(cp)} CP steps timed; "
                                     f"{self.min_hdp_steps} and {self.min_cp_steps} needed")
        modelled_cp = sum(r.modelled_cp_s for r in cp)
        scale = sum(r.measured_s for r in cp) / modelled_cp if modelled_cp > 0 else 1.0
        measured = sum(r.measured_s for r in hdp)
        cp_would = scale * sum(r.modelled_cp_s for r in hdp)
        slower = measured > cp_would * (1.0 + self.tolerance)
        return Verdict(slower, measured, cp_would, scale,
                       f"{len(hdp)} regrouped steps took {measured:.3f} s; plain CP would take "
                       f"{cp_would:.3f} s for the same micro-batches (modelled CP time x "
                       f"{scale:.3f}, measured over {len(cp)} CP steps; tolerance "
                       f"{self.tolerance:.0%})")

    def fall_back_now(self, why: str) -> None:
        """HDP off for the rest of the run (one WARNING line)."""
        self.fell_back = True
        fall_back("hdp", "fixed context parallelism for the rest of the run",
                  f"HDP was measured slower than CP: {why}", cause="measured slower than CP")


GUARD = HdpGuard()


def _device_synchronize() -> None:
    """Wait for the device's queued work, so a wall-clock reading covers it (no-op on CPU)."""
    try:
        from verl.utils.device import get_torch_device, is_cuda_available, is_npu_available
    except ImportError:
        return
    if is_cuda_available or is_npu_available:
        get_torch_device().synchronize()


def _all_reduce_max(values: list[float]) -> list[float]:
    """Element-wise MAX of ``values`` over the whole world (gloo: CPU; else the device)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() != "gloo":
        from verl.utils.device import get_device_name
        t = t.to(get_device_name())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(x) for x in t.tolist()]


def timed_schedule(enabled, guard: HdpGuard = GUARD, clock=time.perf_counter):
    """Wrapper of Megatron-Core's forward/backward schedules (``forward_backward_no_pipelining``
    and the two pipelined ones, keyword-only ``num_microbatches`` / ``forward_only``): times a
    training step whose micro-batches the planner formed, records it, and falls back when the
    verdict says HDP is slower. Forward-only calls (log-probabilities) and steps without a
    noted plan for that many micro-batches run untouched. A timed step pays one all-reduce of
    four numbers (measured, modelled, modelled CP, regrouped), after which every rank records
    the same step and reaches the same verdict. ``clock``: seconds (tests pass recorded
    timings through it)."""

    def _wrapper(wrapped, instance, args, kwargs):
        plan, guard.pending = guard.pending, None  # a noted plan is for the next schedule call
        if plan is None or not enabled() or kwargs.get("forward_only", False) \
                or kwargs.get("num_microbatches") != plan.num_micro_batches:
            return wrapped(*args, **kwargs)
        _device_synchronize()
        start = clock()
        out = wrapped(*args, **kwargs)
        _device_synchronize()
        measured, modelled, modelled_cp, regrouped = _all_reduce_max(
            [clock() - start, plan.modelled_s, plan.modelled_cp_s, 1.0 if plan.regrouped else 0.0])
        verdict = guard.record(StepRecord(measured, modelled, modelled_cp, regrouped > 0))
        if verdict.hdp_slower:
            guard.fall_back_now(verdict.why)
        return out

    return _wrapper
