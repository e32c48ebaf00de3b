"""verl 0.9.1 checkpoint-engine backend ``ascend_rl_alltoallv`` between real Megatron-Core trainer
processes and rollout processes (run by test_verl09_backend.py in child processes; the test
imports only its records).

Two process groups, as in verl 0.9.1: the trainer's (4 gloo ranks: Megatron-Core 0.16.1's
``parallel_state`` and a real GPTModel from the CPU harness, local layers, SequentialMLP or
GroupedMLP experts, EP 2 with ETP 2 or ETP 1) and the rollout's (2 ranks, as verl's
``CheckpointEngineWorker`` processes: nothing but the backend). Each side builds the backend
through verl's real ``CheckpointEngineRegistry`` (the module ``custom_backend_module`` would
name, imported by ``verl.utils.import_utils.import_external_libs`` as verl does), takes its
ranks from the backend's ``build_topology`` and joins the backend's own group. The steps
verl's ``CheckpointEngineManager`` runs over Ray (prepare / topology / send + receive /
finalize) are run here by the two sides' scenarios in the same order, without Ray.

What the trainer sends: the backend reads this rank's local expert shards from the Megatron
model; "the engine's export" is the stock path's output, stood in for by the full HF tensors of
the harness's canonical weights (Megatron-Bridge's ``export_hf_weights``, which verl 0.9.1's
MegatronEngine calls, cannot be installed here: it imports TransformerEngine): dense tensors
under their Megatron names, experts under their HF names, gathered, as the bridge yields them.

Cases, in order, on both sides: ``reshard`` (then ``again``: the plan comes from the cache),
``stock_handoff`` (verl's own hand-off without the feature's patch: the HF export, which the
backend refuses -> the fallback on every rank), ``trainer_refuses`` (trainer rank 2 of 4 cannot
read its model: every rank falls back), ``rollout_refuses`` (the second rollout rank cannot
produce its expert map: every rank falls back), ``after`` (a reshard again). Then, with a second
engine configured with ``fallback_backend`` (the user's own backend: ``test_gloo_broadcast``, a
real subclass of verl's ``CheckpointEngine`` registered through verl's registry, defined below --
every backend verl 0.9.1 ships needs CUDA / cupy, torch_npu, NIXL, Mooncake or the kimi engine,
or, for ``naive``, trainer and rollout in one process): ``delegated_reshard`` (the reshard runs;
the fallback's group is built and unused) and ``delegated_refuses`` (trainer rank 2 of 4 refuses:
every rank hands the whole sync to the fallback backend).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass

ARCH = dict(layers=2, hidden=64, moe_ffn_hidden=32, heads=4, query_groups=2, kv_channels=16, vocab=64, seq_len=8,
            experts=4)
CASES = ("reshard", "again", "stock_handoff", "trainer_refuses", "rollout_refuses", "after")
DELEGATED = ("delegated_reshard", "delegated_refuses")
FALLBACK = "test_gloo_broadcast"
TRAINERS, ROLLOUTS = 4, 2
BUCKET = 1 << 14        # 16 KiB buckets: several broadcast buckets and all-to-all rounds per sync


class _Log(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _engine(port: int, is_master: bool, placement: str, fallback_port: int | None = None,
            trainers: int = TRAINERS, rollouts: int = ROLLOUTS):
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    from ascend_rl_plugins.features import moe_reshard
    import_external_libs(moe_reshard.BACKEND_MODULE)      # what custom_backend_module makes verl do
    kwargs = dict(replica_world_size=rollouts, expert_placement=placement, master_address="127.0.0.1")
    if fallback_port is not None:
        register_fallback_backend()
        kwargs.update(fallback_backend=FALLBACK, fallback_kwargs={"timeout_s": 600.0})
    if is_master:
        engine = CheckpointEngineRegistry.new(moe_reshard.BACKEND, is_master=True, bucket_size=BUCKET, **kwargs)
    else:
        engine = CheckpointEngineRegistry.new(moe_reshard.BACKEND, bucket_size=BUCKET, **kwargs)
    meta = engine.prepare()
    # the test's ports: both process groups must meet without Ray passing trainer rank 0's metadata
    meta.update(host="127.0.0.1", port=port)
    if fallback_port is not None:
        meta["fallback"] = {"host": "127.0.0.1", "port": fallback_port}
    trainer_side, rollout_side = type(engine).build_topology(trainers, rollouts, [meta] * (trainers + rollouts))
    return engine, trainer_side, rollout_side


def register_fallback_backend():
    """``test_gloo_broadcast``: the backend a user would otherwise have, for a CPU test -- a real
    subclass of verl's ``CheckpointEngine``, registered through ``CheckpointEngineRegistry``: one
    gloo group over every trainer and rollout rank, trainer rank 0 broadcasts the whole export (as
    verl's nccl / hccl engines do, without their device buffers). Counts what it moved."""
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
    if FALLBACK in CheckpointEngineRegistry._registry:
        return

    @CheckpointEngineRegistry.register(FALLBACK)
    class GlooBroadcastEngine(CheckpointEngine):
        def __init__(self, bucket_size: int, is_master: bool = False, timeout_s: float = 600.0):
            self.bucket_size, self.is_master, self.timeout_s = bucket_size, is_master, timeout_s
            self.pg, self.rank, self.moved = None, -1, 0

        def prepare(self):
            return {"host": "127.0.0.1", "port": 0} if self.is_master else {}

        @classmethod
        def build_topology(cls, actor_wg_world_size, rollout_world_size, metadata):
            world = actor_wg_world_size + rollout_world_size

            def side(ranks):
                return {"rank": list(ranks), "world_size": [world] * len(ranks), "master": [metadata[0]] * len(ranks)}
            return side(range(actor_wg_world_size)), side(range(actor_wg_world_size, world))

        def init_process_group(self, rank, world_size, master):
            import datetime

            import torch.distributed as dist
            timeout = datetime.timedelta(seconds=self.timeout_s)
            self._store = dist.TCPStore(master["host"], int(master["port"]), world_size, rank == 0, timeout=timeout)
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("fallback/", self._store), rank, world_size, timeout)
            self.rank = rank

        def finalize(self):
            self.pg = None

        def _broadcast(self, payload: bytes | None) -> bytes:
            import torch
            import torch.distributed as dist
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
            self.pg.broadcast([size], opts).wait()
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None else \
                torch.empty(int(size[0]), dtype=torch.uint8)
            self.pg.broadcast([data], opts).wait()
            return data.numpy().tobytes()

        async def send_weights(self, weights, global_steps=None):
            import io

            import torch
            named = [(n, t.detach().cpu().contiguous()) for n, t in weights]   # the export: every trainer rank
            payload = None
            if self.rank == 0:
                buf = io.BytesIO()
                torch.save(named, buf)
                payload = buf.getvalue()
                self.moved = len(named)
            self._broadcast(payload)
            return {"fallback_tensors": self.moved}

        async def receive_weights(self, global_steps=None):
            import io

            import torch
            named = torch.load(io.BytesIO(self._broadcast(None)))
            self.moved = len(named)
            for name, tensor in named:
                yield name, tensor

    return GlooBroadcastEngine


