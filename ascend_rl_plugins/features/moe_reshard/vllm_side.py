"""The rollout side of the MoE reshard: what a live vLLM model hosts, loading a pre-narrowed
expert slice, and the post-load processing after an in-place weight update.

Why a module of its own: the trainer-side hooks (verl 0.6.1 / 0.9.1) must know which experts each
rollout rank hosts (vLLM's ``FusedMoE.expert_map``) and, where the reshard delivers only the
tensor-parallel narrow of an expert, must put it into vLLM's fused ``w13_weight`` / ``w2_weight``
themselves: vLLM's ``FusedMoE.weight_loader`` narrows what it is given by the TP rank, so a
tensor that is already narrowed cannot go through it.

Read in vLLM 0.13 and 0.23 (``vllm/model_executor/layers/fused_moe/layer.py``): ``FusedMoE`` holds
``w13_weight [E_local, 2*I_tp, H]`` (gate rows first, then up rows) and ``w2_weight
[E_local, H, I_tp]``; ``expert_map`` (a property over ``_expert_map`` in 0.23) is ``None``
without expert parallelism (every expert local, slot = global id) or a tensor of
``global_num_experts`` entries: the local slot of each global expert, ``-1`` where not hosted.

Post-load processing: vLLM runs ``process_weights_after_loading`` once, after the initial load;
platforms repack there (vLLM 0.13's CPU SGL kernel packs ``w13``/``w2`` in place, vLLM-Ascend
transposes them for its grouped matmul). Weights written later by ``load_weights`` arrive in
checkpoint layout, so they have to be processed again (the recipe's verl patch 0007). vLLM 0.23
replaced the processed parameters by kernel-format ones (the loaders are gone); there a reload is
bracketed by ``initialize_layerwise_reload`` / ``finalize_layerwise_reload`` (vLLM's own API,
``vllm.model_executor.model_loader.reload``), which :func:`reload_session` uses when present.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Iterator

_EXPERT_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fused_moe_layers(model) -> dict[int, object]:
    """``{decoder layer index: FusedMoE module}`` of a vLLM model (found by the fused expert
    weights, so quantized and platform subclasses count too)."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "w13_weight") and hasattr(module, "w2_weight") and hasattr(module, "global_num_experts"):
            m = re.search(r"layers\.(\d+)\.", name)
            if m:
                out[int(m.group(1))] = module
    return out


def expert_map_of(layer) -> tuple[int, ...]:
    """Global expert ids hosted by one ``FusedMoE``, in local-slot order."""
    emap = getattr(layer, "_expert_map", None)
    if emap is None:
        emap = getattr(layer, "expert_map", None)
    if emap is None:
        return tuple(range(int(layer.global_num_experts)))
    slots = {int(slot): e for e, slot in enumerate(emap.tolist()) if int(slot) >= 0}
    if sorted(slots) != list(range(len(slots))):
        raise ValueError(f"expert map with holes or repeats: {emap.tolist()}")
    return tuple(slots[s] for s in range(len(slots)))


def local_expert_map(model) -> tuple[int, ...] | None:
    """The expert map of this rollout rank (the same for every MoE layer; a per-layer map, as
    EPLB's redundant experts make, is refused), or None for a model without experts."""
    layers = fused_moe_layers(model)
    if not layers:
        return None
    maps = {expert_map_of(m) for m in layers.values()}
    if len(maps) != 1:
        raise ValueError("the MoE layers host different experts (per-layer placement, e.g. EPLB); "
                         "the reshard needs one expert map per rollout rank")
    (only,) = maps
    if getattr(next(iter(layers.values())), "num_redundant_experts", 0):
        raise ValueError("redundant experts (EPLB) are not supported by the reshard")
    return only


def uses_expert_parallel(model) -> bool:
    """Does vLLM load whole experts on this rank (expert parallelism)?"""
    layers = fused_moe_layers(model)
    return any(int(getattr(m, "ep_size", 1)) > 1 for m in layers.values())


@dataclass(frozen=True)
class RolloutRank:
    """Where this process sits in the rollout: vLLM's flattened MoE rank = dp_rank*tp + tp_rank."""
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int

    @property
    def rank(self) -> int:
        return self.dp_rank * self.tp + self.tp_rank


def rollout_rank() -> RolloutRank:
    """This process's rollout coordinates, from vLLM's initialized parallel state."""
    from vllm.distributed import parallel_state as ps
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    dp_group = getattr(ps, "_DP", None)
    dp, dp_rank = (dp_group.world_size, dp_group.rank_in_group) if dp_group is not None else (1, 0)
    return RolloutRank(tp, dp, tp_rank, dp_rank)


def worker_rollout_info(worker) -> dict:
    """What the reshard needs from one vLLM worker, as plain data: meant for vLLM's
    ``collective_rpc`` (``llm.collective_rpc(worker_rollout_info)``, or a server's RPC), so that a
    trainer whose rollout runs in another process (verl 0.9.1's server mode) can learn every
    rollout rank's expert map without reaching the model itself."""
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    rr = rollout_rank()
    hosted = local_expert_map(model)
    return {"rank": rr.rank, "tp": rr.tp, "dp": rr.dp, "expert_parallel": uses_expert_parallel(model),
            "expert_map": None if hosted is None else list(hosted)}


