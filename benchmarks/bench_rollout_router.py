"""Long-tail simulator, verl 0.9 architecture: independent server replicas fed request by request.

``bench_rollout_rebalance.py`` simulates verl 0.6's lockstep DP rollout; this one simulates what
verl 0.9 runs: R independent vLLM server replicas (each TP=4 for the 235B recipe), every
request routed on arrival by a router actor, replicas stepping at their own pace (no lockstep
between replicas), requests arriving asynchronously from the agent-loop workers. Per replica,
the same engine model as the lockstep simulator: vLLM-like admission (FIFO while a slot is free
and the request's tokens fit the KV cache) and preemption (the newest running request goes
back to the head of its replica's queue and re-runs its prefill), a step costing the base of
its graph batch plus attention over the context it holds (``BASE_DOC`` / ``ATTN_DOC_MS``, fitted
to the Qwen3 RL recipe doc's TPOT figures), prefill at ``prefill_tokens_per_s`` per replica
stalling that replica only. A sibling whose prompt is already running on the replica skips the
prompt's prefill (prefix cache; the shared blocks are not deduplicated in the KV count).

Policies, compared in one deterministic run per scenario:

* ``verl least-in-flight``: verl 0.9.1's ``GlobalRequestLoadBalancer``: each request bound on
  arrival to the replica with the fewest requests in flight, ties at random (seeded);
* ``verl abort-and-resubmit``: the same, plus fully_async's ``rebalance_requests()`` called
  whenever a quarter of the replicas are idle while at least R requests are in flight (at most
  3 times): every request in flight is aborted, the prefix caches reset, and each client
  resubmits prompt + generated tokens 1 s later through least-in-flight (full re-prefill);
* ``this router``: :mod:`ascend_rl_plugins.features.rollout_rebalance.routing` itself (the
  code verl loads), fed what it sees in verl: durations at release, KV size/use and mean
  generated length from vLLM's /metrics every ``metrics_interval`` s;
* ``this router + KV migration`` (*simulated*: the planner is the feature's code, the transport
  is not simulated in detail): the router with ``WITH_MIGRATION`` settings, plus every
  ``MIGRATE_EVERY`` s (``ASCEND_RL_ROLLOUT_MIGRATION_INTERVAL``'s default)
  :func:`tail_policy.plan_moves` on what the shipped controller
  (``migration_client.PlannedMigration``) reads (:meth:`ThisRouter.views`, ``CONTROLLERS``):
  per replica its requests, queued ones indistinguishable from running ones, each expected at
  its max_tokens; its moves of running requests applied with their KV (they pause for
  ``tokens x kv_bytes_per_token / link``, the destination keeps decoding: vLLM's KV connector
  loads asynchronously); a move of a request that waits is dropped (the client moves a request
  at its next output). The router is told of each move when the request starts at its
  destination (``RoutingPolicy.move``, what ``verl_client.MigratingLLMServerClient`` calls
  through ``move_request``) and releases it there. The sweep also prints what-ifs that are NOT
  shipped: controller 'full' (sees and moves queued requests, gets the router's expected
  lengths), controller 'siblings' (each request expected at its GRPO group's mean over started
  siblings of final or so-far length), and the router's queue ordered by the true lengths
  (``OracleOrderPolicy``: how much of the gap is information about which waiting request is
  long); and :func:`what_ifs` after it: the planner reserving each destination's expected growth
  (``TailSettings.reserve_expected_growth``), and the hand-back at other router settings;
* ``this router + KV migration + preemption hand-back``: the same, and a request a replica
  preempts goes back to the router's shared queue (``RoutingPolicy.requeue``, flag
  ``ASCEND_RL_ROLLOUT_REQUEUE_PREEMPTED``) instead of that replica's own, at the router settings
  ``REQUEUE_SETTINGS``;
* ``pooled engine``: one engine with R x the KV, slots and prefill rate, its step that of R
  replicas sharing the batch evenly: the reference the issue names (not a bound: it admits
  FIFO and preempts like vLLM); :func:`lower_bounds` gives three bounds for any policy, printed
  per seed with the gain over least-in-flight no policy can exceed.

The step model is ``tail_policy.StepCostModel`` with ``bench_rollout_rebalance``'s fit to the
recipe doc's TPOT figures (uncalibrated for an independent replica); the transfer model is
``tail_policy.TransferCostModel`` with the workload's figures (assumptions).

Run: ``python benchmarks/bench_rollout_router.py`` (all three scenarios and the settings sweep;
``--quick`` shrinks them).
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rollout_rebalance import ATTN_DOC_MS, BASE_DOC, LADDER  # noqa: E402

from ascend_rl_plugins.features import rollout_rebalance as rr  # noqa: E402
from ascend_rl_plugins.features.rollout_rebalance import routing, tail_policy  # noqa: E402


@dataclass(frozen=True)
class Workload:
    """One rollout workload on verl 0.9 replicas."""

    name: str
    replicas: int = 32
    prompts: int = 512
    n: int = 16  # GRPO group size
    batches: int = 1  # generation batches run one after the other (DAPO dynamic sampling)
    max_num_seqs: int = 256
    prompt_tokens: tuple[int, int] = (256, 2048)  # uniform
    max_response: int = 32768
    median_response: int = 7000
    sigma_between: float = 0.7  # log-length spread between prompts (groups)
    sigma_within: float = 0.7  # log-length spread between siblings
    history: float = 0.0  # share of the first batch's prompts the router served one step earlier
    kv_tokens: int = 850_000  # per replica
    kv_bytes_per_token: float = 94 * 2 * 1 * 128 * 2  # Qwen3-235B, TP4: 1 KV head per rank
    link_bytes_per_s: float = 20e9
    prefill_tokens_per_s: float = 8000.0
    arrival_seconds: float = 2.0  # the agent-loop workers' submissions spread over this
    seed: int = 0


SCENARIOS = {
    "qwen3-235b-32k-grpo": Workload("qwen3-235b-32k-grpo"),
    "dapo-dynamic-sampling": Workload(
        "dapo-dynamic-sampling", replicas=16, prompts=256, n=16, batches=3, max_response=20480,
        median_response=3000, sigma_between=1.0, sigma_within=0.5, prompt_tokens=(128, 1024), seed=1),
    "math-8k": Workload(
        "math-8k", replicas=32, prompts=1024, n=8, max_response=8192, median_response=1500,
        sigma_between=0.6, sigma_within=0.6, prompt_tokens=(100, 600), history=1.0, seed=2),
}


WARM_UP_GROUPS = 10**6  # group ids of the warm-up step's other prompts start here (no clash)


@dataclass
class Requests:
    """Every request of one generation batch: lengths, prompt sizes, groups."""

    length: np.ndarray  # response tokens
    prompt: np.ndarray  # prompt tokens
    group: np.ndarray  # prompt index
    arrival: np.ndarray  # seconds after the batch starts
    history: dict  # group -> previous-step response lengths of its siblings (what the router saw)


def make_batches(w: Workload) -> list[Requests]:
    rng = np.random.default_rng(w.seed)
    out = []
    for b in range(w.batches):
        centre = rng.normal(math.log(w.median_response), w.sigma_between, w.prompts)
        lengths = np.exp(np.repeat(centre, w.n) + rng.normal(0, w.sigma_within, w.prompts * w.n))
        lengths = np.clip(lengths.astype(np.int64), 16, w.max_response)
        prompt = np.repeat(rng.integers(w.prompt_tokens[0], w.prompt_tokens[1] + 1, w.prompts), w.n)
        group = np.repeat(np.arange(w.prompts) + b * w.prompts, w.n)
        arrival = np.sort(rng.uniform(0, w.arrival_seconds, w.prompts * w.n))
        history = {}
        for g in range(w.prompts):
            if rng.random() < w.history:  # the same prompt one step earlier: same group law
                past = np.exp(centre[g] + rng.normal(0, w.sigma_within, w.n))
                history[g + b * w.prompts] = np.clip(past, 16, w.max_response).astype(np.int64)
        out.append(Requests(lengths, prompt, group, arrival, history))
    return out


def previous_step(w: Workload, req: Requests) -> Requests:
    """The step the router served before the measured one (the router actor lives for the whole
    run): the prompts in ``req.history`` again, with their previous-step lengths, and other
    prompts (another draw of the workload, group ids from ``WARM_UP_GROUPS``) in place of the
    rest. The router learns from it what it would in verl, durations at the simulated replicas'
    own pace, so its per-prompt statistics and its mean duration are in the same units as what
    it observes in the measured step."""
    other = make_batches(replace(w, seed=w.seed + 1000, batches=1, history=0.0))[0]
    length, prompt, group = other.length.copy(), other.prompt.copy(), other.group + WARM_UP_GROUPS
    first = int(req.group[0])
    for g, past in req.history.items():
        rows = slice((g - first) * w.n, (g - first + 1) * w.n)
        length[rows], prompt[rows], group[rows] = past, req.prompt[rows], g
    return Requests(length, prompt, group, other.arrival, {})


@dataclass
class Tally:
    preempted: int = 0
    prefill_tokens: int = 0
    moved: int = 0
    moved_kv: int = 0
    moved_bytes: float = 0.0
    aborted: int = 0
    rebalances: int = 0
    requeued: int = 0  # preempted requests handed back to the router (the hand-back)


def step_model(w: Workload) -> tail_policy.StepCostModel:
    """A replica's decode step (``bench_rollout_rebalance``'s doc fit: base by graph batch +
    attention over the context, ``ATTN_DOC_MS`` for a full KV cache). Uncalibrated."""
    return tail_policy.StepCostModel(tuple(sorted(BASE_DOC.items())), ATTN_DOC_MS / w.kv_tokens, LADDER)


def transfer_model(w: Workload) -> tail_policy.TransferCostModel:
    return tail_policy.TransferCostModel(w.kv_bytes_per_token, w.link_bytes_per_s, w.prefill_tokens_per_s)


class Replica:
    """One vLLM server replica (``scale`` > 1: the pooled engine of that many replicas)."""

    def __init__(self, sim: "Simulation", index: int, scale: int = 1):
        w = sim.w
        self.sim, self.index, self.scale = sim, index, scale
        self.kv = w.kv_tokens * scale
        self.slots = w.max_num_seqs * scale
        self.prefill_rate = w.prefill_tokens_per_s * scale
        self.attn = ATTN_DOC_MS / (w.kv_tokens * scale)  # ms per context token per step
        self.running: dict[int, tuple[int, int]] = {}  # rid -> (generated at start, start step)
        self.waiting: deque = deque()  # (rid, generated)
        self.groups: Counter = Counter()  # prompt groups running here (prefix cache)
        self.acc = 0  # context(step) = acc + len(running) * step
        self.step = 0
        self.time = 0.0  # at ``step``
        self.finishing: list = []  # (finish step, rid)
        self.version = 0

    # -- time ------------------------------------------------------------------------------
    def _base(self) -> float:
        n = len(self.running)
        model = self.sim.step_model  # the pooled engine: its batch shared by ``scale`` replicas
        return model.base(model.padded(-(-n // self.scale))) if n else 0.0

    def seconds(self, k: int) -> float:
        n = len(self.running)
        if k <= 0 or n == 0:
            return 0.0
        c0 = self.acc + n * self.step
        return (k * self._base() + self.attn * (k * c0 + n * k * (k - 1) / 2)) / 1000

    def steps_within(self, dt: float) -> int:
        n = len(self.running)
        if dt <= 0 or n == 0:
            return 0
        a = self.attn * n / 2
        b = self._base() + self.attn * (self.acc + n * self.step) - a
        k = int((-b + math.sqrt(b * b + 4 * a * dt * 1000)) / (2 * a)) if a > 0 else int(dt * 1000 / b)
        while k > 0 and self.seconds(k) > dt:
            k -= 1
        while self.seconds(k + 1) <= dt:
            k += 1
        return k

    def context(self) -> int:
        return self.acc + len(self.running) * self.step

    def generated(self, rid: int) -> int:
        gen, s0 = self.running[rid]
        return gen + self.step - s0

    # -- state -----------------------------------------------------------------------------
    def _start(self, rid: int, gen: int) -> None:
        p = int(self.sim.req.prompt[rid])
        self.running[rid] = (gen, self.step)
        self.acc += p + gen - self.step
        self.groups[int(self.sim.req.group[rid])] += 1
        heapq.heappush(self.finishing, (self.step + int(self.sim.req.length[rid]) - gen, rid))

    def stop(self, rid: int) -> int:
        gen, s0 = self.running.pop(rid)
        p = int(self.sim.req.prompt[rid])
        self.acc -= p + gen - s0
        g = int(self.sim.req.group[rid])
        self.groups[g] -= 1
        if self.groups[g] <= 0:
            del self.groups[g]
        return gen + self.step - s0

    def advance(self, k: int) -> None:
        self.time += self.seconds(k)
        self.step += k

    def admit(self) -> None:
        """vLLM's scheduler: FIFO while a slot is free and the tokens fit; prefill stalls."""
        tokens = 0
        while self.waiting and len(self.running) < self.slots:
            rid, gen = self.waiting[0]
            p = int(self.sim.req.prompt[rid])
            if self.running and self.context() + p + gen + 1 > self.kv:
                break
            self.waiting.popleft()
            cached = p if self.groups.get(int(self.sim.req.group[rid])) else 0
            self._start(rid, gen)
            tokens += p + gen - cached
        if tokens:
            self.time += tokens / self.prefill_rate
            self.sim.tally.prefill_tokens += tokens

    def next_event_step(self) -> int | None:
        while self.finishing:
            f, rid = self.finishing[0]
            if rid in self.running and f == self._finish_of(rid):
                break
            heapq.heappop(self.finishing)
        steps = []
        if self.finishing:
            steps.append(self.finishing[0][0])
        n = len(self.running)
        if n:
            steps.append(max((self.kv - self.acc) // n + 1, self.step + 1))
        return min(steps) if steps else None

    def _finish_of(self, rid: int) -> int:
        gen, s0 = self.running[rid]
        return s0 + int(self.sim.req.length[rid]) - gen

    def settle(self) -> list[int]:
        """At the current step: finish, preempt, admit. Returns the finished requests."""
        done = []
        while self.finishing and self.finishing[0][0] <= self.step:
            f, rid = heapq.heappop(self.finishing)
            if rid in self.running and f == self._finish_of(rid):
                self.stop(rid)
                done.append(rid)
        handed_back = []
        while self.running and self.context() > self.kv:
            rid = next(reversed(self.running))
            if self.sim.policy.takes_preempted:  # what-if: back to the router's shared queue
                handed_back.append((rid, self.stop(rid)))
            else:  # vLLM: back to the head of this replica's own queue
                self.waiting.appendleft((rid, self.stop(rid)))
            self.sim.tally.preempted += 1
        self.admit()
        for rid, gen in handed_back:
            self.sim.where.pop(rid, None)
            self.sim.tally.requeued += 1
            self.sim.policy.preempted(self.sim, rid, gen, self.index)
        return done

    def idle(self) -> bool:
        return not self.running and not self.waiting


class Simulation:
    """Global event loop over the replicas; the policy routes, the replicas run."""

    def __init__(self, w: Workload, policy: "Policy", pooled: bool = False):
        self.w = w
        self.policy = policy
        self.replicas = [Replica(self, 0, scale=w.replicas)] if pooled else [
            Replica(self, i) for i in range(w.replicas)]
        self.tally = Tally()
        self.step_model = step_model(w)
        self.transfer_model = transfer_model(w)
        self.in_transit = 0  # requests whose KV is on the link (between two replicas)
        self.now = 0.0
        self.events: list = []
        self.seq = 0
        self.where: dict[int, int] = {}
        self.finished: list[int] = []  # every request's finish, in order (exactly once each)

    def push(self, t: float, kind: str, data) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, data))

    def schedule(self, r: Replica) -> None:
        r.version += 1
        s = r.next_event_step()
        if s is not None:
            self.push(r.time + r.seconds(s - r.step), "replica", (r.index, r.version))
        elif r.waiting:  # only queued work (cannot happen: an empty replica admits): admit now
            r.admit()

    def sync(self, r: Replica, t: float) -> None:
        """Bring ``r`` forward to time ``t`` (no event of its own falls before ``t``). An idle
        replica's clock moves to ``t``: work handed to it starts no earlier than it is handed."""
        if not r.running:
            r.time = max(r.time, t)
            return
        limit = r.next_event_step()
        k = r.steps_within(t - r.time)
        if limit is not None:
            k = min(k, limit - r.step - 1)
        r.advance(max(k, 0))

    def deliver(self, rid: int, r_index: int, gen: int = 0, front: bool = False) -> None:
        r = self.replicas[r_index]
        self.sync(r, self.now)
        self.where[rid] = r_index
        if front:
            r.waiting.appendleft((rid, gen))
        else:
            r.waiting.append((rid, gen))
        r.admit()
        self.schedule(r)

    def run_batch(self, req: Requests, start: float) -> float:
        self.req = req
        self.finished_now: set[int] = set()
        for r in self.replicas:
            r.time = max(r.time, start)
        for rid in range(len(req.length)):
            self.push(start + float(req.arrival[rid]), "arrive", (rid, 0))
        self.policy.begin(self, req, start)
        remaining = len(req.length)
        last = start
        while remaining:
            t, _, kind, data = heapq.heappop(self.events)
            self.now = max(self.now, t)
            if kind == "arrive":
                self.policy.arrive(self, data[0], data[1])
            elif kind == "land":  # a request whose KV arrived: it runs there, no prefill
                rid, gen, index = data
                r = self.replicas[index]
                self.sync(r, self.now)
                r._start(rid, gen)
                self.in_transit -= 1
                self.schedule(r)
                self.policy.landed(self, rid, index)
            elif kind == "check":
                if remaining:
                    self.policy.check(self)
                    self.push(self.now + data, "check", data)
            else:
                index, version = data
                r = self.replicas[index]
                if version != r.version:
                    continue
                target = r.next_event_step()
                r.advance(target - r.step)
                done = r.settle()
                self.now = max(self.now, r.time) if not done else self.now
                for rid in done:
                    if rid in self.finished_now:
                        raise AssertionError(f"request {rid} finished twice")
                    self.finished_now.add(rid)
                    self.finished.append(rid)
                    remaining -= 1
                    last = max(last, r.time)
                    self.where.pop(rid, None)
                    self.policy.finish(self, rid, index, r.time)
                self.schedule(r)
        self.events = [e for e in self.events if e[2] == "replica"]
        heapq.heapify(self.events)
        return last


