"""Session fixtures shared by this folder's test modules: each starts its engines once.

An engine start (a vLLM engine core process, Ray and verl's servers) costs far more than the
runs made on it on this CPU, so the modules that check different runs on the same kind of
replicas share one scenario process: ``migration_runs`` (three ``AsyncLLM`` replicas:
``test_kv_migration_e2e`` and ``test_kv_migration_planned``) and ``verl_rollouts`` (verl's
two ``vLLMReplica`` servers: ``test_router_verl_rollout`` and ``test_router_verl_migration``);
``verl_requeue_rollouts`` (two small-KV ``vLLMReplica`` servers, ``test_router_verl_requeue``)
is one module's alone: its servers preempt, which the others must not.
The fixtures are requested only by modules that skip on stacks without vLLM 0.23 / verl 0.9.
"""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.support.child import GREEDY_ENGINE_ENV, run_scenario

# the engines' environment: 1 GiB of KV cache each, one OpenMP thread per engine (three or
# more engine processes share this 2-core machine), quiet logs
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false", "ASCEND_RL_AUTOLOAD": "0"}
# and the greedy-only warm-up shortcut (every request of both scenarios is greedy)
GREEDY_ENV = dict(ENGINE_ENV, **GREEDY_ENGINE_ENV)


def _shared_memory_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


@pytest.fixture(scope="session")
def migration_runs(tiny_model_path):
    from tests.features.rollout_rebalance.kv_migration_scenario import MigrationRuns
    runs = run_scenario("tests.features.rollout_rebalance.kv_migration_scenario", "migration_runs",
                        tiny_model_path, env=GREEDY_ENV, timeout=900, returns=MigrationRuns)
    print("kv migration runs, seconds per phase:", runs.seconds)
    return runs


@pytest.fixture(scope="session")
def verl_rollouts():
    from ascend_rl_plugins.devtools import tiny_qwen3
    from ascend_rl_plugins.features import rollout_rebalance as rr
    from tests.features.rollout_rebalance import verl_rollout_scenario as scenario
    env = {k: v for k, v in GREEDY_ENV.items() if k != "ASCEND_RL_AUTOLOAD"}
    with tempfile.TemporaryDirectory(prefix="arp-verl-kv-migration-", dir=_shared_memory_dir()) as store:
        rollouts = run_scenario("tests.features.rollout_rebalance.verl_rollout_scenario",
                                "grpo_rollouts", tiny_qwen3.cached(chatml=True), rr.router_yaml_path(),
                                scenario.PROMPTS, scenario.N, scenario.TOKENS, store, scenario.AFTER_S,
                                scenario.MAX_MOVES, env=env, timeout=1200, returns=scenario.Rollouts)
    print("verl rollouts, seconds per phase:", rollouts.seconds)
    return rollouts


@pytest.fixture(scope="session")
def verl_requeue_rollouts(tmp_path_factory):
    import yaml

    from ascend_rl_plugins.devtools import tiny_qwen3
    from ascend_rl_plugins.features.rollout_rebalance import router as router_module
    from tests.features.rollout_rebalance import verl_rollout_scenario as scenario
    env = {k: v for k, v in GREEDY_ENV.items() if k != "ASCEND_RL_AUTOLOAD"}
    router_yaml = tmp_path_factory.mktemp("requeue-router") / "router.yaml"
    router_yaml.write_text(yaml.safe_dump({
        "router_class": f"{router_module.__name__}.ExpectedWorkRouterActor", **scenario.REQUEUE_ROUTER}))
    with tempfile.TemporaryDirectory(prefix="arp-verl-requeue-", dir=_shared_memory_dir()) as store:
        rollouts = run_scenario("tests.features.rollout_rebalance.verl_rollout_scenario",
                                "grpo_requeue_rollouts", tiny_qwen3.cached(chatml=True), str(router_yaml),
                                scenario.REQUEUE_PROMPTS, scenario.N, scenario.REQUEUE_TOKENS, store,
                                env=env, timeout=1200, returns=scenario.RequeueRollouts)
    print("verl hand-back rollouts, seconds per phase:", rollouts.seconds)
    return rollouts
