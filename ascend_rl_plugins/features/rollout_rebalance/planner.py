"""Rollout rebalance planner: which unfinished requests move between DP ranks.

Pure and deterministic: every DP rank gathers the same per-rank load and computes the same
plan locally, so no rank has to broadcast a decision. Objectives, in strict order:

1. clear waiting queues (requests a rank cannot admit: over its slot limit, or stuck behind
   a full KV cache) by moving them to ranks with free slots and KV blocks;
2. minimize the largest graph bucket any rank runs (in a synchronous DP rollout every rank
   steps at the pace of the slowest, and a step's time is set by its padded graph batch);
3. no rank preempts while another has room: each rank's running requests are projected
   ``lookahead_steps`` ahead (each grows one token per step); a rank that would outgrow its
   KV blocks sends its next running requests, with their KV, to ranks whose running requests
   leave projected room (a second pass that keeps the waiting count and bucket the first two
   objectives reached; ``Plan.overflow_before/after`` is the projected shortfall in blocks).
   Running requests come before a receiver's own queue, as in one scheduler over the group:
   preempting a running request costs its whole prefill again, while moving its KV costs
   ~1/50 of that (Qwen3-235B, 20 GB/s vs 8K tokens/s);
4. move as little as possible: the minimum number of requests (every donor sheds exactly its
   surplus, or just covers its projected shortfall), each the cheapest one to move, where a
   request's cost is the smaller of sending its KV blocks and re-computing its prefill at the
   destination;
5. spread flows: donors and receivers are paired largest-first, which gives at most
   ``donors + receivers - 1`` flows per pass, so a receiver hears from one or two senders.

Speed (a round must not stall decoding): ranks gather their loads packed
(:meth:`RankLoad.pack`: request ids plus the raw bytes of one int64 array), the planner joins
them with one copy and decides the whole plan in one numba-compiled pass (``_plan_kernel``:
O(ranks + requests) to read, one pass over ranks to pair donors with receivers, O(1) per
moved request); each rank then lists only its own share (``for_rank``). Each rank reports
its requests already in canonical move order (cheapest first, :func:`move_key`), sorted
locally where the state lives, so the planner never sorts requests. Every decision is
integer arithmetic except the KV-or-recompute choice (one comparison of two float products
per moved request, the same IEEE operations everywhere), so every rank computes the same
plan, compiled or not: without numba the same kernel source runs as Python (slowly). No
torch/vLLM here; numpy and numba are imported only when this module is (lazily, by the
engine, when a rebalanced generate starts).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import repeat
from operator import getitem
from typing import Iterable, Mapping, NamedTuple, Sequence

import numpy as np

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
    lookahead_steps: int = 64  # decode steps the KV projection looks ahead: set it to the
    # check interval (steps until the next chance to rebalance); 0: no growth projected

    def __post_init__(self) -> None:
        sizes = tuple(self.graph_sizes)
        if not sizes or any((not isinstance(s, int)) or s <= 0 for s in sizes):
            raise ValueError(f"graph_sizes={self.graph_sizes!r}: expected positive integers "
                             f"(the pre-captured graph batch sizes), e.g. (4, 8, 16, 32, 64)")
        object.__setattr__(self, "graph_sizes", tuple(sorted(set(int(s) for s in sizes))))
        object.__setattr__(self, "_sizes_array", np.array(self.graph_sizes, dtype=np.int64))
        for name in ("kv_bytes_per_token", "link_bytes_per_s", "prefill_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PlannerConfig.{name}={getattr(self, name)!r}: must be > 0")
        if not 0.0 <= self.kv_headroom < 1.0:
            raise ValueError(f"PlannerConfig.kv_headroom={self.kv_headroom!r}: must be in [0, 1)")
        if not (isinstance(self.lookahead_steps, int) and self.lookahead_steps >= 0):
            raise ValueError(f"PlannerConfig.lookahead_steps={self.lookahead_steps!r}: must be an "
                             f"integer >= 0 (decode steps until the next check)")


_HEADER = 6  # packed load: rank, kv used, kv total, block size, max_num_seqs, queued count


@dataclass(eq=False)
class RankLoad:
    """What one DP rank reports. Request fields are parallel and in canonical move order
    (:func:`move_key`; use :meth:`from_requests` or :meth:`canonical`). ``num_tokens`` and
    ``waiting`` may be sequences; the constructors make them numpy arrays (int64, bool) so
    that gathering and planning never touch a request as a Python object."""

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
        return cls(int(d["rank"]), list(d["request_ids"]),
                   np.asarray(d["num_tokens"], dtype=np.int64),
                   np.asarray(d["waiting"], dtype=bool), int(d["kv_blocks_used"]),
                   int(d["kv_blocks_total"]), int(d["block_size"]), int(d["max_num_seqs"]))

    @classmethod
    def from_requests(cls, rank: int, requests: Mapping[str, tuple[int, bool]], *,
                      kv_blocks_used: int, kv_blocks_total: int, block_size: int,
                      max_num_seqs: int) -> "RankLoad":
        """Build from ``{request_id: (num_tokens, waiting)}`` in canonical move order."""
        ids = sorted(requests, key=lambda i: move_key(i, requests[i][0], requests[i][1]))
        return cls(rank, ids, np.array([requests[i][0] for i in ids], dtype=np.int64),
                   np.array([bool(requests[i][1]) for i in ids], dtype=bool),
                   int(kv_blocks_used), int(kv_blocks_total), int(block_size),
                   int(max_num_seqs))

    def canonical(self) -> "RankLoad":
        """The same load in canonical move order (what :func:`plan` expects)."""
        return RankLoad.from_requests(
            self.rank, {i: (int(t), bool(w)) for i, t, w in
                        zip(self.request_ids, self.num_tokens, self.waiting)},
            kv_blocks_used=self.kv_blocks_used, kv_blocks_total=self.kv_blocks_total,
            block_size=self.block_size, max_num_seqs=self.max_num_seqs)

    def pack(self) -> tuple[list, bytes]:
        """The compact form ranks gather and :func:`plan` reads fastest: ``(request_ids,
        values)``, ``values`` the raw bytes of one int64 array ``[rank, kv_blocks_used,
        kv_blocks_total, block_size, max_num_seqs, number queued, *num_tokens]`` (queued
        requests first). Bytes, not an array: they pickle and unpickle several times faster
        than a small numpy array, and the planner joins them with one copy."""
        load = self
        waiting = np.asarray(self.waiting, dtype=bool)
        queued = int(np.count_nonzero(waiting))
        if not waiting[:queued].all():
            load = self.canonical()
        values = np.empty(_HEADER + len(load.request_ids), dtype=np.int64)
        values[:_HEADER] = (self.rank, self.kv_blocks_used, self.kv_blocks_total,
                            self.block_size, self.max_num_seqs, queued)
        values[_HEADER:] = load.num_tokens
        return list(map(str, load.request_ids)), values.tobytes()

    def to_dict(self) -> dict:
        """Picklable and compact (numpy arrays pickle as raw bytes): what ranks gather."""
        return {"rank": self.rank, "request_ids": list(self.request_ids),
                "num_tokens": np.asarray(self.num_tokens, dtype=np.int64),
                "waiting": np.asarray(self.waiting, dtype=bool),
                "kv_blocks_used": self.kv_blocks_used, "kv_blocks_total": self.kv_blocks_total,
                "block_size": self.block_size, "max_num_seqs": self.max_num_seqs}


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
    overflow_before: int = 0  # KV blocks the ranks would lack within the lookahead (summed)
    overflow_after: int = 0

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


_I64 = np.int64
_OK, _UNSORTED, _SHORT = 0, 1, 2  # kernel status


def _packed(load) -> tuple:
    if type(load) is tuple:
        return load
    if isinstance(load, RankLoad):
        return load.pack()
    return RankLoad.from_dict(load).pack()


# -- the kernel: one pass over the gathered arrays, compiled by numba ------------------------
#
# Plain Python over numpy arrays, so the same code runs uncompiled when numba is missing
# (vLLM and vLLM-Ascend both depend on numba, so that is a fallback only, and a slow one).
# All decisions are integer arithmetic; the KV-or-recompute choice is a comparison of two
# float products (no sums, so no contraction/reassociation question): every rank, compiled or
# not, computes the same plan.

try:
    from numba import njit
except ImportError:  # pragma: no cover
    def njit(*args, **kwargs):
        return args[0] if args and callable(args[0]) else (lambda f: f)


@njit(cache=True)
def _bucket(count, sizes):
    if count <= 0:
        return 0
    for s in sizes:
        if s >= count:
            return s
    return count


@njit(cache=True)
def _predict(n, max_seqs, stuck, queued, sizes, flows, nflows):
    """(largest bucket, stuck requests) once the first ``nflows`` flows are applied."""
    R = n.shape[0]
    counts = n.copy()
    gone = np.zeros(R, dtype=np.int64)  # queued requests that left each rank
    for f in range(nflows):
        d, rc, first, k = flows[f, 0], flows[f, 1], flows[f, 2], flows[f, 3]
        counts[d] -= k
        counts[rc] += k
        gone[d] += max(min(first + k, queued[d]) - first, 0)  # queued ones come first
    largest = 0
    over = 0
    left = 0
    for r in range(R):
        c = min(counts[r], max_seqs[r])
        if c > largest:
            largest = c
        if counts[r] > max_seqs[r]:
            over += counts[r] - max_seqs[r]
        left += max(stuck[r] - gone[r], 0)
    return _bucket(largest, sizes), max(left, over)


@njit(cache=True)
def _ranked(give, take):
    """Donors (ranks with ``give > 0``) and receivers (the others with ``take > 0``), each
    largest first; ties keep rank order (stable sort), so every rank ranks alike."""
    donors = np.flatnonzero(give > 0)
    receivers = np.flatnonzero((give <= 0) & (take > 0))
    return (donors[np.argsort(-give[donors], kind="mergesort")],
            receivers[np.argsort(-take[receivers], kind="mergesort")])


@njit(cache=True)
def _assign(target, allow_partial, n, max_seqs, stuck, free, cum, off, flows):
    """Pair donors (above ``target``, or holding stuck requests) with receivers (below it),
    largest surplus with largest room first (rank position breaks ties): few, large flows.
    A receiver takes a donor's next requests while its slots and free KV blocks last.
    Writes flows (donor, receiver, first, count) into ``flows``; returns their number, or
    -1 when ``target`` is unreachable and not ``allow_partial``."""
    R = n.shape[0]
    surplus = np.empty(R, dtype=np.int64)
    room = np.empty(R, dtype=np.int64)
    nd = 0
    nr = 0
    total_surplus = 0
    total_room = 0
    for r in range(R):
        limit = min(target, max_seqs[r])
        surplus[r] = max(n[r] - limit, stuck[r])
        room[r] = limit - n[r]
        if surplus[r] > 0:
            nd += 1
            total_surplus += surplus[r]
        elif room[r] > 0 and free[r] > 0:
            nr += 1
            total_room += room[r]
    if nd == 0:
        return 0
    if not allow_partial and total_surplus > total_room:
        return -1
    donors, receivers = _ranked(surplus, np.where(free > 0, room, 0))
    r_room = room[receivers]
    r_free = free[receivers]
    nflows = 0
    ri = 0
    for d in donors:
        left = surplus[d]
        lo = off[d]
        base = lo
        while left > 0 and ri < nr:
            want = min(left, r_room[ri])
            start = cum[lo]
            fit = 0  # how many of the next ``want`` requests fit in the free blocks
            while fit < want and cum[lo + fit + 1] - start <= r_free[ri]:
                fit += 1
            if fit > 0:
                flows[nflows, 0] = d
                flows[nflows, 1] = receivers[ri]
                flows[nflows, 2] = lo - base
                flows[nflows, 3] = fit
                nflows += 1
                lo += fit
                left -= fit
                r_room[ri] -= fit
                r_free[ri] -= cum[lo] - start
            if fit < want or r_room[ri] == 0:
                ri += 1  # this receiver is full (slots, or blocks for the next request)
        if left > 0 and not allow_partial:
            return -1
    return nflows


@njit(cache=True)
def _moved_blocks(R, queued, pcum, off, flows, nflows):
    """Projected KV blocks each rank gains and loses by the first ``nflows`` flows: a
    receiver gains every request (a queued one will run there), a source loses only running
    ones (its queued requests were not part of its projection)."""
    got = np.zeros(R, dtype=np.int64)
    lost = np.zeros(R, dtype=np.int64)
    for f in range(nflows):
        d, rc, first, k = flows[f, 0], flows[f, 1], flows[f, 2], flows[f, 3]
        got[rc] += pcum[off[d] + first + k] - pcum[off[d] + first]
        q = min(max(queued[d], first), first + k)  # first running index of the flow
        lost[d] += pcum[off[d] + first + k] - pcum[off[d] + q]
    return got, lost


@njit(cache=True)
def _overflow(demand, limit, got, lost):
    """Projected KV blocks the ranks' running requests lack within the lookahead, summed."""
    total = 0
    for r in range(demand.shape[0]):
        left = demand[r] + got[r] - lost[r]
        if left > limit[r]:
            total += left - limit[r]
    return total


