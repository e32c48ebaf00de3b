"""RoPE registry: never pick the flash_attn Triton rotary kernel on an Ascend NPU.

Why: ``ApplyRotaryEmb.__init__`` (vLLM ``model_executor/layers/rotary_embedding/common.py``,
built by every rotary embedding) imports ``flash_attn.ops.triton.rotary`` whenever
``find_spec("flash_attn")`` finds the package. On an NPU host where some dependency
pulled ``flash_attn`` in, that import of a CUDA Triton kernel breaks model construction
(seed 003, vLLM patch 0003). vLLM 0.23 added a guard, but only for the CPU platform
(``not current_platform.is_cpu()``); the NPU platform still takes the branch.

Fix: the module looks ``find_spec`` up as a module global (``from importlib.util import
find_spec``), so that one name is rebound in that one module to a function that answers
"not installed" for ``flash_attn`` when ``torch.npu`` exists (torch_npu registers it) and
defers to the real ``importlib.util.find_spec`` otherwise. Nothing else is touched (the
framework's from-import rebinding is switched off: other modules' ``find_spec`` stay).

Remove when: vLLM checks the platform (or the kernel's usability) instead of the package
being importable, e.g. guards the branch with ``current_platform.is_cuda_alike()``.
"""

from __future__ import annotations

import importlib.util
import sys

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_ROPE_NO_FLASH_ATTN", "bool", True,
    "Hide flash_attn from vLLM's rotary-embedding kernel choice on Ascend NPU (acts only "
    "when torch.npu exists; on other devices vLLM's own choice is unchanged).",
    feature="rope_registry")

FEATURE = Feature(
    "rope_registry", "Do not pick the flash_attn Triton rotary kernel on NPU.", flag=ENABLE,
    replaces="seed 003 vLLM 0003-vllm-bugfix-rope_registry",
    verified=Verified(
        cpu_runtime="real ApplyRotaryEmb and a real vLLM 0.13 engine",
        doubles="a torch.npu double and a flash_attn double package"),
    stacks="recipe, current")

HIDDEN_PACKAGE = "flash_attn"


def running_on_npu() -> bool:
    """torch_npu registers ``torch.npu``; no import happens here."""
    torch = sys.modules.get("torch")
    return torch is not None and hasattr(torch, "npu")


def find_spec_hiding_flash_attn_on_npu(name, package=None):
    """``importlib.util.find_spec`` that answers None for flash_attn on NPU."""
    if running_on_npu() and (name == HIDDEN_PACKAGE or name.startswith(HIDDEN_PACKAGE + ".")):
        return None
    return importlib.util.find_spec(name, package)


FEATURE.replace(
    "vllm.model_executor.layers.rotary_embedding.common:find_spec",
    find_spec_hiding_flash_attn_on_npu, dist="vllm", versions=">=0.13,<0.24", rebind=False,
    name="rope_registry.find_spec",
    reason="ApplyRotaryEmb imports the CUDA Triton rotary kernel of flash_attn whenever the "
           "package is importable; vLLM's guard only excludes the CPU platform, not NPU",
    replaces="seed vLLM 0003 (edits ApplyRotaryEmb.__init__)",
    remove_when="vLLM gates the flash_attn rotary kernel on a CUDA-alike platform")
