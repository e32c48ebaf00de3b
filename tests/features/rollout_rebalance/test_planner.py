"""Planner properties: conservation, KV capacity, determinism, never worse than no-op."""

from __future__ import annotations

import math
from dataclasses import replace
import pickle
import random

import pytest
from hypothesis import given, settings, strategies as st

from ascend_rl_plugins.features.rollout_rebalance import planner as P
from ascend_rl_plugins.features.rollout_rebalance.planner import (
    PlannerConfig, RankLoad, bucket, plan)

LADDER = (4, 8, 16, 32, 64)


@st.composite
def clusters(draw):
    n_ranks = draw(st.integers(1, 12))
    block_size = draw(st.sampled_from([16, 128]))
    max_num_seqs = draw(st.sampled_from([8, 16, 64]))
    loads = []
    for rank in range(n_ranks):
        n = draw(st.integers(0, max_num_seqs + 6))
        tokens = draw(st.lists(st.integers(1, 4000), min_size=n, max_size=n))
        n_running = min(n, max_num_seqs, draw(st.integers(0, n)))
        waiting = [i >= n_running for i in range(n)]
        used = sum((t + block_size - 1) // block_size
                   for t, w in zip(tokens, waiting) if not w)
        total = used + draw(st.integers(0, 400))
        requests = {f"req-{rank}-{i}": (t, w) for i, (t, w) in enumerate(zip(tokens, waiting))}
        loads.append((rank, requests, used, total, block_size, max_num_seqs))
    kv = draw(st.booleans())
    return loads, kv


def build(raw, shuffle_seed=None):
    out = []
    for rank, requests, used, total, block_size, max_num_seqs in raw:
        items = list(requests.items())
        if shuffle_seed is not None:
            random.Random(shuffle_seed + rank).shuffle(items)
        out.append(RankLoad.from_requests(rank, dict(items), kv_blocks_used=used,
                                          kv_blocks_total=total, block_size=block_size,
                                          max_num_seqs=max_num_seqs))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(out)
    return out


def config(kv):
    return PlannerConfig(graph_sizes=LADDER, kv_migration=kv, kv_bytes_per_token=4096,
                         link_bytes_per_s=20e9, prefill_tokens_per_s=20000)


@settings(max_examples=300, deadline=None)
@given(clusters())
def test_conservation_capacity_and_no_regression(case):
    raw, kv = case
    loads = build(raw)
    result = plan(loads, config(kv))
    owner = {rid: load.rank for load in loads for rid in load.request_ids}
    moved = [m.request_id for m in result.migrations]
    # every request moves at most once, from the rank that holds it, to another rank
    assert len(moved) == len(set(moved))
    for m in result.migrations:
        assert owner[m.request_id] == m.src != m.dst
        assert m.dst in {load.rank for load in loads}
        if not kv:
            assert not m.with_kv and m.bytes == 0
    after = dict(owner)
    for m in result.migrations:
        after[m.request_id] = m.dst
    assert sorted(after) == sorted(owner)  # nothing lost, nothing created
    by_rank = {load.rank: load for load in loads}
    for rank, load in by_rank.items():
        incoming = [m for m in result.migrations if m.dst == rank]
        if not incoming:
            continue
        # a receiver never goes over its KV capacity nor its slot limit
        assert not [m for m in result.migrations if m.src == rank]
        assert load.kv_blocks_used + sum(m.blocks for m in incoming) <= load.kv_blocks_total
        assert len(load.request_ids) + len(incoming) <= load.max_num_seqs
    # primary objective (queued requests that cannot run) never worse than doing nothing;
    # a non-empty plan strictly improves the objectives in order (waiting, bucket, projected
    # KV overflow): the first one it changes gets better
    assert result.waiting_after <= result.waiting_before
    before = (result.waiting_before, result.bucket_before, result.overflow_before)
    after = (result.waiting_after, result.bucket_after, result.overflow_after)
    if result.migrations:
        assert after < before
    else:
        assert after == before
    # the projected overflow is what the moved requests really give
    cfg = config(kv)
    assert (result.overflow_before, result.overflow_after) == (
        projected_overflow(loads, [], cfg), projected_overflow(loads, result.migrations, cfg))
    # the predicted bucket is what the moved counts really give
    counts = {rank: len(load.request_ids) for rank, load in by_rank.items()}
    for m in result.migrations:
        counts[m.src] -= 1
        counts[m.dst] += 1
    assert result.bucket_after == max(
        bucket(min(c, by_rank[r].max_num_seqs), LADDER) for r, c in counts.items())


