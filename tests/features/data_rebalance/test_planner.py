"""data_rebalance: the assignment algorithm and the long-tail simulator (pure; no verl).

Properties checked with hypothesis over random batches: a plan is a permutation giving every
rank the same number of samples; it is deterministic; it never models worse than the seed's
permutation (the fallback makes that hold by construction); with no information it *is* the
seed's permutation; the balanced plan spreads every prompt's samples as evenly as the rank
count allows and submits a rank's samples longest first. The simulator's lower bound is
below the makespan of every order, and its list scheduling matches an event-by-event
simulation.
"""

from __future__ import annotations

import heapq

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ascend_rl_plugins.features.data_rebalance import planner, simulator
from ascend_rl_plugins.features.data_rebalance.planner import CostModel


@st.composite
def batches(draw):
    """An interleaved GRPO batch: prompts x n samples, a rank count dividing it, estimates."""
    n = draw(st.integers(1, 6))
    ranks = draw(st.integers(1, 8))
    prompts = draw(st.integers(1, 12)) * ranks // int(np.gcd(ranks, n))
    size = prompts * n
    informative = draw(st.booleans())
    per_prompt = draw(st.lists(st.floats(1, 30000), min_size=prompts, max_size=prompts)) if informative \
        else [1.0] * prompts
    est = np.repeat(per_prompt, n)
    prompt_len = np.repeat(draw(st.lists(st.integers(1, 4096), min_size=prompts, max_size=prompts)), n)
    model = CostModel(step_overhead=draw(st.sampled_from([0.0, 8.0, 64.0])),
                      max_seqs=draw(st.sampled_from([0, 1, 3, 64])),
                      max_len=draw(st.sampled_from([0.0, 16384.0])),
                      prefill_per_token=draw(st.sampled_from([0.0, 0.01])))
    return est, prompt_len.astype(float), np.repeat(np.arange(prompts), n), ranks, n, model, size


