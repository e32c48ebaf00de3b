"""moe_reshard's verl 0.9 backend inside a real verl 0.9.1 deployment: a rollout rank's
``CheckpointEngineWorker`` reads the expert map of its live vLLM worker through verl's own
``vLLMHttpServer`` at every sync (``SyncReport.map_source == "live"``), not the configured rule
(verl #7086's stale ids after EPLB moves experts).

Real: verl 0.9.1's ``LLMServerManager`` / ``vLLMReplica`` / ``CheckpointEngineWorker`` /
``vLLMHttpServer`` on Ray, vLLM 0.23's CPU ``AsyncLLM`` with the feature's worker extension,
Megatron-Core 0.16.1 trainer ranks. Not run: verl's adapter hop into vLLM after the stream
(verl09_deploy_scenario.py says why and what drives the sync instead).
"""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.support.child import GREEDY_ENGINE_ENV, free_port, run_group, run_scenario
from tests.support.stacks import require_installed

from .verl09_deploy_scenario import CASES, REPLICA_WORLD_SIZE, Deployment
from .verl09_engine_scenario import NUM_EXPERTS, TRAINERS, TrainerRun

SCENARIO = "tests.features.moe_reshard.verl09_deploy_scenario"
ENGINE_SCENARIO = "tests.features.moe_reshard.verl09_engine_scenario"
ENV = dict(GREEDY_ENGINE_ENV, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
           VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore",
           ASCEND_RL_AUTOLOAD="0", ASCEND_RL_MOE_RESHARD="auto", ASCEND_RL_MOE_RESHARD_BUCKET_MB="1")


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    version = require_installed("torch", "megatron-core", "vllm", "ray", "verl")
    if not version.startswith("0.9."):
        pytest.skip(f"the checkpoint-engine backend is verl 0.9's (this stack has verl {version})")
    out = str(tmp_path_factory.mktemp("moe-reshard-verl09-deploy"))
    paths = run_scenario(ENGINE_SCENARIO, "prepare", out, env=ENV, timeout=600)
    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        trainers = pool.submit(run_group, ENGINE_SCENARIO, "trainer", TRAINERS, port, paths, 1, CASES, env=ENV,
                               timeout=1200, returns=TrainerRun)
        deployment = pool.submit(run_scenario, SCENARIO, "deployment", port, paths, env=ENV, timeout=1200)
        return trainers.result(), Deployment.from_json(deployment.result())


def test_the_backend_runs_in_verls_checkpoint_engine_worker_and_finds_its_vllm_server(deployed):
    _, d = deployed
    assert d.worker_class == "CheckpointEngineWorker" and d.backend_class == "AllToAllVCheckpointEngine"
    assert d.server_name == "vllm_server_0_0" and d.weight_sync_rank == 0


def test_without_the_worker_extension_the_read_is_a_refusal_naming_the_config_line(deployed):
    """A server whose vLLM workers lack the method (verl's stock extension) cannot report: the
    rank refuses with the line to add (every rank then falls back together), never votes the
    configured map silently."""
    _, d = deployed
    assert d.without_extension == ("vllm_server_0_0's vLLM workers cannot report their expert maps (set "
                                   "+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls="
                                   "ascend_rl_plugins.features.moe_reshard.verl09_worker.ReshardWorkerExtension)")


def test_every_sync_votes_the_live_engines_map_not_the_configured_rule(deployed):
    """The configuration says EP 2 (this rank: experts 0-1); the live CPU engine hosts all four,
    and that is what the rank votes, at each sync."""
    _, d = deployed
    for case in CASES:
        s = d.syncs[case]
        assert s.map_source == "live", (case, s.map_source, s.reason)
        assert s.expert_map == list(range(NUM_EXPERTS))
        assert s.config_map == list(range(NUM_EXPERTS // REPLICA_WORLD_SIZE))


def test_the_rank_receives_every_expert_its_live_engine_hosts_once_bit_identical(deployed):
    trainers, d = deployed
    for case in CASES:
        s = d.syncs[case]
        assert s.resharded and s.reason == "", (case, s.reason)
        assert s.expert_names == d.w1_expert_names            # all 4 experts x 2 layers x gate/up/down
        assert s.dense_names == d.w1_dense_names
        assert s.received == s.unique == len(d.w1_expert_names) + len(d.w1_dense_names)
        assert s.wrong == [], (s.wrong, s.dtypes)
        # experts straight from the harness's fp32 Megatron parameters, dense tensors from the bf16
        # export; vLLM's loader casts both into its bf16 parameters
        assert s.dtypes == {"expert": ["torch.float32"], "dense": ["torch.bfloat16"]}
    first, again = d.syncs["first"], d.syncs["again"]
    assert not first.plan_cached and again.plan_cached and again.plan_key == first.plan_key
    for t in trainers:
        assert [t.cases[c].plan_key for c in CASES] == [first.plan_key] * len(CASES)
