"""HDP planner: per micro-batch, which context-parallel (CP) ranks form which groups and which
sequences each group computes. Never worse than fixed CP under the cost model.

Why: in long RL responses a packed micro-batch mixes very long and short sequences. Under
fixed CP every sequence is cut into ``2*R`` chunks and pays ``R - 1`` ring steps and padding to
``2*R*tp``, even a 300-token answer that one rank could compute alone. HDP regroups the ``R``
CP ranks per micro-batch: a long sequence runs on a sub-group, short ones whole on single
ranks. Whether that is faster depends on attention's quadratic cost, on how much ring
communication the attention compute hides, and on the balance of the groups: the planner
decides with a calibrated :class:`~.cost_model.CostModel` instead of the seed's token counts.

How (all deterministic, so every rank computes the identical plan from the same lengths):

1. Fixed CP's micro-batches, as stock verl forms them (``rearrange_micro_batches``):
   ``K = max(K_min, min(n, ceil(sum L / (R * cap))))`` partitions balancing verl's workload
   ``24576*L + L**2``. verl does not check the token budget per micro-batch after
   balancing; this planner does (the per-rank cap is strict, padding included): if no
   balanced partition fits at that K, K is raised until one does. Its cost under plain CP
   is ``fixed_cp_cost``, the baseline.
2. Grouping, per micro-batch: every allowed way to cut the ``R`` ranks into groups (integer
   partitions of ``R``: any sizes for ``"contiguous"``, powers of two for ``"pow2"``, plus
   plain CP) is tried; sequences, longest first, go to the group where they finish earliest
   without exceeding the cap, no group left empty. A micro-batch takes as long as its
   slowest group; the best candidate wins, plain CP on ties and on gains below the cost
   model's measured ``relative_error`` (the margin), so no micro-batch is slower than under
   CP. One numba-compiled pass over all micro-batches with pruning (a candidate
   is dropped once it cannot beat the best so far).
   This is done for fixed CP's micro-batches and for HDP-native ones (shelf packing: each
   sequence on the fewest ranks that run it with the least rank-seconds, tallest first;
   a micro-batch's height is set by its first sequence and later ones fill its remaining
   ranks or stack under that height, within the cap and always within CP's cap too, at
   the cap and at 85% of it). The cheapest of these plans is returned, never more
   expensive than ``fixed_cp_cost``; HDP-native micro-batches are at least ``K_min`` and
   may be more than CP's K when that is cheaper (each costs its overhead in the model).
3. Groups are laid out as contiguous rank runs, largest first (so power-of-two groups are
   also aligned, as NCCL/TE groups of Megatron's hybrid CP need).
4. ``lower_bound``: no plan under the model can be cheaper: the largest of (all work at each
   sequence's cheapest feasible group size, perfectly balanced over ``R`` ranks with zero
   communication), (the slowest sequence at its best group size) and (the sum over "big"
   sequences, which cannot share a micro-batch under the cap, of their best times), plus the
   overhead of the fewest micro-batches the cap allows.

Planning time is O(n log n) in the number of sequences ``n`` (times a factor of the
candidate partitions of ``R``, and ``log K`` capped-balance passes when the cap raises K):
the capped balance keeps micro-batches in two heaps (:func:`_capped_lpt`), the unit packing
in one segment tree per load (:func:`_unit_kernel`), and shelf packing visits only open
shelves, at most ``_SHELF_WINDOW`` per sequence (:func:`_shelf_kernel`).
:func:`planning_work` counts the steps, which the tests compare across sizes.

The plan is data attached to the micro-batches (``HdpPlan``), never process state; it
serializes to JSON and has a digest so ranks can cross-check it. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from .cost_model import CostModel, pad_multiple, padded_length

GROUP_POLICIES = ("contiguous", "pow2")
VERL_WORKLOAD_LINEAR = 24576  # verl's calculate_workload: 6 * hidden(4096) * L + L**2

# -- outputs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MicroBatchPlan:
    """One micro-batch: its sequences and how the CP ranks are grouped to compute them."""

    sequences: tuple[int, ...]  # indices into the input lengths
    groups: tuple[tuple[int, ...], ...]  # partition of range(cp_size) into rank groups
    group_of: tuple[int, ...]  # per entry of `sequences`: index into `groups`
    fixed_cp: bool  # True: plain CP (one group = all ranks)
    cost: float  # modelled seconds of this micro-batch (overhead included)
    fixed_cp_cost: float  # the same micro-batch under plain CP

    def rank_work(self, rank: int) -> list[tuple[int, tuple[int, ...], int]]:
        """What ``rank`` computes: ``(sequence index, its group's ranks, rank's position in
        that group)`` for every sequence of the rank's group, in micro-batch order."""
        for gi, group in enumerate(self.groups):
            if rank in group:
                position = group.index(rank)
                return [(seq, group, position)
                        for seq, g in zip(self.sequences, self.group_of) if g == gi]
        raise ValueError(f"rank={rank!r}: not in any group of this micro-batch "
                         f"(accepted: 0..{sum(map(len, self.groups)) - 1})")

    def to_dict(self) -> dict:
        return {"sequences": list(self.sequences), "groups": [list(g) for g in self.groups],
                "group_of": list(self.group_of), "fixed_cp": self.fixed_cp,
                "cost": self.cost, "fixed_cp_cost": self.fixed_cp_cost}

    @classmethod
    def from_dict(cls, d: dict) -> "MicroBatchPlan":
        return cls(tuple(int(x) for x in d["sequences"]),
                   tuple(tuple(int(r) for r in g) for g in d["groups"]),
                   tuple(int(x) for x in d["group_of"]), bool(d["fixed_cp"]),
                   float(d["cost"]), float(d["fixed_cp_cost"]))


