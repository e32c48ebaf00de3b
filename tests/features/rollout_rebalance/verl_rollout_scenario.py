"""verl 0.9's own agent-loop rollout on CPU with this router loaded through router_config_path,
and tail migration with KV in it.

verl's ``LLMServerManager`` starts standalone ``vLLMReplica``s (each: a Ray placement group of
one logical "GPU", a ``CheckpointEngineWorker``, a ``vLLMHttpServer`` running vLLM's real
``AsyncLLM`` on the CPU build), builds the router with its own ``get_router_handle`` from
``rollout.router_config_path``, and ``AgentLoopManager`` runs ``single_turn_agent`` over a
GRPO batch (each prompt repeated n times) through verl's ``LLMServerClient``.

``grpo_rollouts`` starts Ray and the servers once (their start costs more than the rollouts
on this CPU) and makes three rollouts on them: verl's own client (the router checks of
``test_router_verl_rollout`` read this one), then the two migrating ones of
``test_router_verl_migration``. The servers load the migration connector (the fault-injecting
subclass, inert until armed) through ``rollout.engine_kwargs.vllm.kv_transfer_config``.
``grpo_requeue_rollouts`` starts its own two servers, with a KV cache too small for their
requests (the preemption hand-back of ``test_router_verl_requeue``).

Ray is started with logical GPUs: verl 0.9.1 takes this CPU host for a CUDA one and asks Ray
for "GPU" bundles; the bundles only reserve a slot, vLLM's CPU platform ignores the device
ids Ray hands out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tests.support.phases import PhaseClock

REPLICAS = 2
# the GRPO batch both verl test modules check: 3 prompts x n=4, greedy, 96 tokens; the
# migrating runs move every hop still running after 0.1 s (cut at whatever token the timer
# meets), up to 8 times per request
PROMPTS, N, TOKENS, AFTER_S, MAX_MOVES = 3, 4, 96, 0.1, 8


def _config(model_dir: str, router_yaml: str, n: int, max_tokens: int, engine_kwargs: dict | None = None):
    import verl
    from omegaconf import OmegaConf
    base = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer", "config",
                                       "_generated_ppo_trainer.yaml"))
    overrides = OmegaConf.create({
        "trainer": {"n_gpus_per_node": REPLICAS, "nnodes": 1},
        "data": {"max_prompt_length": 64, "max_response_length": max_tokens, "return_raw_chat": True},
        "actor_rollout_ref": {
            "model": {"path": model_dir, "use_remove_padding": False},
            "rollout": {
                "name": "vllm", "mode": "async", "nnodes": 1, "n_gpus_per_node": REPLICAS,
                "tensor_model_parallel_size": 1, "data_parallel_size": 1,
                "pipeline_model_parallel_size": 1,
                "n": n, "temperature": 0.0, "top_k": -1, "top_p": 1.0,
                "prompt_length": 64, "response_length": max_tokens, "max_model_len": 256,
                "max_num_seqs": 4, "max_num_batched_tokens": 512, "dtype": "float32",
                "load_format": "auto", "enforce_eager": True, "enable_sleep_mode": False,
                "free_cache_engine": False, "gpu_memory_utilization": 0.5,
                "disable_log_stats": False, "calculate_log_probs": True,
                "router_config_path": router_yaml,
                "agent": {"num_workers": 1, "default_agent_loop": "single_turn_agent"},
                "skip_tokenizer_init": False,
                **({"engine_kwargs": {"vllm": engine_kwargs}} if engine_kwargs else {}),
            },
        },
    })
    return OmegaConf.merge(base, overrides)


def _batch(prompts: int, n: int):
    import numpy as np
    from verl import DataProto
    raw = [[{"role": "user", "content": f"question {p}: what is {p} plus {p + 1}?"}] for p in range(prompts)]
    raw = [r for r in raw for _ in range(n)]  # GRPO: each prompt n times, as the trainer repeats it
    batch = DataProto.from_dict(non_tensors={
        "raw_prompt": np.array(raw, dtype=object),
        "agent_name": np.array(["single_turn_agent"] * len(raw), dtype=object),
        "data_source": np.array(["tiny"] * len(raw), dtype=object),
        "index": np.array([p for p in range(prompts) for _ in range(n)], dtype=object),
    })
    return batch


@dataclass
class RouterRecord:
    """What the router recorded of the reference rollout (read inside its actor right after
    it): the replica it bound each request id to, the requests it saw released, its
    per-prompt (GRPO group) history, and its status."""

    router_class: str
    bound: dict[str, int]          # server address: requests bound there
    requests: int
    released: int
    group_sizes: list[int]
    total_inflight: int
    queued: int
    load_source: str
    kv_capacity_tokens: dict[str, int]   # per server, parsed from its /metrics


def _router_books(router) -> dict:
    from collections import Counter
    policy = router._policy
    return {"bound": dict(Counter(policy.sticky.values())), "requests": len(policy.sticky),
            "released": policy.lengths.observed,
            "group_sizes": sorted(n for _, n in policy.lengths.by_group.values())}


def _router_record(router) -> RouterRecord:
    import ray
    status = ray.get(router.get_status.remote())
    books = ray.get(router.__ray_call__.remote(_router_books))
    return RouterRecord(router_class=ray.get(router.__ray_call__.remote(lambda self: type(self).__name__)),
                        total_inflight=status["total_inflight"], queued=status["queued"],
                        load_source=status["load_source"],
                        kv_capacity_tokens={a: kv["capacity_tokens"] for a, kv in status["kv"].items()},
                        **books)


def _metric(address: str, name: str) -> dict:
    """One vLLM counter of one replica by its label set (the whole line before the value)."""
    import urllib.request
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name)}


@dataclass
class ReplicaCounts:
    finished: float           # vllm:request_success_total
    kv_loaded_tokens: float   # vllm:external_prefix_cache_hits_total
    preempted: float = 0.0    # vllm:num_preemptions_total


@dataclass
class ClientCounts:
    """One agent-loop worker's migrating client, as its ``MigrationStats`` has it (zeros with
    verl's own client)."""

    moved: int = 0
    router_told: int = 0
    moves_undone: int = 0
    requeued: int = 0


