"""Which running requests move between server replicas, where, and how (verl 0.9 tail migration).

The decision a migration controller makes every few seconds from what it can really read: per
replica, its running requests (prompt and generated tokens) and queued ones, its KV capacity
and slots; per request, an expected response length (the router's estimate: finished GRPO
siblings, the same prompt in past steps, else the servers' mean). Pure and deterministic (no
clock, no numpy, no verl/vLLM): the long-tail simulator (``benchmarks/bench_rollout_router.py``)
drives exactly this code, and a real controller drives it with the same observations.

Why moves help (and what they are measured against). A replica's decode step costs
``StepCostModel.step_ms(running, context)``: a base that grows with the batch (decode is
memory-bound at small batches) plus attention over the context it holds. A request finishes
after its remaining tokens times its replica's step time, so the rollout's makespan is set by
the replica whose longest-remaining request runs on the slowest steps. The planner equalises
that: it repeatedly takes the replica whose *horizon* (its longest expected remaining tokens
times its step time) is the largest and moves that request to the replica where it would
finish earliest, if that makes it finish earlier by more than the move costs and leaves the
destination's horizon below the source's (so the maximum falls). Requests a replica holds
queued (preempted, or not admitted for lack of KV) move to a replica with room.

Per request, the move is the cheaper of two, by a cost model with every figure stated:

* with its KV (``TransferCostModel.kv_seconds``): prompt + generated tokens times the KV bytes per
  token over the link; the request pauses meanwhile, the destination keeps decoding (vLLM's
  KV-connector loads asynchronously: the request waits for its remote KV);
* by re-prefill at the destination (what verl's abort-and-resubmit costs): prompt + generated
  tokens at the destination's prefill rate, stalling that replica's batch meanwhile.

A running request moves only if its expected gain (remaining tokens times the step-time
difference) exceeds that cost plus ``margin_s``; the figures are uncalibrated defaults of the
simulator (``StepCostModel`` fitted to the Qwen3 RL recipe doc's TPOT figures; the link a
conservative 20 GB/s, below the A3 RDMA plane's quoted 400 Gbit/s per NPU); only an NPU run
calibrates them.

Expected remaining tokens (``expected_remaining``): the router's expected response minus what
is generated, but never less than a multiple (``survival``) of what is already generated:
response lengths are heavy-tailed, so a request that has already run long is likely to run
long again (the estimate a scheduler without an oracle can use), and never more than the
rollout's maximum response minus what is generated. An expected response at or above the
maximum (what a controller with no estimate passes: the request's ``max_tokens``, the live
client's default) carries no information: the survival rule alone decides. Taken literally it
made every request look equally long (the maximum minus what it generated), so the planner
moved the youngest requests, not the long-running ones: in the long-tail simulator
(``benchmarks/bench_rollout_router.py``, 235B workload, the client's view, router kv_budget 16,
a plan every 5 s, 3 seeds) +3.6 % over verl's router taken literally, +7.5 % with the survival
rule, about what the router's own estimates give (+7.6 %). ``survival`` 2 (the default; the
expected remaining tokens of a request at least twice what it has run: a log-normal's mean
residual length grows with age) against 1: +11.1 % against +10.3 % on that workload (kv_budget
2.5, a plan every 2 s, 3 seeds; 4: +11.2 %, 8: +11.1 %, 0.5: +9.9 %), the same on the DAPO and 8K
math workloads.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

METHODS = ("kv", "prefill", "queued")


@dataclass(frozen=True)
class StepCostModel:
    """Decode step time of one replica: ``base(padded batch) + attention_ms_per_token x context``.

    ``base_ms`` maps batch sizes to milliseconds (linear between points, flat beyond the ends);
    ``graph_sizes`` is the captured-graph ladder a batch is padded to (beyond it: unpadded)."""

    base_ms: tuple[tuple[int, float], ...]
    attention_ms_per_token: float
    graph_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.base_ms or any(b <= 0 or ms <= 0 for b, ms in self.base_ms):
            raise ValueError(f"base_ms={self.base_ms!r}: accepted (batch > 0, ms > 0) pairs")
        if list(self.base_ms) != sorted(self.base_ms):
            raise ValueError(f"base_ms={self.base_ms!r}: accepted pairs in ascending batch order")
        if not self.attention_ms_per_token >= 0:
            raise ValueError(f"attention_ms_per_token={self.attention_ms_per_token!r}: accepted a number >= 0")

    def padded(self, running: int) -> int:
        if running <= 0:
            return 0
        i = bisect_left(self.graph_sizes, running)
        return self.graph_sizes[i] if i < len(self.graph_sizes) else running

    def base(self, batch: float) -> float:
        points = self.base_ms
        if batch <= points[0][0]:
            return points[0][1]
        if batch >= points[-1][0]:
            return points[-1][1]
        i = bisect_left([b for b, _ in points], batch)
        (b0, m0), (b1, m1) = points[i - 1], points[i]
        return m0 + (m1 - m0) * (batch - b0) / (b1 - b0)

    def step_ms(self, running: int, context_tokens: float) -> float:
        if running <= 0:
            return 0.0
        return self.base(self.padded(running)) + self.attention_ms_per_token * context_tokens


@dataclass(frozen=True)
class TransferCostModel:
    """What one move costs, in seconds (uncalibrated: figures of the simulator's scenario)."""

    kv_bytes_per_token: float  # per rank of the replica (ranks transfer their shards in parallel)
    link_bytes_per_s: float  # per rank, the KV connector's achieved point-to-point bandwidth
    prefill_tokens_per_s: float  # per replica
    move_overhead_s: float = 0.05  # abort at the source, resubmit, connector handshake

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "link_bytes_per_s", "prefill_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: accepted a number > 0")
        if not self.move_overhead_s >= 0:
            raise ValueError(f"move_overhead_s={self.move_overhead_s!r}: accepted a number >= 0")

    def kv_seconds(self, tokens: int) -> float:
        return self.move_overhead_s + tokens * self.kv_bytes_per_token / self.link_bytes_per_s

    def prefill_seconds(self, tokens: int) -> float:
        return self.move_overhead_s + tokens / self.prefill_tokens_per_s


