"""The live migration trigger (``PlannedMigration``: ``tail_policy.plan_moves`` every interval
on the client's own bookkeeping) between two independent vLLM 0.23 CPU replicas (runs
``planned_reference`` and ``planned`` of ``kv_migration_scenario.migration_runs``, the session
fixture ``migration_runs`` shared with ``test_kv_migration_e2e``: the same engines, each run
on a cleared prefix cache).

All six requests start on replica A (B idle); every 0.05 s the planner sees A's six running
requests against an idle B and moves the longest-remaining ones with their KV. Checked against
an unmigrated run on the same engines (greedy, one request with a presence penalty,
which ``check_migratable`` refuses): moves happened (planned and started > 0, requests finished on
B), tokens and log-probs identical, each request finished exactly once, every moved hop took
its source's KV, the refused request never moved, no export or in-flight record left.
"""

from __future__ import annotations

import pytest

from tests.features.rollout_rebalance.kv_migration_scenario import (
    PLANNED_MAX_TOKENS,
    PLANNED_PROMPT_LENGTHS,
    REFUSED,
)
from tests.features.rollout_rebalance.test_kv_migration_e2e import pytestmark  # noqa: F401
from tests.support.cpu_isa import log_prob_tolerance, log_probs_match

REQUESTS = len(PLANNED_PROMPT_LENGTHS)


@pytest.fixture
def runs(migration_runs):
    return migration_runs


def test_the_planner_moved_requests_off_the_loaded_replica(runs):
    planned = runs.planned
    summary = {"rounds": planned.rounds, "moves_planned": planned.moves_planned,
               "moves_started": planned.moves_started, "skipped_unmovable": planned.skipped_unmovable,
               "finished_on": planned.finished_on, "capacities": planned.capacities}
    print("planned migration:", summary)   # shown with pytest -s / -rP
    assert planned.moves_started > 0 and planned.moves_planned >= planned.moves_started, summary
    moved = sum(h.outcome == "moved" for hops in planned.hops for h in hops)
    assert moved == planned.moves_started, summary
    assert planned.finished_on.get("B", 0) > 0, summary   # work really left A
    slots, kv_tokens = planned.capacities["A"]
    assert slots == 8 and kv_tokens > 0 and kv_tokens % 16 == 0, summary   # read from the engine


def test_planned_moves_keep_tokens_and_logprobs_identical(runs):
    ref, planned = runs.planned_reference, runs.planned
    assert [len(t) for t in ref.tokens] == [PLANNED_MAX_TOKENS] * REQUESTS, ref
    assert planned.tokens == ref.tokens, planned.hops
    same, diffs = log_probs_match(planned.logprobs, ref.logprobs)
    assert same, {"max abs logprob difference per request": diffs, "tolerance": log_prob_tolerance(),
                  "hops": planned.hops}
    assert planned.finish == ref.finish == ["length"] * REQUESTS


def test_each_request_finished_exactly_once_and_moved_with_its_kv(runs):
    planned = runs.planned
    assert sum(planned.finished_on.values()) == REQUESTS, planned
    for hops in planned.hops:
        assert [h.outcome for h in hops] == ["moved"] * (len(hops) - 1) + ["finished"], hops
        assert sum(h.tokens for h in hops) == PLANNED_MAX_TOKENS, hops
        for h in hops[1:]:
            assert h.loaded_from_export and h.cached_tokens == h.prompt_tokens - 1, hops
    assert planned.exports_left == [] and planned.in_flight_left == 0, planned


def test_a_refused_request_counts_as_load_but_never_moves(runs):
    hops = runs.planned.hops[REFUSED]
    assert [(h.replica, h.outcome) for h in hops] == [("A", "finished")], hops
