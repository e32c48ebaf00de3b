"""Warm-start placement algorithm and simulator (pure numpy, real code only)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ascend_rl_plugins.features.eplb import placement as pl


@st.composite
def problems(draw):
    devices = draw(st.integers(1, 8))
    slots = draw(st.integers(1, 6))
    experts = draw(st.integers(1, devices * slots))
    load = np.array(draw(st.lists(st.integers(0, 1000), min_size=experts, max_size=experts)), dtype=float)
    return load, devices, slots


@settings(max_examples=150, deadline=None)
@given(problems())
def test_placement_is_complete_and_balanced(problem):
    load, devices, slots = problem
    placement = pl.balanced_placement(load, devices, slots)
    assert placement.shape == (devices, slots)
    assert set(range(load.shape[0])) <= set(placement.ravel().tolist())  # every expert placed
    counts = np.bincount(placement.ravel(), minlength=load.shape[0])
    if devices >= counts.max():
        for row in placement:  # replicas of one expert land on different devices
            assert len(set(row.tolist())) == len(row)
    per_device = pl.device_loads(placement, load)
    assert np.isclose(per_device.sum(), load.sum())
    # greedy bound: no device exceeds the mean by more than the heaviest replica
    heaviest = (load / counts).max() if load.size else 0
    assert per_device.max() <= per_device.mean() + heaviest + 1e-9


def test_balancing_beats_the_initial_placement_on_skewed_load():
    rng = np.random.default_rng(0)
    load = np.exp(rng.normal(0, 1, 64)) * 100
    initial = pl.initial_placement(64, 8, 9)
    assert pl.imbalance(pl.balanced_placement(load, 8, 9), load) < pl.imbalance(initial, load) * 0.8


def test_bad_inputs_are_rejected_with_the_name():
    with pytest.raises(ValueError, match="slots"):
        pl.replica_counts(np.ones(10), 5)
    with pytest.raises(ValueError, match="num_devices"):
        pl.TraceConfig(num_experts=100, num_devices=2, slots_per_device=3)
    with pytest.raises(ValueError, match="iterations"):
        pl.TraceConfig(iterations=0)


def test_warm_start_starts_rollouts_better_balanced_when_load_drifts_slowly():
    cfg = pl.TraceConfig(num_layers=2, rollouts=5, iterations=60, collect_iterations=20, wait_iterations=2,
                         drift=0.05, tokens_per_iteration=2048)
    trace = pl.expert_load_trace(cfg)
    window = pl.first_window(cfg)
    reset = pl.simulate(trace, cfg, warm_start=False)
    warm = pl.simulate(trace, cfg, warm_start=True)
    # rollout 0 is identical (both start from the initial placement)
    assert np.allclose(reset[0], warm[0])
    assert warm[1:, :window].mean() < 0.85 * reset[1:, :window].mean()
    # once the first rebalance is live the two modes converge
    assert abs(warm[1:, window + 5:].mean() - reset[1:, window + 5:].mean()) < 0.1
