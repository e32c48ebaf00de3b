"""Tail migration reached the way a verl 0.9 ``main_ppo`` user reaches it: the flag and the lines
``ascend-rl router --migration`` prints, nothing else.

One process, Ray local, two vLLM 0.23 CPU replicas started by verl's ``LLMServerManager`` from a
config holding the printed lines (router YAML, agent-loop manager class, migration connector).
Two GRPO rollouts of the same batch on the same servers:

- ``reference``: verl's default agent-loop manager for the trainer with verl's own client (what
  ``RayPPOTrainer`` builds when the config names no manager), no migration;
- ``migrated``: the manager class the config names, loaded and created exactly as verl's
  trainer does (``load_class_from_fqn(rollout.agent.agent_loop_manager_class)`` then
  ``.create(config=..., llm_client=servers.get_client(), teacher_client=None,
  reward_loop_worker_handles=None)``), with ``ASCEND_RL_ROLLOUT_MIGRATION=planned`` in the
  environment.

The workload makes a tail on purpose: the router packs GRPO siblings (``ASCEND_RL_ROUTER_SIBLINGS
=pack``), one prompt is short (its responses run the whole 96-token budget) and two are long
(``max_model_len`` leaves them ~half that), so one replica ends up decoding the long group alone
while the other drains. Also records what the manager refuses on verl's own router.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from ascend_rl_plugins.features.rollout_rebalance.verl_client import MigrationStats

from tests.features.rollout_rebalance.verl_rollout_scenario import (
    REPLICAS,
    _batch,
    _config,
    _counts,
    _delta,
)

# the environment every Ray actor needs (vLLM on CPU, and the flags the router and servers read)
ENV_KEYS = ("PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS", "VLLM_LOGGING_LEVEL",
            "TOKENIZERS_PARALLELISM", "VLLM_CPU_OMP_THREADS_BIND", "TORCH_COMPILE_DISABLE", "ASCEND_RL_ROUTER_SIBLINGS",
            "ASCEND_RL_ROLLOUT_MIGRATION", "ASCEND_RL_ROLLOUT_MIGRATION_INTERVAL",
            "ASCEND_RL_ROLLOUT_MIGRATION_STEP_MS", "ASCEND_RL_ROLLOUT_MIGRATION_MARGIN")

PROMPT_LENGTH = RESPONSE_LENGTH = 96
MAX_MODEL_LEN = 128       # a ~75-token prompt keeps ~50 tokens of response room, a 25-token one all 96
SHORT = "what is {p} plus {q}?"
LONG = "question {p}: what is {p} plus {q}? " * 4


@dataclass
class Rollout:
    responses: list
    log_probs: list
    lengths: list
    finished: dict          # replica -> vLLM's finished requests during the rollout
    kv_loaded_tokens: dict  # replica -> KV tokens loaded through the connector
    router_bound: dict      # replica -> requests the router's sticky map ends on (this rollout)
    router_inflight_after: int
    exports_left: list
    client_class: str = ""
    stats: list[MigrationStats | None] = field(default_factory=list)   # per agent-loop worker


@dataclass
class MainPpoMigration:
    manager_class: str
    reference: Rollout
    migrated: Rollout
    refusal_on_verl_router: str     # the manager's error with verl's own router
    addresses: list


def _raw_prompts(prompts: int) -> list:
    return [SHORT.format(p=p, q=p + 1) if p == 0 else LONG.format(p=p, q=p + 1) for p in range(prompts)]


def _grpo_batch(prompts: int, n: int):
    batch = _batch(prompts, n)
    import numpy as np
    raw = [[{"role": "user", "content": text}] for text in _raw_prompts(prompts)]
    batch.non_tensor_batch["raw_prompt"] = np.array([r for r in raw for _ in range(n)], dtype=object)
    return batch


def _main_ppo_config(model_dir: str, n: int):
    """The test rollout config plus exactly the lines ``ascend-rl router --migration`` prints."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from ascend_rl_plugins.features import rollout_rebalance as rr
    config = _config(model_dir, rr.router_yaml_path(), n, RESPONSE_LENGTH)
    config = OmegaConf.merge(config, OmegaConf.create({
        "trainer": {"use_v1": False},   # verl's RayPPOTrainer path (v1 needs TransferQueue)
        "data": {"max_prompt_length": PROMPT_LENGTH},
        "actor_rollout_ref": {"rollout": {"prompt_length": PROMPT_LENGTH, "max_model_len": MAX_MODEL_LEN,
                                          "max_num_seqs": 8, "agent": {"num_workers": 2}}}}))
    OmegaConf.set_struct(config, False)
    for line in (part for text in rr.migration_config_lines() for part in text.split()):
        override = OverridesParser.create().parse_override(line)
        OmegaConf.update(config, override.key_or_group, override.value(), merge=True, force_add=True)
    return config


