"""Block-wise FP8 (E4M3) weight quantization: 128x128 blocks, one float32 scale per block.

This is the layout DeepSeek-V3-style FP8 checkpoints use and vLLM's ``Fp8Config`` reads
when ``quantization_config`` has ``weight_block_size: [128, 128]`` (slime's "FP8 rollout"
converter writes it): ``weight`` ``float8_e4m3fn [out, in]`` and ``weight_scale_inv``
``float32 [ceil(out/128), ceil(in/128)]``. Despite its name ``weight_scale_inv`` is the
*dequantization* scale (``w ~ weight * weight_scale_inv`` per block). compressed-tensors'
``FP8_BLOCK`` preset stores the same tensor as ``weight_scale`` (block strategy,
``block_structure [128, 128]``). Edge blocks (``out`` or ``in`` not a multiple of 128)
are partial: their scale covers only the elements that exist.

Formula (float32 throughout, one rounding to E4M3 at the end)::

    scale[i, j] = float32(amax |w[block i, j]|) / 448         (a zero scale -> float32 eps)
    q           = float8_e4m3fn(clamp(float32(w) / scale, -448, 448) + 0)   (nearest even)

(``+ 0`` turns ``-0.0`` into ``+0.0``, as compressed-tensors' zero point does.) slime's
/ DeepGEMM's formula multiplies by ``1 / scale`` and clamps the amax at 1e-4 instead;
the division is used here so the codes are compressed-tensors', and the scale the
engine multiplies back is exactly the stored one.

On CPU a numba kernel (``_int4_kernels.block_fp8_cpu``) does two passes per
block with no full-size temporaries; on an accelerator a compiled one-kernel form
(:mod:`.fused`, weights made of whole blocks; of four equivalent forms the one measured
fastest on the device at first use) does; the blocked torch path is bit-identical
to both (tested). The division by 448 divides by a device tensor (:mod:`.device_math`). A
NaN/inf weight is refused (:class:`~.device_math.NonFiniteWeightError`, naming the tensor).
"""

from __future__ import annotations

import logging

from . import device_math

log = logging.getLogger(__name__)

BLOCK = (128, 128)
FP8_MAX = 448.0
DEFAULT_BLOCK_BYTES = device_math.CPU_BLOCK_BYTES  # torch path on CPU; accelerators: block_bytes_for
_F32_EPS = 2.0 ** -23


def _check(weight, block):
    if weight.dim() != 2:
        raise ValueError(f"block FP8 expects a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"block FP8 expects a floating-point weight, got {weight.dtype}")
    bn, bk = (int(b) for b in block)
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block must be two positive sizes, got {block}")
    n, k = weight.shape
    return n, k, bn, bk, -(-n // bn), -(-k // bk)


def _outputs(weight, n, k, nb, kb, out_weight, out_scale_inv):
    import torch
    if out_weight is None:
        out_weight = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=weight.device)
    elif tuple(out_weight.shape) != (n, k) or out_weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"out_weight must be float8_e4m3fn {(n, k)}, got {out_weight.dtype} "
                         f"{tuple(out_weight.shape)}")
    if out_scale_inv is None:
        out_scale_inv = torch.empty((nb, kb), dtype=torch.float32, device=weight.device)
    elif tuple(out_scale_inv.shape) != (nb, kb) or out_scale_inv.dtype != torch.float32:
        raise ValueError(f"out_scale_inv must be float32 {(nb, kb)}, got {out_scale_inv.dtype} "
                         f"{tuple(out_scale_inv.shape)}")
    return out_weight, out_scale_inv


def quantize(weight, block=BLOCK, *, out_weight=None, out_scale_inv=None, name: str | None = None):
    """``(float8_e4m3fn [out, in], scale_inv float32 [ceil(out/bn), ceil(in/bk)])``.
    ``out_*`` are written in place when given. CPU -> numba kernel; accelerator -> compiled
    kernel (:mod:`.fused`) where verified and the weight is whole blocks; otherwise torch."""
    import torch
    n, k, bn, bk, nb, kb = _check(weight, block)
    if (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
            and all(o is None or (o.device.type == "cpu" and o.is_contiguous()) for o in (out_weight, out_scale_inv))):
        from . import _int4_kernels
        out_weight, out_scale_inv = _outputs(weight, n, k, nb, kb, out_weight, out_scale_inv)
        _int4_kernels.block_fp8_cpu(weight, bn, bk, out_weight, out_scale_inv)
    elif n % bn == 0 and k % bk == 0 and (variant := _variant(weight, bn, bk)):
        out_weight, out_scale_inv = _fused(weight, bn, bk, out_weight, out_scale_inv, variant)
    else:
        return quantize_torch(weight, block, out_weight=out_weight, out_scale_inv=out_scale_inv, name=name)
    device_math.require_finite(out_scale_inv, "block FP8 quantization", name)
    return out_weight, out_scale_inv


