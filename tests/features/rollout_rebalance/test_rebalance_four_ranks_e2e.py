"""End to end with four real vLLM engines (tiny Qwen3, CPU) in one gloo DP group.

The two-rank test covers the sampling state and the failure paths in depth; this one checks
what only more ranks exercise: flows between several pairs at once (two loaded ranks, two
nearly idle ones), a request moving more than once, and every output still coming back
exactly once, in the caller's order, token-identical to the same engines with rebalancing
paused -- for KV migration and for migration by recompute.
"""

from __future__ import annotations

import pytest

from tests.support.child import GREEDY_ENGINE_ENV, run_group

from .test_rebalance_engine_e2e import ENV, MODES, check_outputs, pytestmark  # noqa: F401


@pytest.fixture(scope="module")
def four_ranks(tiny_model_path):
    # every request of engine_scenario.four_ranks is greedy (the two-rank module samples too):
    # the four engines start without torch.compile (tests/support/child.py says why)
    return run_group("tests.features.rollout_rebalance.engine_scenario", "four_ranks", 4,
                     env=dict(ENV, **GREEDY_ENGINE_ENV), timeout=1500)


@MODES
def test_four_ranks_every_output_once_in_order_and_identical(four_ranks, mode):
    for rank in four_ranks:
        check_outputs(rank, rank[mode])
        assert rank[mode]["tokens"] == rank["ref"]["tokens"]
    stats = [r[mode]["stats"] for r in four_ranks]
    assert sum(s["moved_out"] for s in stats) == sum(s["moved_in"] for s in stats) > 0
    # both nearly idle ranks took work, from the loaded ones
    assert stats[2]["moved_in"] > 0 and stats[3]["moved_in"] > 0
    assert stats[0]["moved_out"] > 0
    kv = sum(s["kv_bytes_in"] for s in stats)
    assert (kv > 0) if mode == "on" else (kv == 0)
