"""The ``ascend_rl_alltoallv`` backend's rollout side inside a real verl 0.9.1 deployment: the
expert map a rank votes is read from its live vLLM worker through verl's own server (run by
test_verl09_deploy.py in child processes).

What is real: verl 0.9.1's ``LLMServerManager`` starts one standalone ``vLLMReplica`` (a Ray
placement group of one logical "GPU" -- verl takes this CPU host for a CUDA one, the bundle only
reserves a slot --, a ``CheckpointEngineWorker`` actor that builds the backend through
``custom_backend_module`` and ``CheckpointEngineRegistry`` from the rollout config, and a
``vLLMHttpServer`` running vLLM 0.23's ``AsyncLLM`` on the CPU build with
``worker_extension_cls`` = ``verl09_worker.ReshardWorkerExtension``, from
``rollout.engine_kwargs.vllm``); the group is built the way ``CheckpointEngineManager.
build_process_group`` builds it (``prepare`` on the rollout workers through a ``RayWorkerGroup``
over the replica's workers, the backend's ``build_topology``, ``init_process_group``); the two
trainer ranks are verl09_engine_scenario's (Megatron-Core 0.16.1, SequentialMLP, EP 2), outside
Ray, meeting the rollout rank in the backend's own group.

What is not run: ``CheckpointEngineWorker.update_weights`` hands the received stream to verl's
``ServerAdapter.update_weights`` (ZMQ buckets into ``update_weights_from_ipc``), which fails stock
on vLLM 0.23's CPU build after the CPU MoE prepack (README, "verl's server-adapter hop on CPU").
The sync is therefore driven by running the worker's own ``checkpoint_engine.receive_weights()``
inside the ``CheckpointEngineWorker`` actor (``__ray_call__``) and checking every tensor it yields
against W1; loading into vLLM is test_verl09_engine.py's.

The configuration says what a user with an EP 2 replica writes (``replica_world_size=2``, linear:
this rank would host experts 0-1); the live engine (TP = EP = 1 on CPU) hosts all four. A vote
from the configured rule would key the plan on the stale map (verl #7086); the live one receives
every expert.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .verl09_engine_scenario import TRAINERS, RolloutSync

CASES = ["first", "again"]
REPLICA_WORLD_SIZE = 2        # what the configuration says (EP 2); the CPU engine hosts every expert


@dataclass
class DeploySync(RolloutSync):
    """One sync as the CheckpointEngineWorker's backend saw it."""
    expert_names: list          # expert tensors received, sorted
    dense_names: list           # other tensors received, sorted
    received: int
    unique: int
    wrong: list                 # received tensors whose values, cast to W1's dtype (as vLLM's loader
                                # casts into its parameters), are not bit-identical to W1's
    dtypes: dict                # "expert" / "dense" -> dtypes received


@dataclass
class Deployment:
    worker_class: str           # the Ray actor the backend ran in
    backend_class: str
    server_name: str            # the vLLM server the backend found (its workers list this actor)
    weight_sync_rank: int
    without_extension: str      # the refusal where the server's workers lack the method
    w1_expert_names: list
    w1_dense_names: list
    syncs: dict                 # case -> DeploySync

    @classmethod
    def from_json(cls, d: dict) -> "Deployment":
        return cls(**dict(d, syncs={k: DeploySync(**v) for k, v in d["syncs"].items()}))


def _config(model_dir: str):
    import verl
    from omegaconf import OmegaConf

    from ascend_rl_plugins.features import moe_reshard
    base = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer", "config",
                                       "_generated_ppo_trainer.yaml"))
    overrides = OmegaConf.create({
        "trainer": {"n_gpus_per_node": 1, "nnodes": 1},
        "actor_rollout_ref": {
            "model": {"path": model_dir, "use_remove_padding": False},
            "rollout": {
                "name": "vllm", "mode": "async", "nnodes": 1, "n_gpus_per_node": 1,
                "tensor_model_parallel_size": 1, "data_parallel_size": 1, "pipeline_model_parallel_size": 1,
                "prompt_length": 64, "response_length": 16, "max_model_len": 256, "max_num_seqs": 4,
                "max_num_batched_tokens": 512, "dtype": "bfloat16", "load_format": "auto", "enforce_eager": True,
                "enable_sleep_mode": False, "free_cache_engine": False, "gpu_memory_utilization": 0.5,
                "skip_tokenizer_init": False,
                "engine_kwargs": {"vllm": {"worker_extension_cls": moe_reshard.WORKER_EXTENSION}},
                "checkpoint_engine": {
                    "backend": moe_reshard.BACKEND, "custom_backend_module": moe_reshard.BACKEND_MODULE,
                    "update_weights_bucket_megabytes": 1,
                    "engine_kwargs": {moe_reshard.BACKEND: {
                        "replica_world_size": REPLICA_WORLD_SIZE, "expert_placement": "linear",
                        "master_address": "127.0.0.1"}}},
            },
        },
    })
    return OmegaConf.merge(base, overrides)