# The compiled block-FP8 forms, all the same math (bit-identical, each checked at first use):
# which one an accelerator's compiler schedules best is measured there, not assumed (the four
# forms' times on an H200: features/flashrl/DESIGN.md, the device A/B table).
VARIANTS = ("one_graph", "direct", "split", "three_pass")
TUNE_BYTES = 256 << 20     # the synthetic weight the variants are timed on at first use


def _fused_usable(weight, bn: int, bk: int, variant: str = "one_graph") -> bool:
    """The compiled ``variant`` for this weight's dtype and width (whole blocks) passed its
    first-use check, on probes of that width (its kernels are compiled per width): the tie
    probe gives :func:`quantize_torch`'s bits, and on the NaN/inf probe exactly the blocks
    holding a non-finite weight get a non-finite scale (the refusal)."""
    from . import fused
    k = weight.shape[1]

    def check():
        ties = fused.probe_weight(weight.device, weight.dtype, rows=3 * bn, cols=k)
        if not all(map(fused.same_bits, _fused(ties, bn, bk, None, None, variant),
                       quantize_torch(ties, (bn, bk)))):
            return False
        bad = fused.nonfinite_probe(weight.device, weight.dtype, rows=3 * bn, cols=k)
        return fused.nonfinite_where_expected(_fused(bad, bn, bk, None, None, variant)[1], bad, bn, bk)
    return fused.usable(f"block_fp8 {variant} {bn}x{bk}", weight, check, f"{k} columns")


def _variant(weight, bn: int, bk: int) -> str | None:
    """The compiled form used for ``weight``'s (device type, dtype, width): the fastest verified
    variant, timed once on a synthetic weight of ``TUNE_BYTES``; None when none is verified."""
    from . import fused
    key = ("block_fp8", weight.device.type, str(weight.dtype), weight.shape[1], bn, bk)
    if key not in fused.STATE.choices:
        usable = [v for v in VARIANTS if _fused_usable(weight, bn, bk, v)]
        fused.STATE.choices[key] = choose_variant(usable, lambda v: _time_variant(weight, bn, bk, v))
    return fused.STATE.choices[key]


def choose_variant(usable, seconds) -> str | None:
    """The variant of ``usable`` with the smallest ``seconds(variant)`` (the first on ties); the
    choice and the times are logged once."""
    if not usable:
        return None
    if len(usable) == 1:
        return usable[0]
    times = {v: seconds(v) for v in usable}
    best = min(usable, key=lambda v: times[v])
    log.info("flashrl: compiled block FP8 variant %s chosen (%s)", best,
             ", ".join(f"{v} {t * 1e3:.3f} ms" for v, t in times.items()))
    return best


