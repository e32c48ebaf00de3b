"""verl 0.9's agent-loop manager, with tail migration when ``ASCEND_RL_ROLLOUT_MIGRATION=planned``.

Why a manager: verl's trainers build the rollout client themselves (``LLMServerManager.
get_client()`` with no client class: ``main_ppo`` v1's ``PPOTrainer.get_llm_client``, the legacy
``RayPPOTrainer``) and hand it to the agent-loop manager, which pickles it into every agent-loop
worker. The one official seam between the two is the config key
``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` (both trainers load it with
``load_class_from_fqn`` and call ``<class>.create(config=..., llm_client=..., teacher_client=...,
reward_loop_worker_handles=...)``). :class:`MigratingAgentLoopManager` is that class: with the
flag on it swaps the client for :class:`.verl_client.MigratingLLMServerClient` (same router
handle) and builds verl's own default manager for the trainer (``AgentLoopManagerTQ`` for
``trainer.use_v1=True``, ``AgentLoopManager`` otherwise) with it; with the flag off it builds that
manager with verl's client untouched. Nothing of verl is patched.

What the flag needs, checked here (config time) with the exact line to add in each error:
this project's router (``router_config_path``: it hands out the replica handles and takes
``move_request``), and the migration connector on every server (``engine_kwargs.vllm.
kv_transfer_config``). ``ascend-rl router --migration`` prints all lines.

Remove when: verl lets a config key choose the rollout client class (then that key names
``MigratingLLMServerClient``), or migrates requests between replicas itself.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from verl.utils.ray_utils import auto_await

log = logging.getLogger("ascend_rl_plugins")

MANAGER_FQN = f"{__name__}.MigratingAgentLoopManager"


def default_manager_class(config) -> type:
    """The agent-loop manager verl's trainer builds when the config names none."""
    if config.trainer.get("use_v1", False):
        from verl.trainer.ppo.v1 import AgentLoopManagerTQ
        return AgentLoopManagerTQ
    from verl.experimental.agent_loop import AgentLoopManager
    return AgentLoopManager


def _kv_transfer_config(config) -> dict | None:
    vllm_kwargs = (config.actor_rollout_ref.rollout.get("engine_kwargs", None) or {}).get("vllm", None) or {}
    value = vllm_kwargs.get("kv_transfer_config", None)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return None
    from omegaconf import DictConfig, OmegaConf
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else dict(value)


def store_config_from_config(config) -> dict:
    """The servers' migration connector's ``kv_connector_extra_config`` (from
    ``rollout.engine_kwargs.vllm.kv_transfer_config``): the export store the client must use
    too (a directory, or Mooncake and its settings), validated here, at config time.
    ValueError with the line to add where the servers run no migration connector, or naming
    the bad key."""
    from . import connector_config_line
    from .connector_config import CONNECTOR_CLASS, store_choice
    connector = _kv_transfer_config(config)
    if not connector or connector.get("kv_connector") != CONNECTOR_CLASS:
        raise ValueError(
            "ASCEND_RL_ROLLOUT_MIGRATION=planned: the rollout servers run no migration KV "
            f"connector (actor_rollout_ref.rollout.engine_kwargs.vllm.kv_transfer_config is "
            f"{connector!r}); add `{connector_config_line()}` (or set "
            "ASCEND_RL_ROLLOUT_MIGRATION=off)")
    extra = dict(connector.get("kv_connector_extra_config") or {})
    store_choice(extra)
    return extra


def store_dir_from_config(config) -> str:
    """The directory the servers' connector uses for exports (its transport 'directory'), as
    :func:`store_config_from_config` checks it."""
    from .connector_config import store_choice
    return str(store_choice(store_config_from_config(config)).store_dir)


def migrating_client(config, llm_client: Any, policy: Any = "flags"):
    """The client the agent loop gets: ``llm_client`` itself with migration off (``policy``
    None), else a :class:`.verl_client.MigratingLLMServerClient` on the same router. ``policy``:
    a ``PlannedMigration``, None, or ``"flags"`` (``ASCEND_RL_ROLLOUT_MIGRATION`` and its flags
    decide). ValueError (naming the flag and what to change) where migration is on but the
    setup cannot migrate."""
    from verl.workers.rollout.llm_server import LLMServerClient

    from . import REQUEUE_PREEMPTED, router_yaml_path
    from .migration_client import FROM_FLAGS, policy_from_flags
    from .verl_client import MigratingLLMServerClient
    if policy == FROM_FLAGS:
        policy = policy_from_flags()
    if policy is None and REQUEUE_PREEMPTED.value:
        raise ValueError("ASCEND_RL_ROLLOUT_REQUEUE_PREEMPTED=1 needs ASCEND_RL_ROLLOUT_MIGRATION="
                         "planned (the hand-back runs in the migrating client, through the "
                         "migration KV connector): set it, or turn the hand-back off")
    if policy is None:
        log.info("ascend-rl migration: ASCEND_RL_ROLLOUT_MIGRATION=off, verl's rollout client "
                 "unchanged")
        return llm_client
    if type(llm_client) is not LLMServerClient:
        raise ValueError(
            f"ASCEND_RL_ROLLOUT_MIGRATION=planned: the trainer's rollout client is "
            f"{type(llm_client).__name__}; migration is built on verl's plain LLMServerClient "
            f"(trainer.v1.trainer_mode=sync, or the legacy trainer), not on partial-rollout "
            f"clients: use one of those or set ASCEND_RL_ROLLOUT_MIGRATION=off")
    router = llm_client._load_balancer
    if not (hasattr(router, "move_request") and hasattr(router, "get_server_handles")):
        raise ValueError(
            "ASCEND_RL_ROLLOUT_MIGRATION=planned needs this project's router (it hands out the "
            "replicas and follows moves): add `actor_rollout_ref.rollout.router_config_path="
            f"{router_yaml_path()}`")
    if REQUEUE_PREEMPTED.value and not hasattr(router, "requeue_request"):
        raise ValueError("ASCEND_RL_ROLLOUT_REQUEUE_PREEMPTED=1 needs this project's router (it "
                         "takes handed-back requests): add `actor_rollout_ref.rollout."
                         f"router_config_path={router_yaml_path()}`")
    return MigratingLLMServerClient(config=config, load_balancer_handle=router, policy=policy,
                                    store_config=store_config_from_config(config),
                                    requeue_preempted=REQUEUE_PREEMPTED.value)


class MigratingAgentLoopManager:
    """``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` for tail migration: verl's
    default manager for the trainer, built with the migrating client when the flag is on
    (module docstring). Not a subclass: it returns verl's own manager object."""

    @classmethod
    @auto_await
    async def create(cls, config, llm_client, teacher_client=None, reward_loop_worker_handles=None,
                     **kwargs):
        manager = default_manager_class(config)
        client = migrating_client(config, llm_client)
        return await manager.create(config=config, llm_client=client, teacher_client=teacher_client,
                                    reward_loop_worker_handles=reward_loop_worker_handles, **kwargs)