def _drain(worker, w1_dir: str) -> dict:
    """Runs inside the CheckpointEngineWorker actor: one sync's rollout side, through the backend
    verl built there, checked tensor by tensor against W1."""
    import torch
    from safetensors.torch import load_file

    from ascend_rl_plugins.features.moe_reshard.layout import parse_hf_expert_name
    w1 = load_file(os.path.join(w1_dir, "model.safetensors"))
    engine = worker.checkpoint_engine
    got = [(name, t.clone()) for name, t in engine.receive_weights()]
    r = engine.last
    names = [n for n, _ in got]
    return dataclasses.asdict(DeploySync(
        **RolloutSync.of(r), expert_names=sorted(n for n in names if parse_hf_expert_name(n)),
        dense_names=sorted(n for n in names if not parse_hf_expert_name(n)), received=len(names),
        unique=len(set(names)),
        wrong=sorted(n for n, t in got if n not in w1 or t.shape != w1[n].shape
                     or not torch.equal(t.to(w1[n].dtype), w1[n])),
        dtypes={kind: sorted({str(t.dtype) for n, t in got if bool(parse_hf_expert_name(n)) == (kind == "expert")})
                for kind in ("expert", "dense")}))


def _where(worker) -> dict:
    """Runs inside the CheckpointEngineWorker actor: where the backend read its maps from, and
    what it says where the server's workers lack the method (as without the worker extension)."""
    from ascend_rl_plugins.features.moe_reshard.planner import PlanError
    engine = worker.checkpoint_engine
    reader = engine.live_expert_map
    refused = ""
    try:
        if reader is not None:
            dataclasses.replace(reader, method="ascend_rl_not_a_worker_method")()
    except PlanError as exc:
        refused = str(exc)
    return {"worker_class": type(worker).__name__, "backend_class": type(engine).__name__,
            "server_name": getattr(reader, "server_name", ""), "weight_sync_rank": getattr(reader, "weight_sync_rank", -1),
            "without_extension": refused}


def deployment(port: int, paths: dict) -> dict:
    """Start the replica, build the group with the trainer ranks (already waiting at ``port``),
    run ``CASES`` syncs on the rollout side, return what each delivered."""
    import ray
    from safetensors.torch import load_file

    from ascend_rl_plugins.features.moe_reshard.layout import parse_hf_expert_name
    env = {k: os.environ[k] for k in (
        "PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS", "VLLM_LOGGING_LEVEL", "TOKENIZERS_PARALLELISM",
        "TORCH_COMPILE_DISABLE", "PYTHONWARNINGS", "ASCEND_RL_AUTOLOAD", "ASCEND_RL_MOE_RESHARD",
        "ASCEND_RL_MOE_RESHARD_BUCKET_MB") if k in os.environ}
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=True, runtime_env={"env_vars": env})
    try:
        from verl.checkpoint_engine.base import CheckpointEngineRegistry, _worker_cls
        from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
        from verl.utils.import_utils import import_external_libs
        from verl.workers.rollout.llm_server import LLMServerManager

        from ascend_rl_plugins.features import moe_reshard
        servers = LLMServerManager.create(_config(paths["w0"]))
        replica = servers.get_replicas()[0]
        # CheckpointEngineManager.build_process_group, with the trainer ranks outside Ray
        import_external_libs(moe_reshard.BACKEND_MODULE)
        backend = CheckpointEngineRegistry.get(moe_reshard.BACKEND)
        rollout = RayWorkerGroup(worker_handles=replica.workers, ray_cls_with_init=RayClassWithInitArgs(cls=_worker_cls))
        metadata = ray.get(rollout.execute_checkpoint_engine(["prepare"] * rollout.world_size))
        trainer_meta = {"host": "127.0.0.1", "port": port}
        _, kwargs = backend.build_topology(TRAINERS, rollout.world_size, [trainer_meta] * TRAINERS + metadata)
        kwargs["method"] = ["init_process_group"] * rollout.world_size
        ray.get(rollout.execute_checkpoint_engine(**kwargs))
        worker = replica.workers[0]
        syncs = {case: ray.get(worker.__ray_call__.remote(_drain, paths["w1"])) for case in CASES}
        ray.get(rollout.execute_checkpoint_engine(["finalize"] * rollout.world_size))
        where = ray.get(worker.__ray_call__.remote(_where))
    finally:
        ray.shutdown()
    w1 = load_file(os.path.join(paths["w1"], "model.safetensors"))
    return dataclasses.asdict(Deployment(
        **where, w1_expert_names=sorted(n for n in w1 if parse_hf_expert_name(n)),
        w1_dense_names=sorted(n for n in w1 if not parse_hf_expert_name(n)),
        syncs={k: DeploySync(**v) for k, v in syncs.items()}))