def _router_books(router) -> dict:
    """Inside the router actor: where its sticky map puts each request id."""
    return dict(router._policy.sticky)


@dataclass
class WorkerClient:
    """What one agent-loop worker's client is, and its migration stats (None: verl's own)."""

    client_class: str
    stats: MigrationStats | None


def _worker_stats(worker) -> WorkerClient:
    """Inside an agent-loop worker: its client's class and migration stats."""
    client = worker.llm_client
    stats = getattr(client, "stats", None)
    return WorkerClient(type(client).__name__, stats)


def main_ppo_rollout_migrating(model_dir: str, prompts: int, n: int) -> MainPpoMigration:
    import ray
    ray.init(num_cpus=8, num_gpus=REPLICAS, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {k: os.environ[k] for k in ENV_KEYS if k in os.environ}})
    try:
        from verl.utils.import_utils import load_class_from_fqn
        from verl.workers.rollout.llm_server import LLMServerClient, LLMServerManager
        from verl.workers.rollout.router import GlobalRequestLoadBalancer

        from ascend_rl_plugins.features.rollout_rebalance import kv_migration, verl_manager
        config = _main_ppo_config(model_dir, n)
        store_dir = verl_manager.store_dir_from_config(config)
        servers = LLMServerManager.create(config)
        addresses = servers.get_addresses()
        router = servers.global_load_balancer

        def rollout(manager) -> Rollout:
            books_before = ray.get(router.__ray_call__.remote(_router_books))
            before = {a: _counts(a) for a in addresses}
            output = manager.generate_sequences(_grpo_batch(prompts, n))
            after = {a: _counts(a) for a in addresses}
            books = ray.get(router.__ray_call__.remote(_router_books))
            new = Counter(server for rid, server in books.items() if rid not in books_before)
            delta = _delta(before, after)
            workers = [ray.get(w.__ray_call__.remote(_worker_stats)) for w in manager.agent_loop_workers]
            return Rollout(
                responses=output.batch["responses"].tolist(),
                log_probs=output.batch["rollout_log_probs"].tolist(),
                lengths=[int(sum(m)) for m in output.batch["response_mask"].tolist()],
                finished={a: d.finished for a, d in delta.items()},
                kv_loaded_tokens={a: d.kv_loaded_tokens for a, d in delta.items()},
                router_bound=dict(new), router_inflight_after=ray.get(router.get_total_inflight.remote()),
                exports_left=kv_migration.KVExportStore(store_dir).keys(),
                client_class=workers[0].client_class, stats=[w.stats for w in workers])

        default = verl_manager.default_manager_class(config)
        reference = rollout(default.create(config=config, llm_client=servers.get_client()))
        manager_cls = load_class_from_fqn(config.actor_rollout_ref.rollout.agent.agent_loop_manager_class,
                                          "AgentLoopManager")
        migrated = rollout(manager_cls.create(config=config, llm_client=servers.get_client(),
                                              teacher_client=None, reward_loop_worker_handles=None))
        verl_router = ray.remote(GlobalRequestLoadBalancer).remote(
            dict(zip(addresses, [r.server_handle for r in servers.get_replicas()])))
        try:
            verl_manager.migrating_client(config, LLMServerClient(config, load_balancer_handle=verl_router))
            refusal = ""
        except ValueError as exc:
            refusal = str(exc)
        return MainPpoMigration(manager_cls.__name__, reference, migrated, refusal, addresses)
    finally:
        ray.shutdown()