# -- policies ---------------------------------------------------------------------------------

class Policy:
    check_every: float = 0.0
    takes_preempted: bool = False  # True: a preempted request goes to ``preempted``, not the replica's queue

    def begin(self, sim: Simulation, req: Requests, start: float) -> None:
        if self.check_every:
            sim.push(start + self.check_every, "check", self.check_every)

    def arrive(self, sim, rid, gen): ...

    def finish(self, sim, rid, replica, t): ...

    def preempted(self, sim, rid, gen, replica): ...  # only where ``takes_preempted``

    def landed(self, sim, rid, replica): ...

    def check(self, sim): ...


class LeastInflight(Policy):
    """verl 0.9.1's GlobalRequestLoadBalancer (no stickiness needed: one turn per request)."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.inflight: Counter = Counter()

    def route(self, sim):
        counts = [self.inflight[i] for i in range(len(sim.replicas))]
        low = min(counts)
        ties = [i for i, c in enumerate(counts) if c == low]
        return ties[int(self.rng.integers(len(ties)))] if len(ties) > 1 else ties[0]

    def arrive(self, sim, rid, gen):
        i = self.route(sim)
        self.inflight[i] += 1
        sim.deliver(rid, i, gen)

    def finish(self, sim, rid, replica, t):
        self.inflight[replica] -= 1


class AbortResubmit(LeastInflight):
    """fully_async's rebalance_requests(): clear sticky, abort all, clients resubmit 1 s later."""

    check_every = 5.0

    def __init__(self, seed: int = 0, idle_share: float = 0.25, most: int = 3):
        super().__init__(seed)
        self.idle_share, self.most, self.done = idle_share, most, 0

    def check(self, sim):
        idle = sum(r.idle() for r in sim.replicas)
        inflight = sum(len(r.running) + len(r.waiting) for r in sim.replicas)
        if (self.done >= self.most or idle < self.idle_share * len(sim.replicas)
                or inflight < len(sim.replicas)):
            return
        self.done += 1
        sim.tally.rebalances += 1
        for r in sim.replicas:
            sim.sync(r, sim.now)
            aborted = [(rid, r.stop(rid)) for rid in list(r.running)] + list(r.waiting)
            r.waiting.clear()
            r.groups.clear()  # abort_all_requests resets the prefix cache
            self.inflight[r.index] = 0
            sim.schedule(r)
            for rid, gen in aborted:
                sim.tally.aborted += 1
                sim.push(sim.now + 1.0, "arrive", (rid, gen))


