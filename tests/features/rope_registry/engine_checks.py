"""rope_registry's checks on the shared in-process engine (see tests/features/shared_engine.py).

Doubles: ``torch.npu`` (a bare module attribute: all that the patch and vLLM's branch look
at) and a ``flash_attn`` package (tests/doubles/flash_attn_double) that makes
``find_spec("flash_attn")`` succeed. Real: vLLM's ApplyRotaryEmb, the engine, importlib.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

FLASH_ATTN_DOUBLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                 "doubles", "flash_attn_double")
PATCH = "rope_registry.find_spec"


def _pretend_npu(on: bool) -> None:
    import torch
    if on:
        torch.npu = types.ModuleType("torch_npu_double")  # what torch_npu registers
    elif hasattr(torch, "npu"):
        del torch.npu


def before_engine(ctx) -> dict:
    """The engine is built on "NPU" with flash_attn importable."""
    ctx.pristine_find_spec = importlib.util.find_spec
    sys.path.insert(0, FLASH_ATTN_DOUBLE)
    _pretend_npu(True)
    return {}


def built_engine(ctx) -> dict:
    _pretend_npu(False)
    from ascend_rl_plugins.patching.core import REGISTRY
    import vllm.triton_utils.importing as other_copy  # another `from importlib.util import find_spec`
    core = ctx.llm.llm_engine.engine_core.engine_core
    model = core.model_executor.driver_worker.worker.model_runner.model
    rotary = [m for m in model.modules() if type(m).__name__ == "ApplyRotaryEmb"]
    return {"state": REGISTRY.patches[PATCH].outcome.state,
            "instances": len(rotary),
            "flash_attn_picked": [m.apply_rotary_emb_flash_attn is not None for m in rotary],
            # only the rotary module's global is replaced: the origin and other copies stay
            "importlib_untouched": importlib.util.find_spec is ctx.pristine_find_spec,
            "other_copy_untouched": other_copy.find_spec is ctx.pristine_find_spec}


def construction(ctx) -> dict:
    """ApplyRotaryEmb built directly, off and on "NPU", with and without the patch. vLLM 0.23
    excludes the CPU platform itself, so there the platform is made to answer "not CPU", as
    the NPU platform does."""
    from vllm.config import VllmConfig, set_current_vllm_config
    import vllm.model_executor.layers.rotary_embedding.common as common

    from ascend_rl_plugins.patching.core import REGISTRY
    if hasattr(common, "current_platform"):
        common.current_platform.is_cpu = lambda: False
    config = VllmConfig()

    def picks_flash_attn() -> bool:
        with set_current_vllm_config(config):  # CustomOp construction reads it in vLLM 0.23
            return common.ApplyRotaryEmb().apply_rotary_emb_flash_attn is not None

    out = {"non_npu_patched": picks_flash_attn()}
    _pretend_npu(True)
    out["npu_patched"] = picks_flash_attn()
    REGISTRY.revert(REGISTRY.patches[PATCH])
    out["npu_unpatched"] = picks_flash_attn()
    _pretend_npu(False)
    return out
