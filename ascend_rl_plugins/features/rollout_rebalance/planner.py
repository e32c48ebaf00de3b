"""Rollout rebalance planner: which unfinished requests move between DP ranks.

Pure and deterministic: every DP rank gathers the same per-rank load and computes the same
plan locally, so no rank has to broadcast a decision. Objectives, in strict order:

1. clear waiting queues (requests a rank cannot admit: over its slot limit, or stuck behind
   a full KV cache) by moving them to ranks with free slots and KV blocks;
2. minimize the largest graph bucket any rank runs (in a synchronous DP rollout every rank
   steps at the pace of the slowest, and a step's time is set by its padded graph batch);
3. move as little as possible: the minimum number of requests (every donor sheds exactly its
   surplus), each the cheapest one to move, where a request's cost is the smaller of sending
   its KV blocks and re-computing its prefill at the destination;
4. spread flows: donors and receivers are paired largest-first, which gives at most
   ``donors + receivers - 1`` flows, so a receiver hears from one or two senders, not many.

Complexity: O(R log R) over ranks plus O(1) per moved request. Each rank reports its requests
already in canonical move order (cheapest first, :func:`move_key`), sorted locally where the
state lives, so the planner never sorts requests and needs no numpy. No torch/vLLM here.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Iterable, Mapping, NamedTuple, Sequence

# -- inputs and outputs ------------------------------------------------------------------


@dataclass(frozen=True)
class PlannerConfig:
    """Knobs of the plan. ``graph_sizes``: the pre-captured graph batch-size ladder."""

    graph_sizes: tuple[int, ...] = (4, 8, 16, 32, 64)
    kv_migration: bool = True  # False: every move is by recompute (no KV transfer)
    kv_always: bool = False  # True: running requests always move with their KV (no cost choice)
    kv_bytes_per_token: float = 2 * 2 * 2 * 64  # all layers' K+V bytes per token (the engine
    # adapter sets it from the real KV cache tensors; this default is only a placeholder)
    link_bytes_per_s: float = 20e9  # point-to-point bandwidth used for KV transfer
    prefill_tokens_per_s: float = 20000.0  # destination prefill throughput (recompute cost)
    kv_headroom: float = 0.05  # fraction of a receiver's KV blocks kept free after moves

    def __post_init__(self) -> None:
        sizes = tuple(self.graph_sizes)
        if not sizes or any((not isinstance(s, int)) or s <= 0 for s in sizes):
            raise ValueError(f"graph_sizes={self.graph_sizes!r}: expected positive integers "
                             f"(the pre-captured graph batch sizes), e.g. (4, 8, 16, 32, 64)")
        object.__setattr__(self, "graph_sizes", tuple(sorted(set(int(s) for s in sizes))))
        for name in ("kv_bytes_per_token", "link_bytes_per_s", "prefill_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PlannerConfig.{name}={getattr(self, name)!r}: must be > 0")
        if not 0.0 <= self.kv_headroom < 1.0:
            raise ValueError(f"PlannerConfig.kv_headroom={self.kv_headroom!r}: must be in [0, 1)")


@dataclass
class RankLoad:
    """What one DP rank reports. Request lists are parallel and in canonical move order
    (:func:`move_key`; use :meth:`from_requests` or :meth:`canonical`)."""

    rank: int
    request_ids: Sequence[str]
    num_tokens: Sequence[int]  # tokens whose KV the request holds (or needs): prompt + output
    waiting: Sequence[bool]  # True: queued (no KV held), False: running
    kv_blocks_used: int
    kv_blocks_total: int
    block_size: int
    max_num_seqs: int

    @classmethod
    def from_dict(cls, d: Mapping) -> "RankLoad":
        return cls(int(d["rank"]), list(d["request_ids"]), list(d["num_tokens"]),
                   list(d["waiting"]), int(d["kv_blocks_used"]), int(d["kv_blocks_total"]),
                   int(d["block_size"]), int(d["max_num_seqs"]))

    @classmethod
    def from_requests(cls, rank: int, requests: Mapping[str, tuple[int, bool]], *,
                      kv_blocks_used: int, kv_blocks_total: int, block_size: int,
                      max_num_seqs: int) -> "RankLoad":
        """Build from ``{request_id: (num_tokens, waiting)}`` in canonical move order."""
        ids = sorted(requests, key=lambda i: move_key(i, requests[i][0], requests[i][1]))
        return cls(rank, ids, [int(requests[i][0]) for i in ids],
                   [bool(requests[i][1]) for i in ids], kv_blocks_used, kv_blocks_total,
                   block_size, max_num_seqs)

    def canonical(self) -> "RankLoad":
        """The same load in canonical move order (what :func:`plan` expects)."""
        order = sorted(range(len(self.request_ids)), key=lambda i: move_key(
            self.request_ids[i], self.num_tokens[i], self.waiting[i]))
        return RankLoad(self.rank, [self.request_ids[i] for i in order],
                        [int(self.num_tokens[i]) for i in order],
                        [bool(self.waiting[i]) for i in order], self.kv_blocks_used,
                        self.kv_blocks_total, self.block_size, self.max_num_seqs)

    def to_dict(self) -> dict:
        return {"rank": self.rank, "request_ids": list(self.request_ids),
                "num_tokens": [int(x) for x in self.num_tokens],
                "waiting": [bool(x) for x in self.waiting], "kv_blocks_used": self.kv_blocks_used,
                "kv_blocks_total": self.kv_blocks_total, "block_size": self.block_size,
                "max_num_seqs": self.max_num_seqs}


class Migration(NamedTuple):
    """Move one request from ``src`` to ``dst``; ``with_kv`` False means re-run its prefill."""

    request_id: str
    src: int
    dst: int
    with_kv: bool
    num_tokens: int
    blocks: int
    bytes: int


@dataclass
class Plan:
    migrations: list[Migration] = field(default_factory=list)
    bucket_before: int = 0
    bucket_after: int = 0
    waiting_before: int = 0
    waiting_after: int = 0
    target: int = 0  # the per-rank request count the plan aims at
    total: int = 0  # migrations in the whole plan (``migrations`` may list one rank's share)

    def __bool__(self) -> bool:
        return bool(self.total or self.migrations)

    @property
    def bytes_moved(self) -> int:
        return sum(m.bytes for m in self.migrations)


# -- helpers -------------------------------------------------------------------------------

def bucket(count: int, graph_sizes: Sequence[int]) -> int:
    """Padded graph batch a rank runs with ``count`` running requests (0 when idle; beyond the
    ladder the batch runs unpadded, eagerly)."""
    if count <= 0:
        return 0
    i = bisect_left(graph_sizes, count)
    return graph_sizes[i] if i < len(graph_sizes) else count


# -- the planner --------------------------------------------------------------------------

def move_key(request_id: str, num_tokens: int, waiting: bool) -> tuple:
    """Canonical order of a rank's requests: cheapest to move first. Queued requests hold no
    KV (moving them is free); a running request's cost, min(KV transfer, recompute), grows
    with its token count; the id breaks ties so listing order never matters."""
    return (not waiting, num_tokens, request_id)


class _Cluster:
    """The gathered state, with O(1) work per rank; requests are touched only when moved."""

    def __init__(self, loads: Iterable[RankLoad | Mapping], config: PlannerConfig):
        ranks = [x if isinstance(x, RankLoad) else RankLoad.from_dict(x) for x in loads]
        ranks.sort(key=lambda r: r.rank)
        self.loads = ranks
        self.config = config
        self.counts = counts = []
        self.free_blocks = []
        self.stuck = []
        self.n_waiting = []
        self.max_seqs = [r.max_num_seqs for r in ranks]
        headroom = config.kv_headroom
        free_blocks, stuck, n_waiting = self.free_blocks, self.stuck, self.n_waiting
        previous = None
        for r in ranks:
            if r.rank == previous:
                raise ValueError(f"rank {r.rank} is reported twice")
            previous = r.rank
            n = len(r.request_ids)
            if not (n == len(r.num_tokens) == len(r.waiting)):
                raise ValueError(f"rank {r.rank}: request_ids, num_tokens and waiting differ in "
                                 f"length ({n}, {len(r.num_tokens)}, {len(r.waiting)})")
            counts.append(n)
            total = r.kv_blocks_total
            free = total - r.kv_blocks_used - int(-(-headroom * total // 1))  # ceil reserve
            free_blocks.append(free if free > 0 else 0)
            waiting = r.waiting
            w = waiting.count(True) if type(waiting) is list else sum(map(bool, waiting))
            n_waiting.append(w)  # queued ones come first in canonical order
            if not w:
                stuck.append(0)
                continue
            over = n - r.max_num_seqs if n > r.max_num_seqs else 0
            # queued beyond the slot limit, or queued while the KV cache cannot take any
            smallest = (int(r.num_tokens[0]) + r.block_size) // r.block_size
            stuck.append(w if (w > over and smallest > free) else min(over, w))

    def blocks(self, d: int, first: int, k: int) -> list[int]:
        """KV blocks (incl. the next token's slot) of donor ``d``'s moves ``first..first+k``."""
        bs = self.loads[d].block_size
        return [(int(t) + bs) // bs for t in self.loads[d].num_tokens[first:first + k]]


def _assign(cl: _Cluster, target: int, allow_partial: bool):
    """Pair donors (above ``target``, or holding stuck requests) with receivers (below it).

    Returns flows [(donor, receiver, first, count)] where ``first..first+count`` index the
    donor's move order, or None when ``target`` is unreachable and not ``allow_partial``."""
    donors = []
    receivers = []
    for i, load in enumerate(cl.loads):
        limit = min(target, load.max_num_seqs)
        surplus = max(cl.counts[i] - limit, cl.stuck[i])
        if surplus > 0:
            donors.append((-surplus, i))
        elif cl.counts[i] < limit and cl.free_blocks[i] > 0:
            receivers.append([-(limit - cl.counts[i]), i, cl.free_blocks[i]])
    if not donors:
        return []
    if not allow_partial and -sum(d[0] for d in donors) > -sum(r[0] for r in receivers):
        return None
    donors.sort()  # largest surplus first, rank breaks ties: few, large flows
    receivers.sort()
    for rc in receivers:
        rc[0] = -rc[0]
    flows = []
    ri = 0
    for neg, d in donors:
        surplus = -neg
        taken = 0
        while surplus > 0 and ri < len(receivers):
            rc = receivers[ri]
            want = min(surplus, rc[0])
            need = list(accumulate(cl.blocks(d, taken, want)))
            fit = bisect_right(need, rc[2])
            if fit > 0:
                flows.append((d, rc[1], taken, fit))
                taken += fit
                surplus -= fit
                rc[0] -= fit
                rc[2] -= need[fit - 1]
            if fit < want or rc[0] == 0:
                ri += 1  # this receiver is full (slots, or blocks for the next request)
        if surplus > 0 and not allow_partial:
            return None
    return flows


def _predict(cl: _Cluster, flows, config: PlannerConfig) -> tuple[int, int]:
    """(largest bucket, total stuck requests) once ``flows`` are applied."""
    counts = list(cl.counts)
    stuck = list(cl.stuck)
    for d, rc, first, k in flows:
        counts[d] -= k
        counts[rc] += k
        # queued requests come first in a donor's move order
        stuck[d] = max(0, cl.stuck[d] - (first + k))
    largest = max(map(min, counts, cl.max_seqs))  # bucket() is monotone
    over = sum(c - s for c, s in zip(counts, cl.max_seqs) if c > s)
    return bucket(largest, config.graph_sizes), max(sum(stuck), over)


def plan(loads: Iterable[RankLoad | Mapping], config: PlannerConfig | None = None, *,
         for_rank: int | None = None) -> Plan:
    """The migrations that best rebalance ``loads`` (see the module docstring).

    Each rank lists its requests in canonical move order (:func:`move_key`; build loads with
    :meth:`RankLoad.from_requests` or :meth:`RankLoad.canonical`): the order is computed where
    the state is, in parallel, and the planner never sorts requests. Ranks may come in any
    order. ``for_rank``: list only the migrations this rank sends or receives (every rank
    still computes the whole plan's flows; it just does not materialize others' requests).
    """
    config = config or PlannerConfig()
    cl = _Cluster(loads, config)
    bucket_before, waiting_before = _predict(cl, [], config)
    result = Plan(bucket_before=bucket_before, bucket_after=bucket_before,
                  waiting_before=waiting_before, waiting_after=waiting_before)
    if len(cl.loads) < 2:
        return result
    total = sum(cl.counts)
    most = max(load.max_num_seqs for load in cl.loads)
    lower = -(-total // len(cl.loads))
    candidates = [s for s in config.graph_sizes if lower <= s < most] + [most]
    chosen = None
    for target in candidates:
        if waiting_before == 0 and bucket(target, config.graph_sizes) >= bucket_before:
            break  # no smaller bucket is reachable
        flows = _assign(cl, target, allow_partial=False)
        if flows is not None:
            chosen = (target, flows)
            break
    if chosen is None and waiting_before:
        chosen = (most, _assign(cl, most, allow_partial=True))  # un-stick what fits
    if chosen is None or not chosen[1]:
        return result
    target, flows = chosen
    bucket_after, waiting_after = _predict(cl, flows, config)
    if not (waiting_after < waiting_before
            or (waiting_after == waiting_before and bucket_after < bucket_before)):
        return result
    migrations = []
    kv_on, kv_always = config.kv_migration, config.kv_always
    for d, rc, first, k in flows:
        src = cl.loads[d]
        dst = cl.loads[rc].rank
        if for_rank is not None and for_rank != src.rank and for_rank != dst:
            continue
        block_bytes = src.block_size * config.kv_bytes_per_token
        # KV transfer beats recompute when blocks*block_bytes/link < tokens/prefill
        per_token_recompute = config.link_bytes_per_s / config.prefill_tokens_per_s
        ids, tokens, waiting = src.request_ids, src.num_tokens, src.waiting
        for i, blocks in zip(range(first, first + k), cl.blocks(d, first, k)):
            kv = kv_on and not waiting[i] and (
                kv_always or blocks * block_bytes < int(tokens[i]) * per_token_recompute)
            migrations.append(Migration(str(ids[i]), src.rank, dst, kv, int(tokens[i]), blocks,
                                        int(blocks * block_bytes) if kv else 0))
    result.migrations = migrations
    result.total = sum(k for _, _, _, k in flows)
    result.bucket_after = bucket_after
    result.waiting_after = waiting_after
    result.target = target
    return result
