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


# -- W4A16 and block FP8 ------------------------------------------------------------------------

ALTERNATIVES = ("int8 W8A8 configs (`ascend-rl flashrl setup -m W8A8 -p PROFILE --fn int8`), per-channel FP8 "
                "(`--fn fp8_channel`, vLLM-Ascend >= 0.23 W8A8FP8_DYNAMIC) and bf16")


def _on_npu() -> tuple[bool, str | None]:
    from vllm.platforms import current_platform
    va = _version("vllm-ascend")
    return (va is not None and getattr(current_platform, "device_name", "") == "npu"), va


def _amx() -> bool:
    import torch
    return bool(torch.cpu._is_amx_tile_supported())


CPU_W4A16_MATMUL = "cpu_gemm_wna16"  # torch.ops._C.<this>: the matmul of CPUWNA16LinearKernel's W4A16 mode


def cpu_w4a16_matmul_missing() -> str | None:
    """Why the vLLM CPU kernel library this process loads has no W4A16 matmul, else None.

    vLLM 0.23 selects ``CPUWNA16LinearKernel`` for a W4A16 layer without asking whether its
    matmul, ``torch.ops._C.cpu_gemm_wna16``, exists in the loaded library: an engine on a build
    without it loads the model and then fails at its warm-up forward with an AttributeError.
    Its x86 CPU wheel ships three kernel libraries and loads one by the CPU's ISA
    (``CpuPlatform.import_kernels``); the op is in the AVX-512 ones (``_C``, ``_C_AVX512``),
    not in ``_C_AVX2``, which AVX2-only x86 CPUs get. Asked by loading the kernels as vLLM
    does (``vllm._custom_ops``), so the answer is the engine's on this CPU."""
    if _op_available(CPU_W4A16_MATMUL):
        return None
    import torch
    from vllm.platforms import CpuArchEnum, current_platform
    vv = _version("vllm")
    head = (f"vLLM {vv}'s CPU kernel library loaded here has no torch.ops._C.{CPU_W4A16_MATMUL}, the W4A16 matmul "
            f"CPUWNA16LinearKernel calls in every forward (the engine would load the model and then fail at its "
            f"warm-up with an AttributeError)")
    if current_platform.get_cpu_architecture() == CpuArchEnum.X86 and not torch.cpu._is_avx512_supported():
        return (f"{head}; vLLM's x86 CPU build has it only in its AVX-512 kernel libraries (_C, _C_AVX512), and "
                f"this CPU has no AVX-512, so vLLM loaded _C_AVX2: W4A16 rollout on vLLM's CPU backend needs an "
                f"x86 CPU with AVX-512")
    return f"{head}; this vLLM CPU build was made without W4A16 CPU support"


def w4a16_support(env=None) -> tuple[bool, str]:
    """(supported, explanation): can this platform serve a compressed-tensors W4A16
    (pack-quantized, symmetric, group-wise) checkpoint *and* take flashrl's online reload?

    * vLLM CPU: 0.23 has ``CPUWNA16LinearKernel``, whose matmul is missing from the kernel
      library vLLM loads on AVX2-only x86 CPUs (:func:`cpu_w4a16_matmul_missing`); its W4A16
      mode needs ``VLLM_CPU_INT4_W4A8=0`` on AMX CPUs (otherwise vLLM quantizes the activations
      to int8: W4A8, not what the trainer's QAT sees). vLLM 0.13's CPU build has no W4A16
      kernel for compressed-tensors checkpoints (nor ``cpu_gemm_wna16`` in its x86 wheel).
    * vLLM-Ascend 0.13 / 0.23: W4A16 only for fused-MoE experts (a dense linear raises); the
      reload into its MoE layout is not provided (not verifiable without an NPU).
    """
    import os
    env = os.environ if env is None else env
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # noqa: BLE001
        return False, f"vLLM is not importable ({type(exc).__name__}: {exc})"
    npu, va = _on_npu()
    vv = _version("vllm")
    if npu:
        return False, (f"vLLM-Ascend {va} serves W4A16 only for fused-MoE experts (AscendW4A16FusedMoEMethod; a "
                       f"dense W4A16 linear raises) and flashrl's online reload into that layout is not provided "
                       f"(nothing of it has run on an NPU)")
    if not current_platform.is_cpu():
        return False, (f"flashrl's W4A16 reload is verified on vLLM's CPU kernel only, not on "
                       f"{type(current_platform).__name__}")
    try:
        from vllm.model_executor.kernels.linear.mixed_precision import cpu as wna16_cpu
        has_kernel = hasattr(wna16_cpu, "CPUWNA16LinearKernel")
    except Exception:  # noqa: BLE001
        has_kernel = False
    if not has_kernel:
        return False, (f"vLLM {vv}'s CPU build has no W4A16 kernel (CPUWNA16LinearKernel is in vLLM 0.23, not "
                       f"in {vv}; its Dynamic4bitLinearKernel takes signed int4 with dynamic activations only)")
    missing = cpu_w4a16_matmul_missing()
    if missing is not None:
        return False, missing
    if _amx() and str(env.get("VLLM_CPU_INT4_W4A8", "1")).strip() not in ("0", "false", "False"):
        return False, (f"on this AMX CPU vLLM {vv}'s CPUWNA16 kernel would run W4A8 (int8 activations, not "
                       f"what the trainer sees); set VLLM_CPU_INT4_W4A8=0 for W4A16")
    return True, f"vLLM {vv} CPUWNA16LinearKernel (W4A16 mode)"


def block_fp8_support() -> tuple[bool, str]:
    """(served, explanation): can this platform serve a 128x128 block-FP8 checkpoint
    (``quant_method: fp8``, ``weight_block_size: [128, 128]``, float32 ``weight_scale_inv``)?

    * vLLM CPU 0.23: ``CPUFp8BlockScaledMMKernel`` (FP8 weights, BF16 activations) where
      vLLM says so: it needs AMX tiles (its ``is_supported``; the ``_C.fp8_scaled_mm_cpu``
      op itself also runs without AMX, vLLM refuses anyway). vLLM 0.13 CPU: no such kernel.
    * vLLM-Ascend 0.13: no ``fp8`` quantization method. 0.23: its ``fp8`` method is an MXFP8
      path that keeps only the exponent of each block scale (power-of-two scales), so a
      generic block-FP8 checkpoint would be served with wrong scales.
    """
    try:
        npu, va = _on_npu()
    except Exception as exc:  # noqa: BLE001
        return False, f"vLLM is not importable ({type(exc).__name__}: {exc})"
    if npu:
        mm = tuple(int(x) for x in va.split(".")[:2])
        if mm < (0, 23):
            return False, f"vLLM-Ascend {va} has no fp8 quantization method"
        return False, (f"vLLM-Ascend {va}'s fp8 method (AscendW8A8MXFP8DSDynamicLinearMethod) keeps only the "
                       f"exponent of each 128x128 block scale (MXFP8, power-of-two scales), so a generic block-FP8 "
                       f"checkpoint cannot be served exactly")
    vv = _version("vllm")
    try:
        from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel
    except Exception:  # noqa: BLE001
        return False, f"vLLM {vv} has no CPU block-FP8 kernel (CPUFp8BlockScaledMMKernel is in vLLM 0.23)"
    ok, why = CPUFp8BlockScaledMMKernel.is_supported()
    if not ok:
        return False, f"vLLM {vv} refuses CPU block FP8 here: CPUFp8BlockScaledMMKernel {why}"
    return True, f"vLLM {vv} CPUFp8BlockScaledMMKernel (AMX; FP8 weights, BF16 activations)"
