"""Megatron-Core 0.16.1's hybrid context parallel scheduling, re-implemented as a baseline for
``bench_hdp.py``.

Not product code, and not a copy: written from a reading of
``megatron/core/pipeline_parallel/hybrid_cp_schedule.py`` (``BalancedCPScheduler``,
``hybrid_context_parallel_forward_backward``) in Megatron-Core 0.16.1, so that the simulator
prices what that scheduler decides, under the same cost model as everything else. What it
does, as read there (one DP x CP group of ``R`` ranks; here the ``R`` CP ranks of one DP
replica, the simulator's unit):

- a sequence of ``L`` tokens needs ``need(L)`` ranks: the smallest power of two ``p`` with
  ``p * max_seq_len_per_rank >= L`` (1 for short ones); its workload estimate is
  ``L**2 / need(L)``;
- sequences are sorted longest first once; then "groups" are formed one after another from
  what is left, each by ``next_hdp_group``:

  1. buckets: as many as there are distinct ``need`` values among what is left, cut from the
     list in order, a bucket closing when adding the next sequence would exceed 1.1x the
     mean workload per bucket, or when the sequences left are no more than the buckets still
     wanted (upstream counts that as ``k - 2 * closed``, which is what runs);
  2. repeatedly the head of the first bucket whose head can be placed (an existing rank group
     of exactly its ``need``, or that many ranks still without a group) joins the least-loaded
     existing group of its size, or opens a new group on the free ranks (lowest first) when
     those are less loaded (free ranks carry no load, so a new group wins while ranks are
     free); every member's load grows by the sequence's workload;
  3. once a sequence needing fewer ranks than the group's first one was placed, the group
     ends as soon as the ranks' loads are within 5% of the largest (while sequences remain);
  4. trimming: while the loads are more than 5% apart and no rank is empty, the most-loaded
     rank's group gives back its last sequence if that narrows the spread (never its only
     one);
  5. empty ranks: the first group of the smallest size doubles (up to ``R``), the groups
     after it move up, until no rank is empty;
  6. what was not placed (the buckets' rest, then the trimmed sequences, in that order) is
     scheduled next, without re-sorting.

- At run time every rank runs the sequences of its group **one forward/backward each**
  (``forward_step`` per sub-sample, the sequence alone on its group, ``local_cp_size`` = the
  number of ranks holding it), and the groups are separated by a barrier of the DP x CP
  group. Megatron-Core 0.16.1's hybrid CP has no pipeline-parallel schedule.

The result, :class:`MegatronSchedule`, lists the groups as micro-batches (sequence indices,
and the rank list of every sequence), as ``hdp_seed_schemes.SchemePlan`` does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

BALANCE_SLACK = 0.05  # loads within 5% of the largest: balanced
BUCKET_OVERSHOOT = 1.1  # a bucket closes above 1.1x the mean workload per bucket


@dataclass
class MegatronSchedule:
    """Groups (barrier to barrier) as micro-batches: sequence indices, and per micro-batch
    the rank list of every sequence."""

    micro_batches: list[list[int]]
    rank_groups: list[list[list[int]]]


def ranks_needed(length: int, max_tokens_per_rank: int) -> int:
    """The smallest power of two ``p`` with ``p * max_tokens_per_rank >= length`` (>= 1)."""
    p = 1
    while p * max_tokens_per_rank < length:
        p *= 2
    return p


@dataclass
class _Group:
    size: int
    members: list[int]
    sequences: list[tuple[int, int]]  # (index, length)


def _buckets(items: list[tuple[int, int]], need, workload) -> list[deque]:
    kinds = len({need(length) for _, length in items})
    target = sum(workload(length) for _, length in items) / kinds
    buckets: list[deque] = []
    current: list[tuple[int, int]] = []
    current_work = 0.0
    for position, (index, length) in enumerate(items):
        w = workload(length)
        # upstream decrements its "buckets still wanted" and adds the closed ones: k - 2c
        if current and (current_work + w > BUCKET_OVERSHOOT * target
                        or len(items) - position <= kinds - 2 * len(buckets)):
            buckets.append(deque(current))
            current, current_work = [], 0.0
        current.append((index, length))
        current_work += w
    if current:
        buckets.append(deque(current))
    return buckets


def _one_group(items: list[tuple[int, int]], ranks: int, need, workload
               ) -> tuple[list[_Group], list[tuple[int, int]]]:
    """One group of sub-samples (``next_hdp_group``): its rank groups and what is left."""
    buckets = _buckets(items, need, workload)
    load = [0.0] * ranks
    owner: list[_Group | None] = [None] * ranks
    groups: list[_Group] = []
    first_need = None
    check_balance = False
    while buckets:
        picked = None
        free = [r for r in range(ranks) if owner[r] is None]
        for b, bucket in enumerate(buckets):
            if not bucket:
                continue
            n = need(bucket[0][1])
            if any(g.size == n for g in groups) or len(free) >= n:
                picked = b
                break
        if picked is None:
            break
        index, length = buckets[picked][0]
        n = need(length)
        if first_need is None:
            first_need = n
        same = [g for g in groups if g.size == n]
        best, best_load = None, float("inf")
        for g in same:  # the first of the least loaded
            g_load = max(load[r] for r in g.members)
            if g_load < best_load:
                best, best_load = g, g_load
        if len(free) >= n:
            fresh = sorted(free, key=lambda r: load[r])[:n]
            if load[fresh[-1]] < best_load:
                best = _Group(n, fresh, [])
                groups.append(best)
                for r in fresh:
                    owner[r] = best
        w = workload(length)
        best.sequences.append((index, length))
        for r in best.members:
            load[r] += w
        buckets[picked].popleft()
        while buckets and not buckets[0]:
            buckets.pop(0)
        if n < first_need:
            check_balance = True
        if check_balance and buckets and max(load) - min(load) <= BALANCE_SLACK * max(load):
            break
    left = [item for bucket in buckets for item in bucket]
    # trim the most loaded group's last sequence while that narrows the spread
    while True:
        top, bottom = max(load), min(load)
        if top - bottom <= BALANCE_SLACK * top or bottom == 0:
            break
        g = owner[load.index(top)]
        if len(g.sequences) <= 1:
            break
        w = workload(g.sequences[-1][1])
        after = [x - w if owner[r] is g else x for r, x in enumerate(load)]
        if max(after) - min(after) >= top - bottom:
            break
        left.append(g.sequences.pop())
        load = after
    # no rank left empty: the first group of the smallest size doubles, later groups move up
    groups.sort(key=lambda g: g.members[0])
    while sum(g.size for g in groups) < ranks:
        smallest = min(g.size for g in groups)
        grown = next(g for g in groups if g.size == smallest)
        grown.size = min(2 * smallest, ranks)
        start = 0
        for g in groups:
            g.members = list(range(start, start + g.size))
            start += g.size
    return groups, left


def scheme_megatron(lengths: Sequence[int], *, cp_size: int, max_tokens_per_rank: int
                    ) -> MegatronSchedule:
    """Megatron-Core 0.16.1's hybrid-CP groups for one DP replica's ``cp_size`` ranks
    (``max_seq_len_per_rank = max_tokens_per_rank``)."""
    if cp_size & (cp_size - 1):
        raise ValueError(f"cp_size={cp_size}: Megatron-Core's hybrid CP groups are powers of two")

    def need(length: int) -> int:
        return ranks_needed(length, max_tokens_per_rank)

    def workload(length: int) -> float:
        return length * length / need(length)

    items = sorted(((i, int(x)) for i, x in enumerate(lengths)), key=lambda t: -t[1])
    micro_batches, rank_groups = [], []
    while items:
        groups, items = _one_group(items, cp_size, need, workload)
        seqs, ranks = [], []
        for g in groups:
            for index, _ in g.sequences:
                seqs.append(index)
                ranks.append(list(g.members))
        micro_batches.append(seqs)
        rank_groups.append(ranks)
    return MegatronSchedule(micro_batches, rank_groups)