# What the migration controller sees and does. 'client': migration_client.PlannedMigration as
# shipped: a request's expected length is its max_tokens (the client's default; the router's
# estimate does not reach it), a queued request is indistinguishable from a running one (it
# counts as running with the tokens it has received) and moves only at its next output, i.e.
# once running again; a 'prefill' move exports KV like a 'kv' one. 'full' (NOT shipped, a
# what-if printed by the sweep): the controller also sees which requests are queued and moves
# them (abort before start, no KV), and gets the router's expected lengths. 'siblings' (NOT
# shipped, a what-if): the client's view, but each request expected at its GRPO group's mean
# over its started siblings of final length (finished) or tokens so far (running): what a
# client grouping requests by prompt could compute.
CONTROLLERS = ("client", "full", "siblings")


class OracleOrderPolicy(routing.RoutingPolicy):
    """NOT shipped, a what-if for the sweep: the router's queue ordered by each request's true
    response length (nothing real knows it before the request has run). Everything else is the
    shipped policy (its gate still uses the estimated sizes). It measures how much of the gap
    to the issue's 15 % is information about which waiting request is long."""

    def __init__(self, settings: routing.RouterSettings, lengths: dict):
        super().__init__(settings)
        self.true_lengths = lengths  # request key -> response tokens

    def _key(self, pending):
        if pending.request_id not in self.true_lengths:  # the warm-up step: the shipped order
            return super()._key(pending)
        return -float(self.true_lengths[pending.request_id])