def _collect(weights) -> list:
    """What verl's server adapter would load: (name, tensor) pairs from a plain or async iterator."""
    if hasattr(weights, "__aiter__"):
        async def drain():
            return [(name, t.clone()) async for name, t in weights]
        return asyncio.run(drain())
    return [(name, t.clone()) for name, t in weights]


def _stock_export(arch) -> dict:
    """The full HF-style export of the canonical weights: dense by Megatron name, experts split
    into HF gate / up / down by global expert id (what a gathering export yields)."""
    from tests.support.megatron import canonical_weights

    from ascend_rl_plugins.features.moe_reshard.layout import hf_expert_name
    canonical = canonical_weights(arch, 0)
    out, i = {}, arch.moe_ffn_hidden
    for name, t in canonical.items():
        if ".mlp.experts." not in name:
            out[name] = t
    for layer in range(arch.layers):
        for e in range(arch.experts):
            p = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}."
            fc1, fc2 = canonical[p + "linear_fc1.weight"], canonical[p + "linear_fc2.weight"]
            out[hf_expert_name(layer, e, "gate_proj")] = fc1[:i].contiguous()
            out[hf_expert_name(layer, e, "up_proj")] = fc1[i:].contiguous()
            out[hf_expert_name(layer, e, "down_proj")] = fc2.contiguous()
    return out


