"""Tail migration with KV between two vLLM 0.23 CPU replicas over Mooncake Store (scenario
``kv_migration_scenario.mooncake_migration_runs``): the replicas' connectors run the
``transport="mooncake"`` store, each engine core its own Mooncake client (its own derived
``local_hostname``: two "hosts" on loopback), the driver's client one more; every object is
put on a holder process. The same A -> B -> A move as test_kv_migration_e2e.py: tokens and
log-probs identical to the unmoved run, every destination took the source's KV (nothing
re-prefilled), no export left, and the directory store untouched. Then the source dies after
its export (issue 42): every request started on A' (``DyingAfterExportConnector``) and moved
to B; A' exits right after writing its first export, so that request resumes on B from the
export held by the holder, exactly once, and the others re-prefill on B."""

from __future__ import annotations

import pytest

from tests.features.rollout_rebalance.conftest import GREEDY_ENV
from tests.features.rollout_rebalance.kv_migration_scenario import MAX_TOKENS as TOKENS
from tests.features.rollout_rebalance.kv_migration_scenario import PROMPT_LENGTHS, SOURCE
from tests.support import mooncake
from tests.support.child import run_scenario
from tests.support.cpu_isa import log_prob_tolerance, log_probs_match
from tests.support.stacks import vllm_version

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(vllm_version() is None or not vllm_version().startswith("0.23"),
                                 reason="the KV-connector migration targets vLLM 0.23 (verl 0.9)")]

MiB = 1 << 20
REQUESTS = len(PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def runs(tiny_model_path):
    reason = mooncake.missing()
    if reason is not None:
        pytest.skip(f"Mooncake Store needs {reason}")
    from tests.features.rollout_rebalance.kv_migration_scenario import MooncakeRuns
    with mooncake.running_master() as master, mooncake.running_holder(master, 256 * MiB) as holder:
        settings = {"master_address": master.master_address, "metadata_server": master.metadata_server,
                    "admin_url": master.admin_url, "segment_size": 0, "holder_segment": holder}
        found = run_scenario("tests.features.rollout_rebalance.kv_migration_scenario",
                             "mooncake_migration_runs", tiny_model_path, settings, env=GREEDY_ENV,
                             timeout=900, returns=MooncakeRuns)
    print("kv migration over mooncake, seconds per phase:", found.seconds)
    return found


def test_moved_over_mooncake_gives_identical_tokens_and_logprobs(runs):
    ref, moved = runs.reference, runs.moved
    assert [len(t) for t in ref.tokens] == [TOKENS] * REQUESTS, ref
    assert moved.tokens == ref.tokens, moved
    same, diffs = log_probs_match(moved.logprobs, ref.logprobs)
    assert same, {"max abs logprob difference per request": diffs, "tolerance": log_prob_tolerance()}
    assert moved.finish == ref.finish == ["length"] * REQUESTS


def test_moved_over_mooncake_took_the_sources_kv(runs):
    moved = runs.moved
    for hops in moved.hops:
        assert [(h.replica, h.outcome) for h in hops] == [("A", "moved"), ("B", "moved"),
                                                          ("A", "finished")], hops
        for h in hops[1:]:
            assert h.loaded_from_export and h.cached_tokens == h.prompt_tokens - 1, hops
    assert moved.finished_on == {"A": REQUESTS}, moved
    assert moved.exports_left == [], moved


def test_source_dead_after_export_resumes_from_it_exactly_once(runs):
    ref, dies = runs.reference, runs.source_dies
    assert runs.a_prime_errored and not runs.b_errored, runs
    # exactly once: one final output per request, every one from B, none from the dead source
    assert len(dies.tokens) == REQUESTS and dies.finished_on == {"B": REQUESTS}, dies
    for hops in dies.hops:
        assert [h.replica for h in hops] == [SOURCE, "B"], hops
        assert hops[0].outcome in ("moved", "failed") and hops[1].outcome == "finished", hops
    assert dies.tokens == ref.tokens, dies
    same, diffs = log_probs_match(dies.logprobs, ref.logprobs)
    assert same, {"max abs logprob difference per request": diffs, "tolerance": log_prob_tolerance()}
    assert dies.finish == ["length"] * REQUESTS
    # the source wrote one export and died: that request went on from it (B loaded every
    # prompt token but the last), the others, with no export, re-prefilled on B
    resumed = [hops for hops in dies.hops if hops[0].export_found]
    assert len(resumed) == 1, ("B loaded KV for the moved requests: exactly one request resumes "
                               "from the dead source's export", dies.hops)
    for hops in resumed:
        assert hops[0].outcome == "moved", hops
        assert hops[1].loaded_from_export and hops[1].cached_tokens == hops[1].prompt_tokens - 1, \
            ("B loaded KV for the moved requests", hops)
    for hops in dies.hops:
        if hops not in resumed:
            assert not hops[1].loaded_from_export and not hops[1].cached_tokens, hops
    assert dies.exports_left == [], dies