@dataclass(frozen=True)
class HdpPlan:
    """The plan of one batch: micro-batches in execution order and the modelled costs."""

    micro_batches: tuple[MicroBatchPlan, ...]
    cp_size: int
    cost: float  # modelled seconds of the plan
    fixed_cp_cost: float  # modelled seconds of the same batch under stock verl + fixed CP
    lower_bound: float  # no plan under the model is cheaper
    tp: int = 1  # the tensor parallel size the padding rule (2*g*tp) was planned for
    group_policy: str = "contiguous"

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces; floats by repr, so they round-trip)."""
        return json.dumps({"micro_batches": [m.to_dict() for m in self.micro_batches],
                           "cp_size": self.cp_size, "cost": self.cost,
                           "fixed_cp_cost": self.fixed_cp_cost,
                           "lower_bound": self.lower_bound, "tp": self.tp,
                           "group_policy": self.group_policy},
                          sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str) -> "HdpPlan":
        d = json.loads(s)
        return cls(tuple(MicroBatchPlan.from_dict(m) for m in d["micro_batches"]),
                   int(d["cp_size"]), float(d["cost"]), float(d["fixed_cp_cost"]),
                   float(d["lower_bound"]), int(d.get("tp", 1)),
                   str(d.get("group_policy", "contiguous")))

    def digest(self) -> str:
        """SHA-256 of :meth:`to_json`: ranks compare it to check they planned the same."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)


