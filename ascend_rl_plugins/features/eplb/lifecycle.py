"""Stop and restart vLLM-Ascend's dynamic EPLB on a model runner; keep or reset placement.

Everything here works on the objects ``NPUModelRunner.__init__`` / ``eplb_warmup`` create
(vLLM-Ascend 0.13 and 0.23 read): ``runner.dynamic_eplb``, ``is_eplb_warmuped``,
``policy_type``, ``shared_dict`` (a ``multiprocessing.Manager`` dict), ``eplb_loader``
(``D2DExpertWeightLoader``), ``eplb_process`` (``EplbProcess``) and ``process`` (its
``multiprocessing.Process``), ``eplb_updator`` (``EplbUpdator``), ``eplb_adaptor``
(``VllmEplbAdaptor``, built by ``eplb_warmup``). The Qwen3 RL recipe's verl patch called
``EplbUpdator.get_init_expert_map``, ``VllmEplbAdaptor.release_memory`` and
``model.reset_all_expert_map_and_log2phy``, which exist in neither version; their jobs are
:func:`record_initial_placement`, :func:`release_eplb_memory` and :func:`restore_placement`.

Placement = per MoE layer the tensors ``global_expert_map`` ([ep ranks, experts] -> local
slot or -1), ``_expert_map`` (this rank's row; vLLM's weight loader places experts by it)
and ``log2phy`` (logical -> physical expert used for routing). EPLB updates ``log2phy``
in place and publishes the new global maps in ``shared_dict["expert_maps"]``.
"""

from __future__ import annotations

import inspect
import logging
import sys
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("ascend_rl_plugins")

PLACEMENT_TENSORS = ("global_expert_map", "_expert_map", "log2phy")
STATE_ATTRIBUTE = "_ascend_rl_eplb"


class PlacementMismatch(RuntimeError):
    """A saved placement does not fit the layers (shapes differ)."""


@dataclass
class EplbClasses:
    """The vLLM-Ascend classes a restart constructs (injectable for tests)."""

    EplbProcess: type
    EplbUpdator: type
    D2DExpertWeightLoader: type


def real_classes() -> EplbClasses:
    from vllm_ascend.eplb.core.eplb_device_transfer_loader import D2DExpertWeightLoader
    from vllm_ascend.eplb.core.eplb_worker import EplbProcess
    from vllm_ascend.eplb.eplb_updator import EplbUpdator
    return EplbClasses(EplbProcess, EplbUpdator, D2DExpertWeightLoader)


@dataclass
class EplbState:
    """What ascend-rl keeps on a runner between sleep and wake-up."""

    layers: list = field(default_factory=list)  # the MoE layer modules (persist across sleep)
    rank_rows: list = field(default_factory=list)  # row of global_expert_map that is this rank
    initial: list | None = None  # per layer {tensor name: CPU copy}
    learned: list | None = None
    stopped: bool = False
    restarts: int = 0
    events: list = field(default_factory=list)  # ordered log of what happened (tests, debugging)


def state_of(runner) -> EplbState:
    state = getattr(runner, STATE_ATTRIBUTE, None)
    if state is None:
        state = EplbState()
        setattr(runner, STATE_ATTRIBUTE, state)
    return state


# -- placement -------------------------------------------------------------------------------

def moe_layers(adaptor) -> list:
    """The MoE layer modules an adaptor manages (0.23 keeps them; 0.13 walks the model)."""
    layers = getattr(adaptor, "moe_layers", None)
    if layers is not None:
        return list(layers)
    model = adaptor.model
    first = adaptor.num_dense_layers
    return [model.model.layers[first + i].mlp.experts for i in range(adaptor.num_moe_layers)]


def capture_placement(layers) -> list:
    """CPU copies of every layer's placement tensors."""
    import torch
    out = []
    for layer in layers:
        saved = {}
        for name in PLACEMENT_TENSORS:
            value = getattr(layer, name, None)
            if isinstance(value, torch.Tensor):
                saved[name] = value.detach().cpu().clone()
        out.append(saved)
    return out