class GroupMeanOrderPolicy(routing.RoutingPolicy):
    """NOT shipped, a what-if: the router's queue ordered by the true mean response length of
    each request's GRPO group (what perfect knowledge of every prompt's lengths would give,
    without knowing which sibling is the long one). ``ThisRouter(group_order=True)``."""

    def __init__(self, settings: routing.RouterSettings, group_means: dict):
        super().__init__(settings)
        self.group_means = group_means  # group key -> mean response tokens of its siblings

    def _key(self, pending):
        if pending.group not in self.group_means:  # the warm-up step: the shipped order
            return super()._key(pending)
        return -self.group_means[pending.group]


class ThisRouter(Policy):
    """The router verl loads (routing.RoutingPolicy), fed what it sees there; with
    ``migrate_every`` > 0, plus the tail-migration planner (tail_policy.plan_moves) every that
    many seconds, fed what a migration controller reads from the servers."""

    def __init__(self, settings: routing.RouterSettings, metrics_interval: float = 1.0,
                 migrate_every: float = 0.0, tail: tail_policy.TailSettings | None = None,
                 controller: str = "client", tell_router: bool = True, oracle_order: bool = False,
                 requeue_preempted: bool = False, group_order: bool = False):
        self.tell_router = tell_router
        self.oracle_order = oracle_order
        if controller not in CONTROLLERS:
            raise ValueError(f"controller={controller!r}: accepted {', '.join(CONTROLLERS)}")
        if oracle_order + requeue_preempted + group_order > 1:
            raise ValueError("oracle_order, requeue_preempted, group_order: accepted one what-if at a time")
        self.controller = controller
        self.true_lengths: dict = {}
        self.group_means: dict = {}
        self.group_order = group_order
        self.takes_preempted = requeue_preempted
        self.policy = (OracleOrderPolicy(settings, self.true_lengths) if oracle_order
                       else GroupMeanOrderPolicy(settings, self.group_means) if group_order
                       else routing.RoutingPolicy(settings))
        self.check_every = metrics_interval
        self.migrate_every = migrate_every
        self.tail = tail or tail_policy.TailSettings()
        self.next_migration = 0.0
        self.gen_sum = 0.0
        self.gen_count = 0
        self.batch = -1
        self.pending_gen: dict[int, int] = {}
        self.acquired: dict[int, str] = {}  # request -> the server the router bound it to

    def key(self, rid: int) -> str:
        """The request id verl would pass: unique per request (a uuid there), so a later
        generation batch's request is never mistaken for a sticky multi-turn continuation."""
        return f"{self.batch}:{rid}"

    def begin(self, sim, req, start):
        self.batch += 1
        if self.oracle_order:
            self.true_lengths.update({self.key(rid): int(n) for rid, n in enumerate(req.length)})
        if self.group_order:
            for g in np.unique(req.group):
                self.group_means[str(int(g))] = float(req.length[req.group == g].mean())
        if not self.policy.replicas:
            for r in sim.replicas:
                self.policy.add_replica(str(r.index), r.slots)
            self.policy.max_response_tokens = sim.w.max_response
            self.warm_up(sim.w, req)
        self.report(sim)
        super().begin(sim, req, start)

    def warm_up(self, w: Workload, req: Requests) -> None:
        """Step >= 2 of a run: this router served :func:`previous_step` first (on replicas of
        its own, no migration), so its mean duration, its per-prompt statistics for the prompts
        seen before, and the servers' generated-length histogram (cumulative since they
        started) hold one earlier step. Request ids of that step never clash with the measured
        step's (no false multi-turn stickiness)."""
        earlier = ThisRouter(self.policy.settings, self.check_every)
        earlier.takes_preempted = self.takes_preempted  # the earlier step ran the same system
        earlier.policy, earlier.batch = self.policy, -1000
        Simulation(w, earlier).run_batch(previous_step(w, req), 0.0)
        self.gen_sum, self.gen_count = earlier.gen_sum, earlier.gen_count
        self.policy.clear_sticky()  # single-turn requests: nothing of the earlier step continues

    def _bound(self, sim, dispatches):
        for d in dispatches:
            rid = int(d.request_id.rsplit(":", 1)[1])
            self.acquired[rid] = d.server_id
            sim.deliver(rid, int(d.server_id), self.pending_gen.pop(rid, 0))

    def arrive(self, sim, rid, gen):
        self.pending_gen[rid] = gen
        self._bound(sim, self.policy.submit(self.key(rid), int(sim.req.prompt[rid]),
                                            str(int(sim.req.group[rid])), sim.now))

    def finish(self, sim, rid, replica, t):
        self.gen_sum += float(sim.req.length[rid])
        self.gen_count += 1
        # released to the replica it was acquired from (verl's client does; moves are not told)
        self.policy.release(self.acquired.pop(rid), self.key(rid), t)
        self._bound(sim, self.policy.dispatch(t))

    def preempted(self, sim, rid, gen, replica):
        """``requeue_preempted``, the preemption hand-back (``ASCEND_RL_ROLLOUT_REQUEUE_PREEMPTED``):
        the preempted request's client hands it back to the router
        (``RoutingPolicy.requeue``, what ``MigratingLLMServerClient`` calls through
        ``requeue_request``) and submits it again (prompt + ``gen`` tokens, a re-prefill
        wherever it lands) after one move's overhead (``TransferCostModel.move_overhead_s``)."""
        self.policy.requeue(self.key(rid), self.acquired.pop(rid), gen)
        sim.push(sim.now + sim.transfer_model.move_overhead_s, "arrive", (rid, gen))

    def landed(self, sim, rid, replica):
        """A moved request starts its hop at ``replica``: the shipped client
        (``verl_client.MigratingLLMServerClient._tell_router``) tells the router then
        (``move_request``), so its load follows the move and it is released there."""
        if self.tell_router and self.policy.move(self.key(rid), self.acquired[rid], str(replica)):
            self.acquired[rid] = str(replica)
            self._bound(sim, self.policy.dispatch(sim.now))

    def report(self, sim):
        """vLLM's /metrics: KV capacity and use per replica, mean generated tokens."""
        for r in sim.replicas:
            self.policy.report(str(r.index), kv_capacity_tokens=r.kv, kv_used_tokens=r.context())
        if self.gen_count:
            self.policy.mean_response_tokens = self.gen_sum / self.gen_count

    def check(self, sim):
        self.report(sim)
        self._bound(sim, self.policy.dispatch(sim.now))
        if self.migrate_every and sim.now >= self.next_migration:
            self.next_migration = sim.now + self.migrate_every
            self.migrate(sim)

    def views(self, sim) -> list[tail_policy.ReplicaView]:
        """What a migration controller reads: per replica its running requests (prompt and
        generated tokens) and queued ones, KV capacity, slots; per request an expected response
        (see ``CONTROLLERS``)."""
        client = self.controller in ("client", "siblings")
        siblings = None
        if self.controller == "siblings":
            tokens: dict = {}
            for rid in sim.finished_now:
                tokens.setdefault(int(sim.req.group[rid]), []).append(float(sim.req.length[rid]))
            for r in sim.replicas:
                for rid in r.running:
                    tokens.setdefault(int(sim.req.group[rid]), []).append(float(r.generated(rid)))
                for rid, gen in r.waiting:
                    if gen:
                        tokens.setdefault(int(sim.req.group[rid]), []).append(float(gen))
            siblings = {g: sum(v) / len(v) for g, v in tokens.items()}
        out = []
        for r in sim.replicas:
            def view(rid, gen):
                prompt, group = int(sim.req.prompt[rid]), str(int(sim.req.group[rid]))
                if siblings is not None:
                    expected = siblings.get(int(group), float(sim.w.max_response))
                else:
                    expected = (float(sim.w.max_response) if client  # the client's default: max_tokens
                                else self.policy.expected_tokens(prompt, group) - prompt)
                return tail_policy.RequestView(str(rid), prompt, gen, expected)
            running = [view(rid, r.generated(rid)) for rid in r.running]
            queued = [view(rid, gen) for rid, gen in r.waiting]
            if client:  # it cannot tell a queued request from a running one
                out.append(tail_policy.ReplicaView(str(r.index), r.kv, r.slots, running=running + queued))
            else:
                out.append(tail_policy.ReplicaView(str(r.index), r.kv, r.slots, running=running, queued=queued))
        return out

    def migrate(self, sim):
        """One round of the tail-migration planner, applied: a queued request re-prefills at
        its destination; a running one moves with its KV (it pauses for the transfer, then
        runs at the destination without a prefill: the connector loads asynchronously, the
        destination's batch keeps decoding) or by re-prefill (the destination's batch stalls
        for the prefill, as on admission)."""
        for r in sim.replicas:
            sim.sync(r, sim.now)
        moves = tail_policy.plan_moves(self.views(sim), sim.step_model, sim.transfer_model,
                                       sim.w.max_response, self.tail)
        for m in moves:
            rid = int(m.request_id)
            src, dst = sim.replicas[int(m.source)], sim.replicas[int(m.destination)]
            if self.controller != "full" and rid not in src.running:
                continue  # the client moves a request at its next output: none while it waits
            sim.tally.moved += 1
            if m.method == "queued":
                gen = next(g for x, g in src.waiting if x == rid)
                src.waiting.remove((rid, gen))
                dst.waiting.append((rid, gen))
                dst.admit()
            else:
                gen = src.stop(rid)
                if m.method == "kv" or self.controller != "full":  # the client exports KV either way
                    tokens = int(sim.req.prompt[rid]) + gen
                    sim.tally.moved_kv += 1
                    sim.tally.moved_bytes += tokens * sim.w.kv_bytes_per_token
                    sim.in_transit += 1
                    sim.push(sim.now + m.cost_s, "land", (rid, gen, dst.index))
                else:
                    dst.waiting.appendleft((rid, gen))
                    dst.admit()
            sim.where[rid] = dst.index  # the router is not told (as in verl): its books keep src
            sim.schedule(src)
            sim.schedule(dst)