def parse_expert_name(name: str) -> tuple[int, int, str] | None:
    m = _EXPERT_NAME.match(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def checkpoint_layout(model, hidden: int) -> bool:
    """Are the fused expert weights in the layout ``load_pre_narrowed`` writes
    (``w13 [E, 2I, H]``, ``w2 [E, H, I]``)? vLLM-Ascend's post-load processing transposes them."""
    for layer in fused_moe_layers(model).values():
        w13, w2 = layer.w13_weight, layer.w2_weight
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[2] != hidden or w2.shape[1] != hidden \
                or w13.shape[1] != 2 * w2.shape[2]:
            return False
    return True


def load_pre_narrowed(model, hf_name: str, tensor, layers: dict | None = None) -> None:
    """Copy an expert slice that is already this rank's narrow (gate/up rows or down columns
    ``[r*I/T, (r+1)*I/T)``) into vLLM's fused parameter, bypassing the narrowing loader.

    ``w13_weight[slot]`` holds ``[gate_narrow; up_narrow]`` and ``w2_weight[slot]`` the down
    narrow; the slot comes from the layer's expert map. Shapes must match exactly."""
    import torch
    parsed = parse_expert_name(hf_name)
    if parsed is None:
        raise ValueError(f"{hf_name!r} is not an HF expert weight name")
    layer_idx, expert, proj = parsed
    layers = fused_moe_layers(model) if layers is None else layers
    layer = layers[layer_idx]
    hosted = expert_map_of(layer)
    if expert not in hosted:
        raise ValueError(f"{hf_name}: expert {expert} is not hosted on this rollout rank")
    slot = hosted.index(expert)
    w13, w2 = layer.w13_weight.data, layer.w2_weight.data
    rows = w2.shape[2]
    if proj == "down_proj":
        dst = w2[slot]
    else:
        dst = w13[slot].narrow(0, 0 if proj == "gate_proj" else rows, rows)
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ValueError(f"{hf_name}: pre-narrowed slice {tuple(tensor.shape)} does not fit the "
                         f"fused parameter's {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(tensor)


def model_runner_of(rollout):
    """vLLM's model runner behind a verl 0.6.1 rollout object (sync ``vLLMRollout`` holds an
    ``LLM``; ``vLLMAsyncRollout`` holds the worker wrapper)."""
    engine = getattr(rollout, "inference_engine", None)
    if engine is None:
        return None
    if hasattr(engine, "llm_engine"):
        executor = getattr(engine.llm_engine, "model_executor", None)
        if executor is None:
            executor = engine.llm_engine.engine_core.engine_core.model_executor
        return executor.driver_worker.worker.model_runner
    worker = getattr(engine, "worker", None)
    return getattr(worker, "model_runner", None)


def _layerwise_api():
    try:
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                             initialize_layerwise_reload)
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


def target_device(vllm_config):
    import torch
    load = vllm_config.load_config.device
    return torch.device(vllm_config.device_config.device if load is None else load)


def post_load_process(model, vllm_config) -> None:
    """Re-run the platform's post-load processing on weights ``load_weights`` just wrote (vLLM
    releases without the layerwise reload API)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    process_weights_after_loading(model, vllm_config.model_config, target_device(vllm_config))


@contextlib.contextmanager
def reload_session(model, vllm_config) -> Iterator[None]:
    """Bracket an in-place weight update so that the engine ends with processed weights: vLLM's
    layerwise reload where it exists (0.23), else ``load_weights`` followed by
    ``process_weights_after_loading`` (0.13)."""
    api = _layerwise_api()
    if api is not None:
        api[0](model)
        yield
        api[1](model, vllm_config.model_config)
        return
    yield
    post_load_process(model, vllm_config)


@dataclass
class LiveRollout:
    """One rollout rank's live vLLM model, as the verl 0.9 backend's rollout side uses it: the
    experts it hosts read from its ``FusedMoE`` layers at each sync (never from the
    configuration: EPLB may have moved them), and a received stream loaded in place through
    vLLM's own loader (``model.load_weights`` inside :func:`reload_session`, so that the
    platform's post-load processing runs once per update).

    ``of_runner`` takes vLLM's GPU/CPU model runner (``worker.model_runner``)."""
    model: object
    vllm_config: object

    @classmethod
    def of_runner(cls, runner) -> "LiveRollout":
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        return cls(model, runner.vllm_config)

    def expert_map(self) -> tuple[int, ...]:
        hosted = local_expert_map(self.model)
        if hosted is None:
            raise ValueError("the rollout model has no FusedMoE layers")
        return hosted

    def load(self, weights) -> int:
        """Load every ``(name, tensor)`` of ``weights`` (consumed lazily: a backend's receive
        stream runs its collectives as it is read); returns how many tensors were loaded."""
        count = 0

        def counted():
            nonlocal count
            for item in weights:
                count += 1
                yield item
        with reload_session(self.model, self.vllm_config):
            self.model.load_weights(counted())
        return count