def restore_placement(layers, placement) -> None:
    """Copy a captured placement back into the layers' own tensors (in place)."""
    import torch
    if len(placement) != len(layers):
        raise PlacementMismatch(f"placement has {len(placement)} layers, the model {len(layers)}")
    for index, (layer, saved) in enumerate(zip(layers, placement)):
        for name, value in saved.items():
            target = getattr(layer, name, None)
            if not isinstance(target, torch.Tensor) or target.shape != value.shape:
                raise PlacementMismatch(f"layer {index} {name}: cannot restore shape {tuple(value.shape)}")
    for layer, saved in zip(layers, placement):
        for name, value in saved.items():
            getattr(layer, name).copy_(value.to(getattr(layer, name).device))


def rank_rows(placement) -> list:
    """Which row of each layer's global map is this rank (the row equal to its local map)."""
    import torch
    rows = []
    for saved in placement:
        gmap, local = saved.get("global_expert_map"), saved.get("_expert_map")
        row = None
        if gmap is not None and local is not None:
            for r in range(gmap.shape[0]):
                if torch.equal(gmap[r], local):
                    row = r
                    break
        rows.append(row)
    return rows


def learned_placement(runner, state: EplbState) -> list | None:
    """The placement EPLB has installed: its published global maps plus the live log2phy.

    None when EPLB never planned (nothing learned) or the published maps do not fit."""
    import torch
    maps = runner.shared_dict.get("expert_maps") if runner.shared_dict is not None else None
    if maps is None:
        return None
    maps = torch.as_tensor(maps)
    current = capture_placement(state.layers)
    if maps.shape[0] != len(current):
        return None
    learned = []
    for index, saved in enumerate(current):
        entry = dict(saved)
        if "global_expert_map" in saved:
            if maps[index].shape != saved["global_expert_map"].shape:
                return None
            entry["global_expert_map"] = maps[index].to(saved["global_expert_map"].dtype).clone()
            row = state.rank_rows[index] if index < len(state.rank_rows) else None
            if "_expert_map" in saved:
                if row is None:
                    return None
                entry["_expert_map"] = entry["global_expert_map"][row].clone()
        learned.append(entry)
    return learned


def _first_attribute(obj, *names):
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


def eplb_cycle_in_flight(updator) -> bool:
    """True between the planner's wake-up and the last layer's weight swap: the published
    maps may be ahead of the weights. Unknown counters count as in flight."""
    collect = _first_attribute(updator, "num_iterations_eplb_update", "expert_heat_collection_interval")
    wait = _first_attribute(updator, "num_wait_worker_iterations", "algorithm_execution_interval")
    layers = getattr(updator, "num_moe_layers", None)
    current = getattr(updator, "cur_iterations", None)
    if None in (collect, wait, layers, current):
        return True
    return collect <= current < collect + wait + layers


# -- lifecycle ---------------------------------------------------------------------------------

def record_initial_placement(runner) -> None:
    """After the runner's ``eplb_warmup``: remember the layers and the starting placement."""
    adaptor = getattr(runner, "eplb_adaptor", None)
    if not getattr(runner, "dynamic_eplb", False) or adaptor is None:
        return
    state = state_of(runner)
    if state.initial is None:
        state.layers = moe_layers(adaptor)
        state.initial = capture_placement(state.layers)
        state.rank_rows = rank_rows(state.initial)
        state.events.append("record_initial")


def release_eplb_memory(runner) -> None:
    """Drop the adaptor's transfer buffers and expert views and the updator's gather buffer
    so the device memory can return to the allocator; the next wake-up builds new ones."""
    adaptor = getattr(runner, "eplb_adaptor", None)
    if adaptor is not None:
        for name in ("buffer_tensor_list", "expert_param_per_layer", "param_dict"):
            container = getattr(adaptor, name, None)
            if hasattr(container, "clear"):
                container.clear()
    updator = getattr(runner, "eplb_updator", None)
    if updator is not None and hasattr(updator, "_gather_buffer"):
        updator._gather_buffer = None
    runner.eplb_adaptor = None
    torch = sys.modules.get("torch")
    npu = getattr(torch, "npu", None) if torch is not None else None
    if npu is not None and hasattr(npu, "empty_cache"):
        npu.empty_cache()