def _moves(worker) -> ClientCounts:
    """Inside an agent-loop worker: what its client counted."""
    stats = getattr(worker.llm_client, "stats", None)
    if stats is None:
        return ClientCounts()
    return ClientCounts(stats.moved, stats.router_told, stats.moves_undone, stats.requeued)


def _counts(address: str) -> ReplicaCounts | None:
    """Finished requests (aborted hops are not in vLLM's success counter: none showed up under
    finish reason "abort" in runs with moves) and KV tokens loaded through the connector, from
    one replica's /metrics (None where the replica no longer answers)."""
    try:
        success = _metric(address, "vllm:request_success_total")
        external = _metric(address, "vllm:external_prefix_cache_hits_total")
        preempted = _metric(address, "vllm:num_preemptions_total")
    except Exception:  # noqa: BLE001 - a dead replica's server
        return None
    return ReplicaCounts(finished=sum(success.values()), kv_loaded_tokens=sum(external.values()),
                         preempted=sum(preempted.values()))


def _delta(before: dict, after: dict) -> dict:
    return {a: (None if after[a] is None or before[a] is None else
                ReplicaCounts(finished=after[a].finished - before[a].finished,
                              kv_loaded_tokens=after[a].kv_loaded_tokens - before[a].kv_loaded_tokens,
                              preempted=after[a].preempted - before[a].preempted))
            for a in after}


@dataclass
class Rollout:
    """One GRPO batch through ``AgentLoopManager``: rows in batch order."""

    responses: list[list[int]]
    log_probs: list[list[float]]
    lengths: list[int]                          # response_mask sums
    replicas: dict[str, ReplicaCounts | None]   # per server address, counted over this rollout
    exports_left: list[str]
    router_inflight_after: int   # requests the router still counts in flight after the rollout
    moved: int                   # moves the migrating clients carried out (0 with verl's client)
    router_told: int             # moves the router accepted (move_request)
    moves_undone: int            # moves whose destination had died before the hop started
    requeued: int = 0            # hops preempted and handed back to the router (hand-back on)


@dataclass
class Rollouts:
    reference: Rollout     # verl's own client
    router: RouterRecord   # right after the reference rollout
    moved: Rollout         # migration forced on
    destination_dies: Rollout   # the same with the one-shot fault armed
    errored: dict[str, bool]    # per server address after the fault run
    marker_consumed: bool       # a replica took the fault marker (received a KV load)
    seconds: dict[str, float]   # per phase (Ray and servers start, each rollout): where the time went