# The live policy's defaults (``migration_client.PlannedMigration``), uncalibrated: the
# simulator's figures. Step: ``bench_rollout_rebalance``'s fit to the Qwen3 RL recipe doc's
# TPOT (base by graph batch, 75 ms of attention over a full 850K-token KV cache, graph ladder
# 4-64). Transfer: Qwen3-235B at TP4 (94 layers x K,V x 1 KV head x 128 x bf16 = 48128 bytes
# per token per rank), an assumed 20 GB/s link, 8000 prefill tokens/s per replica.
UNCALIBRATED_STEP = StepCostModel(((4, 50.0), (8, 52.0), (16, 56.0), (32, 64.0), (64, 80.0),
                                   (128, 96.0), (256, 124.0)), 75.0 / 850_000, (4, 8, 16, 32, 64))
UNCALIBRATED_TRANSFER = TransferCostModel(94 * 2 * 1 * 128 * 2, 20e9, 8000.0)


@dataclass(frozen=True)
class TailSettings:
    """How eagerly the planner moves."""

    margin_s: float = 1.0  # a move must gain this much more than it costs
    survival: float = 2.0  # expected remaining >= survival x generated (heavy tails)
    growth_reserve_tokens: int = 2048  # KV left per request at the destination after a move
    # True: a destination must also hold every request's expected growth (``expected_remaining``
    # summed over what it runs, the moved request included), not only the reserve above: a
    # moved request starts there as the newest, vLLM's first preemption victim once its KV runs
    # out (DESIGN.md, 'The live trigger and the planner', says when it matters)
    reserve_expected_growth: bool = False
    moves_per_replica: int = 2  # moves a replica sends or receives per round
    max_moves: int = 64  # moves per round, all replicas

    def __post_init__(self) -> None:
        if not self.margin_s >= 0:
            raise ValueError(f"margin_s={self.margin_s!r}: accepted a number >= 0")
        if not self.survival >= 0:
            raise ValueError(f"survival={self.survival!r}: accepted a number >= 0")
        for name in ("growth_reserve_tokens", "moves_per_replica", "max_moves"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 0):
                raise ValueError(f"{name}={value!r}: accepted an integer >= 0")
        if not isinstance(self.reserve_expected_growth, bool):
            raise ValueError(f"reserve_expected_growth={self.reserve_expected_growth!r}: accepted True or False")


