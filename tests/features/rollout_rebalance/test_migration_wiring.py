"""How a verl 0.9 ``main_ppo`` run reaches tail migration, without engines: the router's move
bookkeeping, the printed config lines (parsed by Hydra into verl's own trainer config), the
manager's checks and refusals, the step-model flag, and the two places in verl 0.9.1's trainers
that load ``agent.agent_loop_manager_class`` (the seam this relies on). The real rollout through
that seam: ``test_verl_main_ppo_migration.py``."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

from ascend_rl_plugins.features import rollout_rebalance as rr
from ascend_rl_plugins.features.rollout_rebalance import routing


def test_a_move_takes_the_request_s_load_group_and_stickiness_along():
    policy = routing.RoutingPolicy(routing.RouterSettings(slots=4))
    for server in ("A", "B"):
        policy.add_replica(server, 4)
    [first] = policy.submit("r1", 10, "g", 0.0)
    other = "B" if first.server_id == "A" else "A"
    policy.submit("r2", 10, "g", 0.0)
    before = dict(policy.replicas[first.server_id].inflight)
    assert policy.move("r1", first.server_id, other)
    src, dst = policy.replicas[first.server_id], policy.replicas[other]
    assert "r1" not in src.inflight and dst.inflight["r1"] == before["r1"]
    assert policy.sticky["r1"] == other and dst.groups["g"] >= 1
    assert not policy.move("r1", first.server_id, other)      # not on the source any more
    assert not policy.move("nope", other, first.server_id)    # unknown request
    for rid in ("r1", "r2"):
        policy.release(policy.sticky[rid], rid, 1.0)
    assert policy.inflight() == 0
    assert all(r.expected_tokens == 0.0 and not r.groups for r in policy.replicas.values())


def test_step_model_flag_parses_and_names_itself_when_bad():
    from ascend_rl_plugins.features.rollout_rebalance.migration_client import step_model_from_text
    from ascend_rl_plugins.features.rollout_rebalance.tail_policy import UNCALIBRATED_STEP
    assert step_model_from_text("") is UNCALIBRATED_STEP
    model = step_model_from_text("1:10, 8:80")
    assert model.step_ms(1, 0) == 10.0 and model.step_ms(8, 0) == 80.0 and model.step_ms(4, 0) == 40.0
    for bad in ("8:80,1:10", "1-10", "x:1"):
        with pytest.raises(ValueError, match="ASCEND_RL_ROLLOUT_MIGRATION_STEP_MS"):
            step_model_from_text(bad)


def test_cli_prints_the_migration_lines():
    out = subprocess.run([sys.executable, "-m", "ascend_rl_plugins", "router", "--migration"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    for line in rr.migration_config_lines():
        assert line in out.stdout
    assert rr.MANAGER_FQN in out.stdout and "kv_transfer_config=" in out.stdout


verl_09 = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("verl.workers.rollout.router") is None,
    reason="verl < 0.9 has no router plug-in point nor this trainer seam")


def _trainer_config(lines):
    import verl
    from hydra import compose, initialize_config_dir
    directory = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    overrides = [part for line in lines for part in line.split()] + ["actor_rollout_ref.rollout.name=vllm"]
    with initialize_config_dir(config_dir=directory, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


@verl_09
def test_printed_lines_compose_into_verl_s_trainer_config():
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import load_class_from_fqn

    from ascend_rl_plugins.features.rollout_rebalance import verl_manager
    from ascend_rl_plugins.features.rollout_rebalance.connector_config import kv_transfer_config
    config = _trainer_config(rr.migration_config_lines())
    rollout = config.actor_rollout_ref.rollout
    assert rollout.router_config_path == rr.router_yaml_path() and rollout.disable_log_stats is False
    assert load_class_from_fqn(rollout.agent.agent_loop_manager_class) is verl_manager.MigratingAgentLoopManager
    assert verl_manager.store_dir_from_config(config) == kv_transfer_config()["kv_connector_extra_config"]["store_dir"]
    # what verl's vLLM server gets: its RolloutConfig's engine_kwargs, a plain dict it JSON-encodes
    engine_kwargs = omega_conf_to_dataclass(rollout).engine_kwargs["vllm"]
    assert dict(engine_kwargs["kv_transfer_config"]) == kv_transfer_config()


@verl_09
def test_connector_module_named_in_the_config_is_the_connector():
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
    from ascend_rl_plugins.features.rollout_rebalance import connector_config, kv_migration
    assert kv_migration.__name__ == connector_config.CONNECTOR_MODULE
    assert hasattr(kv_migration, connector_config.CONNECTOR_CLASS)


@verl_09
def test_manager_checks_name_the_line_to_add(monkeypatch):
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient

    from ascend_rl_plugins.features.rollout_rebalance import verl_manager
    from ascend_rl_plugins.features.rollout_rebalance.migration_client import PlannedMigration
    without_connector = _trainer_config(rr.migration_config_lines()[:2])
    with pytest.raises(ValueError, match=r"kv_transfer_config=\{kv_connector:MigrationKVConnector"):
        verl_manager.store_dir_from_config(without_connector)
    config = _trainer_config(rr.migration_config_lines())
    client = LLMServerClient(config, load_balancer_handle=object())
    assert verl_manager.migrating_client(config, client, policy=None) is client   # off: unchanged
    planned = PlannedMigration(1.0)
    with pytest.raises(ValueError, match="router_config_path="):   # a router without the moves
        verl_manager.migrating_client(config, client, policy=planned)
    with pytest.raises(ValueError, match="FullyAsyncLLMServerClient.*trainer_mode=sync"):
        verl_manager.migrating_client(config, FullyAsyncLLMServerClient(config, object()), policy=planned)
    assert config.trainer.use_v1   # verl's default: main_ppo's v1 trainer, TransferQueue manager
    if __import__("importlib.util").util.find_spec("transfer_queue") is not None:
        assert verl_manager.default_manager_class(config).__name__ == "AgentLoopManagerTQ"
    config.trainer.use_v1 = False
    assert verl_manager.default_manager_class(config).__name__ == "AgentLoopManager"


@verl_09
def test_the_hand_back_flag_is_refused_without_migration_or_this_router(monkeypatch):
    from verl.workers.rollout.llm_server import LLMServerClient

    from ascend_rl_plugins import flags
    from ascend_rl_plugins.features.rollout_rebalance import verl_manager
    from ascend_rl_plugins.features.rollout_rebalance.migration_client import PlannedMigration
    from ascend_rl_plugins.features.rollout_rebalance.router import ExpectedWorkRouter

    class MovesOnly:   # a router that follows moves but takes no hand-back
        move_request = get_server_handles = ExpectedWorkRouter.move_request

    monkeypatch.setenv("ASCEND_RL_ROLLOUT_REQUEUE_PREEMPTED", "maybe")
    flags.reset_cache()
    with pytest.raises(flags.FlagError, match="ASCEND_RL_ROLLOUT_REQUEUE_PREEMPTED"):
        rr.REQUEUE_PREEMPTED.value
    monkeypatch.setenv("ASCEND_RL_ROLLOUT_REQUEUE_PREEMPTED", "1")
    flags.reset_cache()
    try:
        config = _trainer_config(rr.migration_config_lines())
        with pytest.raises(ValueError, match="REQUEUE_PREEMPTED=1 needs ASCEND_RL_ROLLOUT_MIGRATION=planned"):
            verl_manager.migrating_client(config, LLMServerClient(config, load_balancer_handle=object()),
                                          policy=None)
        client = LLMServerClient(config, load_balancer_handle=MovesOnly())
        with pytest.raises(ValueError, match="REQUEUE_PREEMPTED=1 needs this project's router"):
            verl_manager.migrating_client(config, client, policy=PlannedMigration(1.0))
    finally:
        monkeypatch.delenv("ASCEND_RL_ROLLOUT_REQUEUE_PREEMPTED")
        flags.reset_cache()


@verl_09
def test_verl_trainers_load_the_manager_class_from_the_config_key():
    """The seam: both verl 0.9.1 trainers build the agent-loop manager from
    ``rollout.agent.agent_loop_manager_class`` when set, passing the client they built."""
    from verl.trainer import main_ppo
    from verl.trainer.ppo import ray_trainer
    for source in (inspect.getsource(main_ppo.TaskRunnerV1.init_agent_loop_manager),
                   inspect.getsource(ray_trainer.RayPPOTrainer)):
        assert 'get("agent_loop_manager_class")' in source
        assert "load_class_from_fqn(manager_class_fqn" in source
        assert "llm_client=" in source and ".create(" in source
