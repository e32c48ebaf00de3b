"""verl 0.9 checkpoint-engine backend ``ascend_rl_alltoallv``: the MoE reshard as a weight-sync
backend of verl's own registry.

How verl 0.9.1 syncs weights to separate rollout servers (read in ``verl/checkpoint_engine/
base.py`` and ``verl/workers/engine_workers.py``): ``CheckpointEngineManager.update_weights``
asks every trainer worker and every rollout worker (one ``CheckpointEngineWorker`` per vLLM
worker) for ``prepare()`` metadata, builds one group over all of them with the backend's
``build_topology`` (trainer ranks first, then the rollout ranks of every replica in order) and
``init_process_group``, then runs, concurrently, the trainer's ``send_weights`` and the rollout's
``receive_weights`` (whose ``(name, tensor)`` stream the rollout's server adapter loads into
vLLM), and ``finalize()``. A backend joins the registry with
``CheckpointEngineRegistry.register(name)`` from the module ``checkpoint_engine.
custom_backend_module`` names, which verl imports on both sides before building the engine:
this module is that module.

What it does per sync, on every rank of that group together:

1. *Vote* (``agreement.decide`` over this group): each trainer rank reads its layout and local
   expert shards from the training engine (Megatron-Core's ``parallel_state``, the model chunks),
   each rollout rank its expert map, read at this sync from the live engine -- a reader the
   engine's holder attached (``live_expert_map``, e.g. ``vllm_side.LiveRollout``), or, inside
   verl's ``CheckpointEngineWorker``, its vLLM worker through the node's server
   (``verl09_rollout``) -- else (``expert_maps=config`` or no Ray deployment) vLLM's placement
   rule for its replica (:class:`Options`); any
   reason on any rank -- the trainer was handed an HF export instead of the engine, experts the
   planner cannot read, a layout Megatron numbers differently -- is every rank's reason.
2. *Plan*: every rank builds the same plan from the gathered votes: training ranks
   ``[0, A)`` send, rollout ranks ``[A, A+R)`` receive (``RolloutLayout.first_rank = A``), each
   needed expert slice moves once from one of its owners (balanced over expert data-parallel
   replicas), straight to the rollout rank hosting it; planned once per digest
   (``planner.CACHE``) and validated; a second vote on the plan key.
3. *Move*: the experts by the executor's uneven all-to-alls (two rounds in flight), then the
   dense tensors as a broadcast from trainer rank 0 in buckets of ``bucket_size`` -- the way
   verl's nccl / hccl backends move every tensor. On a Megatron-Bridge engine the dense tensors
   are the bridge's export of its non-expert conversion tasks (:func:`bridge_dense_export`):
   no expert is gathered over EP on the trainer. The rollout side yields its hosted experts
   (once per hosted copy) and every dense tensor.

Any refusal: every rank takes the fallback together, with one WARNING naming the rank and reason
(an error on every rank under ``ASCEND_RL_MOE_RESHARD=on``). With ``fallback_backend`` set (the
backend the user would otherwise have, e.g. ``nccl``), every rank hands the whole sync to that
verl backend, built through verl's registry beside this one (its ``prepare`` metadata rides in
this backend's, its topology and group are built every sync); unset, trainer rank 0 broadcasts
verl's full export (experts included) to every rollout rank, as a broadcast backend would.

The group is a gloo process group of its own (``torch.distributed.ProcessGroupGloo`` over a
``TCPStore`` at trainer rank 0, started by its ``prepare`` on a port the kernel picks: the store
holds that port from the moment it is published), outside both sides' ``torch.distributed``
worlds; buffers are in host memory. On an NPU cluster HCCL would carry the same exchange between
device buffers; that transport is not built here (README, "What only an NPU can show").

Trainer side input: the training engine itself, which stock verl 0.9.1 hands only to its
``delta_sharded`` backend; the feature's patch of ``ActorRolloutRefWorker.update_weights``
hands it to any backend whose class says ``takes_training_engine`` (this one). Without the patch verl hands the
backend Megatron-Bridge's HF export, whose experts are already gathered: the backend then
falls back (the export moves whole, as broadcast) and says why.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import numbers
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from . import BACKEND, agreement
from .layout import PLACEMENTS, MoEShape, RolloutLayout, TrainingLayout, parse_hf_expert_name, placement_map
from .planner import PlanError
EXPERT_MAPS = ("auto", "live", "config")
# registered backends that cannot stand in for this one: itself; "naive" (verl's colocated path, no
# checkpoint-engine group: the manager never calls a backend for it); "delta_sharded" (its
# rollout side speaks the "delta_flush" wire format, which verl reads off this backend's class)
NOT_A_FALLBACK = frozenset({BACKEND, "naive", "delta_sharded"})
# the longest group timeout accepted: a year. torch adds the timeout to its clock's now, and far
# above this that sum overflows (torch 2.9.1 and 2.11: a 10**6-day store timeout timed out at once)
MAX_TIMEOUT_S = 365 * 24 * 3600


def fallback_backends() -> list[str]:
    """The backends ``fallback_backend`` may name: verl's registered checkpoint engines (those whose
    transport imported in this process: nccl needs cupy, hccl torch_npu, ...) but the excluded."""
    return sorted(set(CheckpointEngineRegistry._registry) - NOT_A_FALLBACK)


@dataclass(frozen=True)
class Options:
    """``rollout.checkpoint_engine.engine_kwargs.ascend_rl_alltoallv`` (checked when verl builds
    the engine, on both sides).

    ``replica_world_size``: ranks (vLLM workers) of one rollout replica, i.e. its expert-parallel
    size -- vLLM with ``enable_expert_parallel`` spreads every expert over the ranks of its
    replica; ``expert_placement``: vLLM's ``expert_placement_strategy`` (``linear`` or
    ``round_robin``); ``master_address``: the address trainer rank 0 listens on for the group
    (default: this node's address as Ray sees it); ``timeout_s``: the group's timeout;
    ``fallback_backend``: the verl checkpoint-engine backend every rank delegates the whole sync
    to when the reshard cannot run (the backend the user would otherwise have, e.g. ``nccl``,
    which on an NPU build of verl is its HCCL engine), built from ``fallback_kwargs`` through
    verl's registry; unset, the fallback is this backend's own broadcast of the whole export;
    ``expert_maps``: where a rollout rank's expert map comes from at each sync -- ``live`` from
    the live engine (a reader its holder attached, else, inside verl's ``CheckpointEngineWorker``,
    its vLLM worker through the node's server: ``verl09_rollout``; a refusal where neither
    exists), ``config`` the placement rule above, ``auto`` (default) live wherever a live engine
    can be reached and the rule outside a Ray deployment."""
    replica_world_size: int = 1
    expert_placement: str = "linear"
    master_address: str | None = None
    timeout_s: float = 1800.0
    fallback_backend: str | None = None
    fallback_kwargs: dict = dataclasses.field(default_factory=dict)
    expert_maps: str = "auto"

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> "Options":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"checkpoint_engine.engine_kwargs.{BACKEND}: unknown key(s) {unknown}; "
                             f"accepted: {sorted(names)}")
        opts = cls(**kwargs)
        if not isinstance(opts.replica_world_size, int) or opts.replica_world_size < 1:
            raise ValueError(f"checkpoint_engine.engine_kwargs.{BACKEND}.replica_world_size must be an "
                             f"integer >= 1 (vLLM workers per rollout replica), got {opts.replica_world_size!r}")
        if opts.expert_placement not in PLACEMENTS:
            raise ValueError(f"checkpoint_engine.engine_kwargs.{BACKEND}.expert_placement must be one of "
                             f"{PLACEMENTS} (vLLM's expert_placement_strategy), got {opts.expert_placement!r}")
        if opts.expert_maps not in EXPERT_MAPS:
            raise ValueError(f"checkpoint_engine.engine_kwargs.{BACKEND}.expert_maps must be one of {EXPERT_MAPS} "
                             f"(where a rollout rank's expert map is read), got {opts.expert_maps!r}")
        if not _is_timeout(opts.timeout_s):
            raise ValueError(f"checkpoint_engine.engine_kwargs.{BACKEND}.timeout_s must be a finite number of seconds "
                             f"> 0 and <= {MAX_TIMEOUT_S} (a year; the group's timeout), got {opts.timeout_s!r}")
        if opts.fallback_backend is not None and opts.fallback_backend not in fallback_backends():
            raise ValueError(f"checkpoint_engine.engine_kwargs.{BACKEND}.fallback_backend must be one of "
                             f"{fallback_backends()} (the verl checkpoint-engine backends registered in this process, "
                             f"less {sorted(NOT_A_FALLBACK)}) or unset, got {opts.fallback_backend!r}")
        if not isinstance(opts.fallback_kwargs, dict) or (opts.fallback_kwargs and opts.fallback_backend is None):
            raise ValueError(f"checkpoint_engine.engine_kwargs.{BACKEND}.fallback_kwargs must be a mapping of the "
                             f"fallback_backend's engine_kwargs (and needs fallback_backend), got {opts.fallback_kwargs!r}")
        return opts

    def expert_map(self, rollout_rank: int, num_experts: int) -> tuple[int, ...]:
        """The experts rollout rank ``rollout_rank`` (of the whole group's rollout ranks) hosts:
        its rank within its replica under vLLM's placement rule."""
        ep = self.replica_world_size
        return placement_map(self.expert_placement, ep, rollout_rank % ep, num_experts)


def _is_timeout(value) -> bool:
    """A usable group timeout: a real number of seconds in ``(0, MAX_TIMEOUT_S]``. Checked when
    verl builds the engine because otherwise it surfaces only at the first sync, far from the
    configuration: 0 or less times every wait of the group out at once, NaN or infinity fail
    converting to a ``timedelta``, a huge one overflows torch's deadline. A bool is refused
    (``True`` is no number of seconds)."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and 0 < value <= MAX_TIMEOUT_S)


# -- the group ---------------------------------------------------------------------------------

class Link:
    """Two gloo process groups over the trainer and rollout processes of one sync, outside both
    sides' ``torch.distributed`` worlds (the trainer's is Megatron's, the rollout workers' their
    own), with the collectives the backend uses: ``pg`` over every rank (votes, the reshard's
    all-to-alls) and ``fan`` over trainer rank 0 and the rollout ranks (the broadcast: the other
    trainer ranks neither send nor receive there). ``store``: rank 0's store, already listening
    at ``host:port`` (:func:`open_store`); None: this rank opens its own at ``host:port`` (the
    server on rank 0, a client elsewhere)."""

    def __init__(self, host: str, port: int, rank: int, world: int, trainer_world: int, timeout_s: float,
                 store=None):
        import torch.distributed as dist
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world = rank, world
        self._store = store if store is not None else dist.TCPStore(host, port, world, rank == 0, timeout=timeout)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{BACKEND}/all/", self._store), rank, world, timeout)
        fan = [0] + list(range(trainer_world, world))
        self.fan = None
        if rank in fan:
            self.fan = dist.ProcessGroupGloo(dist.PrefixStore(f"{BACKEND}/fan/", self._store), fan.index(rank),
                                             len(fan), timeout)

    def broadcast(self, tensor) -> None:
        """From trainer rank 0 to every rollout rank (members of ``fan`` only)."""
        import torch.distributed as dist
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.fan.broadcast([tensor], opts).wait()

    def broadcast_object(self, obj: Any) -> Any:
        size = torch.zeros(1, dtype=torch.int64)
        data = None
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size[0] = data.numel()
        self.broadcast(size)
        if self.rank != 0:
            data = torch.empty(int(size[0]), dtype=torch.uint8)
        self.broadcast(data)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def all_gather_object(self, obj: Any) -> list:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self.pg.allgather([sizes], [torch.tensor([data.numel()], dtype=torch.int64)]).wait()
        longest = max(int(s[0]) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:data.numel()] = data
        outs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world)]
        self.pg.allgather([outs], [padded]).wait()
        return [pickle.loads(o[:int(s[0])].numpy().tobytes()) for o, s in zip(outs, sizes)]

    def exchange(self, recv, send, *, output_split_sizes, input_split_sizes, group=None):
        """The executor's exchange contract (``executor.all_to_all_exchange``) on this group."""
        import torch.distributed as dist
        return self.pg.alltoall_base(recv, send, list(output_split_sizes), list(input_split_sizes),
                                     dist.AllToAllOptions())


def open_store(host: str, timeout_s: float):
    """Trainer rank 0's store for the next group, listening now on a port the kernel picks
    (``store.port``; torch's server listens on every interface, ``host`` is where this rank's own
    client reaches it: the address the other ranks are given).

    Why here and not at ``init_process_group``: the port is published by ``prepare`` and the
    store starts only after every rank's ``prepare`` and ``build_topology``; a port merely found
    free at ``prepare`` can be taken by any other bind meanwhile -- gloo's own connections
    included -- and the store then fails with EADDRINUSE on every rank. A store that listens
    from the start holds its port until the group is done. It does not wait for the other ranks
    (no world size): the gloo groups built over it do."""
    import torch.distributed as dist
    return dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _node_address() -> str:
    try:
        import ray
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 -- no Ray: a single-node run
        return "127.0.0.1"


# -- the trainer side's input --------------------------------------------------------------------

@dataclass
class TrainingSource:
    """What the trainer side reads: the Megatron model chunks (this rank's local expert shards),
    their ``TransformerConfig``, the engine's full HF export, and, where the engine can produce
    it, an HF export of the dense tensors only (both callables: they are collective over the
    trainer ranks, so they run only once every rank has decided which path to take).

    ``from_engine`` reads it from verl 0.9.1's ``MegatronEngine`` (``module``, ``tf_config``,
    ``get_per_tensor_param``; ``dense`` from its Megatron-Bridge, :func:`bridge_dense_export`)."""
    chunks: list
    config: Any
    export: Callable[[], Iterator[tuple[str, Any]]]
    dense: Callable[[], Iterator[tuple[str, Any]]] | None = None

    # what ``from_engine`` reads; verl 0.9.1's MindSpeed engine (the one an NPU gets) inherits all
    # three from MegatronEngine unchanged (test_hooks.py reads that in verl's source)
    ENGINE_ATTRIBUTES = ("module", "tf_config", "get_per_tensor_param")

    @classmethod
    def from_engine(cls, engine) -> "TrainingSource":
        for attr in cls.ENGINE_ATTRIBUTES:
            if not hasattr(engine, attr):
                raise PlanError(f"the training engine {type(engine).__name__} has no {attr} (the reshard reads "
                                "a Megatron engine's local expert shards)")

        def export():
            weights, _peft = engine.get_per_tensor_param()
            return weights
        return cls(list(engine.module), engine.tf_config, export, bridge_dense_export(engine))

    def dense_tensors(self) -> Iterator[tuple[str, Any]]:
        """The dense (non-routed-expert) HF tensors: the bridge's dense-only export where there is
        one, else the full export with its expert tensors skipped."""
        return self.dense() if self.dense is not None else dense_only(self.export())


def is_routed_expert_param(megatron_name: str) -> bool:
    """A Megatron-Core parameter of the routed experts (SequentialMLP ``local_experts.<i>.*``,
    (TE)GroupedMLP ``weight<N>`` / ``weight1`` / ``weight2``); shared experts are dense."""
    return ".mlp.experts." in megatron_name


def bridge_dense_export(engine, full_export: Callable[[], Iterator[tuple[str, Any]]] | None = None
                        ) -> Callable[[], Iterator[tuple[str, Any]]] | None:
    """The dense tensors of a Megatron-Bridge ``MegatronEngine``, exported by the bridge itself
    (``export_hf_weights`` with the engine's own conversion tasks less the routed experts'),
    or None where the engine does not export through Megatron-Bridge's tasks (the legacy
    ``vanilla_mbridge``, LoRA, QAT, FP8 export: then the full export is filtered instead).

    Why not the full export: Megatron-Bridge gathers every expert over EP inside the trainer
    while exporting, which the reshard exists to avoid, and Megatron-Bridge 0.3.1's gather
    fails for ``SequentialMLP`` at EP > 1 (it parses TEGroupedMLP's ``weight<N>`` names: README,
    "Megatron-Bridge on CPU"); the bridge's tasks for ``GroupedMLP``'s ``weight1`` / ``weight2``
    are None (no mapping) and are skipped like the expert tasks. ``full_export``: the engine's
    full export for the FP8 case (default ``engine.get_per_tensor_param()``; the colocated path
    passes the unpatched one)."""
    bridge = getattr(engine, "bridge", None)
    if (bridge is None or not hasattr(bridge, "export_hf_weights") or not hasattr(engine, "_mbridge_export_tasks")
            or getattr(engine, "vanilla_bridge", False) or getattr(engine, "peft_cls", None) is not None
            or getattr(engine, "_qat_enabled", False)):
        return None

    def dense():
        from verl.utils.megatron_utils import load_megatron_model_to_gpu
        tasks = engine._mbridge_export_tasks()
        if tasks is None:                     # FP8 export: the bridge plans its own tasks
            return dense_only(full_export() if full_export is not None else engine.get_per_tensor_param()[0])
        load_megatron_model_to_gpu(engine.module, load_grad=False)   # as get_per_tensor_param does
        kept = [t for t in tasks if t is not None and not is_routed_expert_param(t.global_param_name)]
        return bridge.export_hf_weights(engine.module, conversion_tasks=kept)
    return dense


def dense_only(weights) -> Iterator[tuple[str, Any]]:
    """The export without its routed-expert tensors (HF expert names), which the reshard moves."""
    for name, tensor in weights:
        if parse_hf_expert_name(name) is None:
            yield name, tensor


@dataclass(frozen=True)
class TrainerVote:
    """What a trainer rank tells the group: the expert geometry and training layout (every
    trainer rank must agree), the experts' dtype (the receivers allocate with it)."""
    shape: MoEShape
    training: TrainingLayout
    dtype: str


@dataclass(frozen=True)
class RolloutVote:
    """What a rollout rank tells the group: the experts it hosts, in local-slot order."""
    expert_map: tuple[int, ...]


def trainer_setup(source: TrainingSource, link_rank: int):
    """This trainer rank's vote payload and local expert parameters (raises PlanError with the
    reason it cannot take part)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from verl.utils.megatron_utils import unwrap_model

    from .hooks_verl06 import expert_impl_of, local_expert_params, moe_layers
    cfg = source.config
    if not getattr(cfg, "num_moe_experts", None):
        raise PlanError("the training model has no routed experts")
    impl = expert_impl_of(unwrap_model(source.chunks[0]))
    if impl is None:
        raise PlanError("no SequentialMLP / GroupedMLP / TEGroupedMLP experts in the training model")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != link_rank:
        raise PlanError(f"trainer rank {rank} is rank {link_rank} of the checkpoint engine's group (the planner "
                        "needs trainer rank r at group rank r)")
    params = local_expert_params(source.chunks, cfg)
    dtypes = sorted({str(t.dtype) for t in params.values()})
    if len(dtypes) != 1:
        raise PlanError(f"expert parameters must share one dtype (got {dtypes})")
    shape = MoEShape(num_layers=cfg.num_layers, num_experts=cfg.num_moe_experts, hidden=cfg.hidden_size,
                     ffn_hidden=cfg.moe_ffn_hidden_size, moe_layers=moe_layers(cfg),
                     dtype_bytes=next(iter(params.values())).element_size())
    training = TrainingLayout(
        tp=mpu.get_tensor_model_parallel_world_size(), pp=mpu.get_pipeline_model_parallel_world_size(),
        ep=mpu.get_expert_model_parallel_world_size(), etp=mpu.get_expert_tensor_parallel_world_size(),
        cp=mpu.get_context_parallel_world_size(), vpp=len(source.chunks), expert_impl=impl).with_world(world)
    coords = training.coords(rank)
    actual = {"tp": mpu.get_tensor_model_parallel_rank(), "pp": mpu.get_pipeline_model_parallel_rank(),
              "ep": mpu.get_expert_model_parallel_rank(), "etp": mpu.get_expert_tensor_parallel_rank()}
    if any(coords[k] != v for k, v in actual.items()):
        raise PlanError(f"Megatron's rank coordinates {actual} are not the planner's {coords} (a rank order "
                        "other than tp-cp-ep-dp-pp)")
    return TrainerVote(shape, training, dtypes[0].replace("torch.", "")), params


@dataclass
class Agreed:
    """The plan inputs every rank built from the gathered votes (identical on every rank)."""
    shape: MoEShape
    training: TrainingLayout
    rollout: RolloutLayout
    dtype: str


def agreed_layouts(votes: list, trainer_world: int) -> Agreed:
    """Shape and layouts from every rank of a checkpoint engine's group: the trainer ranks'
    votes, then the rollout ranks' (:func:`agreed_inputs` with the rollout after the trainers)."""
    return agreed_inputs(votes[:trainer_world], [r.expert_map for r in votes[trainer_world:]], trainer_world)


def agreed_inputs(trainers: list, maps: list, first_rank: int) -> Agreed:
    """Shape and layouts from the trainer ranks' :class:`TrainerVote` and the rollout ranks'
    expert maps, the rollout ranks starting at group rank ``first_rank`` (the trainer world in a
    checkpoint engine's group; 0 when colocated: rollout rank r is trainer rank r). Raises
    PlanError if the trainer ranks disagree. Every rank runs this on the same gathered data, so
    every rank gets the same."""
    first = trainers[0]
    if any(t != first for t in trainers):
        raise PlanError("trainer ranks disagree on the expert geometry or training layout")
    rollout = dataclasses.replace(RolloutLayout.from_expert_maps(1, len(maps), maps), first_rank=first_rank)
    rollout.check(first.shape)
    return Agreed(first.shape, first.training, rollout, first.dtype)


# -- the backend ---------------------------------------------------------------------------------

@CheckpointEngineRegistry.register(BACKEND)
class AllToAllVCheckpointEngine(CheckpointEngine):
    """verl 0.9 checkpoint engine moving MoE experts by the all-to-all-v reshard (module docstring).

    Built by verl with ``bucket_size`` (bytes), ``is_master`` (trainer rank 0; the rollout side
    passes nothing) and the :class:`Options` keys from ``engine_kwargs.ascend_rl_alltoallv``."""

    takes_training_engine = True   # read by the feature's update_weights patch
    wire_format = "named_tensors"

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs):
        if not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"{BACKEND}: bucket_size must be a positive number of bytes "
                             f"(update_weights_bucket_megabytes << 20), got {bucket_size!r}")
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.options = Options.from_kwargs(dict(engine_kwargs))
        self.fallback: CheckpointEngine | None = None
        if self.options.fallback_backend is not None:
            master = {"is_master": True} if is_master else {}   # verl's rollout side passes no is_master
            self.fallback = CheckpointEngineRegistry.new(self.options.fallback_backend, bucket_size=bucket_size,
                                                         **master, **self.options.fallback_kwargs)
        self.link: Link | None = None
        self._store = None            # trainer rank 0: the store its prepare started for the next group
        self.trainer_world = 0
        self.last: SyncReport | None = None
        # rollout side: reads the experts this rank's live engine hosts, at every sync: set by
        # whoever holds the engine (e.g. ``vllm_side.LiveRollout.expert_map``), or found at the
        # first sync inside verl's CheckpointEngineWorker (``verl09_rollout.ServerExpertMaps``);
        # None: vLLM's placement rule applied to the configuration (Options.expert_map)
        self.live_expert_map: Callable[[], Any] | None = None
        self._located = False

    # -- topology ------------------------------------------------------------------------------
    def prepare(self) -> dict:
        """Trainer rank 0 starts the group's store (:func:`open_store`) and publishes its address;
        with a fallback backend every rank also carries that backend's own ``prepare`` metadata
        (its group is built beside this one)."""
        meta = {}
        if self.is_master:
            host = self.options.master_address or _node_address()
            self._store = open_store(host, self.options.timeout_s)   # replaces one an unfinished sync left
            meta = {"host": host, "port": self._store.port}
        if self.fallback is not None:
            meta.update(fallback_backend=self.options.fallback_backend, fallback=self.fallback.prepare())
        return meta

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        """Trainer ranks ``[0, A)``, then the rollout ranks ``[A, A+R)``; everyone meets at trainer
        rank 0's address (``metadata[0]``: verl lists the trainer workers' metadata first)."""
        master = metadata[0]
        if not master.get("port"):
            raise ValueError(f"{BACKEND}: trainer rank 0 gave no group address (is_master was not set on it)")
        world = actor_wg_world_size + rollout_world_size

        def side(ranks):
            n = len(ranks)
            return {"rank": list(ranks), "world_size": [world] * n, "master_metadata": [master] * n,
                    "trainer_world_size": [actor_wg_world_size] * n}
        trainers, rollouts = side(range(actor_wg_world_size)), side(range(actor_wg_world_size, world))
        if master.get("fallback_backend"):     # the fallback backend's own topology, one kwargs dict per rank
            fallback = CheckpointEngineRegistry.get(master["fallback_backend"])
            f_trainers, f_rollouts = fallback.build_topology(actor_wg_world_size, rollout_world_size,
                                                             [m.get("fallback") for m in metadata])
            for mine, theirs, n in ((trainers, f_trainers, actor_wg_world_size),
                                    (rollouts, f_rollouts, rollout_world_size)):
                mine["fallback_kwargs"] = [{k: v[i] for k, v in theirs.items()} for i in range(n)]
        return trainers, rollouts

    def init_process_group(self, rank: int, world_size: int, master_metadata: dict, trainer_world_size: int,
                           fallback_kwargs: dict | None = None):
        """This backend's group, and the fallback backend's beside it (built every sync, as verl
        would build it: which path a sync takes is only known once every rank has voted). Rank 0
        serves the group from the store its ``prepare`` started when the address is the one it
        published (always, under verl's manager); an address chosen by whoever drives the backend
        instead (a harness without Ray) gets a store opened at it, as every other rank does."""
        port = int(master_metadata["port"])
        prepared, self._store = self._store, None
        store = prepared if rank == 0 and prepared is not None and prepared.port == port else None
        self.link = Link(master_metadata["host"], port, rank, world_size, trainer_world_size,
                         self.options.timeout_s, store=store)
        self.trainer_world = trainer_world_size
        if self.fallback is not None:
            self.fallback.init_process_group(**(fallback_kwargs or {}))

    def finalize(self):
        self.link, self._store = None, None
        if self.fallback is not None:
            self.fallback.finalize()

    # -- the sync ------------------------------------------------------------------------------
    async def send_weights(self, weights, global_steps: int | None = None):
        """Trainer side. ``weights``: the training engine (handed by the feature's patch) or a
        :class:`TrainingSource`; anything else (verl's stock hand-off: the bridge's HF export)
        takes the fallback on every rank, with the reason."""
        if self.link is None:
            raise RuntimeError(f"{BACKEND}: send_weights before init_process_group")
        source, why = _source_of(weights)
        params, vote = {}, None
        if source is not None:
            got, why = agreement.attempt("setup", trainer_setup, source, self.link.rank)
            if got is not None:
                vote, params = got
        report = SyncReport()
        for _ in self._sync(vote, why, params, report):
            pass                                       # trainer ranks receive nothing
        fallback_export = source.export if source is not None else (lambda: weights)
        self.last = report
        if not report.resharded and self.fallback is not None:   # every rank: the user's backend, whole
            return await self.fallback.send_weights(fallback_export(), global_steps=global_steps)
        self._dense(source.dense_tensors if report.resharded else fallback_export, report)
        return {}

    def receive_weights(self, global_steps: int | None = None):
        """Rollout side: this rank's hosted experts (reshard) or nothing yet (own fallback), then
        every broadcast tensor, as a plain generator (verl's server adapter accepts one); with a
        fallback backend and a refusal anywhere, that backend's own ``receive_weights`` instead.
        The votes run here, before returning (they decide which of the two is returned)."""
        if self.link is None:
            raise RuntimeError(f"{BACKEND}: receive_weights before init_process_group")
        report = SyncReport()
        experts = self._sync(None, "", {}, report)
        first = next(experts, None)
        if not report.resharded and self.fallback is not None:
            self.last = report
            return self.fallback.receive_weights(global_steps=global_steps)
        return self._received(first, experts, report)

    def _received(self, first, experts, report: "SyncReport"):
        if first is not None:
            yield first
            yield from experts
        yield from self._dense(None, report)
        self.last = report

    def _sync(self, vote: TrainerVote | None, why: str, params: dict, report: "SyncReport"):
        """Both sides: the votes, the plan, the experts (module docstring, steps 1-3)."""
        from . import MODE, bucket_bytes
        from .executor import prepare_reshard
        link = self.link
        trainer = link.rank < self.trainer_world
        # round 1: can every rank take part? (the trainer ranks also say what they train); round 2:
        # the rollout ranks' expert maps, for which they need the expert count from round 1
        first = agreement.decide(agreement.Vote(why, payload=vote if trainer else None), gather=link.all_gather_object)
        reason, agreed = first.reason, None
        if not reason:
            mine = vote
            if not trainer:
                mine, why = agreement.attempt("expert map", self._rollout_vote,
                                              first.votes[0].payload.shape.num_experts, report)
            second = agreement.decide(agreement.Vote(why, payload=mine), gather=link.all_gather_object)
            reason = second.reason
            if not reason:   # built from gathered data: the same answer (or reason) on every rank
                agreed, reason = agreement.attempt("layouts", agreed_layouts, [v.payload for v in second.votes],
                                                   self.trainer_world)
        prepared = None
        if not reason:
            dtype = getattr(torch, agreed.dtype)
            prepared, why = agreement.attempt(
                "plan", lambda: prepare_reshard(params, shape=agreed.shape, training=agreed.training,
                                                rollout=agreed.rollout, bucket_bytes=bucket_bytes(),
                                                rank=link.rank, dtype=dtype, device="cpu", exchange=link.exchange))
            reason = agreement.decide(agreement.Vote(why, prepared.key if prepared else ""),
                                      gather=link.all_gather_object).reason
        if reason:
            report.reason = reason
            if MODE.value == "on":
                raise RuntimeError(f"ASCEND_RL_MOE_RESHARD=on but the expert reshard cannot run: {reason}")
            from ...patching.fallback import fall_back
            to = (f"checkpoint-engine backend {self.options.fallback_backend!r} (fallback_backend): the whole export"
                  if self.fallback is not None else f"{BACKEND}: the whole export broadcast from trainer rank 0")
            fall_back("moe_reshard", to, reason)
            return
        report.resharded, report.plan_key, report.plan_cached = True, prepared.key, prepared.cached
        for name, tensor in prepared.stream():
            report.experts.append(name)
            yield name, tensor

    def _rollout_vote(self, num_experts: int, report: "SyncReport") -> RolloutVote:
        """The experts this rollout rank hosts, read now: from the live engine (EPLB may have
        moved experts since the last sync; a plan keyed on a stale map would load experts into
        the wrong slots, verl #7086) -- a reader its holder attached, else, in a verl deployment,
        its vLLM worker through the node's server -- or, where ``expert_maps`` says so or no
        live engine exists outside a deployment, vLLM's placement rule for the configured replica."""
        rank = self.link.rank - self.trainer_world
        report.config_map = tuple(self.options.expert_map(rank, num_experts))
        reader = self._live_reader()
        if reader is None:
            report.map_source, hosted = "config", report.config_map
        else:
            report.map_source, hosted = "live", tuple(int(e) for e in reader())
            if not hosted or len(set(hosted)) != len(hosted) or not all(0 <= e < num_experts for e in hosted):
                raise PlanError(f"the live engine's expert map {list(hosted)} is not a set of distinct expert ids "
                                f"in [0, {num_experts})")
        report.expert_map = hosted
        return RolloutVote(hosted)

    def _live_reader(self) -> Callable[[], Any] | None:
        """The attached reader, or the deployment's (located once), or None for the rule."""
        mode = self.options.expert_maps
        if mode == "config":
            return None
        if self.live_expert_map is None and not self._located:
            from .verl09_rollout import ServerExpertMaps
            self.live_expert_map = ServerExpertMaps.locate()    # PlanError in an actor no server lists
            self._located = True
        if self.live_expert_map is None and mode == "live":
            raise PlanError(f"engine_kwargs.{BACKEND}.expert_maps=live but no live engine is reachable (no reader "
                            "attached, not inside verl's CheckpointEngineWorker)")
        return self.live_expert_map

    def _dense(self, weights: Callable[[], Iterator] | None, report: "SyncReport"):
        """Broadcast from trainer rank 0 in buckets: every trainer rank runs the export (it is
        collective among them), rank 0 sends; the rollout ranks yield what arrives."""
        link = self.link
        if link.rank < self.trainer_world:
            bucket, size = [], 0
            for name, tensor in weights():
                if link.rank != 0:
                    continue
                t = tensor.detach().to("cpu").contiguous()
                if bucket and size + t.nbytes > self.bucket_size:
                    self._send_bucket(bucket)
                    bucket, size = [], 0
                bucket.append((name, t))
                size += t.nbytes
            if link.rank == 0:
                if bucket:
                    self._send_bucket(bucket)
                link.broadcast_object(None)
            return iter(())
        return self._receive_buckets(report)

    def _send_bucket(self, bucket: list) -> None:
        metas = [(name, tuple(t.shape), str(t.dtype).replace("torch.", ""), t.nbytes) for name, t in bucket]
        self.link.broadcast_object(metas)
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])
        self.link.broadcast(flat)

    def _receive_buckets(self, report: "SyncReport"):
        while True:
            metas = self.link.broadcast_object(None)
            if metas is None:
                return
            flat = torch.empty(sum(m[3] for m in metas), dtype=torch.uint8)
            self.link.broadcast(flat)
            off = 0
            for name, shape, dtype, nbytes in metas:
                report.broadcast.append(name)
                yield name, flat[off:off + nbytes].view(getattr(torch, dtype)).view(shape)
                off += nbytes