@dataclass(frozen=True)
class RequestView:
    """One request as the controller sees it."""

    request_id: str
    prompt_tokens: int
    generated_tokens: int
    expected_response_tokens: float  # the router's estimate for its prompt (group)
    # False: no client can move it (refused by ``check_migratable``, or not submitted by a
    # migrating client); it counts as its replica's load and is never planned to move
    movable: bool = True

    @property
    def tokens(self) -> int:
        """What it holds in KV (and what a re-prefill recomputes)."""
        return self.prompt_tokens + self.generated_tokens


@dataclass
class ReplicaView:
    """One replica as the controller sees it."""

    server_id: str
    kv_capacity_tokens: int
    slots: int
    running: list[RequestView] = field(default_factory=list)
    queued: list[RequestView] = field(default_factory=list)  # preempted or not admitted: no KV held

    def context(self) -> int:
        return sum(r.tokens for r in self.running)


@dataclass(frozen=True)
class Move:
    """One decision: ``request_id`` goes from ``source`` to ``destination``."""

    request_id: str
    source: str
    destination: str
    method: str  # 'kv' (with its KV), 'prefill' (re-prefill there), 'queued' (held no KV)
    cost_s: float  # the request's pause (kv) or the destination's stall (prefill, queued)
    gain_s: float  # how much earlier the request is expected to finish


def expected_remaining(request: RequestView, max_response_tokens: int, survival: float) -> float:
    """Expected tokens still to generate (see the module docstring)."""
    if max_response_tokens and request.expected_response_tokens >= max_response_tokens:
        left = 0.0  # an expectation at the cap carries no information: the survival rule alone
    else:
        left = request.expected_response_tokens - request.generated_tokens
    guess = max(left, survival * request.generated_tokens, 1.0)
    if max_response_tokens:
        guess = min(guess, max(max_response_tokens - request.generated_tokens, 1))
    return float(guess)


class _Book:
    """One replica's state as the planner updates it while it plans a round."""

    def __init__(self, view: ReplicaView, remaining: dict[str, float]):
        self.view = view
        self.running = list(view.running)
        self.remaining = remaining
        self.context = view.context()
        self.moves = 0
        self.growth = sum(remaining[r.request_id] for r in self.running)  # expected tokens still to come

    def step_ms(self, model: StepCostModel, extra_requests: int = 0, extra_tokens: int = 0) -> float:
        return model.step_ms(len(self.running) + extra_requests, self.context + extra_tokens)

    def longest(self) -> RequestView | None:
        if not self.running:
            return None
        return max(self.running, key=lambda r: (self.remaining[r.request_id], r.request_id))

    def horizon_s(self, model: StepCostModel) -> float:
        top = self.longest()
        return 0.0 if top is None else self.remaining[top.request_id] * self.step_ms(model) / 1000

    def room(self) -> int:
        """KV tokens free once every running request keeps its growth reserve (set by plan)."""
        return self.view.kv_capacity_tokens - self.context

    def has_slot(self) -> bool:
        return len(self.running) < self.view.slots


