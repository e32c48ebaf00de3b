"""verl 0.9.1's real ``MegatronEngine`` exporting through the ``ascend_rl_alltoallv`` backend (run
by test_verl09_mcore_engine.py in child processes; never imported by pytest for its work).

Processes: 4 trainer ranks (one gloo group) each holding verl 0.9.1's ``MegatronEngineWithLMHead``,
built and initialized by verl from the HF checkpoint ``W`` through Megatron-Bridge 0.3.1
(Megatron-Core 0.16.1 local layers, SequentialMLP or legacy GroupedMLP, bf16; tests/support/verl_megatron_engine.py
says what is configured for CPU and which test shims it needs), and 2 rollout ranks (one EP 2
replica, vLLM's linear placement: rank 0 hosts experts 0-1, rank 1 experts 2-3) receiving what
the backend yields, without a vLLM engine. Both sides build the backend through verl's
``CheckpointEngineRegistry`` and take their ranks from its ``build_topology``
(verl09_scenario.py); the trainer hands the engine itself to ``send_weights``, as the feature's
``hand_training_engine`` patch does.

Four training layouts, one after the other in the same processes (Megatron's imports and the
rollout processes paid once; each layout its own engine, backend and port): ``LAYOUTS`` --
SequentialMLP at TP 1 / EP 2 / ETP 2 (experts split over expert-TP while the dense layers are
whole) and TP 2 / EP 2 / ETP 1 (the dense layers split, row- and column-parallel, with sequence
parallelism; experts whole); legacy GroupedMLP (``weight1`` / ``weight2``) at TP 1 / EP 2 /
ETP 1 (two expert data-parallel copies of every expert) and TP 1 / EP 2 / ETP 2. Row-parallel
weights at TP or ETP 2 load right only with the harness's ``gloo_strided_scatter`` shim
(tests/support/megatron_shims.py, 8): torch's gloo scatter ignores the strides of the column
blocks Megatron-Bridge scatters on CPU.

``W``: the tiny Qwen3-MoE (4 experts, 4 query heads over 2 KV groups). Megatron-Bridge 0.3.1
does not load the routed experts right: SequentialMLP experts at EP > 1 wrongly (README,
upstream failure (a')), GroupedMLP's not at all (no mapping for ``weight1`` / ``weight2``: its
load fails, (b); ``verl_megatron_engine`` skips them with a test shim). After ``initialize()``
every trainer rank records what the bridge did and puts its shard of the right HF experts in
(``load_global_experts``, through the CPU harness's own Megatron-layout mapping, which the
harness tests check against Megatron-Core's forward); everything else in the model is the
bridge's load. Every tensor a rollout rank receives is compared bit for bit with ``W``'s.

Colocated (verl's ``naive`` sync, ``colocated_export``): after a layout's backend syncs, every
trainer rank calls the same engine's ``get_per_tensor_param`` as verl's naive ``update_weights``
does, inside the colocated scope the worker patch opens there, with ``moe_reshard.colocated_export``
applied, for the rollout configuration ``COLOCATED`` gives that layout (twice, then with rank
``REFUSING_RANK`` alone refusing); no new process or engine.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass

from .verl09_engine_scenario import TrainerSync, send_syncs
from .verl09_scenario import _engine

TRAINERS, ROLLOUTS = 4, 2
NUM_EXPERTS = 4
MODEL = dict(moe=True, num_experts=NUM_EXPERTS, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
SYNCS = ("first", "again")
EXPERT_CLASSES = {"sequential": "SequentialMLP", "grouped": "GroupedMLP"}   # moe= value -> Megatron-Core module


@dataclass(frozen=True)
class EngineLayout:
    """One training configuration of the engine: expert module and parallel sizes."""
    moe: str                        # "sequential" or "grouped" (tests/support/megatron.EXPERT_IMPLS)
    tp: int
    ep: int
    etp: int

    @property
    def sizes(self) -> dict:
        return dict(tp=self.tp, ep=self.ep, etp=self.etp)


LAYOUTS = {"tp1-ep2-etp2": EngineLayout("sequential", tp=1, ep=2, etp=2),
           "tp2-ep2-etp1": EngineLayout("sequential", tp=2, ep=2, etp=1),
           "grouped-tp1-ep2-etp1": EngineLayout("grouped", tp=1, ep=2, etp=1),
           "grouped-tp1-ep2-etp2": EngineLayout("grouped", tp=1, ep=2, etp=2)}
# colocated (verl's 'naive' sync, trainer rank r feeding rollout rank r % W of replica r // W): per
# training layout, the rollout replica's configuration (verl's actor_rollout_ref.rollout keys)
COLOCATED = {"tp1-ep2-etp2": dict(tensor_model_parallel_size=2, expert_parallel_size=2,
                                  engine_kwargs={"vllm": {"expert_placement_strategy": "round_robin"}}),
             "tp2-ep2-etp1": dict(tensor_model_parallel_size=4, expert_parallel_size=4),
             "grouped-tp1-ep2-etp1": dict(tensor_model_parallel_size=1),        # no EP: every rank hosts every expert
             "grouped-tp1-ep2-etp2": dict(tensor_model_parallel_size=2, data_parallel_size=2, expert_parallel_size=4,
                                          engine_kwargs={"vllm": {"expert_placement_strategy": "round_robin"}})}
COLOCATED_SYNCS = ("colocated", "colocated_again", "one_refuses")
REFUSING_RANK = 2       # in "one_refuses": its rollout config turns on vLLM EPLB, which the colocated reshard refuses


@dataclass
class ColocatedExport:
    """One colocated export on one trainer rank, as verl's naive path calls it (inside the scope
    the worker patch opens): what the patch decided and what the stream yielded."""
    resharded: bool
    reason: str
    plan_key: str
    plan_cached: bool
    expert_map: list                # what this rank's co-located vLLM worker hosts
    received: list                  # tensor names, in yield order
    different: list                 # yielded tensors not bit-identical to the checkpoint's
    experts: list                   # [layer, expert, projection] yielded, in order
    outcome: str                    # "ok", or the exception consuming the stream raised
    warnings: list                  # WARNING lines the plugin logged during the export


@dataclass
class LayoutRun:
    """One training layout on one trainer rank: the engine verl built, what the bridge loaded,
    the syncs it sent."""
    engine: str                     # the MegatronEngine class verl built
    experts: list                   # expert module classes in the model
    sizes: dict                     # tp / ep / etp as Megatron's parallel_state has them
    bridge_loaded_experts: list     # [name, global expert, loaded right by the bridge] (SequentialMLP)
    syncs: dict[str, TrainerSync]
    stock_export: str               # what verl's stock export of the same engine gave
    grouped: GroupedUpstream | None  # GroupedMLP layouts: what Megatron-Bridge / verl do with weight1/weight2
    colocated: dict[str, ColocatedExport]   # by COLOCATED_SYNCS


@dataclass
class GroupedUpstream:
    """Upstream failure (b) observed on a GroupedMLP engine (README): which expert parameters
    Megatron-Bridge's mapping registry has no mapping for, what its stock load of the checkpoint
    into this model (verl's ``load_hf_weights`` call, without the test shim) and verl's shard
    export (``get_per_tensor_param_shard``, the ``delta_sharded`` backend's input) gave."""
    expert_params: list             # the model's routed-expert parameter names (global)
    unmapped: list                  # those the bridge's registry maps to no HF tensor
    stock_load: str
    shard_export: str


@dataclass
class MegatronTrainer:
    rank: int
    layouts: dict[str, LayoutRun]


@dataclass
class ReceivedSync(TrainerSync):
    """One sync as a rollout rank received it."""
    expert_map: list
    received: list                  # tensor names, in arrival order
    different: list                 # received tensors not bit-identical to the checkpoint's
    experts: list                   # global experts received (sorted, unique)
    from_reshard: int
    from_broadcast: int


@dataclass
class RolloutReceipt:
    rank: int
    checkpoint: list                # every tensor name in the checkpoint
    layouts: dict[str, dict[str, ReceivedSync]]   # by training layout, then sync


def prepare() -> str:
    from ascend_rl_plugins.devtools import tiny_qwen3
    return tiny_qwen3.cached(**MODEL)


def load_global_experts(megatron, hf_dir: str, moe: str) -> list:
    """This rank's shard of the right HF experts put into the model's expert parameters --
    what a model trained from ``W`` holds -- through the CPU harness's mapping
    (``Harness.local_expert_view``: SequentialMLP fc1 the ETP rank's ``[gate_r; up_r]`` rows,
    fc2 its columns of down; GroupedMLP ``weight1`` / ``weight2`` the local experts' transposed
    shards in Megatron-Core's memory layout). Returns, per SequentialMLP parameter, ``[name,
    global expert, whether the bridge had loaded it right]`` (GroupedMLP: none, the bridge
    loads nothing into ``weight1`` / ``weight2``)."""
    import torch
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file
    from verl.utils.megatron_utils import unwrap_model

    from tests.support.megatron import Arch, Harness, Layout

    from ascend_rl_plugins.features.moe_reshard.layout import hf_expert_name
    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    model = unwrap_model(megatron.module[0])
    cfg = model.config
    canonical = {}
    for layer in range(cfg.num_layers):
        for e in range(cfg.num_moe_experts):
            p = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}."
            canonical[p + "linear_fc1.weight"] = torch.cat([hf[hf_expert_name(layer, e, "gate_proj")],
                                                            hf[hf_expert_name(layer, e, "up_proj")]])
            canonical[p + "linear_fc2.weight"] = hf[hf_expert_name(layer, e, "down_proj")]
    arch = Arch(layers=cfg.num_layers, hidden=cfg.hidden_size, experts=cfg.num_moe_experts, moe=moe)
    want = Harness(model, cfg, arch, Layout()).local_expert_view(canonical)
    local = cfg.num_moe_experts // ps.get_expert_model_parallel_world_size()
    loaded = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in want:
                continue
            if ".local_experts." in name:
                e = ps.get_expert_model_parallel_rank() * local + int(name.split("local_experts.")[1].split(".")[0])
                loaded.append([name, e, bool(torch.equal(p, want[name].to(p.dtype)))])
            p.copy_(want[name])
    return loaded


def grouped_upstream(megatron, hf_dir: str) -> GroupedUpstream:
    """Upstream failure (b) on this GroupedMLP engine (see :class:`GroupedUpstream`); run before
    the experts are put in (the stock load stops at the first unmapped parameter, having loaded
    the checkpoint's own values before it)."""
    from verl.utils.megatron_utils import unwrap_model
    registry = megatron.bridge._model_bridge.mapping_registry()
    names = [n for n, _ in unwrap_model(megatron.module[0]).named_parameters() if ".mlp.experts." in n]

    def outcome(call) -> str:
        try:
            return f"ok: {call()}"
        except Exception as e:  # noqa: BLE001 -- the outcome is what the test pins
            return f"{type(e).__name__}: {e}"
    return GroupedUpstream(
        names, [n for n in names if registry.megatron_to_hf_lookup(n) is None],
        outcome(lambda: megatron.bridge.load_hf_weights(megatron.module, hf_dir, allowed_mismatched_params=[]) and ""),
        outcome(lambda: f"{len(list(megatron.get_per_tensor_param_shard()[0]))} tensors"))


def trainer(ports: list, hf_dir: str) -> dict:
    """Every layout of ``LAYOUTS`` in turn (``ports``: one per layout, for its backend)."""
    import faulthandler
    import sys

    import torch.distributed as dist
    faulthandler.dump_traceback_later(600, exit=True, file=sys.stderr)  # a hang shows where

    from megatron.core import parallel_state as ps

    from tests.support.megatron import Layout, parallel_groups
    from tests.support.verl_megatron_engine import megatron_engine
    rank = dist.get_rank()
    runs = {}
    for (name, layout), port in zip(LAYOUTS.items(), ports):
        with parallel_groups(Layout(**layout.sizes)):
            megatron = megatron_engine(hf_dir, moe=layout.moe, **layout.sizes)
            experts = sorted({type(m).__name__ for m in megatron.module[0].modules()
                              if type(m).__name__ in ("SequentialMLP", "GroupedMLP", "TEGroupedMLP")})
            sizes = dict(tp=ps.get_tensor_model_parallel_world_size(), ep=ps.get_expert_model_parallel_world_size(),
                         etp=ps.get_expert_tensor_parallel_world_size())
            grouped = grouped_upstream(megatron, hf_dir) if layout.moe == "grouped" else None
            loaded = load_global_experts(megatron, hf_dir, layout.moe)
            engine, side, _ = _engine(port, rank == 0, "linear", trainers=TRAINERS, rollouts=ROLLOUTS)
            engine.init_process_group(**{k: v[rank] for k, v in side.items()})
            syncs = send_syncs(engine, megatron, SYNCS)
            engine.finalize()
            colocated = {sync: colocated_export(megatron, hf_dir, name, sync) for sync in COLOCATED_SYNCS}
            try:   # verl's stock export of the same engine (upstream failure (a) in the README)
                stock = f"{len(list(megatron.get_per_tensor_param()[0]))} tensors"
            except Exception as e:  # noqa: BLE001 -- the outcome is what the test pins
                stock = f"{type(e).__name__}: {e}"
            runs[name] = LayoutRun(type(megatron).__name__, experts, sizes, loaded, syncs, stock, grouped, colocated)
            del megatron, engine
    return asdict(MegatronTrainer(rank, runs))


def colocated_export(megatron, hf_dir: str, layout: str, sync: str) -> dict:
    """``megatron.get_per_tensor_param`` called as verl 0.9.1's naive ``update_weights`` calls it,
    inside the scope the feature's worker patch opens there, with the ``moe_reshard.colocated_export``
    patch applied; the stream consumed whole (as verl's adapter does) and checked against ``W``."""
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from safetensors.torch import load_file

    from ascend_rl_plugins.features import moe_reshard
    from ascend_rl_plugins.features.moe_reshard import verl09_colocated
    from ascend_rl_plugins.features.moe_reshard.layout import parse_hf_expert_name
    from ascend_rl_plugins.patching import REGISTRY, fallback
    fallback.forget()           # each export's WARNING is recorded, not only the process's first
    patch = next(p for p in moe_reshard.FEATURE.patches if p.name == "moe_reshard.colocated_export")
    if patch.outcome.state != "applied":
        REGISTRY.apply(patch)
    rank = dist.get_rank()
    config = {"name": "vllm", "data_parallel_size": 1, "pipeline_model_parallel_size": 1, **COLOCATED[layout]}
    if sync == "one_refuses" and rank == REFUSING_RANK:
        config["engine_kwargs"] = {"vllm": dict(config.get("engine_kwargs", {}).get("vllm", {}), enable_eplb=True)}
    width = config["tensor_model_parallel_size"] * config["data_parallel_size"]
    rollout = verl09_colocated.ColocatedRollout.from_config(OmegaConf.create(config), rank % width)
    want = load_file(os.path.join(hf_dir, "model.safetensors"))
    verl09_colocated.LAST.reset()
    names, different, experts, outcome = [], [], [], "ok"
    warnings = _Recorder()
    logging.getLogger("ascend_rl_plugins").addHandler(warnings)
    with verl09_colocated.scope(rollout):
        try:
            weights, _peft = megatron.get_per_tensor_param(layered_summon=False, base_sync_done=True)
            for name, tensor in weights:
                names.append(name)
                parsed = parse_hf_expert_name(name)
                if parsed is not None:
                    experts.append(list(parsed))
                if name not in want or not (tensor.dtype == want[name].dtype and torch.equal(tensor, want[name])):
                    different.append(name)
        except Exception as e:  # noqa: BLE001 -- the outcome is what the test checks
            outcome = f"{type(e).__name__}: {e}"
    logging.getLogger("ascend_rl_plugins").removeHandler(warnings)
    r = verl09_colocated.LAST.sync
    return asdict(ColocatedExport(r.resharded, r.reason, r.plan_key, r.plan_cached, list(r.expert_map), names,
                                  different, experts, outcome, warnings.lines))


class _Recorder(logging.Handler):
    """Keeps the WARNING lines logged while it is attached."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def rollout(ports: list, rank: int, hf_dir: str) -> dict:
    """Receives every layout's two syncs, in ``LAYOUTS``' order, as rollout rank ``rank``."""
    import faulthandler
    import sys

    import torch
    from safetensors.torch import load_file
    faulthandler.dump_traceback_later(600, exit=True, file=sys.stderr)

    from ascend_rl_plugins.features.moe_reshard.layout import parse_hf_expert_name
    want = load_file(os.path.join(hf_dir, "model.safetensors"))
    layouts = {}
    for name, port in zip(LAYOUTS, ports):
        engine, _, side = _engine(port, False, "linear", trainers=TRAINERS, rollouts=ROLLOUTS)
        engine.init_process_group(**{k: v[rank] for k, v in side.items()})
        syncs = {}
        for sync in SYNCS:
            names, different = [], []
            for tensor_name, tensor in engine.receive_weights():
                names.append(tensor_name)
                if tensor_name not in want or not (tensor.dtype == want[tensor_name].dtype
                                                   and torch.equal(tensor, want[tensor_name])):
                    different.append(tensor_name)
            r = engine.last
            syncs[sync] = ReceivedSync(
                r.resharded, r.reason, r.plan_key, r.plan_cached, expert_map=list(r.expert_map), received=names,
                different=different,
                experts=sorted({parse_hf_expert_name(n)[1] for n in names if parse_hf_expert_name(n)}),
                from_reshard=len(r.experts), from_broadcast=len(r.broadcast))
        engine.finalize()
        layouts[name] = syncs
    return asdict(RolloutReceipt(rank, sorted(want), layouts))
