"""The router in verl 0.9.1's own agent-loop rollout, with real vLLM servers on CPU.

Nothing of verl's rollout path is replaced: ``LLMServerManager`` starts two standalone
``vLLMReplica``s (one logical Ray "GPU" each; ``vLLMHttpServer`` running vLLM 0.23's
``AsyncLLM`` on its CPU build, ``/metrics`` on), builds the router from the shipped
``router.yaml`` through ``rollout.router_config_path`` with its own ``get_router_handle``, and
``AgentLoopManager`` runs ``single_turn_agent`` over a GRPO batch (3 prompts x n=4, greedy,
96 tokens) through ``LLMServerClient``. The tiny Qwen3 carries Qwen's ChatML tokens
(``tiny_qwen3.cached(chatml=True)``): verl's agent loop requires ``<|im_end|>`` for qwen3.
This is the reference rollout of ``verl_rollout_scenario.grpo_rollouts`` (the session fixture
``verl_rollouts`` of this folder's conftest.py): the servers are shared with
``test_router_verl_migration`` and carry its KV connector (inert in this rollout: no request
is moved, no KV loaded), the router's books are read right after this rollout.

Each replica runs at most 4 requests (max_num_seqs, which the router reads from the servers),
so 12 requests make the router queue and bind late. Checked: every request answered exactly
once (vLLM's own finished-request counters per replica sum to the batch, and equal, per
replica, the requests the router bound there), both replicas served, the router's books are
empty afterwards, it read the servers' KV metrics, and it saw the GRPO groups (4 siblings per
prompt). verl 0.6.1 (recipe stack) has no router plug-in point: skipped there.
"""

from __future__ import annotations

import pytest

from tests.features.rollout_rebalance.verl_rollout_scenario import N, PROMPTS, TOKENS
from tests.features.rollout_rebalance.test_router_verl_migration import pytestmark  # noqa: F401


@pytest.fixture
def rollout(verl_rollouts):
    return verl_rollouts


def test_verl_built_this_router_from_router_config_path(rollout):
    assert rollout.router.router_class == "ExpectedWorkRouter", rollout.router


def test_every_request_answered_exactly_once_by_the_replica_the_router_chose(rollout):
    total = PROMPTS * N
    ref, record = rollout.reference, rollout.router
    assert len(ref.responses) == total and ref.lengths == [TOKENS] * total, ref.lengths
    # vLLM's vllm:request_success_total, per replica, over the reference rollout
    served = {address: counts.finished for address, counts in ref.replicas.items()}
    assert len(served) == 2 and sum(served.values()) == total, (served, record)
    assert all(count > 0 for count in served.values()), (served, record)  # both replicas worked
    assert record.requests == total and record.released == total, record
    assert record.bound == {address: int(count) for address, count in served.items()}, (served, record)
    assert record.total_inflight == 0 and record.queued == 0, record


def test_router_used_the_servers_metrics_and_saw_the_grpo_groups(rollout):
    record = rollout.router
    assert record.load_source == "metrics", record
    # the /metrics reader parsed each live vLLM server's KV capacity (num_gpu_blocks x block_size)
    capacity = record.kv_capacity_tokens
    assert set(capacity) == set(rollout.reference.replicas) and all(c > 0 for c in capacity.values()), record
    assert record.group_sizes == [N] * PROMPTS, record


def test_greedy_siblings_decode_the_same_tokens(rollout):
    """Real decoding on both replicas: greedy siblings agree wherever they ran."""
    responses = rollout.reference.responses
    unequal = [(p, k) for p in range(PROMPTS) for k in range(N) if responses[p * N + k] != responses[p * N]]
    assert unequal == [], {"(prompt, sibling) differing from sibling 0": unequal}
