"""FlashRL's device-side checks for ``ascend-rl selftest`` (and the tests that call them).

For each quantizer the rollout reload (and QAT) runs on an accelerator:

* **bit identity**: the public entry point on the device (compiled or eager, whichever this
  device takes) and the eager torch path on the device, each against an independent CPU
  reference on a CPU copy of the same input -- codes and scales compared byte for byte. The
  reference is a numba kernel the package ships (FP8 rows: the block-FP8 kernel with one-row
  or whole-tensor blocks, the same math), or, for fp16 INT4 codes (no kernel takes fp16), a
  numpy evaluation of the documented formula. Never the entry point itself: on a CPU the entry
  point *is* the kernel or the torch path, so comparing it with itself would prove nothing
  (:class:`IdentityCase` refuses such a row). The rows are built with
  :mod:`ascend_rl_plugins.quant.identity`, which INT4 QAT's device check shares;
* **speed** (bf16, the reload's case): the entry point against the formula it replaces
  (:mod:`ascend_rl_plugins.quant.baselines`), against that formula compiled with
  ``torch.compile`` ("fused reference"), and against the time a single read of the weight plus
  a single write of the result takes at the measured copy bandwidth ("limit"); targets: >= 1.5x
  the formula and within 3x of the fused reference (accelerators only: on a CPU the numba
  kernels are measured by ``benchmarks/bench_low_precision.py``);
* **non-finite input**: one NaN and one infinity each give ``NonFiniteWeightError``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

# the identity-row pieces, below the features (INT4 QAT's device check uses them too); the CPU
# references stay reachable here as device_checks.<name>, as before
from ...quant.identity import (IdentityCase, block_fp8_kernel, fp8_rows_by_block_kernel,  # noqa: F401
                               identity_row, int4_ct_codes_numpy)

FORMULA_TARGET = 1.5
FUSED_TARGET = 3.0


@dataclass(frozen=True)
class QuantPath:
    """One quantizer as the self-test drives it: ``ours(w)`` (the public entry point),
    ``eager(w)`` (the torch path), ``reference(w)`` (the independent CPU reference, see
    :class:`IdentityCase`), ``baseline(w)`` (the formula it replaces, or None),
    ``out_bytes(n, k)`` (bytes of its result, for the bandwidth limit)."""
    name: str
    ours: Callable
    eager: Callable
    reference: Callable
    baseline: Callable | None
    out_bytes: Callable
    variants: Callable | None = None   # w -> {compiled variant name: its function}, each timed too

    def __post_init__(self):
        self.identity_case()   # refuses a path whose reference is not independent

    def identity_case(self) -> IdentityCase:
        return IdentityCase(self.name, self.ours, self.eager, self.reference)


def paths() -> list[QuantPath]:
    from ...quant import _cpu_kernels, _int4_kernels, baselines, block_fp8, int4, quant
    ct, slime = int4.Int4Spec(128, "ct"), int4.Int4Spec(128, "slime")
    return [
        QuantPath("INT8 rows (W8A8 reload)", quant.quantize_int8_rows, quant.quantize_int8_rows_torch,
                  _cpu_kernels.quantize_int8_rows_cpu, baselines.flashrl_int8_rows, lambda n, k: n * k + 4 * n),
        QuantPath("FP8 rows, channel (W8A8 FP8 reload)", quant.quantize_fp8_rows,
                  quant.quantize_fp8_rows_torch, functools.partial(fp8_rows_by_block_kernel, strategy="channel"),
                  None, lambda n, k: n * k + 4 * n),
        QuantPath("INT4 pack, ct g128 (W4A16 reload)", functools.partial(int4.quantize_pack, spec=ct),
                  functools.partial(int4.quantize_pack_torch, spec=ct),
                  functools.partial(_int4_kernels.quantize_pack_cpu, spec=ct),
                  lambda w: baselines.slime_int4_quantize_pack(w, 128), lambda n, k: n * k // 2 + 2 * n * k // 128),
        QuantPath("INT4 pack, slime g128", functools.partial(int4.quantize_pack, spec=slime),
                  functools.partial(int4.quantize_pack_torch, spec=slime),
                  functools.partial(_int4_kernels.quantize_pack_cpu, spec=slime),
                  lambda w: baselines.slime_int4_quantize_pack(w, 128), lambda n, k: n * k // 2 + 2 * n * k // 128),
        QuantPath("block FP8 128x128", block_fp8.quantize, block_fp8.quantize_torch, block_fp8_kernel,
                  baselines.slime_block_fp8, lambda n, k: n * k + 4 * (n // 128) * (k // 128), _block_fp8_variants),
    ]


def _block_fp8_variants(w) -> dict:
    """Every compiled block-FP8 form verified on this device (the entry point uses the fastest)."""
    from ...quant import block_fp8
    return {v: (lambda v=v: block_fp8._fused(w, 128, 128, None, None, v)) for v in block_fp8.VARIANTS
            if block_fp8._fused_usable(w, 128, 128, v)}


def _weight(shape, dtype, device, seed: int, *, on_device: bool = False):
    """A random weight with a few outlier columns, as real weights have. Drawn on the CPU (the
    same bits on every device: the identity checks' input), or with ``on_device`` on the device
    itself (the large speed-check weight: host RAM and PCIe are not the point there)."""
    import torch
    where = device if on_device and device.type != "cpu" else torch.device("cpu")
    g = torch.Generator(device=where).manual_seed(seed)
    w = torch.randn(shape, generator=g, dtype=torch.float32, device=where).mul_(0.02)
    w[:, :: max(1, shape[1] // 7)] *= 30.0
    return w.to(dtype).to(device)


def extra_identity_cases() -> list[tuple[IdentityCase, object]]:
    """``(case, dtype)`` of the other dtypes and forms the quantizers accept, beyond the bf16
    reload paths of :func:`paths`."""
    import torch
    from ...quant import _cpu_kernels, _int4_kernels, block_fp8, int4, quant
    ct32, ct64, slime = int4.Int4Spec(32, "ct"), int4.Int4Spec(64, "ct"), int4.Int4Spec(128, "slime")
    partial = functools.partial
    return [
        (IdentityCase("INT8 rows, float32", quant.quantize_int8_rows, quant.quantize_int8_rows_torch,
                      _cpu_kernels.quantize_int8_rows_cpu), torch.float32),
        (IdentityCase("INT4 pack, ct g32, float32", partial(int4.quantize_pack, spec=ct32),
                      partial(int4.quantize_pack_torch, spec=ct32),
                      partial(_int4_kernels.quantize_pack_cpu, spec=ct32)), torch.float32),
        (IdentityCase("INT4 codes, ct g64, fp16", partial(int4.quantize, spec=ct64),
                      partial(int4.quantize_torch, spec=ct64), partial(int4_ct_codes_numpy, spec=ct64)),
         torch.float16),
        (IdentityCase("INT4 fake-quant, slime g128, float32", partial(int4.fake_quantize, spec=slime),
                      partial(int4.fake_quantize_torch, spec=slime),
                      partial(_int4_kernels.fake_quantize_cpu, spec=slime)), torch.float32),
        (IdentityCase("FP8 rows, tensor", partial(quant.quantize_fp8_rows, strategy="tensor"),
                      partial(quant.quantize_fp8_rows_torch, strategy="tensor"),
                      partial(fp8_rows_by_block_kernel, strategy="tensor")), torch.bfloat16),
        (IdentityCase("block FP8, partial edge blocks", block_fp8.quantize, block_fp8.quantize_torch,
                      block_fp8_kernel), torch.bfloat16),
    ]


def identity_checks(ctx, shape, extra_shape) -> list:
    """Every path on ``ctx.device`` vs its independent CPU reference, bf16 (the reload's dtype)
    and the other dtypes the quantizers accept."""
    import torch
    results = []
    for i, p in enumerate(paths()):
        w = _weight(shape, torch.bfloat16, ctx.device, seed=100 + i)
        results.append(identity_row("flashrl", p.identity_case(), w))
    for i, (case, dtype) in enumerate(extra_identity_cases()):
        s = (extra_shape[0] - 37, extra_shape[1] + 96) if "edge" in case.name else extra_shape
        w = _weight(s, dtype, ctx.device, seed=200 + i)
        results.append(identity_row("flashrl", case, w))
    return results


def nonfinite_checks(ctx) -> list:
    """Each entry point refuses a weight holding one NaN, and one holding one infinity."""
    import torch
    from ...selftest import CheckResult
    from ...quant import int4
    from ...quant.device_math import NonFiniteWeightError
    results = []
    entry_points = [(p.name, p.ours) for p in paths()] + [
        ("INT4 fake-quant", lambda w: int4.fake_quantize(w, int4.Int4Spec(128, "ct")))]
    for name, fn in entry_points:
        for bad in (float("nan"), float("inf")):
            w = _weight((256, 512), torch.bfloat16, ctx.device, seed=7)
            w[17, 300] = bad
            try:
                fn(w)
                ok, detail = False, "accepted the weight"
            except NonFiniteWeightError:
                ok, detail = True, ""
            results.append(CheckResult("flashrl", f"refuses {bad}: {name}", ok, detail))
    return results


def speed_checks(ctx, shape) -> list:
    """bf16 ``shape``: each entry point vs its replaced formula, the compiled formula and the
    copy-bandwidth limit. Skipped on CPU (see the module docstring)."""
    import torch
    from ...selftest import CheckResult
    if ctx.device.type == "cpu":
        return [CheckResult("flashrl", "speed vs replaced formulas", None,
                            "on CPU: benchmarks/bench_low_precision.py measures the numba kernels")]
    n, k = shape
    w = _weight(shape, torch.bfloat16, ctx.device, seed=3, on_device=True)
    bandwidth = ctx.copy_bandwidth(min(w.numel() * 2, 1 << 30))
    results = [CheckResult("flashrl", "device copy bandwidth", True, "",
                           {"GB/s (read + write)": bandwidth / 1e9})]
    for p in paths():
        metrics = {}
        ours_s = ctx.seconds(lambda: p.ours(w))
        metrics["ours ms"] = ours_s * 1e3
        limit_s = (w.numel() * 2 + p.out_bytes(n, k)) / bandwidth
        metrics["limit ms"] = limit_s * 1e3
        target_met, target = None, ""
        if p.baseline is not None:
            base_s = ctx.seconds(lambda: p.baseline(w))
            metrics["formula ms"] = base_s * 1e3
            fused_s = _compiled_seconds(ctx, p.baseline, w)
            if fused_s is not None:
                metrics["fused formula ms"] = fused_s * 1e3
            metrics["x formula"] = base_s / ours_s
            target = f">= {FORMULA_TARGET}x the formula" + (f", <= {FUSED_TARGET}x the fused formula"
                                                              if fused_s is not None else "")
            target_met = base_s / ours_s >= FORMULA_TARGET and (fused_s is None or ours_s <= FUSED_TARGET * fused_s)
        if p.variants is not None:
            for variant, fn in p.variants(w).items():
                metrics[f"compiled {variant} ms"] = ctx.seconds(fn, warmup=2) * 1e3
        eager_s = ctx.seconds(lambda: p.eager(w), reps=max(3, ctx.reps // 3))
        metrics["eager torch path ms"] = eager_s * 1e3
        metrics["x limit"] = ours_s / limit_s
        results.append(CheckResult("flashrl", f"speed: {p.name} {tuple(shape)} bf16", True, "", metrics,
                                   target, target_met))
        torch.cuda.empty_cache() if ctx.device.type == "cuda" else None
    return results


def _compiled_seconds(ctx, formula, w):
    """Time of ``torch.compile(formula)`` on ``w`` (None where it does not compile)."""
    try:
        import torch
        fn = torch.compile(formula, dynamic=False)
        return ctx.seconds(lambda: fn(w), warmup=2)
    except Exception:  # noqa: BLE001 - no compiler for this device: no fused reference
        return None


def scalar_division_row(ctx):
    """Whether this device evaluates ``tensor / python_number`` differently from a true division
    (CUDA: a multiply by the float32 reciprocal). Informative: the quantizers never divide by a
    host scalar, which is why their bits do not depend on the answer."""
    import torch
    from ...selftest import CheckResult
    from ...quant.device_math import constant
    g = torch.Generator().manual_seed(11)
    x = (torch.rand(1 << 20, generator=g) * 1000).to(ctx.device)
    host = x / 127.0
    true = x / constant(127.0, x)
    differ = int((host != true).sum())
    return CheckResult("flashrl", "device division by a host scalar (informative)", True,
                       f"{differ} of {x.numel()} quotients x / 127.0 differ from the IEEE division "
                       f"(the quantizers divide by device tensors)", {"differing quotients": differ})


def run(ctx) -> list:
    quick = ctx.quick
    if ctx.device.type == "cpu":
        id_shape, speed_shape = ((256, 1024) if quick else (2048, 4096)), None
        extra_shape = id_shape
    else:
        id_shape = (4096, 4096) if quick else (393216, 4096)
        extra_shape = (4096, 4096)
        speed_shape = (12288, 4096) if quick else (393216, 4096)
    results = [scalar_division_row(ctx)]
    results += identity_checks(ctx, id_shape, extra_shape)
    results += nonfinite_checks(ctx)
    results += speed_checks(ctx, speed_shape or id_shape)
    results += compiled_path_rows(ctx)
    return results


def compiled_path_rows(ctx) -> list:
    """Which quantizers ran compiled on this device, and why the others did not."""
    from ...selftest import CheckResult
    from ...quant.fused import STATE, mode, wanted
    if not wanted(ctx.device):
        return [CheckResult("flashrl", "compiled (fused) quantizers", None,
                            f"not used on {ctx.device.type} (ASCEND_RL_FLASHRL_DEVICE_FUSED={mode()}; CPUs use the "
                            f"numba kernels)")]
    rows = []
    for (kind, dev, dtype), used in sorted(STATE.verdicts.items()):
        rows.append(CheckResult("flashrl", f"compiled path: {kind} {dtype.replace('torch.', '')} on {dev}",
                                True if used else None,
                                "in use (verified bit-identical to the eager path at first use)" if used else
                                f"eager fallback: {STATE.reasons.get((kind, dev, dtype), '')}"))
    return rows