def trainer(ports: list, moe: str, tp: int, ep: int, etp: int, placement: str) -> dict:
    import faulthandler
    import sys

    import torch.distributed as dist
    faulthandler.dump_traceback_later(600, exit=True, file=sys.stderr)  # a hang shows where

    from tests.support.megatron import megatron_model

    from ascend_rl_plugins.features.moe_reshard import verl09_backend
    from ascend_rl_plugins.patching.fallback import forget
    rank = dist.get_rank()
    handler = _Log()
    logging.getLogger("ascend_rl_plugins").addHandler(handler)
    out = {"rank": rank, "cases": {}}
    with megatron_model(tp=tp, ep=ep, etp=etp, moe=moe, **ARCH) as h:
        stock = _stock_export(h.arch)

        def export():
            return iter(list(stock.items()))
        source = verl09_backend.TrainingSource([h.model], h.config, export)
        for engine_ports, cases in (((ports[0], None), CASES), ((ports[1], ports[2]), DELEGATED)):
            engine, kwargs, _ = _engine(engine_ports[0], rank == 0, placement, engine_ports[1])
            engine.init_process_group(**{k: v[rank] for k, v in kwargs.items()})
            for case in cases:
                forget()
                handler.lines.clear()
                given = source
                if case == "stock_handoff":
                    given = export()                      # verl 0.9.1 without the patch: the HF export
                elif case in ("trainer_refuses", "delegated_refuses") and rank == 2:
                    given = verl09_backend.TrainingSource([h.model], _NoExperts(h.config), export)
                returned = asyncio.run(engine.send_weights(given))
                r = engine.last
                out["cases"][case] = {"resharded": r.resharded, "reason": r.reason, "cached": r.plan_cached,
                                      "key": r.plan_key, "log": list(handler.lines), "returned": returned,
                                      "fallback_moved": engine.fallback.moved if engine.fallback else None}
                if engine.fallback:
                    engine.fallback.moved = 0
            engine.finalize()
    return out


class _NoExperts:
    """A TransformerConfig seen without its experts (a rank that cannot read its model)."""

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        if name == "num_moe_experts":
            return None
        return getattr(self._config, name)


def rollout(ports: list, moe: str, placement: str) -> dict:
    import faulthandler
    import sys

    import torch
    faulthandler.dump_traceback_later(600, exit=True, file=sys.stderr)  # a hang shows where
    import torch.distributed as dist

    from tests.support.megatron import Arch

    from ascend_rl_plugins.features.moe_reshard.layout import RolloutLayout, parse_hf_expert_name
    from ascend_rl_plugins.patching.fallback import forget
    local = dist.get_rank()
    rank = TRAINERS + local
    handler = _Log()
    logging.getLogger("ascend_rl_plugins").addHandler(handler)
    arch = Arch(moe=moe, **ARCH)
    stock = _stock_export(arch)
    make = RolloutLayout.linear if placement == "linear" else RolloutLayout.round_robin
    hosted = list(make(ROLLOUTS, 1, arch.experts).expert_maps[local])
    out = {"rank": rank, "hosted": hosted, "cases": {}}
    for engine_ports, cases in (((ports[0], None), CASES), ((ports[1], ports[2]), DELEGATED)):
        engine, _, kwargs = _engine(engine_ports[0], False, placement, engine_ports[1])
        engine.init_process_group(**{k: v[local] for k, v in kwargs.items()})
        for case in cases:
            forget()
            handler.lines.clear()
            if case == "rollout_refuses" and local == 1:
                def broken(*_a, **_k):
                    raise RuntimeError("expert map unreadable (injected)")
                engine.options = _Options(engine.options, broken)
            got = _collect(engine.receive_weights())
            if case == "rollout_refuses" and local == 1:
                engine.options = engine.options.inner
            names = [n for n, _ in got]
            expert_ids = sorted({parse_hf_expert_name(n)[1] for n in names if parse_hf_expert_name(n)})
            r = engine.last
            out["cases"][case] = {
                "resharded": r.resharded, "reason": r.reason, "cached": r.plan_cached, "key": r.plan_key,
                "log": list(handler.lines), "names": len(names), "unique": len(set(names)),
                "expert_ids": expert_ids, "expert_names": sorted(n for n in names if parse_hf_expert_name(n)),
                "dense_names": sorted(n for n in names if not parse_hf_expert_name(n)),
                "wrong": sorted(n for n, t in got if n not in stock or t.dtype != stock[n].dtype
                                or not torch.equal(t, stock[n])),
                "from_reshard": len(r.experts), "from_broadcast": len(r.broadcast),
                "fallback_moved": engine.fallback.moved if engine.fallback else None}
            if engine.fallback:
                engine.fallback.moved = 0
        engine.finalize()
    out["stock_dense"] = sorted(n for n in stock if not parse_hf_expert_name(n))
    out["stock_experts"] = len([n for n in stock if parse_hf_expert_name(n)])
    return out