@settings(max_examples=150, deadline=None)
@given(batches())
def test_a_plan_is_a_balanced_deterministic_permutation_never_modeled_worse_than_the_seed(b):
    est, prompt_len, group, ranks, n, model, size = b
    p = planner.plan(est, prompt_len, group, ranks, model)
    assert sorted(p.order.tolist()) == list(range(size))
    assert np.array_equal(np.bincount(p.rank_of(), minlength=ranks), np.full(ranks, size // ranks))
    assert np.array_equal(planner.plan(est, prompt_len, group, ranks, model).order, p.order)
    seed = planner.seed_order(size, n)
    ours = planner.makespan(p.order, est, prompt_len, ranks, model)
    assert ours <= planner.makespan(seed, est, prompt_len, ranks, model)
    assert p.chosen in ("seed", "balanced", "identity")
    if p.chosen == "balanced":
        assert ours < (1 - model.margin) * p.modeled["seed"]
    # the restore index puts the dispatched order back
    assert np.array_equal(p.order[p.inverse()], np.arange(size))


@settings(max_examples=60, deadline=None)
@given(batches())
def test_without_information_the_seed_permutation_is_what_runs(b):
    _, _, group, ranks, n, model, size = b
    p = planner.plan(np.ones(size), np.full(size, 100.0), group, ranks, model)
    assert np.array_equal(p.order, planner.seed_order(size, n))


@settings(max_examples=80, deadline=None)
@given(batches())
def test_the_balanced_order_spreads_groups_and_submits_longest_first(b):
    est, prompt_len, group, ranks, n, model, size = b
    order = planner.balanced_order(est, prompt_len, group, ranks, model)
    per_rank = size // ranks
    rank = np.empty(size, dtype=np.int64)
    rank[order] = np.arange(size) // per_rank
    counts = np.zeros((group.max() + 1, ranks), dtype=np.int64)
    np.add.at(counts, (group, rank), 1)
    assert counts.max() <= -(-n // ranks)  # as even as the rank count allows
    queued = est[order].reshape(ranks, per_rank)
    assert np.all(np.diff(queued, axis=1) <= 0)


def test_the_seed_permutation_is_the_recipes():
    """``i*n+j -> j*B+i``: dispatch position ``j*B+i`` holds sample ``j`` of prompt ``i``."""
    B, n = 5, 3
    order = planner.seed_order(B * n, n)
    for i in range(B):
        for j in range(n):
            assert order[j * B + i] == i * n + j


def test_layouts_other_than_interleaved_fall_back_to_the_callers_order():
    group = np.array([0, 1, 0, 1, 2, 2])
    assert planner.interleaved_group_size(group) == 0
    p = planner.plan(np.ones(6), np.ones(6), group, 2, mode="seed")
    assert p.chosen == "identity" and p.is_identity
    assert planner.plan(np.ones(5), np.ones(5), np.arange(5), 2).chosen == "identity"  # 5 rows, 2 ranks


def test_bad_inputs_are_refused_with_the_accepted_values():
    with pytest.raises(ValueError, match="balanced, seed"):
        planner.plan(np.ones(4), np.ones(4), np.arange(4), 2, mode="greedy")
    with pytest.raises(ValueError, match="margin"):
        CostModel(margin=1.5)


def test_history_makes_the_plan_balance_a_skewed_batch():
    """Two heavy prompts that the seed's permutation puts on the same half of the ranks."""
    prompts, n, ranks = 8, 2, 4
    est = np.repeat([9000.0, 8000.0, 100, 100, 100, 100, 100, 100], n)
    p = planner.plan(est, np.full(prompts * n, 50.0), np.repeat(np.arange(prompts), n), ranks,
                     CostModel(max_seqs=2))
    assert p.chosen == "balanced"
    heavy_ranks = p.rank_of()[:4]
    assert len(set(heavy_ranks.tolist())) == 4  # the four long samples on four ranks


# -- the simulator ---------------------------------------------------------------------------

def _event_simulation(lengths, slots):
    """Steps until the last request finishes, one request admitted per free slot in order."""
    running, t = [], 0.0
    for length in lengths:
        if slots > 0 and len(running) >= slots:
            t = heapq.heappop(running)
        heapq.heappush(running, t + length)
    return max(running) if running else 0.0


@given(st.lists(st.integers(1, 500), min_size=1, max_size=40), st.integers(0, 8))
def test_list_scheduling_matches_an_event_simulation(lengths, slots):
    arr = np.array(lengths, dtype=np.float64)
    assert planner.decode_steps(arr, slots) == _event_simulation(lengths, slots)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from([2, 4, 8]), st.sampled_from([0, 4]), st.booleans())
def test_the_lower_bound_is_below_every_order(seed, n, max_seqs, pareto):
    s = simulator.Scenario("t", prompts=8, n=n, ranks=4, max_seqs=max_seqs,
                           tail="pareto" if pareto else "lognormal")
    d = simulator.draw(s, np.random.default_rng(seed))
    bound = simulator.lower_bound(d, s)
    rng = np.random.default_rng(seed + 1)
    for order in list(simulator.orders(d, s, CostModel(max_seqs=max_seqs)).values())[:3] + \
            [rng.permutation(len(d.lengths))]:
        assert simulator.rank_times(order, d, s).max() >= bound * (1 - 1e-12)


def test_simulated_lengths_are_correlated_within_groups_and_heavy_tailed():
    s = simulator.Scenario("t", prompts=400, n=8, ranks=8, max_len=10**7, drift=0.0)
    d = simulator.draw(s, np.random.default_rng(0))
    per_group = np.log(d.lengths).reshape(s.prompts, s.n)
    within = per_group.var(axis=1).mean()
    between = per_group.mean(axis=1).var()
    assert between > 2 * within
    assert np.percentile(d.lengths, 99) > 5 * np.median(d.lengths)
    assert np.corrcoef(np.log(d.est[:: s.n]), per_group.mean(axis=1))[0, 1] > 0.8  # history informs


def test_scenarios_refuse_what_cannot_be_split():
    with pytest.raises(ValueError, match="split"):
        simulator.Scenario("bad", prompts=3, n=1, ranks=2)
    with pytest.raises(ValueError, match="tail"):
        simulator.Scenario("bad", tail="cauchy")
