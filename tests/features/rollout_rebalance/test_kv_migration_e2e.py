"""Tail migration with KV between independent vLLM 0.23 engines on CPU (scenario
``kv_migration_scenario.migration_runs``, the session fixture ``migration_runs`` of this
folder's conftest.py, shared with ``test_kv_migration_planned``: three ``AsyncLLM`` replicas
with their own engine core processes, the connector loaded through ``kv_transfer_config`` /
``kv_connector_module_path``).

Checked against the unmoved run on the same engines (greedy, 4 concurrent requests of 24
tokens, prompts of 5-50 tokens, block size 16):

- moved A -> B -> A after 8 and 16 tokens: tokens and log-probs identical (exact float
  equality), each request finished once (on A), every destination took the source's KV (vLLM
  reports prompt - 1 tokens cached on the hop's first output: nothing re-prefilled), and no
  export is left in the store;
- the destination dies mid-migration (its engine core exits when the first KV load reaches
  it): every request resumes on its source from the kept export, tokens and log-probs
  identical, each finished once, on A only.

vLLM 0.13 (recipe stack) is not a target: verl 0.6 migrates inside its SPMD group instead.
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


@pytest.fixture
def runs(migration_runs):
    return migration_runs


def test_reference_run_is_unmoved(runs):
    ref = runs.reference
    assert [len(t) for t in ref.tokens] == [TOKENS] * REQUESTS, ref
    assert all(len(h) == 1 and h[0].outcome == "finished" for h in ref.hops), ref
    assert sum(ref.finished_on.values()) == REQUESTS, ref


def test_moved_twice_with_kv_gives_identical_tokens_and_logprobs(runs):
    ref, moved = runs.reference, runs.moved
    assert moved.tokens == ref.tokens, moved
    assert len(moved.logprobs) == REQUESTS and all(len(lp) == TOKENS for lp in moved.logprobs)
    same, diffs = log_probs_match(moved.logprobs, ref.logprobs)
    assert same, {"max abs logprob difference per request": diffs, "tolerance": log_prob_tolerance()}
    assert moved.finish == ref.finish == ["length"] * REQUESTS


def test_moved_requests_took_the_sources_kv(runs):
    moved = runs.moved
    for hops in moved.hops:
        assert [h.replica for h in hops] == ["A", "B", "A"], hops
        assert [h.outcome for h in hops] == ["moved", "moved", "finished"], hops
        assert sum(h.tokens for h in hops) == TOKENS, hops
        for h in hops[1:]:
            # the destination computed only the last prompt token: the rest came as KV
            assert h.loaded_from_export and h.cached_tokens == h.prompt_tokens - 1, hops
    assert moved.finished_on == {"A": REQUESTS}, moved
    assert moved.exports_left == [], moved   # every export released after its ack


def test_destination_dying_mid_migration_loses_and_duplicates_nothing(runs):
    ref, dies = runs.reference, runs.destination_dies
    # C died; A (and B, which served the planned runs before) did not
    assert runs.c_errored and not runs.a_errored and not runs.b_errored, runs
    assert dies.dead == ["C"], dies
    assert dies.tokens == ref.tokens, dies
    assert log_probs_match(dies.logprobs, ref.logprobs)[0], (dies, log_prob_tolerance())
    assert dies.finished_on == {"A": REQUESTS}, dies   # exactly once each, all on A
    for hops in dies.hops:
        assert [(h.replica, h.outcome) for h in hops] == \
            [("A", "moved"), ("C", "failed"), ("A", "finished")], hops
        assert hops[1].tokens == 0, hops   # C never answered
        # resumed at the source from the export it kept
        assert hops[2].loaded_from_export and \
            hops[2].cached_tokens == hops[2].prompt_tokens - 1, hops
    assert dies.exports_left == [], dies