def projected_overflow(loads, migrations, cfg):
    """KV blocks the ranks' running requests lack ``lookahead_steps`` from now (the planner's
    third objective), recomputed here request by request: running requests grow where they
    are; a moved request, queued or running, needs its grown size at its destination."""
    where = {m.request_id: m.dst for m in migrations}
    by_rank = {load.rank: load for load in loads}
    demand = {rank: load.kv_blocks_used for rank, load in by_rank.items()}
    for load in loads:
        bs = load.block_size
        for rid, t, w in zip(load.request_ids, load.num_tokens, load.waiting):
            grown = (int(t) + cfg.lookahead_steps + bs) // bs  # block size of the source
            if not w:
                demand[load.rank] += grown - (int(t) + bs) // bs
            if rid in where:
                if not w:
                    demand[load.rank] -= grown
                demand[where[rid]] += grown
    total = 0
    for rank, load in by_rank.items():
        limit = load.kv_blocks_total - math.ceil(cfg.kv_headroom * load.kv_blocks_total)
        total += max(demand[rank] - limit, 0)
    return total


@settings(max_examples=150, deadline=None)
@given(clusters(), st.integers(0, 10_000))
def test_identical_plan_from_permuted_input(case, seed):
    raw, kv = case
    a = plan(build(raw), config(kv))
    b = plan(build(raw, shuffle_seed=seed), config(kv))
    c = plan([load.to_dict() for load in build(raw, shuffle_seed=seed + 1)], config(kv))
    # the packed form ranks gather, after a pickle round trip, in any order
    packed = pickle.loads(pickle.dumps([load.pack() for load in build(raw, shuffle_seed=seed)]))
    d = plan(packed, config(kv))
    for rank in range(len(raw)):  # a rank's share is exactly its rows of the whole plan
        mine = [m for m in a.migrations if rank in (m.src, m.dst)]
        share = plan(packed, config(kv), for_rank=rank)
        assert share.migrations == mine and share.total == len(a.migrations)
    assert a.migrations == b.migrations == c.migrations == d.migrations
    assert (a.bucket_after, a.waiting_after, a.target) == (d.bucket_after, d.waiting_after, d.target)


@settings(max_examples=60, deadline=None)
@given(clusters(), st.booleans())
def test_compiled_kernel_equals_its_python_source(case, always):
    """Ranks with and without numba (or a stale cache) must agree: the same source runs."""
    raw, kv = case
    cfg = PlannerConfig(graph_sizes=LADDER, kv_migration=kv, kv_always=always,
                        kv_bytes_per_token=4096, link_bytes_per_s=20e9, prefill_tokens_per_s=20000)
    compiled = plan(build(raw), cfg)
    names = ("_bucket", "_predict", "_assign", "_moved_blocks", "_overflow", "_kv_assign",
             "_plan_kernel")
    saved = {name: getattr(P, name) for name in names}
    if not hasattr(saved["_plan_kernel"], "py_func"):
        pytest.skip("numba not installed: the planner already runs as Python")
    try:
        for name, fn in saved.items():
            setattr(P, name, fn.py_func)
        python = plan(build(raw), cfg)
    finally:
        for name, fn in saved.items():
            setattr(P, name, fn)
    assert python == compiled


def test_bad_loads_are_named():
    loads = long_tail_ranks()
    with pytest.raises(ValueError, match="rank 1 is reported twice"):
        plan(loads + [loads[1]], config(True))
    ids, values = loads[0].pack()
    with pytest.raises(ValueError, match="differ in length"):
        plan([(ids[:-1], values)] + [x.pack() for x in loads[1:]], config(True))
    with pytest.raises(ValueError, match="at least one rank"):
        plan([], config(True))