def stop_eplb(runner, *, warm_start: bool) -> None:
    """Before the worker sleeps: keep the learned placement (warm start), stop the planner
    process, release EPLB memory."""
    if not getattr(runner, "dynamic_eplb", False) or not getattr(runner, "is_eplb_warmuped", False):
        return
    state = state_of(runner)
    if state.stopped:
        return
    updator = runner.eplb_updator
    if warm_start and state.initial is not None:
        if eplb_cycle_in_flight(updator):
            state.events.append("keep_previous_learned(in_flight)")
        else:
            learned = learned_placement(runner, state)
            if learned is not None:
                state.learned = learned
                state.events.append("snapshot_learned")
    updator.shutdown()
    state.events.append("shutdown")
    release_eplb_memory(runner)
    state.events.append("release_memory")
    state.stopped = True


def clear_moe_loads(layers) -> None:
    """Zero every layer's expert-load counters so the new cycle gathers fresh loads (0.13
    does this through a model method, 0.23 through the adaptor; both end at the layer)."""
    for layer in layers:
        if hasattr(layer, "clear_moe_load"):
            layer.clear_moe_load()
        elif getattr(layer, "moe_load", None) is not None:
            layer.moe_load.zero_()


def build_eplb_process(cls, runner):
    """``EplbProcess`` with the arguments of the installed version (0.23 added tp_size)."""
    params = inspect.signature(cls.__init__).parameters
    kwargs: dict[str, Any] = {"shared_dict": runner.shared_dict, "policy_type": runner.policy_type,
                              "enable_d2d": True}
    if "tp_size" in params:
        kwargs["tp_size"] = runner.parallel_config.tensor_parallel_size
    return cls(**kwargs)


def build_eplb_updator(cls, runner):
    """``EplbUpdator``: 0.13 takes the whole ascend config, 0.23 its ``eplb_config``."""
    first = list(inspect.signature(cls.__init__).parameters)[1]
    if first == "eplb_config":
        config = runner.ascend_config.eplb_config
    elif first == "ascend_config":
        config = runner.ascend_config
    else:
        raise TypeError(f"EplbUpdator takes {first!r} first; ascend-rl knows ascend_config "
                        f"(vLLM-Ascend 0.13) and eplb_config (0.23)")
    return cls(config, runner.eplb_loader, runner.eplb_process, runner.process)


def restart_eplb(runner, *, warm_start: bool, classes: EplbClasses | None = None) -> None:
    """After the worker woke its weights: placement (learned or initial), a new planner
    process, updator and loader, cleared loads, then the runner's own ``eplb_warmup``
    (new adaptor on the woken parameters, fresh load gathering, published maps)."""
    if not getattr(runner, "dynamic_eplb", False):
        return
    state = state_of(runner)
    if not state.stopped:
        return
    try:
        classes = classes or real_classes()
        placement = state.learned if warm_start and state.learned is not None else state.initial
        if placement is not None:
            try:
                restore_placement(state.layers, placement)
                state.events.append("restore_learned" if placement is state.learned else "restore_initial")
            except PlacementMismatch as exc:
                log.warning("ascend-rl eplb: %s; starting from the initial placement", exc)
                restore_placement(state.layers, state.initial)
                state.events.append("restore_initial")
        if runner.shared_dict is not None:
            for key in ("expert_map", "moe_load", "expert_maps"):
                runner.shared_dict[key] = None
        runner.eplb_loader = classes.D2DExpertWeightLoader()
        runner.eplb_process = build_eplb_process(classes.EplbProcess, runner)
        runner.process = runner.eplb_process._launch_process()
        runner.eplb_updator = build_eplb_updator(classes.EplbUpdator, runner)
        state.events.append("new_process")
        clear_moe_loads(state.layers)
        state.events.append("clear_loads")
        runner.is_eplb_warmuped = False
        runner.eplb_warmup()
        state.events.append("warmup")
        state.stopped = False
        state.restarts += 1
    except Exception:
        # Decoding must go on: without EPLB the engine keeps its current placement.
        log.exception("ascend-rl eplb: restarting dynamic EPLB failed; EPLB stays off in this engine")
        runner.dynamic_eplb = False
        state.events.append("disabled")