def _time_variant(weight, bn: int, bk: int, variant: str, reps: int = 3) -> float:
    """Median seconds of ``variant`` on a random weight of ``TUNE_BYTES`` (whole blocks) on
    ``weight``'s device, after one warm-up call (the compile)."""
    import statistics
    import time
    import torch
    k = weight.shape[1]
    rows = max(bn, TUNE_BYTES // (k * weight.element_size()) // bn * bn)
    w = torch.randn(rows, k, device=weight.device, dtype=torch.float32).mul_(0.02).to(weight.dtype)
    sync = getattr(getattr(torch, weight.device.type, None), "synchronize", lambda: None)
    _fused(w, bn, bk, None, None, variant)
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _fused(w, bn, bk, None, None, variant)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fused(weight, bn: int, bk: int, out_weight, out_scale_inv, variant: str = "one_graph"):
    """The compiled ``variant`` over the weight: one call when the result is returned, else
    strips of whole block rows (about the device block size of output) copied into place."""
    import torch
    from . import fused
    n, k = weight.shape
    fp8_max = device_math.constant(FP8_MAX, weight, torch.float64, shape=(1,))
    eps = device_math.constant(_F32_EPS, weight, shape=(1,))
    dtype_width = (str(weight.dtype), k)
    if variant in ("split", "three_pass"):
        apply_fn = fused.compiled("block_fp8_apply", dtype_width, rows_args=(0, 1), bn=bn, bk=bk)
        if variant == "split":
            scale_fn = fused.compiled("block_scale", dtype_width, bn=bn, bk=bk)
        else:
            runs_fn = fused.compiled("block_runs", dtype_width, bk=bk)
            from_runs_fn = fused.compiled("block_scale_from_runs", dtype_width, bn=bn)

            def scale_fn(w, fp8_max, eps):
                return from_runs_fn(runs_fn(w), fp8_max, eps)

        def fn(w, fp8_max, eps):
            s, r = scale_fn(w, fp8_max, eps)
            return apply_fn(w, r), s
    else:
        one_graph = fused.compiled("block_fp8" if variant == "one_graph" else "block_fp8_direct", dtype_width,
                                   bn=bn, bk=bk)

        def fn(w, fp8_max, eps):
            q, s, _reciprocal = one_graph(w, fp8_max, eps)
            return q, s
    if out_weight is None and out_scale_inv is None and n:
        return fn(weight, fp8_max, eps)
    out_weight, out_scale_inv = _outputs(weight, n, k, n // bn, k // bk, out_weight, out_scale_inv)
    step = max(1, device_math.block_bytes_for(weight.device) // max(1, k * bn))  # block rows per call
    for i0 in range(0, n // bn, step):
        i1 = min(n // bn, i0 + step)
        q, s = fn(weight[i0 * bn: i1 * bn], fp8_max, eps)
        out_weight[i0 * bn: i1 * bn].copy_(q)
        out_scale_inv[i0:i1].copy_(s)
    return out_weight, out_scale_inv


def quantize_torch(weight, block=BLOCK, *, out_weight=None, out_scale_inv=None,
                   block_bytes: int | None = None, name: str | None = None):
    """Device-agnostic torch implementation of :func:`quantize`: a few rows of blocks at a
    time (about ``block_bytes`` of float32 -- per-op overhead dominates below a few MiB on
    CPU; 512 MiB on an accelerator), so the extra memory stays bounded whatever the size of
    the weight."""
    import torch
    n, k, bn, bk, nb, kb = _check(weight, block)
    out_weight, out_scale_inv = _outputs(weight, n, k, nb, kb, out_weight, out_scale_inv)
    step = max(1, device_math.block_bytes_for(weight.device, block_bytes) // (4 * kb * bk * bn))
    fp8_max = device_math.constant(FP8_MAX, weight)
    with torch.no_grad():
        for i0 in range(0, nb, step):
            i1 = min(nb, i0 + step)
            r0, r1 = i0 * bn, min(n, i1 * bn)
            strip = weight[r0:r1].to(torch.float32, copy=True)  # never the input itself
            if (r1 - r0) % bn or k % bk:  # zero padding to whole blocks (no block's amax changes)
                strip = torch.nn.functional.pad(strip, (0, kb * bk - k, 0, (i1 - i0) * bn - (r1 - r0)))
            blocks = strip.view(i1 - i0, bn, kb, bk)
            s = blocks.abs().amax(dim=3).amax(dim=1).div_(fp8_max)  # [rows of blocks, kb]
            s = torch.where(s == 0, torch.full_like(s, _F32_EPS), s)
            out_scale_inv[i0:i1].copy_(s)
            q = blocks.div_(s.view(i1 - i0, 1, kb, 1)).clamp_(-FP8_MAX, FP8_MAX).add_(0.0)
            out_weight[r0:r1].copy_(q.view((i1 - i0) * bn, kb * bk)[: r1 - r0, :k])
    device_math.require_finite(out_scale_inv, "block FP8 quantization", name)
    return out_weight, out_scale_inv


def dequantize(weight_fp8, scale_inv, block=BLOCK, dtype=None):
    """``weight * scale_inv`` per block (float32 product), cast to ``dtype`` (bf16 default)."""
    import torch
    dtype = torch.bfloat16 if dtype is None else dtype
    n, k = weight_fp8.shape
    bn, bk = (int(b) for b in block)
    s = scale_inv.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (weight_fp8.float() * s).to(dtype)