class _Options:
    """The backend's options with ``expert_map`` replaced (an injected failure on one rank)."""

    def __init__(self, inner, expert_map):
        self.inner, self.expert_map = inner, expert_map


# -- registration, configuration and the hand-off patch (one process) -----------------------------

def registry_and_handoff() -> dict:
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    from ascend_rl_plugins.features import moe_reshard
    import_external_libs(moe_reshard.BACKEND_MODULE)
    cls = CheckpointEngineRegistry.get(moe_reshard.BACKEND)
    engine = CheckpointEngineRegistry.new(moe_reshard.BACKEND, is_master=True, bucket_size=1 << 20,
                                          replica_world_size=4, expert_placement="round_robin",
                                          master_address="127.0.0.1")
    meta = engine.prepare()
    trainers, rollouts = cls.build_topology(2, 3, [meta, {}, {}, {}, {}])
    registry = {"subclass": issubclass(cls, CheckpointEngine), "takes_training_engine": cls.takes_training_engine,
                "meta_host": meta["host"], "meta_port": meta["port"], "trainer_ranks": trainers["rank"],
                "rollout_ranks": rollouts["rank"], "world": rollouts["world_size"],
                "trainer_world": trainers["trainer_world_size"],
                "same_master": trainers["master_metadata"] == [meta] * 2 and rollouts["master_metadata"] == [meta] * 3,
                "replica1_rank1_round_robin": list(engine.options.expert_map(5, 8))}
    bad = {}
    for key, kwargs in (("replica_world_size", dict(replica_world_size=0)),
                        ("expert_placement", dict(expert_placement="random")), ("unknown", dict(replica_size=2)),
                        ("fallback_backend", dict(fallback_backend="ncll")),
                        ("fallback_kwargs", dict(fallback_kwargs={"group_name": "x"})),
                        ("expert_maps", dict(expert_maps="stale")),
                        *((f"timeout_s={value!r}", dict(timeout_s=value)) for value in BAD_TIMEOUTS)):
        try:
            CheckpointEngineRegistry.new(moe_reshard.BACKEND, bucket_size=1 << 20, **kwargs)
            bad[key] = "accepted"
        except Exception as exc:  # noqa: BLE001 -- the test reads the message
            bad[key] = f"{type(exc).__name__}: {exc}"
    good = {repr(value): CheckpointEngineRegistry.new(moe_reshard.BACKEND, bucket_size=1 << 20,
                                                      timeout_s=value).options.timeout_s for value in GOOD_TIMEOUTS}
    out = {"registry": registry, "bad_kwargs": bad, "good_timeouts": good, "live_map": _live_map(engine),
           "handoff": _handoff(), "published_port": asdict(_published_port())}
    out["naive"] = _naive_scope()
    return out


BAD_TIMEOUTS = (0, 0.0, -1, float("nan"), float("inf"), 365 * 24 * 3600 + 1, "30", None, True)
GOOD_TIMEOUTS = (0.5, 30, 365 * 24 * 3600)


@dataclass
class PublishedPort:
    """Two syncs of a group of trainer rank 0 and one rollout rank; in each, between ``prepare``
    and ``init_process_group``, another socket tries to bind the port trainer rank 0 published --
    what any listener or outgoing connection on the node may do while verl's manager gathers
    every rank's metadata. Per sync: the port published, whether the other socket got it, the
    error of forming the group ("" where it formed) and what an all-gather over it returned."""
    ports: list[int]
    taken_by_other: list[bool]
    errors: list[str]
    gathered: list[list[int]]


