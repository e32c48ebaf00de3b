"""verl 0.9.1's real ``MegatronEngine`` exporting through the ``ascend_rl_alltoallv`` backend (run
by test_verl09_mcore_engine.py in child processes; never imported by pytest for its work).

Processes: 4 trainer ranks (one gloo group) each holding verl 0.9.1's ``MegatronEngineWithLMHead``,
built and initialized by verl from the HF checkpoint ``W`` through Megatron-Bridge 0.3.1
(Megatron-Core 0.16.1 local layers, SequentialMLP, bf16; tests/support/verl_megatron_engine.py
says what is configured for CPU and which test shims it needs), and 2 rollout ranks (one EP 2
replica, vLLM's linear placement: rank 0 hosts experts 0-1, rank 1 experts 2-3) receiving what
the backend yields, without a vLLM engine. Both sides build the backend through verl's
``CheckpointEngineRegistry`` and take their ranks from its ``build_topology``
(verl09_scenario.py); the trainer hands the engine itself to ``send_weights``, as the feature's
``hand_training_engine`` patch does.

Two training layouts, one after the other in the same processes (Megatron's imports and the
rollout processes paid once; each layout its own engine, backend and port): ``LAYOUTS`` --
TP 1 / EP 2 / ETP 2 (experts split over expert-TP while the dense layers are whole) and TP 2 /
EP 2 / ETP 1 (the dense layers split, row- and column-parallel, with sequence parallelism;
experts whole). Row-parallel weights at TP or ETP 2 load right only with the harness's
``gloo_strided_scatter`` shim (tests/support/megatron_shims.py, 8): torch's gloo scatter
ignores the strides of the column blocks Megatron-Bridge scatters on CPU.

``W``: the tiny Qwen3-MoE (4 experts, 4 query heads over 2 KV groups).
Megatron-Bridge 0.3.1 loads SequentialMLP experts wrongly at EP > 1 (README, upstream failure
(a')): after ``initialize()`` every trainer rank records what the bridge loaded and puts its
shard of the right HF experts in (``load_global_experts``); everything else in the model is the
bridge's load. Every tensor a rollout rank receives is compared bit for bit with ``W``'s.
"""

from __future__ import annotations

import os

from dataclasses import asdict, dataclass

from .verl09_engine_scenario import TrainerSync, send_syncs
from .verl09_scenario import _engine

TRAINERS, ROLLOUTS = 4, 2
LAYOUTS = {"tp1-ep2-etp2": dict(tp=1, ep=2, etp=2), "tp2-ep2-etp1": dict(tp=2, ep=2, etp=1)}
NUM_EXPERTS = 4
MODEL = dict(moe=True, num_experts=NUM_EXPERTS, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
SYNCS = ("first", "again")


@dataclass
class LayoutRun:
    """One training layout on one trainer rank: the engine verl built, what the bridge loaded,
    the syncs it sent."""
    engine: str                     # the MegatronEngine class verl built
    experts: list                   # expert module classes in the model
    sizes: dict                     # tp / ep / etp as Megatron's parallel_state has them
    bridge_loaded_experts: list     # [name, global expert, loaded right by the bridge]
    syncs: dict[str, TrainerSync]
    stock_export: str               # what verl's stock export of the same engine gave


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


def load_global_experts(megatron, hf_dir: str) -> list:
    """Per local expert parameter ``[name, global expert, whether the bridge loaded it right]``;
    then this rank's shard of the right HF expert is put in (fc1: the ETP rank's gate and up
    rows, Megatron's ``[gate_r; up_r]``; fc2: its columns of down) -- what a model trained
    from ``W`` holds."""
    import torch
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from tests.support.megatron import _chunk, _glu_chunk

    from ascend_rl_plugins.features.moe_reshard.layout import hf_expert_name
    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    ep_rank, etp, etp_rank = (ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                              ps.get_expert_tensor_parallel_rank())
    local = NUM_EXPERTS // ps.get_expert_model_parallel_world_size()
    loaded = []
    with torch.no_grad():
        for name, p in megatron.module[0].named_parameters():
            if ".local_experts." not in name:
                continue
            layer = int(name.split("layers.")[1].split(".")[0])
            e = ep_rank * local + int(name.split("local_experts.")[1].split(".")[0])
            if "linear_fc1" in name:
                full = torch.cat([hf[hf_expert_name(layer, e, "gate_proj")], hf[hf_expert_name(layer, e, "up_proj")]])
                want = _glu_chunk(full, etp, etp_rank)
            else:
                want = _chunk(hf[hf_expert_name(layer, e, "down_proj")], etp, etp_rank, 1)
            loaded.append([name.split("module.", 1)[-1], e, bool(torch.equal(p, want.to(p.dtype)))])
            p.copy_(want)
    return loaded


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
        with parallel_groups(Layout(**layout)):
            megatron = megatron_engine(hf_dir, moe="sequential", **layout)
            experts = sorted({type(m).__name__ for m in megatron.module[0].modules()
                              if type(m).__name__ in ("SequentialMLP", "GroupedMLP", "TEGroupedMLP")})
            sizes = dict(tp=ps.get_tensor_model_parallel_world_size(), ep=ps.get_expert_model_parallel_world_size(),
                         etp=ps.get_expert_tensor_parallel_world_size())
            loaded = load_global_experts(megatron, hf_dir)
            engine, side, _ = _engine(port, rank == 0, "linear", trainers=TRAINERS, rollouts=ROLLOUTS)
            engine.init_process_group(**{k: v[rank] for k, v in side.items()})
            syncs = send_syncs(engine, megatron, SYNCS)
            engine.finalize()
            try:   # verl's stock export of the same engine (upstream failure (a) in the README)
                stock = f"{len(list(megatron.get_per_tensor_param()[0]))} tensors"
            except Exception as e:  # noqa: BLE001 -- the outcome is what the test pins
                stock = f"{type(e).__name__}: {e}"
            runs[name] = LayoutRun(type(megatron).__name__, experts, sizes, loaded, syncs, stock)
            del megatron, engine
    return asdict(MegatronTrainer(rank, runs))


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