@njit(cache=True)
def _kv_assign(nflows, bucket_cap, n, max_seqs, queued, demand, limit, pcum, off, flows):
    """Second pass, after the count plan (the first ``nflows`` flows): a rank whose running
    requests, grown by the lookahead, outgrow its KV blocks (it would preempt) sends its next
    running requests in move order, with their KV, to ranks whose running requests leave
    projected room — as one scheduler over the group would: no rank preempts while another
    has room, and running requests come before queued ones (a receiver's own queue may wait
    longer for the room; the donor keeps its queue, which its projection does not count). A
    rank that sent in the first pass does not receive, one that received does not send; a
    receiver never goes above ``bucket_cap`` requests (the bucket the first pass reached),
    so waiting and bucket stay as the first pass left them. Returns the new flow count."""
    R = n.shape[0]
    cnt = n.copy()
    nxt = queued.copy()  # a donor's next running request in move order
    sent = np.zeros(R, dtype=np.bool_)
    recv = np.zeros(R, dtype=np.bool_)
    for f in range(nflows):
        d, rc, first, k = flows[f, 0], flows[f, 1], flows[f, 2], flows[f, 3]
        cnt[d] -= k
        cnt[rc] += k
        if first + k > nxt[d]:
            nxt[d] = first + k
        sent[d] = True
        recv[rc] = True
    got, lost = _moved_blocks(R, queued, pcum, off, flows, nflows)
    excess = np.zeros(R, dtype=np.int64)
    spare = np.zeros(R, dtype=np.int64)
    room = np.zeros(R, dtype=np.int64)
    nd = 0
    nr = 0
    for r in range(R):
        left = demand[r] + got[r] - lost[r]
        if not recv[r] and left > limit[r] and nxt[r] < n[r]:
            excess[r] = left - limit[r]
            nd += 1
        elif not sent[r] and left < limit[r]:
            room[r] = min(bucket_cap, max_seqs[r]) - cnt[r]
            if room[r] > 0:
                spare[r] = limit[r] - left
                nr += 1
    if nd == 0 or nr == 0:
        return nflows
    donors, receivers = _ranked(excess, spare)
    r_room = room[receivers]
    r_spare = spare[receivers]
    ri = 0
    for d in donors:
        if ri >= nr:
            break
        left = excess[d]
        lo = off[d] + nxt[d]
        end = off[d] + n[d]
        while left > 0 and lo < end and ri < nr:
            start = pcum[lo]
            fit = 0  # the next requests, while the excess lasts and the receiver has room
            while (fit < r_room[ri] and lo + fit < end and pcum[lo + fit] - start < left
                   and pcum[lo + fit + 1] - start <= r_spare[ri]):
                fit += 1
            if fit > 0:
                flows[nflows, 0] = d
                flows[nflows, 1] = receivers[ri]
                flows[nflows, 2] = lo - off[d]
                flows[nflows, 3] = fit
                nflows += 1
                lo += fit
                left -= pcum[lo] - start
                r_room[ri] -= fit
                r_spare[ri] -= pcum[lo] - start
            if left > 0 and lo < end:
                ri += 1  # this receiver is full (slots, or spare blocks for the next request)
    return nflows


