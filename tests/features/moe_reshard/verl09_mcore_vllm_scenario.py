"""verl 0.9.1's real ``MegatronEngine`` exporting through ``ascend_rl_alltoallv`` into real vLLM 0.23
CPU engines (run by test_verl09_mcore_vllm.py in child processes; never imported by pytest for
its work).

Processes: 4 trainer ranks (one gloo group) each holding verl 0.9.1's ``MegatronEngineWithLMHead``,
built by verl through Megatron-Bridge 0.3.1 from the HF checkpoint ``W`` exactly as in
verl09_mcore_engine_scenario.py (same model, same CPU configuration and shims, the same
correction of upstream failures (a') and (b)); 2 rollout ranks, each its own process holding a
vLLM 0.23 CPU engine (in-process engine core) started on ``Wn`` = ``W`` plus seeded noise; one
reference engine started on ``W`` (verl09_engine_scenario.reference). Two syncs, ``SYNCS``, one
per training engine, in the same processes (each its own engine, backend and port): SequentialMLP
at TP 2 / EP 2 / ETP 1, then legacy GroupedMLP (``weight1`` / ``weight2``) at TP 1 / EP 2 /
ETP 2. Each: the trainer hands the engine to ``send_weights``; each rollout rank reads its
expert map from its live engine and loads the stream through vLLM's own loader
(``vllm_side.LiveRollout.load``), comparing every tensor with ``W``'s as it arrives, then
generates greedily and compares what vLLM keeps with the reference engine. Before the second
sync each rollout engine loads ``Wn`` again through the same loader (and generates: the tokens
``Wn`` gives), so the second sync has to change every tensor back.

Why each rollout engine hosts all 4 experts although the configuration says one EP 2 replica
(linear: rank 0 experts 0-1, rank 1 experts 2-3): vLLM 0.23's CPU MoE does not compute expert
parallelism (verl09_engine_scenario.py); the live maps therefore differ from the configured
rule, and each rank must receive every expert -- what the live reader is for.

TP 2 on the first engine: the dense layers arrive through Megatron-Bridge's tensor-parallel export
(``linear_qkv`` column-parallel, ``linear_proj`` row-parallel), the case where a wrong
``o_proj`` once left the engines' kept parameters identical but their tokens different (README).
"""

from __future__ import annotations

import os

from dataclasses import asdict, dataclass

from .verl09_engine_scenario import RolloutSync, TrainerRun, differing_parameters, reference_parameters, send_syncs
from .verl09_mcore_engine_scenario import MODEL, EngineLayout, load_global_experts
from .verl09_scenario import _engine

TRAINERS, ROLLOUTS = 4, 2
SYNCS = {"sequential-tp2-ep2-etp1": EngineLayout("sequential", tp=2, ep=2, etp=1),
         "grouped-tp1-ep2-etp2": EngineLayout("grouped", tp=1, ep=2, etp=2)}


@dataclass
class SyncedEngine(RolloutSync):
    """One sync on one rollout rank: its engine just before, what the sync delivered, the engine after."""
    before: list                # greedy tokens just before the sync (the engine on Wn)
    experts: list               # global experts received (sorted, unique)
    received: int               # tensors received
    unique: int
    loaded: int                 # tensors vLLM's loader consumed
    received_different: list    # received tensors not bit-identical to W's
    tokens: list                # greedy tokens after the sync
    logprobs: list
    different: list             # kept parameters != the reference engine's
    packed_away: list           # parameters vLLM's CPU linears emptied (weight kept packed)


@dataclass
class SyncedRollout:
    """One rollout rank's engine over every sync of ``SYNCS``."""
    rank: int
    syncs: dict[str, SyncedEngine]


