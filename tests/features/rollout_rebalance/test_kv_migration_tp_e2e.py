"""Tail migration with KV between two vLLM 0.23 engines at tensor_parallel_size=2 on CPU
(scenario ``kv_migration_tp_scenario.tp_migration_runs``: two ``AsyncLLM`` replicas of two TP
workers each, a tiny Qwen3 with one KV head per TP rank; issue 42, finding 1).

Every request moved A -> B -> A after 8 and 16 tokens gives the tokens and log-probs of the
unmoved run, and each destination took the source's KV (nothing re-prefilled): each TP rank
exported its own KV heads and loaded its own at the destination (one shared export file, as
before the fix, gave one rank the other's head, and the moved tokens differed).

One scenario process (two engine starts) serves both tests of this module.
"""

from __future__ import annotations

import pytest

from tests.features.rollout_rebalance.kv_migration_scenario import MAX_TOKENS as TOKENS
from tests.features.rollout_rebalance.kv_migration_scenario import PROMPT_LENGTHS
from tests.support.cpu_isa import log_prob_tolerance, log_probs_match
from tests.support.stacks import vllm_version

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(vllm_version() is None or not vllm_version().startswith("0.23"),
                                 reason="the KV-connector migration targets vLLM 0.23 (verl 0.9)")]

REQUESTS = len(PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def runs():
    from tests.features.rollout_rebalance.conftest import GREEDY_ENV
    from tests.features.rollout_rebalance.kv_migration_tp_scenario import TpMigrationRuns, model_path
    from tests.support.child import run_scenario
    got = run_scenario("tests.features.rollout_rebalance.kv_migration_tp_scenario", "tp_migration_runs",
                       model_path(), env=GREEDY_ENV, timeout=900, returns=TpMigrationRuns)
    print("kv migration at TP 2, seconds per phase:", got.seconds)
    return got


def test_moved_twice_at_tp2_gives_identical_tokens_and_logprobs(runs):
    ref, moved = runs.reference, runs.moved
    assert [len(t) for t in ref.tokens] == [TOKENS] * REQUESTS, ref
    assert all(len(h) == 1 and h[0].outcome == "finished" for h in ref.hops), ref
    assert moved.tokens == ref.tokens, moved
    same, diffs = log_probs_match(moved.logprobs, ref.logprobs)
    assert same, {"max abs logprob difference per request": diffs, "tolerance": log_prob_tolerance()}
    assert moved.finish == ref.finish == ["length"] * REQUESTS
    assert not runs.a_errored and not runs.b_errored, runs


def test_moved_requests_at_tp2_took_the_sources_kv(runs):
    moved = runs.moved
    for hops in moved.hops:
        assert [(h.replica, h.outcome) for h in hops] == \
            [("A", "moved"), ("B", "moved"), ("A", "finished")], hops
        for h in hops[1:]:
            # the destination computed only the last prompt token: the rest came as KV
            assert h.loaded_from_export and h.cached_tokens == h.prompt_tokens - 1, hops
    assert moved.finished_on == {"A": REQUESTS}, moved
    assert moved.exports_left == [], moved   # every rank's part released after its ack