def run(w: Workload, make_policy, pooled: bool = False) -> tuple[float, Tally]:
    result = simulate(w, make_policy, pooled)
    return result.seconds, result.tally


@dataclass(frozen=True)
class SimulatedRun:
    """One policy simulated over every generation batch of a workload."""
    seconds: float        # makespan
    tally: Tally
    finished: list        # per batch, the request ids in finish order
    in_transit: int       # KV transfers started and not landed when the run ended (0: none lost)


def simulate(w: Workload, make_policy, pooled: bool = False) -> SimulatedRun:
    policy = make_policy()
    sim = Simulation(w, policy, pooled=pooled)
    t = 0.0
    finished = []
    for req in make_batches(w):
        t = sim.run_batch(req, t)
        finished.append(list(sim.finished))
        sim.finished.clear()
    return SimulatedRun(t, sim.tally, finished, sim.in_transit)


# The router's settings under migration: a looser expected-size KV gate than alone (kv_budget
# 2.5 instead of 1.5). The shipped controller cannot move a request that waits in a replica's
# queue, so preemptions cost it (no gate, 16: 6586 preemptions on 235B, +7.7 %); too tight a gate
# (1.5: 184, +6.4 %) starts unrecognised long requests late; 2.5 (about 510, +10.3 % at the
# planner's former survival 1, +11.1 % at 2) is the
# best of 1.5, 2.0, 2.5, 3.0, 16 on 235B (3 seeds each, separate runs of this simulator; the
# feature's DESIGN.md lists them) and equals 16 on DAPO and 8K math, where nothing is preempted.
WITH_MIGRATION = {"kv_budget": 2.5}