def prepare(workdir: str) -> dict:
    """``W`` (cached per machine) and ``Wn`` (in ``workdir``); ``w1`` names ``W`` for the
    reference engine of verl09_engine_scenario."""
    import torch
    from safetensors.torch import load_file

    from ascend_rl_plugins.devtools import tiny_qwen3
    w = tiny_qwen3.cached(**MODEL)
    wn = os.path.join(workdir, "wn")
    g = torch.Generator().manual_seed(7)
    tensors = load_file(os.path.join(w, "model.safetensors"))
    tiny_qwen3.write_moe_checkpoint(wn, {n: (t.float() + 0.02 * torch.randn(t.shape, generator=g)).to(t.dtype)
                                         for n, t in sorted(tensors.items())})
    tiny_qwen3.copy_model_files(w, wn)
    return {"w": w, "w1": w, "wn": wn}


def trainer(ports: list, hf_dir: str) -> dict:
    """One sync per engine of ``SYNCS`` (``ports``: one per sync, for its backend)."""
    import faulthandler
    import sys

    import torch.distributed as dist
    faulthandler.dump_traceback_later(600, exit=True, file=sys.stderr)  # a hang shows where

    from tests.support.megatron import Layout, parallel_groups
    from tests.support.verl_megatron_engine import megatron_engine
    rank = dist.get_rank()
    cases = {}
    for (name, layout), port in zip(SYNCS.items(), ports):
        with parallel_groups(Layout(**layout.sizes)):
            megatron = megatron_engine(hf_dir, moe=layout.moe, **layout.sizes)
            load_global_experts(megatron, hf_dir, layout.moe)
            engine, side, _ = _engine(port, rank == 0, "linear", trainers=TRAINERS, rollouts=ROLLOUTS)
            engine.init_process_group(**{k: v[rank] for k, v in side.items()})
            cases.update(send_syncs(engine, megatron, (name,)))
            engine.finalize()
            del megatron, engine
    return asdict(TrainerRun(rank, cases))


def rollout(ports: list, rank: int, paths: dict, out_dir: str) -> dict:
    import faulthandler
    import sys

    import torch
    from safetensors.torch import load_file
    faulthandler.dump_traceback_later(600, exit=True, file=sys.stderr)

    from ascend_rl_plugins.features.moe_reshard.layout import parse_hf_expert_name
    from ascend_rl_plugins.features.moe_reshard.vllm_side import LiveRollout

    from .engine_scenario import _generate, _runner
    from .verl09_engine_scenario import _llm
    want = load_file(os.path.join(paths["w"], "model.safetensors"))
    noisy = load_file(os.path.join(paths["wn"], "model.safetensors"))
    llm = _llm(paths["wn"])
    live = LiveRollout.of_runner(_runner(llm))
    ref = None
    syncs = {}
    for i, (sync, port) in enumerate(zip(SYNCS, ports)):
        if i:
            live.load(iter(sorted(noisy.items())))            # back to Wn: the next sync must change everything
        before = [o["tokens"] for o in _generate(llm)]
        engine, _, side = _engine(port, False, "linear", trainers=TRAINERS, rollouts=ROLLOUTS)
        engine.init_process_group(**{k: v[rank] for k, v in side.items()})
        engine.live_expert_map = live.expert_map
        names, received_different = [], []

        def received(stream, names=names, received_different=received_different):
            for name, tensor in stream:
                names.append(name)
                if name not in want or not (tensor.dtype == want[name].dtype and torch.equal(tensor, want[name])):
                    received_different.append(name)
                yield name, tensor
        loaded = live.load(received(engine.receive_weights()))
        report = engine.last
        engine.finalize()
        outs = _generate(llm)
        ref = ref if ref is not None else reference_parameters(out_dir)
        kept = {n: p.detach() for n, p in live.model.named_parameters()}
        syncs[sync] = SyncedEngine(
            **RolloutSync.of(report), before=before,
            experts=sorted({parse_hf_expert_name(n)[1] for n in names if parse_hf_expert_name(n)}),
            received=len(names), unique=len(set(names)), loaded=loaded, received_different=received_different,
            tokens=[o["tokens"] for o in outs], logprobs=[o["logprobs"] for o in outs],
            different=differing_parameters(ref, kept), packed_away=sorted(n for n, p in kept.items() if p.numel() == 0))
    return asdict(SyncedRollout(rank, syncs))