def _published_port() -> PublishedPort:
    import concurrent.futures
    import socket

    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    from ascend_rl_plugins.features import moe_reshard
    import_external_libs(moe_reshard.BACKEND_MODULE)
    # a short group timeout: where the port was lost, rank 1 waits for the store only this long
    kwargs = dict(bucket_size=1 << 20, master_address="127.0.0.1", timeout_s=10.0)
    ranks = [CheckpointEngineRegistry.new(moe_reshard.BACKEND, is_master=True, **kwargs),
             CheckpointEngineRegistry.new(moe_reshard.BACKEND, **kwargs)]
    cls = type(ranks[0])
    out = PublishedPort([], [], [], [])
    for _sync in range(2):
        metadata = [engine.prepare() for engine in ranks]
        trainer_side, rollout_side = cls.build_topology(1, 1, metadata)
        other = socket.socket()
        try:
            other.bind(("", metadata[0]["port"]))
            other.listen()
            taken = True
        except OSError:
            taken = False
        try:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:   # both ranks join together
                joined = [pool.submit(engine.init_process_group, **{k: v[0] for k, v in side.items()})
                          for engine, side in zip(ranks, (trainer_side, rollout_side))]
                # the other socket goes once the group formed or a rank failed: rank 1, connected to
                # it where it took the port, then fails within the group timeout instead of waiting
                concurrent.futures.wait(joined, return_when=concurrent.futures.FIRST_EXCEPTION)
                other.close()
                errors = [f.exception() for f in joined]
                if not any(errors):
                    gathered = [pool.submit(e.link.all_gather_object, e.link.rank) for e in ranks]
                    out.gathered.append(gathered[0].result())
                    gathered[1].result()
        finally:
            other.close()
            for engine in ranks:
                engine.finalize()
        out.ports.append(metadata[0]["port"])
        out.taken_by_other.append(taken)
        out.errors.append("; ".join(f"rank {r}: {type(e).__name__}: {str(e).splitlines()[0]}"
                                    for r, e in enumerate(errors) if e))
    return out


def _live_map(engine) -> dict:
    """The rollout vote with a live reader attached: taken as read, or refused with the reason."""
    from types import SimpleNamespace

    from ascend_rl_plugins.features.moe_reshard import agreement, verl09_backend
    engine.link, engine.trainer_world = SimpleNamespace(rank=3), 2     # rollout rank 1 of the group
    out = {}
    for case, reader in (("none", None), ("live", lambda: [3, 0, 5]), ("repeats", lambda: (1, 1)),
                         ("out_of_range", lambda: (0, 8))):
        engine.live_expert_map = reader
        report = verl09_backend.SyncReport()
        vote, why = agreement.attempt("expert map", engine._rollout_vote, 8, report)
        out[case] = {"map": list(vote.expert_map) if vote else None, "why": why, "source": report.map_source,
                     "config": list(report.config_map)}
    # expert_maps=config: the rule even with a reader attached; =live: a refusal where no live engine
    # is reachable (no reader, not in a Ray actor)
    import dataclasses
    for mode, reader in (("config", lambda: [3, 0, 5]), ("live", None)):
        engine.options = dataclasses.replace(engine.options, expert_maps=mode)
        engine.live_expert_map, engine._located = reader, False
        report = verl09_backend.SyncReport()
        vote, why = agreement.attempt("expert map", engine._rollout_vote, 8, report)
        out[f"mode_{mode}"] = {"map": list(vote.expert_map) if vote else None, "why": why,
                               "source": report.map_source}
    engine.options = dataclasses.replace(engine.options, expert_maps="auto")
    engine.link, engine.live_expert_map = None, None
    return out


class _Engine:
    """The training engine the worker holds (what is handed over is all that is looked at)."""
    module = ()
    tf_config = None

    def get_per_tensor_param(self, **kwargs):
        return iter([("model.embed_tokens.weight", None)]), None


def _backend(takes: bool):
    class Recorder:
        """A checkpoint engine that records what verl's update_weights hands it."""
        takes_training_engine = takes

        def __init__(self):
            self.got = None

        async def send_weights(self, weights, global_steps=None):
            self.got = "engine" if isinstance(weights, _Engine) else "export"
            return {"sent": 1}
    return Recorder()


def _worker(backend, name="ascend_rl_alltoallv"):
    from types import SimpleNamespace
    return SimpleNamespace(config=SimpleNamespace(rollout=SimpleNamespace(checkpoint_engine=SimpleNamespace(
        backend=name))), actor=SimpleNamespace(engine=_Engine()), checkpoint_engine=backend)


