"""Expandable segments hot swap on NPU: verl 0.6's ``set_expandable_segments`` for Ascend.

verl 0.6.1 switches the caching allocator's expandable segments off before the rollout
(``rollout_mode``: the inference engine wakes up and takes its memory) and on again for
training (``trainer_mode``), but ``verl.utils.device.set_expandable_segments`` only talks to
CUDA. It is wrapped so that, when verl found an NPU (``verl.utils.device.is_npu_available``),
the same setting also goes to the NPU allocator:
``torch.npu.memory._set_allocator_settings("expandable_segments:True|False")`` -- the call
verl 0.9 makes on NPU (``verl/plugin/platform/platform_npu.py``). The CUDA path is unchanged.
Copies of the function that verl modules made with ``from verl.utils.device import
set_expandable_segments`` (Megatron and FSDP workers, sharding managers) are rebound by the
framework. README.md beside this file: why, flags, verified where.

Remove when: running verl >= 0.9.
"""

from __future__ import annotations

import logging
import sys

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_EXPANDABLE_SEGMENTS_SWAP", "bool", True,
    "verl 0.6: when verl toggles the allocator's expandable segments around rollout and training, "
    "toggle them on the NPU allocator too (verl 0.6 only does it on CUDA). Acts only where verl "
    "found an NPU.", feature="expandable_segments_swap")

FEATURE = Feature(
    "expandable_segments_swap", "verl 0.6's expandable-segments hot swap reaches the NPU allocator.",
    flag=ENABLE, replaces="the recipe's verl patch 0016-verl-bugfix-hot_swap_expandable_segments",
    verified=Verified(cpu_runtime="real verl 0.6.1 rollout_mode / trainer_mode of the Megatron "
                                  "ActorRolloutRefWorker; CPU and CUDA paths unchanged",
                      doubles="torch.npu (allocator settings, device memory and RNG calls) with verl's "
                              "NPU detection switched on after import"),
    stacks="recipe")

log = logging.getLogger("ascend_rl_plugins")
_WARNED: list = []


def npu_allocator_setting(enable) -> str:
    return f"expandable_segments:{'True' if enable else 'False'}"


@FEATURE.wrap("verl.utils.device:set_expandable_segments", name="expandable_segments_swap.set_expandable_segments",
              dist="verl", versions=">=0.6,<0.9", order=50, params=("enable",),
              reason="verl 0.6's set_expandable_segments configures the CUDA allocator only; on NPU the "
                     "sleep-mode hot swap around rollout and training never happens",
              replaces="recipe verl 0016 (adds the NPU branch to set_expandable_segments)",
              fixed_upstream="verl 0.9 (set_expandable_segments goes through the platform; the NPU "
                             "platform calls torch.npu.memory._set_allocator_settings)",
              remove_when="running verl >= 0.9")
def _also_on_npu(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    device = sys.modules.get("verl.utils.device")
    if device is not None and getattr(device, "is_npu_available", False):
        enable = args[0] if args else kwargs["enable"]
        import torch
        try:
            setter = torch.npu.memory._set_allocator_settings
        except AttributeError:
            if not _WARNED:
                _WARNED.append(True)
                log.warning("ascend-rl expandable_segments_swap: this torch_npu has no "
                            "torch.npu.memory._set_allocator_settings (verl 0.9 asks for torch-npu >= "
                            "2.9.0 for it); the NPU allocator's expandable segments stay as configured "
                            "at start-up")
            return result
        setter(npu_allocator_setting(enable))
    return result