@dataclass
class SyncReport:
    """What the last sync did on this rank (tests and logs read it): whether the experts were
    resharded (else ``reason``), the plan's key and whether it came from the cache, the expert
    tensors received from the reshard and the tensors received by broadcast, by name; on rollout
    ranks, where the expert map came from."""
    resharded: bool = False
    reason: str = ""
    plan_key: str = ""
    plan_cached: bool = False
    experts: list = dataclasses.field(default_factory=list)
    broadcast: list = dataclasses.field(default_factory=list)
    map_source: str = ""             # rollout ranks: "live" (read from the engine) or "config" (placement rule)
    expert_map: tuple = ()           # rollout ranks: the experts this rank voted it hosts
    config_map: tuple = ()           # rollout ranks: what the placement rule says it hosts


def _source_of(weights) -> tuple[TrainingSource | None, str]:
    if isinstance(weights, TrainingSource):
        return weights, ""
    if hasattr(weights, "get_per_tensor_param") and hasattr(weights, "module"):
        src, why = agreement.attempt("training engine", TrainingSource.from_engine, weights)
        return src, why
    return None, ("verl handed the backend an HF export (experts already gathered), not the training engine: "
                  "the moe_reshard.hand_training_engine patch is not applied (ASCEND_RL_MOE_RESHARD=off?)")


__all__ = ["AllToAllVCheckpointEngine", "BACKEND", "Options", "TrainingSource", "SyncReport", "bridge_dense_export",
           "dense_only", "fallback_backends", "is_routed_expert_param"]
