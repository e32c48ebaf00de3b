"""Which DP rank generates which sample: a pure, deterministic assignment.

Inputs, one entry per sample of the generation batch (in the caller's order): ``group`` (the
prompt a sample belongs to; GRPO samples ``n`` responses per prompt), ``est`` (its estimated
response length in decode steps: the prompt's past mean response length when it was seen
before, else one common value) and ``prompt_len``. The batch is cut into ``ranks`` equal
contiguous chunks by verl's dispatch, so a plan is a dispatch *order*: position ``k`` holds the
caller's sample ``order[k]`` and rank ``k // (N / ranks)`` generates it.

Cost model (time in units of one sequence's share of a decode step). A rank decodes its
samples in one continuous batch; a decode step costs ``step_overhead + active sequences``, so a
rank's time is ``step_overhead * steps + sum(est) + prefill_per_token * sum(prompt_len)``, where
``steps`` is when its longest sample ends: a soft maximum of its estimates,
``(sum est^p)^(1/p)`` (estimates are uncertain: the more long samples a rank holds, the longer
its longest is expected to be), capped at the response limit ``max_len``; when at most
``max_seqs`` sequences run at once, at least the time to run its estimates in submission order
on ``max_seqs`` slots (list scheduling; while a plan is built, the fluid bound
``sum(est) / max_seqs`` stands in for it). The plan's makespan is the slowest rank's time.

The balanced plan, in three vectorized/numba passes:

1. *LPT with capacities and spreading*: samples in decreasing ``est + prefill * prompt_len``
   (a prompt's samples interleaved with other prompts' of equal weight), each to the rank
   that (a) holds the fewest samples of its prompt so far, then (b) would have the smallest
   modeled time after taking it, among ranks below their ``N / ranks`` share. (a) spreads every
   prompt's group as evenly over the ranks as their number allows, as the seed's permutation
   does: response lengths within a group are correlated, so a group kept whole puts its whole
   (unknown) tail on one rank. (b) is longest-processing-time-first on the modeled cost.
   Where capacity ran out and a prompt got more samples on a rank than an even spread
   allows, the surplus is exchanged with another prompt's sample (cheapest exchange).
2. *Swap refinement*: while some exchange of one sample of the slowest rank with one of
   another rank lowers the slower of the two, and keeps both prompts spread, make the best
   such exchange (candidates found by binary search on weights; exact model for the check).
3. *Within a rank, longest first*: with a concurrency limit, late starters of long samples
   make the tail; vLLM admits requests in submission order.

Never worse than the seed: the seed's fixed permutation (``i*n+j -> j*B+i`` of the
interleaved GRPO batch) is evaluated with the same model, and the balanced plan is used only
when it models at least ``margin`` faster; otherwise the seed's order is returned as is. With
no information (every ``est`` equal, prompts of equal length) both model the same and the
seed's order is what runs.

numpy + numba only (the kernels run as plain Python if numba is missing); no torch or verl.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

try:
    from numba import njit
except ImportError:  # pragma: no cover - numba ships with vLLM; plain Python is the fallback
    def njit(*args, **kwargs):
        return args[0] if args and callable(args[0]) else (lambda f: f)

MODES = ("balanced", "seed")


@dataclass(frozen=True)
class CostModel:
    """Knobs of the modeled rank time (see the module docstring)."""

    step_overhead: float = 64.0  # fixed cost of a decode step, in per-sequence step costs
    max_seqs: int = 0  # sequences a rank runs at once (vLLM max_num_seqs / KV limit); 0: no limit
    prefill_per_token: float = 0.01  # prefill cost of one prompt token, in per-sequence step costs
    margin: float = 0.01  # the balanced plan must model this much faster than the seed's order
    tail_power: float = 2.0  # p of the soft maximum (see _steps); larger: closer to the plain max
    max_len: float = 0.0  # response length limit (no rank runs longer); 0: unknown
    swap_rounds: int = 0  # refinement exchanges; 0: 4 * ranks

    def __post_init__(self):
        if not (self.step_overhead >= 0 and self.prefill_per_token >= 0 and 0 <= self.margin < 1
                and self.max_seqs >= 0 and self.swap_rounds >= 0 and self.tail_power >= 1
                and self.max_len >= 0):
            raise ValueError(f"invalid CostModel {self}: step_overhead, prefill_per_token, max_seqs, max_len "
                             f"and swap_rounds must be >= 0, tail_power >= 1 and 0 <= margin < 1")


@dataclass(frozen=True)
class Plan:
    """A dispatch order and why it was chosen."""

    order: np.ndarray  # position k of the dispatched batch holds the caller's sample order[k]
    ranks: int
    chosen: str  # "balanced" | "seed" | "identity"
    modeled: dict = field(default_factory=dict)  # modeled makespan of each candidate

    @property
    def per_rank(self) -> int:
        return len(self.order) // self.ranks

    def rank_of(self) -> np.ndarray:
        """The rank that generates each of the caller's samples."""
        rank = np.empty(len(self.order), dtype=np.int64)
        rank[self.order] = np.arange(len(self.order)) // self.per_rank
        return rank

    def inverse(self) -> np.ndarray:
        """Indices that put the dispatched order back into the caller's order."""
        inv = np.empty(len(self.order), dtype=np.int64)
        inv[self.order] = np.arange(len(self.order))
        return inv

    @property
    def is_identity(self) -> bool:
        return bool(np.array_equal(self.order, np.arange(len(self.order))))