def _handoff() -> dict:
    import verl.workers.engine_workers as workers

    from ascend_rl_plugins.features import moe_reshard
    from ascend_rl_plugins.patching import REGISTRY
    patch = next(p for p in moe_reshard.FEATURE.patches if p.name == "moe_reshard.hand_training_engine")
    out = {"at_start": patch.outcome.state}
    if patch.outcome.state == "applied":        # the plugin's autoload (verl's entry point) applied it
        REGISTRY.revert(patch)
    stock = _backend(True)
    asyncio.run(workers.ActorRolloutRefWorker.update_weights(_worker(stock)))
    out["stock"] = stock.got
    REGISTRY.apply(patch)
    try:
        out["state"] = patch.outcome.state
        taker, other = _backend(True), _backend(False)
        out["taker_returns"] = asyncio.run(workers.ActorRolloutRefWorker.update_weights(_worker(taker)))
        out["taker"] = taker.got
        asyncio.run(workers.ActorRolloutRefWorker.update_weights(_worker(other)))
        out["other"] = other.got
        # 'naive' is verl's colocated path (no checkpoint engine): the patch must not take it over
        naive = _backend(True)
        try:
            asyncio.run(workers.ActorRolloutRefWorker.update_weights(_worker(naive, "naive")))
        except Exception:  # noqa: BLE001 -- verl's own naive path needs a real rollout; it ran
            pass
        out["naive_untouched"] = naive.got is None
    finally:
        REGISTRY.revert(patch)
    again = _backend(True)
    asyncio.run(workers.ActorRolloutRefWorker.update_weights(_worker(again)))
    out["reverted"] = again.got
    return out


class _NaiveEngine:
    """The training engine of a colocated worker: records the colocated scope (if any) in force
    when verl's naive path asks it for its export, and the arguments it was asked with."""
    is_param_offload_enabled = False

    def __init__(self):
        self.seen, self.kwargs = "not called", None

    def get_per_tensor_param(self, **kwargs):
        from dataclasses import asdict

        from ascend_rl_plugins.features.moe_reshard.verl09_colocated import current
        scope = current()
        self.seen, self.kwargs = (None if scope is None else asdict(scope)), sorted(kwargs.items())
        return iter([("model.embed_tokens.weight", None)]), None


class _NaiveRollout:
    """What verl 0.9.1's naive update_weights calls on the worker's rollout (a ServerAdapter's
    ``rollout_rank``, ``resume``, ``update_weights``)."""
    rollout_rank = 1

    def __init__(self):
        self.got = None

    async def resume(self, tags):
        pass

    async def update_weights(self, weights, **kwargs):
        self.got = [name for name, _ in weights]


def _naive_worker():
    from types import SimpleNamespace

    from omegaconf import OmegaConf
    rollout = {"name": "vllm", "free_cache_engine": False, "checkpoint_engine": {"backend": "naive"},
               "tensor_model_parallel_size": 2, "data_parallel_size": 1, "pipeline_model_parallel_size": 1,
               "expert_parallel_size": 2, "engine_kwargs": {"vllm": {"expert_placement_strategy": "round_robin"}}}
    return SimpleNamespace(config=OmegaConf.create({"rollout": rollout}), actor=SimpleNamespace(engine=_NaiveEngine()),
                           rollout=_NaiveRollout(), layered_summon=False, peft_merge=False, base_sync_done=False,
                           checkpoint_engine=None)


def _naive_scope() -> dict:
    """verl 0.9.1's real ``ActorRolloutRefWorker.update_weights(mode="naive")`` on a minimal
    colocated worker (verl's CPU platform double): what scope its engine's export ran in, stock
    and with the ``hand_training_engine`` patch, and whether any scope outlives the call."""
    import verl.workers.engine_workers as workers

    from ascend_rl_plugins.features import moe_reshard
    from ascend_rl_plugins.features.moe_reshard.verl09_colocated import current
    from ascend_rl_plugins.patching import REGISTRY
    from tests.support import verl_cpu_platform
    verl_cpu_platform.install()
    patch = next(p for p in moe_reshard.FEATURE.patches if p.name == "moe_reshard.hand_training_engine")
    if patch.outcome.state == "applied":
        REGISTRY.revert(patch)
    out = {}
    for case in ("stock", "patched"):
        if case == "patched":
            REGISTRY.apply(patch)
        worker = _naive_worker()
        asyncio.run(workers.ActorRolloutRefWorker.update_weights(worker, global_steps=3))
        out[case] = {"scope": worker.actor.engine.seen, "kwargs": worker.actor.engine.kwargs,
                     "loaded": worker.rollout.got}
    REGISTRY.revert(patch)
    out["after"] = current()
    return out
