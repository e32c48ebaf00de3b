"""The seed's two HDP grouping schemes, re-implemented as baselines for ``bench_hdp.py``.

Not product code: these exist so the simulator can price what the recipe's verl patches do,
under the same cost model as the planner. Re-implemented from the description of the public
patches (hicann/cann-recipes-train, ``llm_rl/qwen3/patches/verl``), not copied:

- **0010** (``enable_hdp``): micro-batches are ``K = max(K_min, min(n, ceil(sum L / budget)))``
  buckets filled first-fit-decreasing up to ``ceil(sum L / K)`` tokens (an item that fits
  nowhere goes to the lightest bucket). Per micro-batch each sequence needs
  ``L / (sum L / R)`` ranks; integer parts become rank runs; a fractional part below
  ``min(0.1 * whole ranks, 0.5)`` is absorbed, above 0.9 rounds up, others are packed
  (greedy by fraction, largest first) onto the ranks left, or merged into existing groups
  when none are left; remaining ranks go to the smallest group. All ranks in one group, or a
  rank load above 1.3x the mean, falls back to CP. (The first call in a process is always CP;
  the simulator models the steady state and ignores that.) The merging can make two
  sequences claim overlapping but different rank sets, which the runtime rejects
  (``find_group`` raises): such micro-batches are counted as ``invalid`` and priced as CP.
- **0015** (``hdp_binpack_optimization``): every sequence needs
  ``max(1, ceil(L / (1.18 * cap)))`` rank units (18% memory overload allowed); units are
  packed best-fit-decreasing into bins of ``R``; the bin count is raised to ``K_min`` by
  splitting single sequences off the last multi-sequence bins. In a bin each sequence gets
  its units as a contiguous run; spare ranks go to the longest sequence. No CP fallback
  except when one sequence gets all ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass
class SchemePlan:
    """Micro-batches as lists of sequence indices, and per micro-batch the rank list of every
    sequence (``None``: plain CP)."""

    micro_batches: list[list[int]]
    rank_groups: list[list[list[int]] | None]
    invalid: int = 0  # micro-batches the runtime would reject (priced as CP)


# -- 0010 -------------------------------------------------------------------------------------


def _buckets_0010(lengths: Sequence[int], bucket_tokens: int, num_buckets: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = [[] for _ in range(num_buckets)]
    sums = [0] * num_buckets
    for i in order:
        target = next((b for b in range(num_buckets) if sums[b] + lengths[i] <= bucket_tokens),
                      None)
        if target is None:
            target = min(range(num_buckets), key=lambda b: sums[b])
        buckets[target].append(i)
        sums[target] += lengths[i]
    return buckets


def _groups_0010(lens: list[int], cp_size: int) -> tuple[list[list[int]] | None, bool]:
    """Rank list per sequence, or None for CP; second value: runtime would reject it."""
    total = sum(lens)
    need = [length / (total / cp_size) for length in lens]
    groups: list[list[int]] = [[] for _ in lens]
    fractional = []
    next_rank = 0
    for i, r in enumerate(need):
        whole, frac = int(r), r % 1
        if r >= 1:
            groups[i] = list(range(next_rank, next_rank + whole))
            next_rank += whole
            if frac < min(0.1 * whole, 0.5):
                continue
            if frac > 0.9:
                groups[i].append(next_rank)
                next_rank += 1
                continue
        fractional.append((i, frac))
    if fractional:
        if next_rank >= cp_size:  # no rank left: merge into existing groups
            # existing groups are read lazily (their state when reached), then cycled
            cache: list[tuple[list[int], int]] = []
            scan = 0
            for j, (i, _) in enumerate(fractional):
                while scan < len(groups) and not groups[scan]:
                    scan += 1
                if scan < len(groups):
                    cache.append((list(groups[scan]), scan))
                    scan += 1
                    g, idx = cache[-1]
                elif cache:
                    g, idx = cache[j % len(cache)]
                else:
                    continue
                merged = sorted(set(groups[i] + g))
                groups[i] = merged
                groups[idx] = merged  # one shared list, as the patch does
        else:  # greedy by fraction over the ranks left
            free = cp_size - next_rank
            bins: list[list[int]] = [[] for _ in range(free)]
            bin_sum = [0.0] * free
            for i, frac in sorted(fractional, key=lambda x: -x[1]):
                b = bin_sum.index(min(bin_sum))
                bins[b].append(i)
                bin_sum[b] += frac
            for members in bins:
                if not members:
                    continue
                ranks = [next_rank]
                for i in members:
                    ranks.extend(groups[i])
                ranks.sort()
                for i in members:
                    groups[i] = list(ranks)  # a copy each, as the patch does
                next_rank += 1
    while next_rank < cp_size:  # spare ranks to the smallest group (by list identity)
        smallest = groups[min(range(len(groups)), key=lambda i: len(groups[i]))]
        for g in [g for g in groups if g is smallest]:
            g.append(next_rank)
        next_rank += 1
    if len(groups[0]) == cp_size:
        return None, False
    load = [0.0] * cp_size
    for i, g in enumerate(groups):
        for r in g:
            if r < cp_size:
                load[r] += need[i] / len(g)
    if any(x > 1.3 for x in load):
        return None, False
    return groups, not _consistent(groups, cp_size)


def _consistent(groups: list[list[int]], cp_size: int) -> bool:
    """Every rank sees one rank set (what the runtime's find_group requires), all ranks
    valid."""
    seen: dict[int, tuple[int, ...]] = {}
    for g in groups:
        if len(set(g)) != len(g):
            return False
        key = tuple(sorted(g))
        for r in g:
            if r >= cp_size or seen.setdefault(r, key) != key:
                return False
    return True


def scheme_0010(lengths: Sequence[int], *, cp_size: int, max_tokens_per_rank: int,
                min_micro_batches: int = 1) -> SchemePlan:
    n = len(lengths)
    total = sum(lengths)
    budget = cp_size * max_tokens_per_rank
    k = max(min_micro_batches, min(n, -(-total // budget)))
    buckets = [b for b in _buckets_0010(lengths, -(-total // k), k) if b]
    groups, invalid = [], 0
    for b in buckets:
        g, bad = _groups_0010([lengths[i] for i in b], cp_size)
        if bad:
            invalid += 1
            g = None
        groups.append(g)
    return SchemePlan(buckets, groups, invalid)


# -- 0015 -------------------------------------------------------------------------------------


def scheme_0015(lengths: Sequence[int], *, cp_size: int, max_tokens_per_rank: int,
                min_micro_batches: int = 1, overload: float = 1.18) -> SchemePlan:
    budget = cp_size * max_tokens_per_rank
    rank_tokens = budget * overload / cp_size
    units = [max(1, math.ceil(length / rank_tokens)) for length in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (-units[i], -lengths[i]))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        best, best_left = None, None
        for b, load in enumerate(loads):
            left = cp_size - load - units[i]
            if left >= 0 and (best_left is None or left < best_left):
                best, best_left = b, left
                if left == 0:
                    break
        if best is None:
            bins.append([i])
            loads.append(units[i])
        else:
            bins[best].append(i)
            loads[best] += units[i]
    target = max(len(bins), min_micro_batches)
    split = len(bins) - 1
    while len(bins) < target:
        while split >= 0 and len(bins[split]) <= 1:
            split -= 1
        if split < 0:
            raise RuntimeError("0015: not enough sequences to reach K_min")
        bins.append([bins[split].pop()])
    groups: list[list[list[int]] | None] = []
    for b in bins:
        need = [units[i] for i in b]
        spare = cp_size - sum(need)
        if spare > 0:
            longest = max(range(len(b)), key=lambda j: lengths[b[j]])
            need[longest] += spare
        start, g = 0, []
        for r in need:
            g.append(list(range(start, start + r)))
            start += r
        groups.append(None if len(g[0]) == cp_size else g)
    return SchemePlan(bins, groups)
