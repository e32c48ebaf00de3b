"""RoPE registry: never pick the flash_attn Triton rotary kernel on an Ascend NPU.

vLLM's ``ApplyRotaryEmb.__init__`` imports flash_attn's CUDA Triton rotary kernel whenever
``find_spec("flash_attn")`` finds the package (vLLM 0.23 excludes only the CPU platform). That
module looks ``find_spec`` up as a module global, so that one name in that one module is
replaced by a function answering "not installed" for flash_attn when ``torch.npu`` exists and
deferring to ``importlib.util.find_spec`` otherwise; from-import rebinding is off, so no other
module's ``find_spec`` changes. README.md beside this file: why, flags, verified where.

Remove when: vLLM gates the kernel on a CUDA-alike platform instead of the package's presence.
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
    replaces="Qwen3 RL recipe vLLM patch 0003-vllm-bugfix-rope_registry",
    verified=Verified(
        cpu_runtime="real ApplyRotaryEmb (vLLM 0.13, 0.23) and real engines; other find_spec "
                    "copies untouched",
        doubles="a torch.npu double and a flash_attn double package",
        static="hook point (module-global find_spec called with flash_attn) in vLLM 0.13 and 0.23"),
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
    replaces="recipe vLLM patch 0003 (edits ApplyRotaryEmb.__init__)",
    remove_when="vLLM gates the flash_attn rotary kernel on a CUDA-alike platform")