# The live trigger's interval (ASCEND_RL_ROLLOUT_MIGRATION_INTERVAL's default): the simulated
# controller plans as often as the shipped one.
MIGRATE_EVERY = rr.MIGRATION_INTERVAL.default


# The router's settings under the preemption hand-back: admitting on the KV in use (no
# expected-size gate, 512 tokens of room per running request) rather than holding requests
# back, since a request a replica preempts comes back to the shared queue: the best of
# kv_reserve 256 / 512 / 768 / 1024 / 2048 with kv_budget 16, and of kv_budget 2.5 / 16 at
# kv_reserve 512, on the 235B workload (3 seeds, separate runs of these functions during the
# feature's DESIGN.md lists them). Checked again with the hand-back's current queue order
# (fewest generated first): kv_reserve 256 equal within 0.1 point, 1024 and kv_budget 2.5 lower.
REQUEUE_SETTINGS = {"kv_budget": 16.0, "kv_reserve": 512}


HAND_BACK = "this router + KV migration + preemption hand-back (simulated)"


def policies(w: Workload, defaults: routing.RouterSettings):
    migrating = replace(defaults, **WITH_MIGRATION)
    handing_back = replace(defaults, **REQUEUE_SETTINGS)
    return [
        ("verl least-in-flight", lambda: LeastInflight(w.seed), False),
        ("verl abort-and-resubmit", lambda: AbortResubmit(w.seed), False),
        ("this router", lambda: ThisRouter(defaults), False),
        ("this router + KV migration (simulated)", lambda: ThisRouter(migrating, migrate_every=MIGRATE_EVERY), False),
        (HAND_BACK, lambda: ThisRouter(handing_back, migrate_every=MIGRATE_EVERY, requeue_preempted=True), False),
        ("pooled engine (reference)", lambda: LeastInflight(w.seed), True),
    ]


def compare(w: Workload, defaults: routing.RouterSettings, seeds: int) -> list:
    """Each policy on ``seeds`` draws of the workload (lengths, arrivals, verl's tie-breaks)."""
    rows = []
    for name, make, pooled in policies(w, defaults):
        runs = []
        for k in range(seeds):
            ws = replace(w, seed=w.seed + 100 * k)
            make_k = policies(ws, defaults)[[p[0] for p in policies(ws, defaults)].index(name)][1]
            runs.append(run(ws, make_k, pooled))
        rows.append((name, [r[0] for r in runs], [r[1] for r in runs]))
    return rows


