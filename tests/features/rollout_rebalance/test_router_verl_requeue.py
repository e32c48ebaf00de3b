"""The preemption hand-back inside verl 0.9.1's own agent-loop rollout, real vLLM 0.23 CPU servers.

Scenario ``verl_rollout_scenario.grpo_requeue_rollouts`` (session fixture
``verl_requeue_rollouts``): two ``vLLMReplica``s whose KV cache (``num_gpu_blocks_override``
through ``rollout.engine_kwargs.vllm``) is too small for the requests they run, so vLLM
preempts; both load the migration connector; the router comes from ``router_config_path``
(admitting on slots only). One GRPO batch (2 prompts x n=4, 180 tokens, greedy, log-probs) with verl's own
client, then with ``MigratingLLMServerClient(requeue_preempted=True)`` and no moves: each hop
the engine preempts is marked by the connector, aborted by the client, handed back to the
router (``requeue_request``) and acquired again ahead of the router's queue.

Checked: vLLM preempted in the reference (its own counter) and hops were handed back in the
other run (the connector marks only what the scheduler preempted); tokens identical
to the reference, log-probs too (a handed-back hop re-prefills, as vLLM's own recompute
preemption does in the reference); every request finished exactly once (vLLM's success
counters); the router's books empty, and its length statistics keyed by the batch's prompts
only (a handed-back request is acquired again under its own prompt); no export and no
preemption mark left.
"""

from __future__ import annotations

from tests.features.rollout_rebalance.test_router_verl_migration import pytestmark  # noqa: F401
from tests.features.rollout_rebalance.verl_rollout_scenario import N, REQUEUE_PROMPTS, REQUEUE_TOKENS
from tests.support.cpu_isa import log_prob_tolerance, log_probs_match


def _preempted(run) -> float:
    return sum(c.preempted for c in run.replicas.values() if c is not None)


def _finished(run) -> float:
    return sum(c.finished for c in run.replicas.values() if c is not None)


def test_small_kv_makes_vllm_preempt_in_the_reference(verl_requeue_rollouts):
    ref = verl_requeue_rollouts.reference
    print("verl hand-back: reference", ref.replicas, "hand-back", verl_requeue_rollouts.requeued.replicas,
          "requeued", verl_requeue_rollouts.requeued.requeued, "KV tokens", verl_requeue_rollouts.kv_capacity_tokens)
    assert _preempted(ref) > 0, ref.replicas   # or the scenario has no teeth
    assert ref.lengths == [REQUEUE_TOKENS] * REQUEUE_PROMPTS * N and _finished(ref) == REQUEUE_PROMPTS * N, ref


def test_preempted_hops_are_handed_back_and_nothing_changes_or_is_lost(verl_requeue_rollouts):
    ref, back = verl_requeue_rollouts.reference, verl_requeue_rollouts.requeued
    # marks are written only for requests the scheduler preempted; vLLM's own counter misses
    # these (it counts a preemption when the request next sends output: a handed-back hop is
    # aborted first)
    assert back.requeued > 0, (back.replicas, back.requeued)
    assert back.moved == 0, back
    assert back.responses == ref.responses
    same, diffs = log_probs_match(back.log_probs, ref.log_probs)
    assert same, {"max abs log-prob difference per row": diffs, "tolerance": log_prob_tolerance()}
    assert back.lengths == [REQUEUE_TOKENS] * REQUEUE_PROMPTS * N
    assert _finished(back) == REQUEUE_PROMPTS * N, back.replicas   # each request finished exactly once
    assert back.router_inflight_after == 0, back
    # acquired again under its own prompt: the router's statistics know the batch's prompts only
    assert verl_requeue_rollouts.router_prompt_groups == REQUEUE_PROMPTS, verl_requeue_rollouts.router_prompt_groups
    assert back.exports_left == [] and verl_requeue_rollouts.marks_left == [], (
        back.exports_left, verl_requeue_rollouts.marks_left)