@njit(cache=True)
def _plan_kernel(flat, lens, sizes, headroom, lookahead, kv_on, kv_always, kv_bytes_per_token,
                 per_token_recompute, only_rank, for_rank):
    """The whole plan from the packed loads (``flat``: their int64 arrays concatenated,
    ``lens``: their lengths). Returns (status, bad rank position, bucket before, waiting
    before, bucket after, waiting after, target, total moves, overflow before, overflow
    after, and per listed migration: source position, source rank, destination rank, index
    in the source's move order, tokens, blocks, with KV, bytes)."""
    R = lens.shape[0]
    H = 6
    n = np.empty(R, dtype=np.int64)
    rank = np.empty(R, dtype=np.int64)
    used = np.empty(R, dtype=np.int64)
    total = np.empty(R, dtype=np.int64)
    bs = np.empty(R, dtype=np.int64)
    max_seqs = np.empty(R, dtype=np.int64)
    queued = np.empty(R, dtype=np.int64)
    e = np.zeros(0, dtype=np.int64)
    b = np.zeros(0, dtype=np.bool_)
    head = 0
    N = 0
    for r in range(R):
        if lens[r] < H:
            return _SHORT, r, 0, 0, 0, 0, 0, 0, 0, 0, e, e, e, e, e, e, b, e
        rank[r] = flat[head]
        used[r] = flat[head + 1]
        total[r] = flat[head + 2]
        bs[r] = flat[head + 3]
        max_seqs[r] = flat[head + 4]
        n[r] = lens[r] - H
        queued[r] = min(max(flat[head + 5], 0), n[r])
        if r and rank[r] <= rank[r - 1]:
            return _UNSORTED, r, 0, 0, 0, 0, 0, 0, 0, 0, e, e, e, e, e, e, b, e
        head += lens[r]
        N += n[r]
    tokens = np.empty(N, dtype=np.int64)
    blocks = np.empty(N, dtype=np.int64)
    # pcum[j]: projected KV blocks of flat requests 0..j-1, each grown by ``lookahead``
    # tokens (what it will hold at the next check, wherever it runs)
    pcum = np.zeros(N + 1, dtype=np.int64)
    off = np.empty(R, dtype=np.int64)
    free = np.empty(R, dtype=np.int64)
    stuck = np.empty(R, dtype=np.int64)
    demand = np.empty(R, dtype=np.int64)  # projected blocks: used + running requests' growth
    limit = np.empty(R, dtype=np.int64)  # blocks less the headroom
    head = 0
    j = 0
    for r in range(R):
        off[r] = j
        grow = 0
        for i in range(n[r]):
            t = flat[head + H + i]
            tokens[j] = t
            blocks[j] = (t + bs[r]) // bs[r]  # incl. the next token's slot
            p = (t + lookahead + bs[r]) // bs[r]
            pcum[j + 1] = pcum[j] + p
            if i >= queued[r]:  # running: it grows (queued ones are not in the projection)
                grow += p - blocks[j]
            j += 1
        head += lens[r]
        reserve = np.int64(np.ceil(headroom * np.float64(total[r])))
        limit[r] = total[r] - reserve
        demand[r] = used[r] + grow
        free[r] = max(limit[r] - demand[r], 0)  # what the rank can take and still not preempt
        w = queued[r]  # queued requests come first in canonical order
        if w == 0:
            stuck[r] = 0
        else:
            over = max(n[r] - max_seqs[r], 0)
            # queued beyond the slot limit, or queued while the KV cache cannot take any
            if w > over and blocks[off[r]] > total[r] - used[r] - reserve:
                stuck[r] = w
            else:
                stuck[r] = min(over, w)
    flows = np.zeros((4 * R + 2, 4), dtype=np.int64)
    zero = np.zeros(R, dtype=np.int64)
    bucket_before, waiting_before = _predict(n, max_seqs, stuck, queued, sizes, flows, 0)
    overflow_before = _overflow(demand, limit, zero, zero)
    if R < 2:
        return _OK, 0, bucket_before, waiting_before, bucket_before, waiting_before, 0, 0, \
            overflow_before, overflow_before, e, e, e, e, e, e, b, e
    # first pass: the smallest bucket every rank fits under, queues cleared
    most = 0
    for r in range(R):
        most = max(most, max_seqs[r])
    lower = (N + R - 1) // R
    nflows = -1
    target = 0
    for s in sizes:
        if s < lower or s >= most:
            continue
        if waiting_before == 0 and _bucket(s, sizes) >= bucket_before:
            break  # no smaller bucket is reachable
        nflows = _assign(s, False, n, max_seqs, stuck, free, pcum, off, flows)
        if nflows >= 0:
            target = s
            break
    if nflows < 0 and not (waiting_before == 0 and _bucket(most, sizes) >= bucket_before):
        nflows = _assign(most, False, n, max_seqs, stuck, free, pcum, off, flows)
        target = most
    if nflows < 0 and waiting_before:
        nflows = _assign(most, True, n, max_seqs, stuck, free, pcum, off, flows)  # un-stick
        target = most
    bucket_after, waiting_after = bucket_before, waiting_before
    if nflows > 0:
        bucket_after, waiting_after = _predict(n, max_seqs, stuck, queued, sizes, flows, nflows)
        if not (waiting_after < waiting_before
                or (waiting_after == waiting_before and bucket_after < bucket_before)):
            nflows = 0
            bucket_after, waiting_after = bucket_before, waiting_before
    if nflows < 0:
        nflows = 0
    if nflows == 0:
        target = 0
    # second pass: projected KV, within the bucket and queues the first pass reached
    cap = bucket_after
    if nflows == 0 and waiting_before:
        cap = 0  # queues the first pass could not clear: leave the counts alone
    if kv_on:  # moving a running request by recompute would only re-run what it saves
        nflows = _kv_assign(nflows, cap, n, max_seqs, queued, demand, limit, pcum, off, flows)
    if nflows <= 0:
        return _OK, 0, bucket_before, waiting_before, bucket_before, waiting_before, 0, 0, \
            overflow_before, overflow_before, e, e, e, e, e, e, b, e
    bucket_after, waiting_after = _predict(n, max_seqs, stuck, queued, sizes, flows, nflows)
    got, lost = _moved_blocks(R, queued, pcum, off, flows, nflows)
    overflow_after = _overflow(demand, limit, got, lost)
    moves = 0
    listed = 0
    for f in range(nflows):
        moves += flows[f, 3]
        if not only_rank or rank[flows[f, 0]] == for_rank or rank[flows[f, 1]] == for_rank:
            listed += flows[f, 3]
    src_pos = np.empty(listed, dtype=np.int64)
    src = np.empty(listed, dtype=np.int64)
    dst = np.empty(listed, dtype=np.int64)
    index = np.empty(listed, dtype=np.int64)
    m_tokens = np.empty(listed, dtype=np.int64)
    m_blocks = np.empty(listed, dtype=np.int64)
    m_kv = np.zeros(listed, dtype=np.bool_)
    m_bytes = np.zeros(listed, dtype=np.int64)
    m = 0
    for f in range(nflows):
        d, rc, first, k = flows[f, 0], flows[f, 1], flows[f, 2], flows[f, 3]
        if only_rank and rank[d] != for_rank and rank[rc] != for_rank:
            continue
        block_bytes = np.float64(bs[d]) * kv_bytes_per_token
        for i in range(first, first + k):
            p = off[d] + i
            src_pos[m] = d
            src[m] = rank[d]
            dst[m] = rank[rc]
            index[m] = i
            m_tokens[m] = tokens[p]
            m_blocks[m] = blocks[p]
            # KV transfer beats recompute when blocks*block_bytes/link < tokens/prefill
            if kv_on and i >= queued[d] and (
                    kv_always or np.float64(blocks[p]) * block_bytes
                    < np.float64(tokens[p]) * per_token_recompute):
                m_kv[m] = True
                m_bytes[m] = np.int64(np.float64(blocks[p]) * block_bytes)
            m += 1
    return _OK, 0, bucket_before, waiting_before, bucket_after, waiting_after, target, moves, \
        overflow_before, overflow_after, src_pos, src, dst, index, m_tokens, m_blocks, m_kv, \
        m_bytes


