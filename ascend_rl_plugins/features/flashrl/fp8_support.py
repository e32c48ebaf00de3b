"""Can this platform serve an FP8 W8A8 (compressed-tensors) model? Asked of vLLM itself.

* vLLM (CUDA, CPU): the compressed-tensors config picks its FP8 W8A8 scheme only when
  ``CompressedTensorsConfig._check_scheme_supported(CompressedTensorsW8A8Fp8
  .get_min_capability())`` holds; otherwise it falls back to W8A16 FP8, which this
  project does not target. On vLLM's CPU backend the device capability is None, so the
  check fails (vLLM 0.13 and 0.23: verified by starting engines on this machine). With
  per-tensor weight scales vLLM's post-processing also needs ``_C.static_scaled_fp8_quant``
  (``requantize_with_max_scale`` for fused layers), which the CPU wheels lack.
* vLLM-Ascend: 0.23 serves compressed-tensors FP8 W8A8 with per-channel weights and
  per-token activations as ``W8A8FP8_DYNAMIC`` (``methods/w8a8fp8_dynamic.py``); 0.13 has
  no such scheme (only MXFP8). Whether the NPU model supports FP8 matmuls is not checked
  here (no NPU).
"""

from __future__ import annotations


def _op_available(name: str) -> bool:
    """A ``torch.ops._C`` op with a real schema (the CPU wheels declare some CUDA ops as
    argument-less stubs)."""
    import torch
    try:
        import vllm._custom_ops  # noqa: F401  (loads _C)
        packet = getattr(torch.ops._C, name)
        return any(len(getattr(packet, o)._schema.arguments) > 0 for o in packet.overloads())
    except Exception:  # noqa: BLE001
        return False


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    for d in (dist, dist + "-cpu"):
        try:
            return version(d)
        except PackageNotFoundError:
            continue
    return None


def fp8_support(strategy: str = "channel") -> tuple[bool, str]:
    """(supported, explanation) for FP8 W8A8 with ``strategy`` weight scales."""
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # noqa: BLE001
        return False, f"vLLM is not importable ({type(exc).__name__}: {exc})"
    plat = type(current_platform).__name__
    va = _version("vllm-ascend")
    if va is not None and getattr(current_platform, "device_name", "") == "npu":
        major_minor = tuple(int(x) for x in va.split(".")[:2])
        if major_minor < (0, 23):
            return False, (f"vLLM-Ascend {va} has no compressed-tensors FP8 W8A8 scheme (0.23 adds "
                           f"W8A8FP8_DYNAMIC)")
        if strategy != "channel":
            return False, (f"vLLM-Ascend {va}'s W8A8FP8_DYNAMIC takes per-channel FP8 weights only "
                           f"(fn: fp8_channel)")
        return True, (f"vLLM-Ascend {va} W8A8FP8_DYNAMIC (per-channel FP8 weights, per-token FP8 activations; "
                      f"whether this NPU has FP8 matmuls is not checked)")
    try:
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsConfig)
        from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsW8A8Fp8
        need = CompressedTensorsW8A8Fp8.get_min_capability()
        ok = bool(CompressedTensorsConfig._check_scheme_supported(need, error=False))
    except Exception as exc:  # noqa: BLE001
        return False, f"vLLM's compressed-tensors FP8 W8A8 scheme could not be queried ({type(exc).__name__}: {exc})"
    vv = _version("vllm")
    if not ok:
        cap = current_platform.get_device_capability()
        return False, (f"vLLM {vv} on {plat} does not select its compressed-tensors FP8 W8A8 scheme: it needs "
                       f"device capability >= {need / 10:.1f} and this platform reports "
                       f"{'none' if cap is None else cap}")
    if strategy == "tensor" and current_platform.is_cpu() and not _op_available("static_scaled_fp8_quant"):
        return False, (f"vLLM {vv} on {plat}: per-tensor FP8 post-processing of fused layers calls "
                       f"_C.static_scaled_fp8_quant, which this wheel lacks; use fn: fp8_channel")
    return True, f"vLLM {vv} compressed-tensors FP8 W8A8 on {plat}"