# -- the fixed orders ------------------------------------------------------------------------

def seed_order(n_samples: int, n: int) -> np.ndarray:
    """The recipe's permutation of an interleaved batch (sample ``j`` of prompt ``i`` at
    ``i*n+j``): dispatch position ``j*B+i`` holds it, so every contiguous chunk takes the same
    samples of many prompts."""
    if n <= 0 or n_samples % n:
        raise ValueError(f"{n_samples} samples are not {n} samples per prompt")
    return np.arange(n_samples, dtype=np.int64).reshape(n_samples // n, n).T.reshape(-1).copy()


def interleaved_group_size(group: np.ndarray) -> int:
    """``n`` when ``group`` is the interleaved GRPO layout (consecutive runs of one prompt, all
    of length ``n``), else 0."""
    group = np.asarray(group)
    if len(group) == 0:
        return 0
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    lengths = np.diff(np.r_[starts, len(group)])
    n = int(lengths[0])
    if not np.all(lengths == n) or len(np.unique(group[starts])) != len(starts):
        return 0
    return n


# -- the model -------------------------------------------------------------------------------

@njit(cache=True)
def _rank_time(load, pow_sum, sum_est, overhead, cap, power, max_len):
    """Modeled time of a rank from its running sums (see :func:`rank_times`)."""
    steps = pow_sum ** (1.0 / power)
    if max_len > 0 and steps > max_len:
        steps = max_len
    if cap > 0 and sum_est / cap > steps:
        steps = sum_est / cap
    return overhead * steps + load


@njit(cache=True)
def decode_steps(lengths, slots):
    """When the last of ``lengths`` (in submission order) finishes when at most ``slots`` run at
    once (list scheduling; ``slots`` <= 0: all at once)."""
    if len(lengths) == 0:
        return 0.0
    if slots <= 0 or slots >= len(lengths):
        return lengths.max()
    free_at = np.zeros(slots)
    for length in lengths:
        k = np.argmin(free_at)
        free_at[k] += length
    return free_at.max()


def rank_times(order: np.ndarray, est: np.ndarray, prompt_len: np.ndarray, ranks: int,
               model: CostModel) -> np.ndarray:
    """Modeled time of every rank for dispatch ``order``.

    A rank's decode steps are a *soft* maximum of its estimates, ``(sum est^p)^(1/p)``: the
    longest response of several uncertain ones is expected to exceed the largest estimate, the
    more so the more long ones a rank holds (for lognormal lengths with the spread seen within
    GRPO groups, ``p`` = 2 did best in the simulator); capped at ``max_len``.
    Under a concurrency limit, at least the time to run its estimates in dispatch order on
    ``max_seqs`` slots (so the order within a rank counts)."""
    est = np.asarray(est, dtype=np.float64)
    per_rank = len(order) // ranks
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order)) // per_rank
    sum_est = np.bincount(rank, weights=est, minlength=ranks)
    load = sum_est + model.prefill_per_token * np.bincount(rank, weights=np.asarray(prompt_len, np.float64),
                                                           minlength=ranks)
    steps = np.bincount(rank, weights=est ** model.tail_power, minlength=ranks) ** (1.0 / model.tail_power)
    if model.max_len > 0:
        steps = np.minimum(steps, model.max_len)
    if 0 < model.max_seqs < per_rank:
        queued = np.ascontiguousarray(est[order]).reshape(ranks, per_rank)
        steps = np.maximum(steps, [decode_steps(row, model.max_seqs) for row in queued])
    return model.step_overhead * steps + load


def makespan(order, est, prompt_len, ranks, model) -> float:
    return float(rank_times(order, est, prompt_len, ranks, model).max())


# -- the balanced plan -----------------------------------------------------------------------