_kernel_entry: list = [None, None]  # (unused, compiled entry point)


def _run_kernel(*args):
    """Call the compiled kernel without numba's per-call type dispatch once the types are
    known (they never change: the glue below fixes every argument's type)."""
    kernel = _plan_kernel
    if not hasattr(kernel, "overloads"):  # numba missing: plain Python
        return kernel(*args)
    entry = _kernel_entry[1]
    if entry is None:
        out = kernel(*args)
        from numba import typeof
        _kernel_entry[1] = kernel.overloads[tuple(typeof(x) for x in args)].entry_point
        return out
    return entry(*args)


def plan(loads: Iterable[RankLoad | Mapping | tuple], config: PlannerConfig | None = None, *,
         for_rank: int | None = None) -> Plan:
    """The migrations that best rebalance ``loads`` (see the module docstring).

    ``loads``: one per rank, as :class:`RankLoad`, its :meth:`~RankLoad.to_dict` or (fastest)
    its :meth:`~RankLoad.pack`; each lists its requests in canonical move order
    (:func:`move_key`; build loads with :meth:`RankLoad.from_requests`): the order is computed
    where the state is, in parallel, and the planner never sorts requests. Ranks may come in
    any order. ``for_rank``: list only the migrations this rank sends or receives (every rank
    still computes the whole plan's flows; it just does not materialize others' requests).
    """
    config = config or PlannerConfig()
    loads = loads if isinstance(loads, list) else list(loads)
    if set(map(type, loads)) != {tuple}:
        loads = list(map(_packed, loads))
    if not loads:
        raise ValueError("plan() needs the load of at least one rank")
    sizes = config._sizes_array
    ratio = config.link_bytes_per_s / config.prefill_tokens_per_s
    while True:
        ids, arrays = zip(*loads)
        if set(map(type, arrays)) == {bytes}:  # the packed form
            lens = np.fromiter(map(len, arrays), dtype=_I64, count=len(arrays))
            if (lens % 8).any():
                raise ValueError("a packed load's values must be whole int64s (RankLoad.pack)")
            lens //= 8
            flat = np.frombuffer(b"".join(arrays), dtype=_I64).copy()
        else:
            arrays = [np.asarray(a, dtype=_I64).reshape(-1) for a in arrays]
            lens = np.fromiter(map(len, arrays), dtype=_I64, count=len(arrays))
            flat = np.concatenate(arrays)
        out = _run_kernel(flat, lens, sizes, float(config.kv_headroom),
                          int(config.lookahead_steps), bool(config.kv_migration),
                          bool(config.kv_always), float(config.kv_bytes_per_token), float(ratio),
                          for_rank is not None, -1 if for_rank is None else int(for_rank))
        status, bad = out[0], out[1]
        if status == _UNSORTED:
            heads = (np.cumsum(lens) - lens).tolist()
            order = sorted(range(len(loads)), key=lambda i: int(flat[heads[i]]))
            ranks = [int(flat[heads[i]]) for i in order]
            twice = [a for a, b in zip(ranks, ranks[1:]) if a == b]
            if twice:
                raise ValueError(f"rank {twice[0]} is reported twice")
            loads = [loads[i] for i in order]
            continue
        if status == _SHORT:
            raise ValueError(f"load #{bad}: a packed load needs at least {_HEADER} values, "
                             f"got {int(lens[bad])}")
        break
    counts = (lens - _HEADER).tolist()
    if counts != list(map(len, ids)):
        bad = next(i for i, (c, x) in enumerate(zip(counts, ids)) if c != len(x))
        raise ValueError(f"rank {int(flat[int((np.cumsum(lens) - lens)[bad])])}: request_ids, "
                         f"num_tokens and waiting "
                         f"differ in length ({len(ids[bad])}, {counts[bad]})")
    (_, _, bucket_before, waiting_before, bucket_after, waiting_after, target, moves,
     overflow_before, overflow_after, src_pos, src, dst, index, tokens, blocks, kv, nbytes) = out
    result = Plan(bucket_before=int(bucket_before), bucket_after=int(bucket_after),
                  waiting_before=int(waiting_before), waiting_after=int(waiting_after),
                  target=int(target), total=int(moves), overflow_before=int(overflow_before),
                  overflow_after=int(overflow_after))
    if len(src):
        request_ids = map(str, map(getitem, map(ids.__getitem__, src_pos.tolist()),
                                   index.tolist()))
        result.migrations = list(map(tuple.__new__, repeat(Migration), zip(
            request_ids, src.tolist(), dst.tolist(), kv.tolist(), tokens.tolist(),
            blocks.tolist(), nbytes.tolist())))
    return result
