"""verl 0.9.1 backend ``ascend_rl_alltoallv`` with real vLLM 0.23 CPU engines behind its rollout
ranks (run by test_verl09_engine.py in child processes; never imported by pytest for its work).

Processes: 2 trainer ranks (one gloo group: Megatron-Core 0.16.1, the CPU harness's real
GPTModel, local layers, SequentialMLP, EP 2), 2 rollout ranks (each its own process holding a
real vLLM 0.23 CPU engine, in-process engine core) and one reference engine. They meet in the
backend's own group, built from verl's ``CheckpointEngineRegistry`` as in verl09_scenario.py.

Why each rollout rank is an engine with TP = EP = 1 (hosting every expert): vLLM 0.23's CPU MoE
(``CPUFusedMOE``) is handed the layer's ``expert_map`` and does not use it -- router ids index
the local weight slots directly -- so expert parallelism does not compute correctly on CPU.
The backend's configuration still says what a user with an EP 2 replica would write
(``replica_world_size=2``, linear placement: rank 0 hosts experts 0-1, rank 1 experts 2-3); the
live engines host all four. That is the situation EPLB creates on a device (the live map is
not the configured rule), and it decides what a sync must deliver.

The weights: ``W0`` = the tiny Qwen3-MoE (``tiny_qwen3.cached(moe=True, num_experts=4)``), on
which the rollout engines start; ``W1`` = W0's dense tensors plus seeded noise, with the
experts of the trainer's Megatron model (the harness's canonical weights, gate/up/down split,
bf16): the reference engine starts on W1. The trainer sends W1: experts from its local
Megatron shards through the reshard, dense tensors from "the engine's export" (W1's HF tensors,
standing in for Megatron-Bridge's export, which needs TransformerEngine).

Cases, in order on every rank: ``stale`` (no live reader: the expert maps come from the
configured rule, as a sync keyed on a stale map would), ``live`` (the maps read from the
engines at sync time: a new plan), ``live_again`` (the cached plan). After each, every rollout
rank loads what it received through vLLM's own loader (``vllm_side.LiveRollout.load``: the
layerwise reload around ``model.load_weights``), generates greedily and keeps its parameters;
at the end it compares them with the reference engine's. Each received tensor is also compared
with W1's as it arrives: vLLM 0.23's CPU linear layers pack their weight for oneDNN / the AMX
kernel after loading and leave an empty ``weight`` parameter (``dispatch_cpu_unquantized_gemm``,
``remove_weight``), so the parameter comparison cannot see ``qkv_proj``, ``o_proj`` or the
router ``gate`` -- only the tokens and this comparison do (``packed_away`` lists them).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

from .verl09_scenario import ARCH, _engine, _stock_export

TRAINERS, ROLLOUTS = 2, 2
CASES = ("stale", "live", "live_again")
NUM_EXPERTS = ARCH["experts"]


@dataclass
class TrainerSync:
    """What the backend's ``SyncReport`` said of one sync on a trainer rank."""
    resharded: bool
    reason: str
    plan_key: str
    plan_cached: bool


@dataclass
class TrainerRun:
    """One trainer rank's syncs, by case."""
    rank: int
    cases: dict[str, TrainerSync]


def send_syncs(engine, source, cases) -> dict[str, TrainerSync]:
    """Each of ``cases`` sent once from this trainer rank through the backend (every rank of the
    group does the same at once); what the backend reported of each."""
    import asyncio
    syncs = {}
    for case in cases:
        asyncio.run(engine.send_weights(source))
        r = engine.last
        syncs[case] = TrainerSync(r.resharded, r.reason, r.plan_key, r.plan_cached)
    return syncs


@dataclass
class RolloutSync:
    """What the backend's ``SyncReport`` said of one sync on a rollout rank (the part every
    rollout-side scenario records; :meth:`of` reads it)."""
    resharded: bool
    reason: str
    plan_key: str
    plan_cached: bool
    map_source: str
    expert_map: list
    config_map: list

    @staticmethod
    def of(report) -> dict:
        return dict(resharded=report.resharded, reason=report.reason, plan_key=report.plan_key,
                    plan_cached=report.plan_cached, map_source=report.map_source,
                    expert_map=list(report.expert_map), config_map=list(report.config_map))


