"""vLLM 0.13 on CPU: RMSNorm of a strided view (Qwen3's per-head q/k norm) reads wrong rows.

The CPU C++ kernel behind ``layernorm.rms_norm`` assumes contiguous rows; the wrapper gives it
a contiguous copy of strided CPU inputs (contiguous and non-CPU tensors pass untouched).
README.md beside this file: why, flags, verified where. Remove when: running vLLM >= 0.23 on
CPU (it normalizes in PyTorch there) or the kernel honours input strides.
"""

from __future__ import annotations

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_CPU_RMS_NORM_FIX", "bool", True,
    "vLLM 0.13 on CPU: give the C++ RMSNorm kernel a contiguous input (it ignores strides, "
    "so Qwen3's q/k norm produced wrong logits). Acts only on strided CPU tensors.",
    feature="cpu_rms_norm")

FEATURE = Feature(
    "cpu_rms_norm", "vLLM 0.13 CPU RMSNorm on strided inputs (Qwen3 q/k norm) made correct.",
    flag=ENABLE, replaces="(found here; not in the Qwen3 RL recipe)",
    verified=Verified(
        cpu_runtime="the real vLLM 0.13 CPU kernel on a strided view, patched and not; real vLLM "
                    "0.13 and 0.23 engines against Hugging Face transformers"), stacks="recipe")


@FEATURE.wrap("vllm.model_executor.layers.layernorm:rms_norm", dist="vllm",
              versions=">=0.13,<0.14", params=("x", "weight", "variance_epsilon"),
              reason="the CPU C++ rms_norm kernel ignores input strides; Qwen3's q/k norm passes "
                     "a strided view of the fused qkv output, so logits are wrong on CPU",
              remove_when="running vLLM >= 0.23 on CPU (normalizes in PyTorch there)")
def contiguous_rms_norm_input(wrapped, instance, args, kwargs):
    x = args[0] if args else kwargs["x"]
    if x.device.type == "cpu" and not x.is_contiguous():
        if args:
            args = (x.contiguous(),) + tuple(args[1:])
        else:
            kwargs = dict(kwargs, x=x.contiguous())
    return wrapped(*args, **kwargs)