@njit(cache=True)
def _lpt(sequence, weight, est, group, n_groups, ranks, per_rank, m):
    """Pass 1: every sample of ``sequence`` (heaviest first) to the rank holding the fewest of
    its prompt, then the smallest modeled time after taking it; returns each sample's rank.
    ``m``: (step_overhead, max_seqs, tail_power, max_len)."""
    overhead, cap, power, max_len = m
    load = np.zeros(ranks)
    pow_sum = np.zeros(ranks)
    sum_est = np.zeros(ranks)
    count = np.zeros(ranks, np.int64)
    spread = np.zeros((n_groups, ranks), np.int64)
    assign = np.empty(len(weight), np.int64)
    for i in sequence:
        g = group[i]
        best = -1
        best_spread = 0
        best_time = 0.0
        for r in range(ranks):
            if count[r] >= per_rank:
                continue
            t = _rank_time(load[r] + weight[i], pow_sum[r] + est[i] ** power, sum_est[r] + est[i],
                           overhead, cap, power, max_len)
            s = spread[g, r]
            if best < 0 or s < best_spread or (s == best_spread and t < best_time):
                best, best_spread, best_time = r, s, t
        assign[i] = best
        load[best] += weight[i]
        sum_est[best] += est[i]
        pow_sum[best] += est[i] ** power
        count[best] += 1
        spread[g, best] += 1
    return assign


@njit(cache=True)
def _sums(members, weight, est, power):
    """Per rank: sum of weights, of est^power and of est."""
    ranks, per_rank = members.shape
    sums = np.zeros((ranks, 3))
    for r in range(ranks):
        for k in range(per_rank):
            i = members[r, k]
            sums[r, 0] += weight[i]
            sums[r, 1] += est[i] ** power
            sums[r, 2] += est[i]
    return sums


@njit(cache=True)
def _time_after_swap(sums, r, out, incoming, weight, est, m):
    """Modeled time of rank ``r`` with sample ``out`` replaced by ``incoming``."""
    overhead, cap, power, max_len = m
    return _rank_time(sums[r, 0] - weight[out] + weight[incoming],
                      max(sums[r, 1] - est[out] ** power + est[incoming] ** power, 0.0),
                      sums[r, 2] - est[out] + est[incoming], overhead, cap, power, max_len)


@njit(cache=True)
def _swap(members, spread, group, r, kr, s, ks):
    x = members[r, kr]
    y = members[s, ks]
    members[r, kr] = y
    members[s, ks] = x
    spread[group[x], r] -= 1
    spread[group[x], s] += 1
    spread[group[y], s] -= 1
    spread[group[y], r] += 1


@njit(cache=True)
def _repair(members, weight, est, group, limit, spread, m):
    """Pass 1b: where the greedy pass had to put more of a prompt's samples on a rank than an
    even spread allows (its capacity ran out elsewhere), exchange the surplus with a sample of
    another prompt from a rank that still has room for it, cheapest exchange first."""
    ranks, per_rank = members.shape
    sums = _sums(members, weight, est, m[2])
    for r in range(ranks):
        kr = 0
        while kr < per_rank:
            x = members[r, kr]
            gx = group[x]
            if spread[gx, r] <= limit[gx]:
                kr += 1
                continue
            best, best_s, best_ks = np.inf, -1, -1
            for s in range(ranks):
                if s == r or spread[gx, s] >= limit[gx]:
                    continue
                for ks in range(per_rank):
                    y = members[s, ks]
                    gy = group[y]
                    if gy == gx or spread[gy, r] >= limit[gy]:
                        continue
                    worst = max(_time_after_swap(sums, r, x, y, weight, est, m),
                                _time_after_swap(sums, s, y, x, weight, est, m))
                    if worst < best:
                        best, best_s, best_ks = worst, s, ks
            if best_s < 0:  # no exchange keeps both prompts spread: leave it
                kr += 1
                continue
            y = members[best_s, best_ks]
            for col in range(3):
                delta = (weight[y] - weight[x], est[y] ** m[2] - est[x] ** m[2], est[y] - est[x])[col]
                sums[r, col] += delta
                sums[best_s, col] -= delta
            _swap(members, spread, group, r, kr, best_s, best_ks)
    return members


@njit(cache=True)
def _refine(members, weight, est, group, limit, spread, m, rounds):
    """Pass 2: exchanges between the slowest rank and another one (see the module docstring)."""
    overhead, cap, power, max_len = m
    ranks, per_rank = members.shape
    for _ in range(rounds):
        sums = _sums(members, weight, est, power)
        times = np.empty(ranks)
        for q in range(ranks):
            times[q] = _rank_time(sums[q, 0], sums[q, 1], sums[q, 2], overhead, cap, power, max_len)
        r = np.argmax(times)
        best_gain = 1e-9 * (1.0 + times[r])
        best = (-1, -1, -1)
        for s in range(ranks):
            if s == r:
                continue
            gap = times[r] - times[s]
            if gap <= best_gain:
                continue
            ws = np.empty(per_rank)
            for k in range(per_rank):
                ws[k] = weight[members[s, k]]
            by_weight = np.argsort(ws)
            sorted_ws = ws[by_weight]
            for kr in range(per_rank):
                x = members[r, kr]
                target = weight[x] - gap / 2.0
                pos = np.searchsorted(sorted_ws, target)
                for cand in (pos - 1, pos):
                    if cand < 0 or cand >= per_rank:
                        continue
                    ks = by_weight[cand]
                    y = members[s, ks]
                    gx, gy = group[x], group[y]
                    if gx != gy and (spread[gx, s] + 1 > limit[gx] or spread[gy, r] + 1 > limit[gy]):
                        continue
                    new_r = _time_after_swap(sums, r, x, y, weight, est, m)
                    new_s = _time_after_swap(sums, s, y, x, weight, est, m)
                    gain = times[r] - max(new_r, new_s)
                    if gain > best_gain:
                        best_gain = gain
                        best = (s, kr, ks)
        s, kr, ks = best
        if s < 0:
            break
        _swap(members, spread, group, r, kr, s, ks)
    return members