@dataclass
class SyncCase(RolloutSync):
    """One sync as one rollout rank saw it, with what its vLLM engine did after the load."""
    expert_ids: list            # experts received by the reshard (sorted, unique)
    expert_tensors: int         # expert tensors received
    unique_names: int
    received: int               # tensors received in all
    loaded: int                 # tensors vLLM's loader consumed
    tokens: list                # greedy tokens per prompt after the load
    logprobs: list
    received_different: list = field(default_factory=list)   # received tensors != W1's (cast to its dtype)
    different: list = field(default_factory=list)   # parameters != the reference engine's


@dataclass
class RolloutOutcome:
    rank: int
    live_map: list              # what the engine's FusedMoE layers say it hosts
    moe_paths: list
    before: list                # greedy tokens on W0
    cases: dict                 # case -> SyncCase
    parameters: int
    packed_away: list = field(default_factory=list)  # parameters vLLM's CPU linear emptied (weight packed)

    @classmethod
    def from_json(cls, d: dict) -> "RolloutOutcome":
        return cls(**dict(d, cases={k: SyncCase(**v) for k, v in d["cases"].items()}))


@dataclass
class Reference:
    tokens: list
    logprobs: list
    moe_paths: list


def prepare(workdir: str) -> dict:
    """W0 (cached per machine) and W1 (module docstring) in ``workdir``."""

    import torch
    from safetensors.torch import load_file

    from tests.support.megatron import Arch

    from ascend_rl_plugins.devtools import tiny_qwen3
    from ascend_rl_plugins.features.moe_reshard.layout import parse_hf_expert_name
    w0 = tiny_qwen3.cached(moe=True, num_experts=NUM_EXPERTS)
    w1 = os.path.join(workdir, "w1")
    os.makedirs(w1, exist_ok=True)
    a = load_file(os.path.join(w0, "model.safetensors"))
    trained = _stock_export(Arch(moe="sequential", **ARCH))
    g = torch.Generator().manual_seed(123)
    b = {}
    for name, t in sorted(a.items()):
        if parse_hf_expert_name(name) is not None:
            b[name] = trained[name].to(t.dtype)
            assert b[name].shape == t.shape, (name, b[name].shape, t.shape)
        else:
            noise = torch.randn(t.shape, generator=g) * (0.05 if "norm" in name else 0.02)
            b[name] = (t.float() + noise).to(t.dtype)
    tiny_qwen3.write_moe_checkpoint(w1, b)
    tiny_qwen3.copy_model_files(w0, w1)
    return {"w0": w0, "w1": w1}


def trainer(port: int, paths: dict, rollouts: int = ROLLOUTS, cases: list = CASES) -> dict:
    """A trainer rank sending W1 (``cases`` syncs) to ``rollouts`` rollout ranks (also run by
    verl09_deploy_scenario.py, against a verl deployment's CheckpointEngineWorker)."""
    import faulthandler
    import sys

    import torch.distributed as dist
    from safetensors.torch import load_file
    faulthandler.dump_traceback_later(600, exit=True, file=sys.stderr)  # a hang shows where

    from tests.support.megatron import megatron_model

    from ascend_rl_plugins.features.moe_reshard import verl09_backend
    rank = dist.get_rank()
    export_tensors = load_file(os.path.join(paths["w1"], "model.safetensors"))
    with megatron_model(tp=1, ep=2, etp=1, moe="sequential", **ARCH) as h:
        source = verl09_backend.TrainingSource([h.model], h.config, lambda: iter(list(export_tensors.items())))
        engine, side, _ = _engine(port, rank == 0, "linear", trainers=TRAINERS, rollouts=rollouts)
        engine.init_process_group(**{k: v[rank] for k, v in side.items()})
        run = TrainerRun(rank, send_syncs(engine, source, cases))
        engine.finalize()
    return dataclasses.asdict(run)