@dataclass(frozen=True)
class Bounds:
    """Makespan lower bounds of one workload draw in this model, any policy (seconds)."""

    alone: float  # the longest response decoded alone
    work: float  # all the work spread evenly at the full batch's per-token base cost
    kv_steps: float  # every replica step at most a full KV cache, each at least the smallest base

    @property
    def best(self) -> float:
        return max(self.alone, self.work, self.kv_steps)


def lower_bounds(w: Workload) -> Bounds:
    """Three makespan lower bounds in this model, any policy, per generation batch summed over
    batches. The attention part of a step is linear in its context, so its total over a batch,
    ``attention_ms_per_token x sum(prompt x length + length x (length - 1) / 2)`` (each token
    attends over its prompt and the tokens before it), is the same under every policy
    (preemption and re-prefill only add to it). (1) ``alone``: the longest response decoded
    alone, at the smallest batch's step and no other context. (2) ``work``: all the work spread
    evenly over the replicas, every token at the full batch's per-token base cost plus the
    attention total. (3) ``kv_steps``: a replica step holds at most its KV cache (plus one token
    per running request: the simulated replica preempts at the step that overflows), so the
    replicas make at least ``context total / (kv_tokens + max_num_seqs)`` steps (and at least
    ``tokens / max_num_seqs``), each costing at least the smallest batch's base, plus the
    attention total, spread evenly. (3) is what binds on the 235B workload: decode there is
    KV-bound, not batch-bound."""
    model = step_model(w)
    alone = work = kv_steps = 0.0
    smallest = model.base(model.padded(1))
    for req in make_batches(w):
        length, prompt = req.length.astype(float), req.prompt.astype(float)
        context = prompt * length + length * (length - 1) / 2  # tokens attended, per request
        attention_ms = model.attention_ms_per_token * context.sum()
        i = int(np.argmax(length))
        alone += (prompt[i] / w.prefill_tokens_per_s + length[i] * smallest / 1000
                  + model.attention_ms_per_token * context[i] / 1000)
        full = w.max_num_seqs
        work += (length.sum() * model.base(model.padded(full)) / full + attention_ms) / 1000 / w.replicas
        steps = max(context.sum() / (w.kv_tokens + full), length.sum() / full)
        kv_steps += (steps * smallest + attention_ms) / 1000 / w.replicas
    return Bounds(alone, work, kv_steps)


def print_rows(w: Workload, rows) -> dict:
    base = np.array(rows[0][1])
    pooled = np.array(rows[-1][1])
    print(f"\n== {w.name}: {w.replicas} replicas x {w.max_num_seqs} slots, {w.kv_tokens // 1000}K KV "
          f"tokens each; {w.batches} x {w.prompts} prompts x n={w.n}; response median "
          f"{w.median_response}, max {w.max_response}; history {w.history:.0%}; {len(base)} seeds")
    for k, lif in enumerate(base):
        b = lower_bounds(replace(w, seed=w.seed + 100 * k))
        print(f"lower bounds (seed {w.seed + 100 * k}): longest response alone {b.alone:.0f} s; all work "
              f"evenly at full-batch cost {b.work:.0f} s; KV-bound steps {b.kv_steps:.0f} s; best "
              f"{b.best:.0f} s = {1 - b.best / lif:+.1%} vs least-in-flight (no policy cuts more; "
              f"15 % needs <= {0.85 * lif:.0f} s)")
    print("| policy | makespan s (mean) | vs least-in-flight (mean; worst seed) | vs pooled (mean) "
          "| preempted | prefill M tokens | moved (with KV) | KV GB | aborted |")
    print("|---|---|---|---|---|---|---|---|---|")
    out = {}
    for name, seconds, tallies in rows:
        sec = np.array(seconds)
        gain = 1 - sec / base
        out[name] = sec
        t = lambda f: np.mean([getattr(x, f) for x in tallies])  # noqa: E731
        print(f"| {name} | {sec.mean():.0f} | {gain.mean():+.1%}; {gain.min():+.1%} | "
              f"{(sec / pooled).mean() - 1:+.1%} | {t('preempted'):.0f} | {t('prefill_tokens') / 1e6:.1f} | "
              f"{t('moved'):.0f} ({t('moved_kv'):.0f}) | {t('moved_bytes') / 1e9:.1f} | {t('aborted'):.0f} |")
    return out


def sweep(w: Workload, defaults: routing.RouterSettings, seeds: int) -> None:
    """The router's settings, one change at a time from the defaults: alone and with the
    simulated migration, mean gain over least-in-flight across seeds (worst seed)."""
    print(f"\nsettings sweep on {w.name}, {seeds} seeds (vs least-in-flight: mean, worst seed):")
    draws = [replace(w, seed=w.seed + 100 * k) for k in range(seeds)]
    base = np.array([run(x, lambda: LeastInflight(x.seed))[0] for x in draws])
    changes = [("defaults", {})] + [(f"kv_budget={b}", {"kv_budget": b}) for b in (1.0, 2.0, 2.5, 16.0)] + [
        (f"kv_reserve={r}", {"kv_reserve": r}) for r in (1024, 4096)] + [
        ("siblings=pack", {"siblings": "pack"}), ("order=arrival", {"order": "arrival"})]
    for label, change in changes:
        s = replace(defaults, **change)
        alone = 1 - np.array([run(x, lambda: ThisRouter(s))[0] for x in draws]) / base
        mig = 1 - np.array([run(x, lambda: ThisRouter(s, migrate_every=MIGRATE_EVERY))[0] for x in draws]) / base
        print(f"  {label:>16}: alone {alone.mean():+.1%} ({alone.min():+.1%}), + migration "
              f"{mig.mean():+.1%} ({mig.min():+.1%})")
    migrating = replace(defaults, **WITH_MIGRATION)
    print(f"  the table's router + migration ({', '.join(f'{k}={v}' for k, v in WITH_MIGRATION.items())}), "
          "one change at a time:")
    for label, kw in [("as in the table", {}), ("migrate_every=5", {"migrate_every": 5.0}),
                      ("controller=full (NOT shipped)", {"controller": "full"}),
                      ("controller=siblings (NOT shipped)", {"controller": "siblings"}),
                      ("oracle queue order (NOT shipped)", {"oracle_order": True})]:
        kw = {"migrate_every": MIGRATE_EVERY, **kw}
        mig = 1 - np.array([run(x, lambda: ThisRouter(migrating, **kw))[0] for x in draws]) / base
        print(f"  {label:>34}: {mig.mean():+.1%} ({mig.min():+.1%})")
    alone = 1 - np.array([run(x, lambda: ThisRouter(defaults, oracle_order=True))[0] for x in draws]) / base
    print(f"  the router alone, oracle queue order (NOT shipped): {alone.mean():+.1%} ({alone.min():+.1%})")