def _start_ray(extra_env: dict | None = None) -> None:
    """Ray local, with logical GPUs (module docstring); every Ray worker gets this process's
    engine environment (and ``extra_env``)."""
    import ray
    env = {k: os.environ[k] for k in (
        "PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS", "VLLM_LOGGING_LEVEL",
        "TOKENIZERS_PARALLELISM", "VLLM_CPU_OMP_THREADS_BIND", "TORCH_COMPILE_DISABLE") if k in os.environ}
    ray.init(num_cpus=8, num_gpus=REPLICAS, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {**env, **(extra_env or {})}})


def _rollout(config, client, servers, addresses: list, prompts: int, n: int, store_dir: str) -> Rollout:
    """One GRPO batch through verl's ``AgentLoopManager`` with ``client``, counted."""
    import ray
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager

    from ascend_rl_plugins.features.rollout_rebalance import kv_migration
    manager = AgentLoopManager.create(config, llm_client=client)
    before = {a: _counts(a) for a in addresses}
    output = manager.generate_sequences(_batch(prompts, n))
    after = {a: _counts(a) for a in addresses}
    mask = output.batch["response_mask"].tolist()
    counts = [ray.get(w.__ray_call__.remote(_moves)) for w in manager.agent_loop_workers]
    return Rollout(responses=output.batch["responses"].tolist(),
                   log_probs=output.batch["rollout_log_probs"].tolist(),
                   lengths=[int(sum(m)) for m in mask], replicas=_delta(before, after),
                   exports_left=kv_migration.KVExportStore(store_dir).keys(),
                   router_inflight_after=ray.get(servers.global_load_balancer.get_total_inflight.remote()),
                   moved=sum(c.moved for c in counts), router_told=sum(c.router_told for c in counts),
                   moves_undone=sum(c.moves_undone for c in counts),
                   requeued=sum(c.requeued for c in counts))


def grpo_rollouts(model_dir: str, router_yaml: str, prompts: int, n: int, max_tokens: int,
                  store_dir: str, after_s: float, max_moves: int) -> Rollouts:
    """Three rollouts of one GRPO batch through verl's own ``AgentLoopManager`` on the same two
    vLLM replicas (each with the migration connector through ``engine_kwargs.vllm.
    kv_transfer_config``): verl's own client (reference, and what its router recorded);
    ``MigratingLLMServerClient`` moving every hop still running after ``after_s`` s, up to
    ``max_moves`` times per request (migration forced on); the same after arming the one-shot
    fault, so the first replica that receives a KV load dies mid-migration."""
    import json

    import ray

    from ascend_rl_plugins.features.rollout_rebalance import kv_migration
    from tests.features.rollout_rebalance import kv_migration_faults as faults
    clock = PhaseClock()
    marker = os.path.join(store_dir, "die-on-next-load")
    _start_ray({faults.DIE_MARKER_ENV: marker})
    clock.lap("start Ray")
    try:
        from verl.workers.rollout.llm_server import LLMServerManager

        from ascend_rl_plugins.features.rollout_rebalance.verl_client import (
            MigratingLLMServerClient,
            TimedMigration,
            engine_errored,
        )
        connector = kv_migration.kv_transfer_config(
            store_dir, connector_class="DyingOnceOnLoadConnector", module=faults.__name__)
        config = _config(model_dir, router_yaml, n, max_tokens,
                         engine_kwargs={"kv_transfer_config": json.dumps(connector)})
        servers = LLMServerManager.create(config)
        addresses = servers.get_addresses()
        handles = {r.server_address: r.server_handle for r in servers.get_replicas()}
        clock.lap("start two vLLM servers and the router")

        def rollout(client) -> Rollout:
            return _rollout(config, client, servers, addresses, prompts, n, store_dir)

        reference = rollout(servers.get_client())
        router = _router_record(servers.global_load_balancer)
        clock.lap("reference rollout")
        policy = TimedMigration(after_s=after_s, max_moves=max_moves)
        moved = rollout(servers.get_client(client_cls=MigratingLLMServerClient, replicas=handles,
                                           policy=policy, store_dir=store_dir))
        clock.lap("moved rollout")
        open(marker, "w").close()
        dies = rollout(servers.get_client(client_cls=MigratingLLMServerClient, replicas=handles,
                                          policy=policy, store_dir=store_dir))
        errored = {a: ray.get(h.__ray_call__.remote(engine_errored)) for a, h in handles.items()}
        clock.lap("fault rollout")
        return Rollouts(reference=reference, router=router, moved=moved, destination_dies=dies,
                        errored=errored, marker_consumed=not os.path.exists(marker), seconds=clock.seconds)
    finally:
        ray.shutdown()


