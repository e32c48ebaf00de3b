"""expandable_segments_swap in a fresh process (run by test_expandable_segments_swap.py).

Real: verl 0.6.1's ``ActorRolloutRefWorker.rollout_mode`` / ``trainer_mode`` (Megatron worker,
made as tests/features/rollout_torch_compile/megatron_worker.py says) and
``verl.utils.device.set_expandable_segments`` with the copies verl's modules hold. Doubles:
``torch.npu`` (torch_npu_memory_double.py), installed after ``import verl`` with verl's NPU
detection (``verl.utils.device.is_npu_available``) switched on then -- at import time verl
would import torch_npu; ``torch.cuda.memory._set_allocator_settings`` as a recorder for the
CUDA case; the rollout (records resume / update_weights / release) and the weight exporter.
"""

from __future__ import annotations

import asyncio
import types

from tests.features.expandable_segments_swap.torch_npu_memory_double import TorchNpuDouble
from tests.features.rollout_torch_compile.megatron_worker import make_worker

COPIES = ("verl.workers.megatron_workers", "verl.workers.fsdp_workers", "verl.workers.sharding_manager.megatron_vllm",
          "verl.workers.sharding_manager.fsdp_vllm")


class RecordingRollout:
    def __init__(self, events: list):
        self.events = events

    async def resume(self, tags):
        self.events.append(["rollout resume", list(tags)])

    async def update_weights(self, weights, **kwargs):
        self.events.append(["rollout update_weights", len(list(weights))])

    async def release(self):
        self.events.append(["rollout release"])


class NoWeights:
    @staticmethod
    def export_weights(modules):
        return iter(())


def _activate():
    import torch.distributed as dist
    dist.init_process_group("gloo")
    import ascend_rl_plugins
    ascend_rl_plugins.activate()


def run() -> dict:
    """The Megatron worker's copy of ``set_expandable_segments`` called off NPU (CPU, then CUDA
    as verl would see it), then one rollout_mode -> generation -> trainer_mode cycle with verl
    believing it is on NPU. One process: verl is imported once."""
    _activate()
    import importlib
    import torch

    import verl.utils.device as device
    import verl.workers.megatron_workers as workers
    for name in COPIES:
        importlib.import_module(name)
    out = {}
    events: list = []
    torch.npu = TorchNpuDouble(events)  # present, but verl did not find an NPU (yet)
    for case in ("cpu", "cuda"):
        if case == "cuda":
            device.is_cuda_available = True
            real_cuda = torch.cuda.memory._set_allocator_settings
            torch.cuda.memory._set_allocator_settings = lambda s: events.append(["cuda allocator", s])
        workers.set_expandable_segments(False)
        workers.set_expandable_segments(True)
        out[case] = list(events)
        events.clear()
    device.is_cuda_available = False
    torch.cuda.memory._set_allocator_settings = real_cuda

    device.is_npu_available = True
    worker = make_worker({"rollout": {"free_cache_engine": True}}, _is_offload_param=False, bridge=NoWeights(),
                         actor=types.SimpleNamespace(actor_module=[]), rollout=RecordingRollout(events),
                         gen_random_states=torch.get_rng_state())
    loop = asyncio.new_event_loop()
    loop.run_until_complete(worker.rollout_mode())
    events.append(["generate"])
    loop.run_until_complete(worker.trainer_mode())
    from ascend_rl_plugins.patching.core import REGISTRY
    installed = device.set_expandable_segments
    out["npu"] = events
    out["patch_state"] = REGISTRY.patches["expandable_segments_swap.set_expandable_segments"].outcome.state
    out["copies_patched"] = {name: vars(importlib.import_module(name)).get("set_expandable_segments") is installed
                             for name in COPIES}
    return out