def split_for_group(length: int, group_size: int, position: int, *, pad_multiple: int
                    ) -> list[tuple[int, int]]:
    """Token ``[start, stop)`` ranges of a sequence that the rank at ``position`` of a group of
    ``group_size`` ranks computes: Megatron's load-balanced causal CP split. The length is
    padded to a multiple of ``pad_multiple`` (verl pads to ``2*g*tp``), cut into ``2*g``
    equal chunks, and position ``p`` takes chunks ``p`` and ``2g-1-p`` (an early and a late
    chunk, so causal attention work is equal on every rank). Padding is excluded from the
    ranges, so a range may be shorter or absent. ``group_size == 1``: ``[(0, length)]``."""
    if group_size < 1:
        raise ValueError(f"group_size={group_size!r}: expected an integer >= 1")
    if not 0 <= position < group_size:
        raise ValueError(f"position={position!r}: expected 0..{group_size - 1}")
    if group_size == 1:
        return [(0, length)] if length > 0 else []
    if pad_multiple < 1 or pad_multiple % (2 * group_size):
        raise ValueError(f"pad_multiple={pad_multiple!r}: expected a positive multiple of "
                         f"2*group_size={2 * group_size}")
    padded = -(-length // pad_multiple) * pad_multiple
    chunk = padded // (2 * group_size)
    out = []
    for c in (position, 2 * group_size - 1 - position):
        start, stop = c * chunk, min((c + 1) * chunk, length)
        if stop > start:
            out.append((start, stop))
    return out


# -- kernels (numba; the same source runs as plain Python without numba) ----------------------
#
# All integer decisions, plus comparisons of float sums accumulated in a fixed order (no
# fastmath, so no reassociation): compiled or not, every rank gets the same plan.

try:
    from numba import njit
except ImportError:  # pragma: no cover
    def njit(*args, **kwargs):
        return args[0] if args and callable(args[0]) else (lambda f: f)


@njit(cache=True)
def _state_before(a, b, spread, top, top_count, top_first):
    """verl's heap order of Karmarkar-Karp states: largest spread first, then the larger
    largest set (by sum, then item count, then first item)."""
    if spread[a] != spread[b]:
        return spread[a] > spread[b]
    if top[a] != top[b]:
        return top[a] > top[b]
    if top_count[a] != top_count[b]:
        return top_count[a] > top_count[b]
    return top_first[a] > top_first[b]


@njit(cache=True)
def _sift_down(heap, size, i, spread, top, top_count, top_first):
    while True:
        left, right, best = 2 * i + 1, 2 * i + 2, i
        if left < size and _state_before(heap[left], heap[best], spread, top, top_count,
                                         top_first):
            best = left
        if right < size and _state_before(heap[right], heap[best], spread, top, top_count,
                                          top_first):
            best = right
        if best == i:
            return
        heap[i], heap[best] = heap[best], heap[i]
        i = best


@njit(cache=True)
def _kk_partition(values, k):
    """Karmarkar-Karp (largest differencing) of ``values`` into ``k`` parts, the algorithm
    and tie-breaking of verl's ``karmarkar_karp(equal_size=False)`` (sets ordered by sum,
    then item count, then first item). Returns the part of every item. Sets are linked
    lists of items, so merging two is O(1); O(n k log k) overall."""
    n = values.shape[0]
    order = np.argsort(values, kind="mergesort")
    sums = np.zeros((n, k), np.int64)
    sid = np.empty((n, k), np.int64)
    head = np.full(n * k, -1, np.int64)
    tail = np.full(n * k, -1, np.int64)
    count = np.zeros(n * k, np.int64)
    nxt = np.full(n, -1, np.int64)
    spread = np.empty(n, np.int64)
    top = np.empty(n, np.int64)
    top_count = np.ones(n, np.int64)
    top_first = np.empty(n, np.int64)
    for s in range(n):
        item = order[s]
        for j in range(k):
            sid[s, j] = s * k + j
        sums[s, 0] = values[item]
        head[s * k] = item
        tail[s * k] = item
        count[s * k] = 1
        spread[s] = values[item] if k > 1 else 0
        top[s] = values[item]
        top_first[s] = item
    heap = np.arange(n).astype(np.int64)
    size = n
    for start in range(size // 2 - 1, -1, -1):
        _sift_down(heap, size, start, spread, top, top_count, top_first)
    new_sums = np.empty(k, np.int64)
    new_sid = np.empty(k, np.int64)
    while size > 1:
        a = heap[0]
        size -= 1
        heap[0] = heap[size]
        _sift_down(heap, size, 0, spread, top, top_count, top_first)
        b = heap[0]
        size -= 1
        heap[0] = heap[size]
        _sift_down(heap, size, 0, spread, top, top_count, top_first)
        for j in range(k):  # a's j-th largest set joins b's j-th smallest
            x, y = sid[a, j], sid[b, k - 1 - j]
            if head[y] != -1:
                if head[x] == -1:
                    head[x] = head[y]
                else:
                    nxt[tail[x]] = head[y]
                tail[x] = tail[y]
                count[x] += count[y]
            new_sums[j] = sums[a, j] + sums[b, k - 1 - j]
            new_sid[j] = x
        # descending by (sum, item count, first item): sort by sum, then order the (rare)
        # runs of equal sums by the other two keys
        perm = np.argsort(-new_sums, kind="mergesort")
        for j in range(1, k):
            p = perm[j]
            i = j - 1
            while i >= 0 and new_sums[perm[i]] == new_sums[p]:
                x, y = new_sid[perm[i]], new_sid[p]
                if count[x] > count[y] or (count[x] == count[y] and head[x] > head[y]):
                    break
                perm[i + 1] = perm[i]
                i -= 1
            perm[i + 1] = p
        for j in range(k):
            sums[a, j] = new_sums[perm[j]]
            sid[a, j] = new_sid[perm[j]]
        spread[a] = sums[a, 0] - sums[a, k - 1]
        top[a] = sums[a, 0]
        top_count[a] = count[sid[a, 0]]
        top_first[a] = head[sid[a, 0]]
        heap[size] = a
        i = size
        size += 1
        while i > 0:
            parent = (i - 1) // 2
            if _state_before(heap[i], heap[parent], spread, top, top_count, top_first):
                heap[i], heap[parent] = heap[parent], heap[i]
                i = parent
            else:
                break
    final = heap[0]
    part = np.full(n, -1, np.int64)
    for j in range(k):
        item = head[sid[final, j]]
        while item != -1:
            part[item] = j
            item = nxt[item]
    return part


@njit(cache=True)
def _pack_time(work_sum, exposed_sum, size, latency):
    """Per-rank seconds of a pack on ``size`` ranks from its summed terms (the pack formula
    of ``cost_model.py``: one exchange of the pack's K/V per ring step); ``latency[s-1]``:
    the ring step latency of a group of ``s`` ranks."""
    if size <= 1:
        return work_sum
    exposed = latency[size - 1] + exposed_sum
    if exposed < 0.0:
        exposed = 0.0
    return work_sum + (size - 1) * exposed


@njit(cache=True)
def _group_kernel(mb_ptr, mb_items, work, exposed, latency, toks, parts, nparts, cap,
                  margin):
    """For every micro-batch (items ``mb_items[mb_ptr[b]:mb_ptr[b+1]]``, longest first), the
    best candidate rank partition (row of ``parts``; row 0 is plain CP) and the group slot
    of every item. ``work[i, s-1]``/``exposed[i, s-1]``: the pack terms of item ``i`` on a
    group of ``s`` ranks (a group's time is :func:`_pack_time` of their sums);
    ``toks[i, s-1]``: its per-rank tokens. Greedy earliest-finish assignment under the token
    cap with no group left empty; a candidate wins only if strictly faster than the best so
    far and than plain CP by more than ``margin`` (the model's measured relative error:
    ties, and gains the model cannot vouch for, keep CP)."""
    nmb = mb_ptr.shape[0] - 1
    ncand = parts.shape[0]
    width = parts.shape[1]
    best_part = np.zeros(nmb, np.int64)
    best_cost = np.zeros(nmb, np.float64)
    cp_cost = np.zeros(nmb, np.float64)
    assign = np.zeros(mb_items.shape[0], np.int64)
    trial = np.zeros(mb_items.shape[0], np.int64)
    load = np.zeros(width, np.float64)
    wsum = np.zeros(width, np.float64)
    xsum = np.zeros(width, np.float64)
    tok = np.zeros(width, np.int64)
    count = np.zeros(width, np.int64)
    for b in range(nmb):
        lo, hi = mb_ptr[b], mb_ptr[b + 1]
        m = hi - lo
        best = np.inf
        bar = np.inf  # what a regrouping must beat
        bp = -1
        for p in range(ncand):
            q = nparts[p]
            if q > m:
                continue
            for j in range(q):
                load[j] = 0.0
                wsum[j] = 0.0
                xsum[j] = 0.0
                tok[j] = 0
                count[j] = 0
            empty = q
            ok = True
            for t in range(lo, hi):
                i = mb_items[t]
                force = (hi - t) <= empty
                chosen = -1
                finish = np.inf
                for j in range(q):
                    if force and count[j] > 0:
                        continue
                    s = parts[p, j]
                    if tok[j] + toks[i, s - 1] > cap:
                        continue
                    c = _pack_time(wsum[j] + work[i, s - 1], xsum[j] + exposed[i, s - 1], s,
                                   latency)
                    if c < finish:
                        finish = c
                        chosen = j
                if chosen < 0 or (p > 0 and finish >= bar):
                    ok = False
                    break
                if count[chosen] == 0:
                    empty -= 1
                count[chosen] += 1
                load[chosen] = finish
                wsum[chosen] += work[i, parts[p, chosen] - 1]
                xsum[chosen] += exposed[i, parts[p, chosen] - 1]
                tok[chosen] += toks[i, parts[p, chosen] - 1]
                trial[t] = chosen
            if not ok:
                continue
            slowest = 0.0
            for j in range(q):
                if load[j] > slowest:
                    slowest = load[j]
            if p == 0:
                cp_cost[b] = slowest
                bar = slowest * (1.0 - margin)
            elif slowest < bar:
                bar = slowest
            else:
                continue
            best = slowest
            bp = p
            for t in range(lo, hi):
                assign[t] = trial[t]
        best_part[b] = bp
        best_cost[b] = best
    return best_part, best_cost, cp_cost, assign


@njit(cache=True)
def _shelf_kernel(order, native, times, work, exposed, latency, toks, cp_tokens, cap, cp_size,
                  increase_floor, window):
    """Micro-batches formed for HDP (shelf packing, first-fit-decreasing-height style).

    Items come tallest first (``order``: by their time on their ``native`` group size, the
    allowed size that fits the cap with the least rank-seconds). A micro-batch is a shelf of
    ``cp_size`` ranks whose height is its first (tallest) item's time; later items join an
    existing group of a shelf, or open a group of their native size on the shelf's free
    ranks, wherever they fit under the height and the token cap with the least slack left
    (ties: the earliest shelf). Each shelf also stays within the cap under plain CP (so CP
    is always a valid fallback for it). Returns the shelf of every item, the shelf count and
    the number of shelf visits (the work done, for the complexity test); the grouping itself
    is then chosen by :func:`_group_kernel` like for any micro-batch.

    Linear time: only *open* shelves are visited, at most ``window`` of them per item, the
    most recently opened first. A shelf closes for good when no later item can join it:
    its plain-CP tokens plus the fewest of any later item exceed the cap, or every group's
    slack under the height (and, with free ranks, the height itself) is below
    ``increase_floor[t]``, the least time any item from position ``t`` on adds to any pack
    (a pack never gets faster by adding a sequence, see ``cost_model.py``)."""
    n = order.shape[0]
    gsize = np.zeros((n, cp_size), np.int64)
    gwork = np.zeros((n, cp_size), np.float64)
    gexp = np.zeros((n, cp_size), np.float64)
    gtime = np.zeros((n, cp_size), np.float64)
    gtok = np.zeros((n, cp_size), np.int64)
    ngroups = np.zeros(n, np.int64)
    free = np.zeros(n, np.int64)
    height = np.zeros(n, np.float64)
    cptok = np.zeros(n, np.int64)
    shelf_of = np.full(n, -1, np.int64)
    # the fewest plain-CP tokens of any item from position t on
    least_cp = np.empty(n + 1, np.int64)
    least_cp[n] = cap + 1
    for t in range(n - 1, -1, -1):
        least_cp[t] = min(least_cp[t + 1], cp_tokens[order[t]])
    open_list = np.empty(n, np.int64)
    nopen = 0
    nsh = 0
    visits = 0
    for t in range(n):
        i = order[t]
        g0 = native[i]
        best_sh = -1
        best_slot = -1
        best_slack = np.inf
        floor = increase_floor[t]
        low = max(0, nopen - window)
        for idx in range(nopen - 1, low - 1, -1):
            sh = open_list[idx]
            visits += 1
            h = height[sh]
            if cptok[sh] + least_cp[t] > cap:
                open_list[idx] = -1
                continue
            alive = free[sh] > 0 and h >= floor
            shelf_slack = np.inf
            shelf_slot = -1
            if cptok[sh] + cp_tokens[i] <= cap:
                for j in range(ngroups[sh]):
                    if h - gtime[sh, j] >= floor:
                        alive = True
                    sz = gsize[sh, j]
                    nl = _pack_time(gwork[sh, j] + work[i, sz - 1],
                                    gexp[sh, j] + exposed[i, sz - 1], sz, latency)
                    if nl <= h and gtok[sh, j] + toks[i, sz - 1] <= cap and h - nl < shelf_slack:
                        shelf_slack = h - nl
                        shelf_slot = j
                if free[sh] >= g0 and times[i, g0 - 1] <= h and \
                        h - times[i, g0 - 1] < shelf_slack:
                    shelf_slack = h - times[i, g0 - 1]
                    shelf_slot = -1
                if shelf_slack <= best_slack and shelf_slack < np.inf:
                    best_slack = shelf_slack
                    best_sh = sh
                    best_slot = shelf_slot
            else:
                for j in range(ngroups[sh]):
                    if h - gtime[sh, j] >= floor:
                        alive = True
            if not alive:
                open_list[idx] = -1
        # drop the closed shelves from the visited tail of the open list
        w = low
        for idx in range(low, nopen):
            if open_list[idx] >= 0:
                open_list[w] = open_list[idx]
                w += 1
        nopen = w
        if best_sh < 0:
            best_sh = nsh
            nsh += 1
            height[best_sh] = times[i, g0 - 1]
            free[best_sh] = cp_size
            open_list[nopen] = best_sh
            nopen += 1
        sh = best_sh
        if best_slot < 0:
            best_slot = ngroups[sh]
            ngroups[sh] += 1
            gsize[sh, best_slot] = g0
            free[sh] -= g0
        sz = gsize[sh, best_slot]
        gwork[sh, best_slot] += work[i, sz - 1]
        gexp[sh, best_slot] += exposed[i, sz - 1]
        gtime[sh, best_slot] = _pack_time(gwork[sh, best_slot], gexp[sh, best_slot], sz,
                                          latency)
        gtok[sh, best_slot] += toks[i, sz - 1]
        cptok[sh] += cp_tokens[i]
        shelf_of[i] = sh
    return shelf_of, nsh, visits


@njit(cache=True)
def _tree_set(tree, size, pos, value):
    """Point update of a min segment tree (leaves at ``size + pos``)."""
    k = size + pos
    tree[k] = value
    k //= 2
    while k >= 1:
        tree[k] = min(tree[2 * k], tree[2 * k + 1])
        k //= 2


@njit(cache=True)
def _tree_first_at_most(tree, size, limit):
    """Lowest leaf index whose value is ``<= limit`` (-1 if none), O(log size)."""
    if tree[1] > limit:
        return -1
    k = 1
    while k < size:
        k = 2 * k if tree[2 * k] <= limit else 2 * k + 1
    return k - size


@njit(cache=True)
def _unit_kernel(order, units, cp_tokens, cap, cp_size):
    """Micro-batches formed by rank units (best-fit decreasing): every sequence needs
    ``units[i]`` ranks (the fewest that fit it under the cap), a micro-batch holds
    ``cp_size`` units and, so CP stays a valid fallback, at most the cap under plain CP.
    Items in ``order`` (most units first); each goes to the micro-batch it fills most
    tightly (ties: the earliest). Returns the micro-batch of every item, the count and the
    number of tree steps (the work done, for the complexity test).

    O(n * cp_size * log n): one min segment tree per unit load ``1..cp_size`` over the
    micro-batches' plain-CP tokens (absent: a value above the cap), so the earliest
    micro-batch of a load with room for the item's tokens is one descent."""
    n = order.shape[0]
    size = 1
    while size < n:
        size *= 2
    absent = cap + 1
    trees = np.full((cp_size + 1, 2 * size), absent, np.int64)
    load = np.zeros(n, np.int64)
    cptok = np.zeros(n, np.int64)
    bin_of = np.full(n, -1, np.int64)
    nb = 0
    steps = 0
    for t in range(n):
        i = order[t]
        best = -1
        for level in range(cp_size - units[i], 0, -1):  # least left over first
            steps += 1
            b = _tree_first_at_most(trees[level], size, cap - cp_tokens[i])
            if b >= 0:
                best = b
                break
        if best < 0:
            best = nb
            nb += 1
        else:
            _tree_set(trees[load[best]], size, best, absent)
        load[best] += units[i]
        cptok[best] += cp_tokens[i]
        if load[best] < cp_size:
            _tree_set(trees[load[best]], size, best, cptok[best])
        bin_of[i] = best
    return bin_of, nb, steps


# -- candidates -------------------------------------------------------------------------------

_MAX_FULL_ENUMERATION = 16  # R <= 16: all integer partitions (231 at R = 16)
_NATIVE_TOLERANCE = 0.01  # sizes within 1% of the least rank-seconds count as equal
_SHELF_WINDOW = 64  # open shelves visited per item (the most recent): keeps packing linear
_SHELF_CAP_FRACTIONS = (1.0, 0.85)  # formation caps tried for HDP-native micro-batches
_KK_MAX_PARTS = 64  # Karmarkar-Karp is O(n K log K); beyond this K only the capped balance


@lru_cache(maxsize=64)
def _candidates(cp_size: int, policy: str, allow_hdp: bool) -> np.ndarray:
    """Candidate group sizes, one partition of ``cp_size`` per row (descending, 0-padded);
    row 0 is plain CP. ``"pow2"``: power-of-two sizes only; ``"contiguous"``: any sizes up to
    R = 16, power-of-two sizes beyond (the full set grows too fast)."""
    rows = [(cp_size,)]
    if allow_hdp and cp_size > 1:
        pow2_only = policy == "pow2" or cp_size > _MAX_FULL_ENUMERATION
        allowed = [s for s in range(cp_size, 0, -1) if not pow2_only or s & (s - 1) == 0]

        def rec(remaining, largest, prefix):
            if remaining == 0:
                if len(prefix) > 1:
                    rows.append(tuple(prefix))
                return
            for s in allowed:
                if s <= min(largest, remaining):
                    rec(remaining - s, s, prefix + [s])

        rec(cp_size, cp_size, [])
    out = np.zeros((len(rows), cp_size), np.int64)
    for r, sizes in enumerate(rows):
        out[r, :len(sizes)] = sizes
    out.setflags(write=False)
    return out


# -- the planner ------------------------------------------------------------------------------


def _validate(lengths, cp_size, max_tokens_per_rank, min_micro_batches, group_policy, tp):
    def integer(name, value, low):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name}={value!r}: expected an integer >= {low}")
    integer("cp_size", cp_size, 1)
    integer("max_tokens_per_rank", max_tokens_per_rank, 1)
    integer("min_micro_batches", min_micro_batches, 1)
    integer("tp", tp, 1)
    if group_policy not in GROUP_POLICIES:
        raise ValueError(f"group_policy={group_policy!r}: accepted values are "
                         f"{', '.join(map(repr, GROUP_POLICIES))}")
    arr = np.asarray(lengths)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"lengths: expected a non-empty sequence of integers >= 1 "
                         f"(token counts), got {lengths!r:.200}")
    arr = arr.astype(np.int64)
    if int(arr.min()) < 1:
        raise ValueError(f"lengths: every sequence needs at least 1 token "
                         f"(got {int(arr.min())})")
    if min_micro_batches > arr.size:
        raise ValueError(f"min_micro_batches={min_micro_batches}: more micro-batches than "
                         f"sequences ({arr.size}); accepted: 1..{arr.size}")
    cp_share = padded_length(arr, cp_size, tp) // cp_size
    too_long = np.flatnonzero(cp_share > max_tokens_per_rank)
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(f"lengths[{i}]={int(arr[i])}: longer than cp_size*max_tokens_per_rank"
                         f" = {cp_size}*{max_tokens_per_rank} after padding to a multiple of "
                         f"{pad_multiple(cp_size, tp)}; accepted: sequences whose padded "
                         f"length is <= {cp_size * max_tokens_per_rank}")
    return arr


