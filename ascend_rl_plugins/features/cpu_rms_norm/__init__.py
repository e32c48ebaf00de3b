"""vLLM 0.13 on CPU: RMSNorm of a strided view (Qwen3's per-head q/k norm) reads wrong rows.

Why: on CPU, vLLM 0.13's ``RMSNorm`` calls ``layernorm.rms_norm``, which hands its input to
the C++ ``_C.rms_norm`` kernel. That kernel assumes rows are contiguous; Qwen3 (and other
q/k-norm models) normalize ``q.view(tokens, heads, head_dim)`` where ``q`` is a column
slice of the fused qkv projection, so every row after the first is read from the wrong
place. The result is wrong logits from the first token and outputs that change with the
batch a request shares (measured on a tiny Qwen3: vLLM 0.13 disagreed with Hugging Face
transformers on every prompt; the kernel alone is off by ~7 in absolute value on a
strided input). vLLM 0.23 normalizes in PyTorch on CPU and matches transformers.

Fix: give the kernel a contiguous copy when the input is a strided CPU view (the copy is
one activation tensor; contiguous inputs and non-CPU tensors are untouched).

Remove when: running vLLM >= 0.23 on CPU (or the kernel honours input strides).
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
    flag=ENABLE, replaces="(found here; not in the seeds)",
    verified=Verified(
        cpu_runtime="the real vLLM 0.13 CPU kernel on a strided view, and a real vLLM 0.13 engine "
                    "against Hugging Face transformers"), stacks="recipe")


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