# the preemption hand-back scenario: a GRPO batch of 2 prompts x n=4 on two replicas whose KV
# cache holds REQUEUE_BLOCKS blocks (vLLM's CPU block: 128 tokens). Each request (~25 prompt
# tokens + REQUEUE_TOKENS) starts in one block and needs a second one at its 128th token, so
# the three a replica admits outgrow its cache and vLLM preempts; one request fits alone
REQUEUE_BLOCKS = 3
REQUEUE_PROMPTS, REQUEUE_TOKENS = 2, 180
REQUEUE_ROUTER = {"kv_budget": 16, "kv_reserve": 0}   # admit on slots only: let vLLM preempt


@dataclass
class RequeueRollouts:
    reference: Rollout     # verl's own client: each replica preempts into its own queue
    requeued: Rollout      # MigratingLLMServerClient, hand-back on (no moves)
    marks_left: list[str]  # preemption marks still in the store afterwards
    kv_capacity_tokens: dict[str, int]   # per server, as the router read its /metrics
    # prompt (GRPO group) keys the router's length statistics hold after both rollouts: one per
    # prompt where a handed-back request is acquired again under its own prompt
    router_prompt_groups: int
    seconds: dict[str, float]


def _router_prompt_groups(router) -> int:
    """Inside the router actor: how many prompt keys its length statistics hold."""
    return len(router._policy.lengths.by_group)


def grpo_requeue_rollouts(model_dir: str, router_yaml: str, prompts: int, n: int, max_tokens: int,
                          store_dir: str) -> RequeueRollouts:
    """Two rollouts of one GRPO batch on two vLLM replicas with a KV cache too small for their
    running requests (both load the migration connector): verl's own client, then
    ``MigratingLLMServerClient`` with the preemption hand-back on and no moves
    (``TimedMigration(max_moves=0)``): each preempted hop is marked by the connector, aborted by
    the client and acquired again from the router, which binds it ahead of the queue."""
    import json

    import ray

    from ascend_rl_plugins.features.rollout_rebalance import kv_migration
    clock = PhaseClock()
    _start_ray()
    clock.lap("start Ray")
    try:
        from verl.workers.rollout.llm_server import LLMServerManager

        from ascend_rl_plugins.features.rollout_rebalance.verl_client import (
            MigratingLLMServerClient,
            TimedMigration,
        )
        config = _config(model_dir, router_yaml, n, max_tokens, engine_kwargs={
            "kv_transfer_config": json.dumps(kv_migration.kv_transfer_config(store_dir)),
            "num_gpu_blocks_override": REQUEUE_BLOCKS})
        servers = LLMServerManager.create(config)
        addresses = servers.get_addresses()
        handles = {r.server_address: r.server_handle for r in servers.get_replicas()}
        clock.lap("start two small-KV vLLM servers and the router")
        reference = _rollout(config, servers.get_client(), servers, addresses, prompts, n, store_dir)
        clock.lap("reference rollout")
        client = servers.get_client(client_cls=MigratingLLMServerClient, replicas=handles,
                                    policy=TimedMigration(after_s=3600.0, max_moves=0),
                                    store_dir=store_dir, requeue_preempted=True)
        requeued = _rollout(config, client, servers, addresses, prompts, n, store_dir)
        clock.lap("hand-back rollout")
        status = ray.get(servers.global_load_balancer.get_status.remote())
        groups = ray.get(servers.global_load_balancer.__ray_call__.remote(_router_prompt_groups))
        return RequeueRollouts(reference=reference, requeued=requeued, router_prompt_groups=groups,
                               marks_left=sorted(kv_migration.KVExportStore(store_dir).preempted_keys()),
                               kv_capacity_tokens={a: kv["capacity_tokens"] for a, kv in status["kv"].items()},
                               seconds=clock.seconds)
    finally:
        ray.shutdown()