def _cp_micro_batches(lengths: np.ndarray, cp_tokens: np.ndarray, cap: int, k_min: int,
                      cp_size: int) -> tuple[np.ndarray, int, int]:
    """verl's micro-batch formation for fixed CP, made strict (the baseline: what stock
    verl runs; under the pack model its cost also depends on which sequences share a pack,
    so the partition is verl's own balance, not one tuned to the model). What matters first
    is K: verl's ``K = max(K_min, min(n, ceil(sum L / (R * cap))))`` whenever some partition
    at that K fits the cap. Tried at verl's K: a capped balance of verl's workload
    (:func:`_capped_lpt`, like verl's ``greedy_partition`` but never over the cap), then
    verl's own Karmarkar-Karp partition (for K <= 64; verl never re-checks the budget after
    balancing, so it may overflow). If neither fits, the smallest larger K at which the
    capped balance fits (gallop, then bisect). The third value counts the capped-balance
    passes (each O(n log K); the gallop and bisection make O(log K) of them)."""
    n = lengths.size
    k = max(k_min, min(n, -(-int(lengths.sum()) // (cp_size * cap))))
    workload = VERL_WORKLOAD_LINEAR * lengths + lengths * lengths
    order = np.lexsort((np.arange(n), -workload)).astype(np.int64)
    part = _capped_lpt(order, workload, cp_tokens, np.int64(cap), k)
    passes = 1
    if part[0] >= 0:
        return part, k, passes
    if k <= _KK_MAX_PARTS and int(cp_tokens.sum()) <= k * cap:
        part = _kk_partition(workload, k)
        per_mb = np.bincount(part, weights=cp_tokens, minlength=k)
        if (per_mb <= cap).all() and (np.bincount(part, minlength=k) > 0).all():
            return part, k, passes
    cap64 = np.int64(cap)
    # smallest K (from verl's) at which the capped balance fits: gallop, then bisect
    low, step, found = k, 1, None
    while found is None:
        trial = min(n, low + step)
        part = _capped_lpt(order, workload, cp_tokens, cap64, trial)
        passes += 1
        if part[0] >= 0:
            found = (part, trial)
        elif trial >= n:  # every sequence alone fits (validated): unreachable
            return np.arange(n, dtype=np.int64), n, passes
        else:
            low, step = trial, step * 2
    high_part, high = found
    while high - low > 1:
        mid = (low + high) // 2
        part = _capped_lpt(order, workload, cp_tokens, cap64, mid)
        passes += 1
        if part[0] >= 0:
            high_part, high = part, mid
        else:
            low = mid
    return high_part, high, passes


@njit(cache=True)
def _load_before(a, b, load):
    """Heap order of micro-batches by (load, index)."""
    return load[a] < load[b] or (load[a] == load[b] and a < b)


@njit(cache=True)
def _push_by_load(heap, size, item, load):
    heap[size] = item
    i = size
    while i > 0:
        parent = (i - 1) // 2
        if not _load_before(heap[i], heap[parent], load):
            break
        heap[i], heap[parent] = heap[parent], heap[i]
        i = parent
    return size + 1


@njit(cache=True)
def _pop_by_load(heap, size, load):
    size -= 1
    heap[0] = heap[size]
    i = 0
    while True:
        left, right, best = 2 * i + 1, 2 * i + 2, i
        if left < size and _load_before(heap[left], heap[best], load):
            best = left
        if right < size and _load_before(heap[right], heap[best], load):
            best = right
        if best == i:
            return size
        heap[i], heap[best] = heap[best], heap[i]
        i = best


@njit(cache=True)
def _push_by_room(heap, size, item, room):
    heap[size] = item
    i = size
    while i > 0:
        parent = (i - 1) // 2
        if room[heap[i]] <= room[heap[parent]]:
            break
        heap[i], heap[parent] = heap[parent], heap[i]
        i = parent
    return size + 1


@njit(cache=True)
def _pop_by_room(heap, size, room):
    size -= 1
    heap[0] = heap[size]
    i = 0
    while True:
        left, right, best = 2 * i + 1, 2 * i + 2, i
        if left < size and room[heap[left]] > room[heap[best]]:
            best = left
        if right < size and room[heap[right]] > room[heap[best]]:
            best = right
        if best == i:
            return size
        heap[i], heap[best] = heap[best], heap[i]
        i = best


@njit(cache=True)
def _capped_lpt(order, workload, tokens, cap, k):
    """Longest-processing-time balance of ``workload`` over ``k`` micro-batches in ``order``
    (heaviest first): each item joins the least-loaded micro-batch with room for its tokens
    (ties: lowest index). Empty micro-batches are filled first so none stays empty.
    ``part[0] == -1``: some item fit nowhere (the caller raises K).

    O(n log k): micro-batches with room for the current item wait in a heap by (load,
    index); those without wait in a heap by room and come back once an item small enough
    arrives (a micro-batch's room only shrinks, and only when it takes an item)."""
    n = order.shape[0]
    part = np.full(n, -1, np.int64)
    load = np.zeros(k, np.int64)
    room = np.full(k, cap, np.int64)
    count = np.zeros(k, np.int64)
    fits = np.arange(k).astype(np.int64)  # a heap already: equal loads, ascending index
    nfits = k
    full = np.empty(k, np.int64)
    nfull = 0
    empty = k
    for t in range(n):
        i = order[t]
        need = tokens[i]
        while nfull > 0 and room[full[0]] >= need:
            b = full[0]
            nfull = _pop_by_room(full, nfull, room)
            nfits = _push_by_load(fits, nfits, b, load)
        chosen = -1
        while nfits > 0:
            b = fits[0]
            nfits = _pop_by_load(fits, nfits, load)
            if room[b] >= need:
                chosen = b
                break
            nfull = _push_by_room(full, nfull, b, room)
        # when only as many items are left as empty micro-batches, each must open one: the
        # least-loaded micro-batch with room is then an empty one (load 0), or none is left
        if chosen < 0 or ((n - t) <= empty and count[chosen] > 0):
            part[0] = -1
            return part
        if count[chosen] == 0:
            empty -= 1
        part[i] = chosen
        load[chosen] += workload[i]
        room[chosen] -= need
        count[chosen] += 1
        if room[chosen] >= need:
            nfits = _push_by_load(fits, nfits, chosen, load)
        else:
            nfull = _push_by_room(full, nfull, chosen, room)
    return part


def _lower_bound(times_nocomm, times, toks, padded_all, cap, cp_size, k_min, overhead):
    """No plan under the model is cheaper (see the module docstring). Three valid bounds on
    the summed micro-batch times, the largest is used: all work (each sequence on its
    cheapest feasible group size, no communication) spread perfectly over the R ranks; the
    slowest single sequence at its best size; and the "big" sequences (more than half of a
    micro-batch's token capacity even at their least padded size, so no two share a
    micro-batch), each in its own micro-batch at its best size. Plus the overhead of the
    fewest micro-batches the cap allows."""
    feasible = toks <= cap
    sizes = np.arange(1, cp_size + 1, dtype=np.float64)
    work = np.where(feasible, times_nocomm * sizes, np.inf).min(axis=1)
    fastest = np.where(feasible, times, np.inf).min(axis=1)
    slots = np.where(feasible, padded_all, np.iinfo(np.int64).max).min(axis=1)
    big = 2 * slots > cp_size * cap
    k_lb = max(k_min, -(-int(slots.sum()) // (cp_size * cap)), int(big.sum()))
    summed = max(math.fsum(work.tolist()) / cp_size, float(fastest.max()),
                 math.fsum(fastest[big].tolist()))
    return summed + k_lb * overhead


def plan(lengths: Sequence[int], *, cp_size: int, max_tokens_per_rank: int,
         min_micro_batches: int = 1, group_policy: str = "contiguous",
         cost_model: CostModel | None = None, tp: int = 1, allow_hdp: bool = True,
         max_micro_batches: int | None = None) -> HdpPlan:
    """Plan the micro-batches and HDP groups of one batch (see the module docstring).

    ``lengths``: valid tokens per sequence; ``cp_size``: R; ``max_tokens_per_rank``: strict cap
    of tokens (padding included) a rank computes per micro-batch; ``min_micro_batches``:
    verl's DP-synchronized minimum K; ``group_policy``: ``"contiguous"`` (any group sizes,
    contiguous rank runs: MindSpeed ring attention) or ``"pow2"`` (power-of-two, aligned:
    TransformerEngine/NCCL); ``cost_model``: ``None`` loads the shipped default;
    ``allow_hdp=False`` returns the fixed-CP plan. ``max_micro_batches``: HDP-native plans
    with more micro-batches are not considered (fixed CP's micro-batches always are, their
    count is set by the cap); with ``min_micro_batches == max_micro_batches == K`` the plan
    has exactly K micro-batches unless fixed CP's balanced partition cannot fit the cap in
    K, which is how DP ranks agree on one count (plan with verl's K_min, all-reduce MAX of
    the counts, re-plan with both set to it; a rank whose count still differs re-plans
    with fixed CP's count, all-reduced the same way).
    Invalid input is a ``ValueError``."""
    return _plan(lengths, cp_size=cp_size, max_tokens_per_rank=max_tokens_per_rank,
                 min_micro_batches=min_micro_batches, group_policy=group_policy,
                 cost_model=cost_model, tp=tp, allow_hdp=allow_hdp,
                 max_micro_batches=max_micro_batches)[0]


def planning_work(lengths: Sequence[int], **kwargs) -> int:
    """How much work :func:`plan` does for these arguments, counted in the steps of its
    inner loops (items through a capped-balance pass, shelf visits, unit-tree levels,
    candidate partitions tried per item): the complexity test compares it across sizes,
    where a timing on a shared machine would say little."""
    return _plan(lengths, **kwargs)[1]


def _plan(lengths, *, cp_size, max_tokens_per_rank, min_micro_batches=1,
          group_policy="contiguous", cost_model=None, tp=1, allow_hdp=True,
          max_micro_batches=None) -> tuple[HdpPlan, int]:
    arr = _validate(lengths, cp_size, max_tokens_per_rank, min_micro_batches, group_policy, tp)
    if max_micro_batches is not None and (
            isinstance(max_micro_batches, bool) or not isinstance(max_micro_batches, int)
            or max_micro_batches < min_micro_batches):
        raise ValueError(f"max_micro_batches={max_micro_batches!r}: expected None or an "
                         f"integer >= min_micro_batches={min_micro_batches}")
    model = cost_model if cost_model is not None else _default_model()
    cap = int(max_tokens_per_rank)
    n = arr.size
    # per-sequence, per-group-size tables (vectorized, one numpy pass per size)
    times = np.empty((n, cp_size), np.float64)
    times_nocomm = np.empty((n, cp_size), np.float64)
    work = np.empty((n, cp_size), np.float64)
    exposed = np.empty((n, cp_size), np.float64)
    padded_all = np.empty((n, cp_size), np.int64)
    for s in range(1, cp_size + 1):
        work[:, s - 1], exposed[:, s - 1] = model.pack_terms(arr, s, tp=tp)
        times_nocomm[:, s - 1] = work[:, s - 1]
        times[:, s - 1] = work[:, s - 1] + (s - 1) * np.maximum(
            0.0, model.ring(s)[0] + exposed[:, s - 1])  # each sequence alone
        padded_all[:, s - 1] = padded_length(arr, s, tp)
    toks = padded_all // np.arange(1, cp_size + 1, dtype=np.int64)
    latency = np.array([model.ring(s)[0] for s in range(1, cp_size + 1)], np.float64)
    terms = (work, exposed, latency)
    part, k, passes = _cp_micro_batches(arr, toks[:, cp_size - 1], cap, min_micro_batches,
                                        cp_size)
    cands = _candidates(int(cp_size), group_policy, bool(allow_hdp))
    nparts = (cands > 0).sum(axis=1).astype(np.int64)
    steps = passes * n + cands.shape[0] * n
    overhead = model.per_micro_batch_overhead
    margin = model.relative_error
    best = _group(arr, part, k, terms, toks, cands, nparts, cap, overhead, margin)
    fixed_cp_cost = best["fixed_cp_cost"]
    if allow_hdp and cp_size > 1:
        # HDP-native micro-batches (shelf packing), kept only if cheaper overall; packed at
        # the cap and at a tighter formation cap (shelves that hold less balance better
        # when the cap, not time, limits how much a rank can stack); grouped at the cap
        sizes = np.arange(1, cp_size + 1, dtype=np.int64)
        allowed = np.zeros(cp_size, bool)
        allowed[np.unique(cands[cands > 0]) - 1] = True
        for fraction in _SHELF_CAP_FRACTIONS:
            shelf_cap = max(1, int(cap * fraction))
            fits = (toks <= shelf_cap) & allowed[None, :]
            fits[~fits.any(axis=1)] = (toks <= cap)[~fits.any(axis=1)] & allowed[None, :]
            rank_work = np.where(fits, times * sizes, np.inf)
            # the smallest size within 1% of the least rank-seconds: padding makes sizes
            # differ by a few tokens, and a smaller group leaves more ranks for others
            near = rank_work <= rank_work.min(axis=1, keepdims=True) * (1.0 + _NATIVE_TOLERANCE)
            native = (near.argmax(axis=1) + 1).astype(np.int64)
            tall = times[np.arange(n), native - 1]
            order = np.lexsort((np.arange(n), -tall)).astype(np.int64)
            # the least time a sequence adds to any pack it joins, suffix minima in order
            floor = np.where(allowed[None, :],
                             work + (sizes - 1)[None, :] * np.minimum(0.0, exposed),
                             np.inf).min(axis=1)
            floor = np.minimum.accumulate(floor[order][::-1])[::-1].copy()
            shelf_of, nsh, visits = _shelf_kernel(
                order, native, times, *terms, toks, toks[:, cp_size - 1],
                np.int64(shelf_cap), int(cp_size), floor, _SHELF_WINDOW)
            steps += int(visits)
            formations = [(shelf_of, int(nsh))]
            if fraction == 1.0:
                # rank units: every sequence on the fewest ranks that fit it, best-fit
                # decreasing into micro-batches of R ranks (what the seed's 0015 packs,
                # without its memory overload)
                units = ((toks <= cap) & allowed[None, :]).argmax(axis=1).astype(np.int64) + 1
                order = np.lexsort((np.arange(n), -arr, -units)).astype(np.int64)
                unit_of, nunits, tree_steps = _unit_kernel(
                    order, units, toks[:, cp_size - 1], np.int64(cap), int(cp_size))
                steps += int(tree_steps) * max(1, int(n).bit_length())
                formations.append((unit_of, nunits))
            for shelf_of, nsh in formations:
                nsh = int(nsh)
                if nsh < min_micro_batches:
                    shelf_of, nsh = _split_shelves(shelf_of, nsh, min_micro_batches, tall)
                if max_micro_batches is None or nsh <= max_micro_batches:
                    other = _group(arr, shelf_of, nsh, terms, toks, cands, nparts, cap,
                                   overhead, margin)
                    steps += cands.shape[0] * n
                    if other["cost"] < best["cost"] and \
                            other["cost"] < fixed_cp_cost * (1.0 - margin):
                        best = other
    lower = _lower_bound(times_nocomm, times, toks, padded_all, cap, cp_size,
                         min_micro_batches, overhead)
    return HdpPlan(micro_batches=_materialize(best, cands, nparts, overhead),
                   cp_size=int(cp_size), cost=float(min(best["cost"], fixed_cp_cost)),
                   fixed_cp_cost=float(fixed_cp_cost), lower_bound=float(lower), tp=int(tp),
                   group_policy=group_policy), steps


def _split_shelves(shelf_of: np.ndarray, nsh: int, k_min: int, tall: np.ndarray):
    """Reach ``k_min`` micro-batches (verl's DP-synchronized minimum) by moving, one at a
    time, the quickest sequence of the micro-batch holding the most sequences into a new
    one. Moving a sequence out never breaks the cap of the micro-batch it leaves."""
    shelf_of = shelf_of.copy()
    n = shelf_of.size
    index = np.arange(n)
    while nsh < k_min:
        counts = np.bincount(shelf_of, minlength=nsh)
        fullest = int(counts.argmax())  # k_min <= n, so it holds at least two
        members = index[shelf_of == fullest]
        quickest = members[np.lexsort((-members, tall[members]))[0]]
        shelf_of[quickest] = nsh
        nsh += 1
    return shelf_of, nsh


def _group(arr, part, k, terms, toks, cands, nparts, cap, overhead, margin) -> dict:
    """Group every micro-batch of the partition ``part`` (``k`` parts) with
    :func:`_group_kernel`: arrays of the result, its cost and the fixed-CP cost of the same
    micro-batches (sums of per-micro-batch costs, overhead included, exactly rounded)."""
    n = arr.size
    order = np.lexsort((np.arange(n), -arr, part))  # by micro-batch, longest first
    mb_ptr = np.zeros(k + 1, np.int64)
    mb_ptr[1:] = np.cumsum(np.bincount(part, minlength=k))
    mb_items = order.astype(np.int64)
    best_part, best_cost, cp_cost, assign = _group_kernel(
        mb_ptr, mb_items, *terms, toks, cands, nparts, np.int64(cap), float(margin))
    return dict(mb_ptr=mb_ptr, mb_items=mb_items, best_part=best_part, best_cost=best_cost,
                cp_cost=cp_cost, assign=assign,
                cost=math.fsum((best_cost + overhead).tolist()),
                fixed_cp_cost=math.fsum((cp_cost + overhead).tolist()))


def _materialize(r: dict, cands, nparts, overhead) -> tuple[MicroBatchPlan, ...]:
    """The chosen grouping as :class:`MicroBatchPlan` objects (sequences in index order)."""
    starts_of = np.zeros((cands.shape[0], cands.shape[1] + 1), np.int64)
    starts_of[:, 1:] = np.cumsum(cands, axis=1)
    group_tuples = [tuple(tuple(range(int(st[j]), int(st[j + 1])))
                          for j in range(int(q))) for st, q in zip(starts_of, nparts)]
    ptr = r["mb_ptr"]
    mb_ptr = ptr.tolist()
    # within each micro-batch, its sequences in index order (one sort for all of them)
    mb_id = np.repeat(np.arange(len(mb_ptr) - 1), np.diff(ptr))
    by_index = np.lexsort((r["mb_items"], mb_id))
    items = r["mb_items"][by_index].tolist()
    assign = r["assign"][by_index].tolist()
    best_part = r["best_part"].tolist()
    costs = (r["best_cost"] + overhead).tolist()
    cp_costs = (r["cp_cost"] + overhead).tolist()
    out = []
    for b in range(len(mb_ptr) - 1):
        lo, hi = mb_ptr[b], mb_ptr[b + 1]
        p = best_part[b]
        out.append(MicroBatchPlan(tuple(items[lo:hi]), group_tuples[p], tuple(assign[lo:hi]),
                                  p == 0, costs[b], cp_costs[b]))
    return tuple(out)


@lru_cache(maxsize=1)
def _default_model() -> CostModel:
    return CostModel.load(None)