def what_ifs(w: Workload, defaults: routing.RouterSettings, seeds: int) -> None:
    """What is NOT shipped and what it would give (mean gain over least-in-flight, worst seed):
    the planner reserving each destination's expected growth, with the shipped router and with
    the router's queue in true-length order; the queue ordered by each GRPO group's true mean;
    and the preemption hand-back (shipped, the table's last migrating row) at other settings:
    the router alone at ``REQUEUE_SETTINGS``, and with migration at the table's settings."""
    print(f"\nwhat-ifs on {w.name}, {seeds} seeds (NOT shipped; vs least-in-flight: mean, worst seed):")
    draws = [replace(w, seed=w.seed + 100 * k) for k in range(seeds)]
    base = np.array([run(x, lambda: LeastInflight(x.seed))[0] for x in draws])
    migrating = replace(defaults, **WITH_MIGRATION)
    requeue = replace(defaults, **REQUEUE_SETTINGS)
    growth = tail_policy.TailSettings(reserve_expected_growth=True)
    cases = [
        ("router + migration, planner reserving expected growth", migrating,
         {"migrate_every": MIGRATE_EVERY, "tail": growth}),
        ("router + migration, queue ordered by the true GRPO-group mean", migrating,
         {"migrate_every": MIGRATE_EVERY, "group_order": True}),
        ("router + migration (kv_budget 1.5), oracle queue order", defaults,
         {"migrate_every": MIGRATE_EVERY, "oracle_order": True}),
        ("router + migration (kv_budget 1.5), oracle queue order, planner reserving expected growth", defaults,
         {"migrate_every": MIGRATE_EVERY, "oracle_order": True, "tail": growth}),
        ("router alone, preemption hand-back", requeue, {"requeue_preempted": True}),
        ("router + migration, preemption hand-back, table's settings (kv_budget 2.5)", migrating,
         {"migrate_every": MIGRATE_EVERY, "requeue_preempted": True}),
    ]
    for label, settings, kw in cases:
        runs = [run(x, lambda: ThisRouter(settings, **kw)) for x in draws]
        gain = 1 - np.array([r[0] for r in runs]) / base
        preempted = np.mean([r[1].preempted for r in runs])
        print(f"  {label}: {gain.mean():+.1%} ({gain.min():+.1%}); preempted {preempted:.0f}")


def quick_workload(w: Workload) -> Workload:
    """``--quick``: a quarter of the prompts and replicas (at least 2)."""
    return replace(w, replicas=max(w.replicas // 4, 2), prompts=w.prompts // 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a quarter of the prompts, 8 replicas")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--seeds", type=int, default=3, help="draws of each workload")
    ap.add_argument("--what-ifs-only", action="store_true", help="only the what-ifs (no table, no sweep)")
    args = ap.parse_args()
    from ascend_rl_plugins.features import rollout_rebalance as rr
    defaults = routing.RouterSettings(siblings=rr.ROUTER_SIBLINGS.default, order=rr.ROUTER_ORDER.default,
                                      kv_budget=rr.ROUTER_KV_BUDGET.default,
                                      kv_reserve=rr.ROUTER_KV_RESERVE.default)
    print(f"router defaults: siblings={defaults.siblings}, order={defaults.order}, "
          f"kv_budget={defaults.kv_budget}, kv_reserve={defaults.kv_reserve}")
    t0 = time.perf_counter()
    results = {}
    for key in args.scenarios.split(",") if not args.what_ifs_only else ():
        w = SCENARIOS[key]
        if args.quick:
            w = quick_workload(w)
        results[key] = print_rows(w, compare(w, defaults, args.seeds))
    print()
    worst = []
    for key, r in results.items():
        lif, abort = r["verl least-in-flight"], r["verl abort-and-resubmit"]
        alone, pooled = r["this router"], r["pooled engine (reference)"]
        for who, mig in (("router + migration", r["this router + KV migration (simulated)"]),
                         ("router + migration + hand-back", r[HAND_BACK])):
            print(f"{key} (means over seeds): {who} vs least-in-flight "
                  f"{1 - (mig / lif).mean():+.1%} (target >= +15% on 235B), vs abort-and-resubmit "
                  f"{1 - (mig / abort).mean():+.1%} (>= +5%), vs pooled {(mig / pooled).mean() - 1:+.1%} "
                  f"(<= +5%)")
            worst.append((who, key, float((1 - mig / lif).min())))
        print(f"{key}: pooled vs least-in-flight {1 - (pooled / lif).mean():+.1%}; router alone vs "
              f"least-in-flight {1 - (alone / lif).mean():+.1%}")
        worst.append(("router alone", key, float((1 - alone / lif).min())))
    for who in ("router + migration", "router + migration + hand-back", "router alone") if worst else ():
        mine = [x for x in worst if x[0] == who]
        low = min(mine, key=lambda x: x[2])
        print(f"{who} never worse than verl's least-in-flight on any scenario and seed: "
              f"{'yes' if low[2] >= 0 else 'NO'} (worst {low[2]:+.1%}, {low[1]})")
    for key in args.scenarios.split(","):
        w = SCENARIOS[key]
        w = quick_workload(w) if args.quick else w
        if not args.no_sweep and not args.what_ifs_only:
            sweep(w, defaults, args.seeds)
        if not args.no_sweep:
            what_ifs(w, defaults, args.seeds)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"(simulated in {time.perf_counter() - t0:.0f} s; load average {load:.1f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