def plan_moves(replicas: list[ReplicaView], step: StepCostModel, transfer: TransferCostModel,
               max_response_tokens: int = 0, settings: TailSettings | None = None) -> list[Move]:
    """One round of moves (see the module docstring). Deterministic: ties go by position and
    request id. Every running move has ``gain_s > cost_s + margin_s``."""
    settings = settings or TailSettings()
    remaining = {r.request_id: expected_remaining(r, max_response_tokens, settings.survival)
                 for v in replicas for r in v.running}
    books = [_Book(v, remaining) for v in replicas]
    reserve = settings.growth_reserve_tokens
    moves: list[Move] = []

    def fits(book: _Book, tokens: int, left: float) -> bool:
        """Room at ``book`` for a request holding ``tokens`` with ``left`` expected to come."""
        need = (len(book.running) + 1) * reserve
        if settings.reserve_expected_growth:
            need = max(need, book.growth + left)
        return book.has_slot() and book.room() - tokens >= need

    # 1. queued requests (they hold no KV) to a replica that can start them now
    for src in books:
        for request in list(src.view.queued):
            if len(moves) >= settings.max_moves:
                return moves
            left = expected_remaining(request, max_response_tokens, settings.survival)
            dst = min((b for b in books if b is not src and not b.view.queued
                       and b.moves < settings.moves_per_replica and fits(b, request.tokens, left)),
                      key=lambda b: (b.step_ms(step, 1, request.tokens), b.view.server_id), default=None)
            if dst is None:
                break
            cost = transfer.prefill_seconds(request.tokens)
            moves.append(Move(request.request_id, src.view.server_id, dst.view.server_id, "queued",
                              cost, 0.0))
            dst.running.append(request)
            dst.context += request.tokens
            remaining[request.request_id] = left
            dst.growth += left
            dst.moves += 1

    # 2. the longest-horizon replica's longest request to where it finishes earliest
    done: set[str] = {m.request_id for m in moves}
    pinned_top: set[str] = set()   # replicas whose longest request cannot move
    while len(moves) < settings.max_moves:
        candidates = [b for b in books if b.moves < settings.moves_per_replica and b.running
                      and b.view.server_id not in pinned_top]
        if not candidates:
            break
        src = max(candidates, key=lambda b: (b.horizon_s(step), b.view.server_id))
        request = src.longest()
        if request.request_id in done:
            break
        if not request.movable:
            # the replica's horizon is a request nobody can move: no move shortens it, and a
            # planned move nobody carries out would still spend the round's moves
            pinned_top.add(src.view.server_id)
            continue
        left = remaining[request.request_id]
        src_step_s = src.step_ms(step) / 1000
        finish_here = left * src_step_s
        src.running.remove(request)
        src.context -= request.tokens
        src.growth -= left
        best = None
        for dst in books:
            if dst is src or dst.moves >= settings.moves_per_replica or not fits(dst, request.tokens, left):
                continue
            by_kv = transfer.kv_seconds(request.tokens)
            by_prefill = transfer.prefill_seconds(request.tokens)
            method, cost = ("kv", by_kv) if by_kv <= by_prefill else ("prefill", by_prefill)
            dst_step_s = dst.step_ms(step, 1, request.tokens) / 1000
            finish_there = cost + left * dst_step_s
            top = dst.longest()
            stall = cost if method == "prefill" else 0.0
            dst_after = stall + (remaining[top.request_id] * dst_step_s if top is not None else 0.0)
            gain = left * (src_step_s - dst_step_s)  # its remaining decode, on faster steps
            if gain <= cost + settings.margin_s or max(finish_there, dst_after) >= finish_here:
                continue
            key = (finish_there, dst.view.server_id)
            if best is None or key < best[0]:
                best = (key, dst, method, cost, gain)
        if best is None:
            src.running.append(request)  # stays; nothing better for the worst replica: done
            src.context += request.tokens
            src.growth += left
            break
        _, dst, method, cost, gain = best
        moves.append(Move(request.request_id, src.view.server_id, dst.view.server_id, method, cost, gain))
        done.add(request.request_id)
        dst.running.append(request)
        dst.context += request.tokens
        dst.growth += left
        src.moves += 1
        dst.moves += 1
    return moves