def long_tail_ranks():
    loads = []
    for rank, n in enumerate([30, 28, 3, 2, 1, 0, 5, 9]):
        requests = {f"r{rank}-{i}": (100 + 37 * i, False) for i in range(n)}
        used = sum((t + 127) // 128 for t, _ in requests.values())
        loads.append(RankLoad.from_requests(rank, requests, kv_blocks_used=used,
                                            kv_blocks_total=used + 2000, block_size=128,
                                            max_num_seqs=64))
    return loads


def test_long_tail_drops_to_the_smallest_reachable_bucket_with_fewest_moves():
    result = plan(long_tail_ranks(), config(True))
    assert result.bucket_before == 32
    assert result.bucket_after == 16  # 78 requests over 8 ranks: 16 is the smallest rung
    assert len(result.migrations) == (30 - 16) + (28 - 16)  # only the surplus moves
    # cheapest (fewest tokens) requests of each donor are the ones that move
    moved_from_0 = sorted(int(m.request_id.split("-")[1]) for m in result.migrations if m.src == 0)
    assert moved_from_0 == list(range(14))
    # few flows: each receiver hears from at most two senders
    senders = {}
    for m in result.migrations:
        senders.setdefault(m.dst, set()).add(m.src)
    assert max(len(s) for s in senders.values()) <= 2


def test_waiting_queue_is_cleared_first():
    loads = []
    for rank, (running, waiting) in enumerate([(8, 5), (2, 0), (1, 0)]):
        requests = {f"r{rank}-{i}": (50, i >= running) for i in range(running + waiting)}
        loads.append(RankLoad.from_requests(rank, requests, kv_blocks_used=running,
                                            kv_blocks_total=1000, block_size=128, max_num_seqs=8))
    result = plan(loads, config(True))
    assert result.waiting_before == 5 and result.waiting_after == 0
    moved = {m.request_id for m in result.migrations}
    assert {f"r0-{i}" for i in range(8, 13)} <= moved  # the queued ones leave first
    assert all(not m.with_kv for m in result.migrations if int(m.request_id.split("-")[1]) >= 8)


def test_kv_off_moves_by_recompute_and_large_kv_moves_with_kv():
    loads = long_tail_ranks()
    assert all(not m.with_kv for m in plan(loads, config(False)).migrations)
    heavy = PlannerConfig(graph_sizes=LADDER, kv_bytes_per_token=1024, link_bytes_per_s=1e12,
                          prefill_tokens_per_s=1000)
    assert all(m.with_kv and m.bytes > 0 for m in plan(loads, heavy).migrations)


def test_bad_config_names_the_argument():
    with pytest.raises(ValueError, match="graph_sizes"):
        PlannerConfig(graph_sizes=(0, 8))
    with pytest.raises(ValueError, match="kv_headroom"):
        PlannerConfig(kv_headroom=1.5)


def test_rank_about_to_run_out_of_kv_sheds_running_requests_with_kv():
    """Second pass: rank 0 would outgrow its KV cache within the lookahead (40 running
    requests x 64 steps); rank 1 has room. The counts already sit in the same bucket, so only
    the projected KV moves requests: the fewest, cheapest ones that cover the excess, with
    their KV, and the bucket never rises."""
    cfg = PlannerConfig(graph_sizes=LADDER, kv_bytes_per_token=4096, link_bytes_per_s=20e9,
                        prefill_tokens_per_s=20000, kv_headroom=0.0, lookahead_steps=64)
    big = {f"a{i}": (3000 + i, False) for i in range(40)}
    small = {f"b{i}": (500, False) for i in range(34)}
    loads = []
    for rank, requests, spare in ((0, big, 10), (1, small, 2000)):
        used = sum((t + 127) // 128 for t, _ in requests.values())
        loads.append(RankLoad.from_requests(rank, requests, kv_blocks_used=used,
                                            kv_blocks_total=used + spare, block_size=128,
                                            max_num_seqs=64))
    result = plan(loads, cfg)
    assert (result.waiting_before, result.bucket_before) == (0, 64)
    assert result.bucket_after == 64 and result.overflow_before > 0
    assert result.overflow_after == 0
    assert result.migrations and all(m.src == 0 and m.dst == 1 and m.with_kv
                                     for m in result.migrations)
    # the cheapest first, and no more than the excess needs
    ids = [m.request_id for m in result.migrations]
    assert ids == [f"a{i}" for i in range(len(ids))]
    covered = sum((3000 + i + 64 + 128) // 128 for i in range(len(ids) - 1))
    assert covered < result.overflow_before
    # with KV migration off, running requests stay (moving them would only re-run prefill)
    assert not plan(loads, replace(cfg, kv_migration=False)).migrations
    # without a lookahead nothing is about to overflow
    assert not plan(loads, replace(cfg, lookahead_steps=0)).migrations


def test_bad_lookahead_is_named():
    with pytest.raises(ValueError, match="lookahead_steps"):
        PlannerConfig(lookahead_steps=-1)