def _llm(model_dir: str):
    from vllm import LLM
    return LLM(model=model_dir, enforce_eager=True, max_model_len=256, max_num_seqs=4, dtype="bfloat16", seed=0,
               gpu_memory_utilization=0.5)


def _state(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_parameters(out_dir: str, timeout: float = 600) -> dict:
    """The reference engine's parameters, once :func:`reference` (another process) wrote them."""
    from safetensors.torch import load_file
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(out_dir, "reference.done")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the reference engine wrote no parameters in {timeout:.0f} s")
        time.sleep(0.5)
    return load_file(os.path.join(out_dir, "reference.safetensors"))


def differing_parameters(ref: dict, state: dict) -> list[str]:
    """Names of the reference parameters that ``state`` lacks or holds with other dtype, shape or bits."""
    import torch
    return sorted(n for n in ref if n not in state or not (
        state[n].dtype == ref[n].dtype and state[n].shape == ref[n].shape and torch.equal(state[n], ref[n])))


def reference(paths: dict, out_dir: str) -> dict:
    """An engine started on W1: its greedy outputs and parameters (written for the rollout ranks)."""
    from safetensors.torch import save_file

    from .engine_scenario import _generate, _runner, moe_paths
    llm = _llm(paths["w1"])
    model = _runner(llm).model
    outs = _generate(llm)
    save_file({n: t.contiguous() for n, t in _state(model).items()}, os.path.join(out_dir, "reference.safetensors"))
    open(os.path.join(out_dir, "reference.done"), "w").close()
    return dataclasses.asdict(Reference([o["tokens"] for o in outs], [o["logprobs"] for o in outs],
                                        moe_paths(model)))


def rollout(port: int, rank: int, paths: dict, out_dir: str) -> dict:
    import faulthandler
    import sys

    import torch
    from safetensors.torch import load_file
    faulthandler.dump_traceback_later(600, exit=True, file=sys.stderr)

    from ascend_rl_plugins.features.moe_reshard.layout import parse_hf_expert_name
    from ascend_rl_plugins.features.moe_reshard.vllm_side import LiveRollout

    from .engine_scenario import _generate, _runner, moe_paths
    w1 = load_file(os.path.join(paths["w1"], "model.safetensors"))
    llm = _llm(paths["w0"])
    runner = _runner(llm)
    live = LiveRollout.of_runner(runner)
    before = [o["tokens"] for o in _generate(llm)] if rank == 0 else []
    engine, _, side = _engine(port, False, "linear", trainers=TRAINERS, rollouts=ROLLOUTS)
    engine.init_process_group(**{k: v[rank] for k, v in side.items()})
    cases, states = {}, {}
    for case in CASES:
        engine.live_expert_map = None if case == "stale" else live.expert_map
        names, received_different = [], []

        def received(stream, names=names, received_different=received_different):
            for name, tensor in stream:
                names.append(name)
                if name not in w1 or not torch.equal(tensor.to(w1[name].dtype), w1[name]):
                    received_different.append(name)
                yield name, tensor
        loaded = live.load(received(engine.receive_weights()))
        r = engine.last
        outs = _generate(llm)
        experts = [n for n in names if parse_hf_expert_name(n)]
        cases[case] = SyncCase(
            **RolloutSync.of(r), expert_ids=sorted({parse_hf_expert_name(n)[1] for n in experts}), expert_tensors=len(experts),
            unique_names=len(set(names)), received=len(names), loaded=loaded, received_different=received_different,
            tokens=[o["tokens"] for o in outs], logprobs=[o["logprobs"] for o in outs])
        states[case] = _state(live.model)
    engine.finalize()
    ref = reference_parameters(out_dir)
    for case, state in states.items():
        cases[case].different = differing_parameters(ref, state)
    outcome = RolloutOutcome(rank=rank, live_map=list(live.expert_map()), moe_paths=moe_paths(live.model),
                             before=before, cases=cases, parameters=len(ref),
                             packed_away=sorted(n for n, p in live.model.named_parameters() if p.numel() == 0))
    return dataclasses.asdict(outcome)