def _occurrence(group: np.ndarray) -> np.ndarray:
    """Index of each sample within its prompt's group, in the caller's order."""
    by_group = np.argsort(group, kind="stable")
    counts = np.bincount(group)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    occurrence = np.empty(len(group), dtype=np.int64)
    occurrence[by_group] = np.arange(len(group)) - starts
    return occurrence


def balanced_order(est, prompt_len, group, ranks: int, model: CostModel) -> np.ndarray:
    """The balanced dispatch order (passes 1-3 of the module docstring)."""
    est = np.ascontiguousarray(est, dtype=np.float64)
    _, group = np.unique(np.asarray(group), return_inverse=True)
    group = np.ascontiguousarray(group, dtype=np.int64)
    n_samples = len(est)
    per_rank = n_samples // ranks
    weight = est + model.prefill_per_token * np.asarray(prompt_len, dtype=np.float64)
    m = (float(model.step_overhead), float(model.max_seqs), float(model.tail_power), float(model.max_len))
    # heaviest first; equal weights: the first sample of every prompt, then the second, ...
    sequence = np.lexsort((group, _occurrence(group), -weight))
    assign = _lpt(sequence, weight, est, group, int(group.max()) + 1, ranks, per_rank, m)
    members = np.argsort(assign, kind="stable").reshape(ranks, per_rank).copy()
    sizes = np.bincount(group)
    limit = -(-sizes // ranks)  # a prompt's samples per rank when spread as evenly as possible
    spread = np.zeros((len(sizes), ranks), dtype=np.int64)
    np.add.at(spread, (group, assign), 1)
    rounds = model.swap_rounds or 4 * ranks
    members = _repair(members, weight, est, group, limit, spread, m)
    members = _refine(members, weight, est, group, limit, spread, m, rounds)
    rank = np.empty(n_samples, dtype=np.int64)
    rank[members.reshape(-1)] = np.repeat(np.arange(ranks), per_rank)
    # pass 3: by rank, longest first within a rank, then the caller's order
    return np.lexsort((np.arange(n_samples), -est, rank))


def plan(est, prompt_len, group, ranks: int, model: CostModel | None = None, mode: str = "balanced") -> Plan:
    """The dispatch order for one generation batch (see the module docstring).

    ``mode="seed"``: the seed's permutation when the batch is the interleaved GRPO layout, else
    the caller's order. ``mode="balanced"``: the balanced plan when it models at least
    ``model.margin`` faster than the seed's order (or than the caller's order when the batch
    is not interleaved), else that order."""
    if mode not in MODES:
        raise ValueError(f"data rebalance mode {mode!r} is not one of {', '.join(MODES)}")
    model = model or CostModel()
    est = np.asarray(est, dtype=np.float64)
    prompt_len = np.asarray(prompt_len, dtype=np.float64)
    group = np.asarray(group)
    n_samples = len(est)
    if not (len(prompt_len) == len(group) == n_samples):
        raise ValueError("est, prompt_len and group must have one entry per sample")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    identity = np.arange(n_samples, dtype=np.int64)
    if n_samples == 0 or n_samples % ranks:
        return Plan(identity, ranks, "identity")
    n = interleaved_group_size(group)
    reference, name = (seed_order(n_samples, n), "seed") if n else (identity, "identity")
    modeled = {"identity": makespan(identity, est, prompt_len, ranks, model)}
    if n:
        modeled["seed"] = makespan(reference, est, prompt_len, ranks, model)
    if mode == "seed":
        return Plan(reference, ranks, name, modeled)
    order = balanced_order(est, prompt_len, group, ranks, model)
    modeled["balanced"] = makespan(order, est, prompt_len, ranks, model)
    if modeled["balanced"] < (1.0 - model.margin) * modeled[name]:
        return Plan(order, ranks, "balanced", modeled)
    return Plan(reference, ranks, name, modeled)
