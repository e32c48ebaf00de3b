"""Tail migration with KV inside verl 0.9.1's own agent-loop rollout, real vLLM 0.23 CPU servers.

Scenario ``verl_rollout_scenario.grpo_rollouts`` (the session fixture ``verl_rollouts`` of this
folder's conftest.py, shared with ``test_router_verl_rollout``): verl's ``LLMServerManager`` starts
two standalone ``vLLMReplica``s whose vLLM engines load the migration connector through
``rollout.engine_kwargs.vllm.kv_transfer_config`` (the fault-injecting subclass, inert until
armed), builds this router from ``router_config_path``, and ``AgentLoopManager`` runs a GRPO
batch (3 prompts x n=4, greedy, log-probs) three times on the same servers: with verl's own
client (reference), with ``MigratingLLMServerClient`` (``get_client(client_cls=...)``) moving
every hop still running after 0.1 s to the other replica, up to 8 times per request (96
tokens: cut at whatever token the timer meets, so some hop of some request has computed KV
to move however fast this machine decodes), and the same with the fault armed (the first
replica that receives a KV load exits mid-migration).

Checked: responses and rollout log-probs identical to the reference in both migrating runs;
every request finished exactly once (vLLM's own finished counters, which count no abort);
moves happened with KV (KV tokens loaded through the connector at the destinations: vLLM's
``external_prefix_cache_hits``); every move told to the router (``move_request``), whose
books are empty afterwards; no export left; in the fault run the armed replica died and
nothing was lost.
"""

from __future__ import annotations

import pytest

from tests.features.rollout_rebalance.verl_rollout_scenario import N, PROMPTS, TOKENS
from tests.support.cpu_isa import log_prob_tolerance, log_probs_match
from tests.support.stacks import vllm_version

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(vllm_version() is None or not vllm_version().startswith("0.23"),
                                 reason="the KV-connector migration targets vLLM 0.23 (verl 0.9)")]

pytest.importorskip("verl.workers.rollout.router",
                    reason="verl < 0.9 has no router plug-in point (rollout.router_config_path)")
pytest.importorskip("ray")


@pytest.fixture
def runs(verl_rollouts):
    return verl_rollouts


def summary(runs) -> dict:
    """The figures the README quotes."""
    return {name: {"replicas": getattr(runs, name).replicas, "exports_left": getattr(runs, name).exports_left,
                   "moved": getattr(runs, name).moved, "router_told": getattr(runs, name).router_told,
                   "moves_undone": getattr(runs, name).moves_undone}
            for name in ("reference", "moved", "destination_dies")} | {"errored": runs.errored}


def _finished(run) -> float:
    return sum(c.finished for c in run.replicas.values() if c is not None)


def test_reference_rollout_answers_every_request_once(runs):
    print("verl migration rollout:", summary(runs))
    ref = runs.reference
    assert ref.lengths == [TOKENS] * PROMPTS * N, ref.lengths
    assert _finished(ref) == PROMPTS * N, ref.replicas
    assert all(c.kv_loaded_tokens == 0 for c in ref.replicas.values()), ref.replicas
    assert ref.router_inflight_after == 0 and ref.moved == 0, ref


def test_migration_forced_on_gives_identical_responses_and_log_probs(runs):
    ref, moved = runs.reference, runs.moved
    assert moved.responses == ref.responses
    same, diffs = log_probs_match(moved.log_probs, ref.log_probs)
    assert same, {"max abs log-prob difference per row": diffs, "tolerance": log_prob_tolerance()}
    assert _finished(moved) == PROMPTS * N, moved.replicas   # each finished exactly once
    # moves happened, with KV: tokens loaded through the connector (vLLM's
    # external_prefix_cache_hits); a move with nothing computed yet loads nothing
    assert sum(c.kv_loaded_tokens for c in moved.replicas.values()) > 0, moved.replicas
    assert moved.exports_left == [], moved
    # every move was told to the router, and each request left its books once, where it ended
    assert moved.router_told == moved.moved > 0 and moved.router_inflight_after == 0, moved
    assert moved.moves_undone == 0, moved   # no replica died


def test_replica_dying_mid_migration_loses_no_request(runs):
    ref, dies = runs.reference, runs.destination_dies
    assert runs.marker_consumed, "no replica received a KV load after the fault was armed"
    assert dies.responses == ref.responses
    same, diffs = log_probs_match(dies.log_probs, ref.log_probs)
    assert same, {"max abs log-prob difference per row": diffs, "tolerance": log_prob_tolerance()}
    assert dies.lengths == [TOKENS] * PROMPTS * N
    assert sorted(runs.errored.values()) == [False, True], runs.errored   # one replica died
    live = [a for a, dead in runs.errored.items() if not dead]
    # the survivor finished what it ran; the dead replica's counters may be unreadable
    assert dies.replicas[live[0]].finished >= 1, dies.replicas
    assert dies.exports_left == [], dies
    # every move told, and so is every failover to the survivor (not a move); a move ordered
    # to the replica after it had died is undone (the request went on where it ran): neither
    # a move nor told
    assert dies.router_told >= dies.moved and dies.router_inflight_after == 0, dies
