"""The router in verl 0.9.1's own agent-loop rollout, with real vLLM servers on CPU.

Nothing of verl's rollout path is replaced: ``LLMServerManager`` starts two standalone
``vLLMReplica``s (one logical Ray "GPU" each; ``vLLMHttpServer`` running vLLM 0.23's
``AsyncLLM`` on its CPU build, ``/metrics`` on), builds the router from the shipped
``router.yaml`` through ``rollout.router_config_path`` with its own ``get_router_handle``, and
``AgentLoopManager`` runs ``single_turn_agent`` over a GRPO batch (3 prompts x n=4, greedy,
8 tokens) through ``LLMServerClient``. The tiny Qwen3 carries Qwen's ChatML tokens
(``tiny_qwen3.cached(chatml=True)``): verl's agent loop requires ``<|im_end|>`` for qwen3.

Each replica runs at most 4 requests (max_num_seqs, which the router reads from the servers),
so 12 requests make the router queue and bind late. Checked: every request answered exactly
once (vLLM's own finished-request counters per replica sum to the batch, and equal, per
replica, the requests the router bound there), both replicas served, the router's books are
empty afterwards, it read the servers' KV metrics, and it saw the GRPO groups (4 siblings per
prompt). verl 0.6.1 (recipe stack) has no router plug-in point: skipped there.
"""

from __future__ import annotations

import pytest

from tests.support.child import run_scenario
from tests.support.stacks import vllm_version

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(vllm_version() is None, reason="vLLM is not installed here")]

pytest.importorskip("verl.workers.rollout.router",
                    reason="verl < 0.9 has no router plug-in point (rollout.router_config_path)")
pytest.importorskip("ray")

PROMPTS, N, TOKENS = 3, 4, 8
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
       "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def rollout():
    from ascend_rl_plugins.devtools import tiny_qwen3
    from ascend_rl_plugins.features import rollout_rebalance as rr
    return run_scenario("tests.features.rollout_rebalance.verl_rollout_scenario", "grpo_rollout",
                        tiny_qwen3.cached(chatml=True), rr.router_yaml_path(), PROMPTS, N, TOKENS,
                        env=ENV, timeout=900)


def test_verl_built_this_router_from_router_config_path(rollout):
    assert rollout["router_class"] == "ExpectedWorkRouter", rollout


def test_every_request_answered_exactly_once_by_the_replica_the_router_chose(rollout):
    total = PROMPTS * N
    assert rollout["rows"] == total and rollout["lengths"] == [TOKENS] * total, rollout
    served = rollout["served"]  # vLLM's vllm:request_success_total, per replica
    assert len(served) == 2 and sum(served.values()) == total, rollout
    assert all(count > 0 for count in served.values()), rollout  # both replicas worked
    record = rollout["router"]
    assert record["requests"] == total and record["released"] == total, rollout
    assert record["bound"] == {address: int(count) for address, count in served.items()}, rollout
    assert rollout["status"]["total_inflight"] == 0 and rollout["status"]["queued"] == 0, rollout


def test_router_used_the_servers_metrics_and_saw_the_grpo_groups(rollout):
    assert rollout["status"]["load_source"] == "metrics", rollout
    # the /metrics reader parsed each live vLLM server's KV capacity (num_gpu_blocks x block_size)
    capacity = rollout["kv_capacity_tokens"]
    assert set(capacity) == set(rollout["served"]) and all(c > 0 for c in capacity.values()), rollout
    assert rollout["router"]["group_sizes"] == [N] * PROMPTS, rollout


def test_greedy_siblings_decode_the_same_tokens(rollout):
    """Real decoding on both replicas: greedy siblings agree wherever they ran."""
    assert rollout["greedy_siblings_equal"], rollout
