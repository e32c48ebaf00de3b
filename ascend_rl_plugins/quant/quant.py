"""INT8 and FP8 W8A8 quantization math (torch, any device).

One function, :func:`quantize_int8_rows`, is used by the offline checkpoint writer, by
the profile round trip and by the online reload, so the three agree bit for bit.

Layout and rounding follow compressed-tensors W8A8 ("channel" weight strategy,
symmetric, no zero point) as consumed by vLLM's ``CompressedTensorsW8A8Int8`` and by
vLLM-Ascend's ``AscendW8A8LinearMethod`` / ``AscendW8A8DynamicLinearMethod``:

    weight_int8[n, k] = clamp(round_half_even(w[n, k] * s_col[k] * g_row[n] / scale[n]), -128, 127)
    scale[n]          = max_k |w[n, k] * s_col[k] * g_row[n]| / 127         (float32)

``s_col`` is the SmoothQuant input smoothing of the layer (folded into the preceding
norm: ``norm' = norm / s_col``) and ``g_row`` a per-output-row gain (used to move
``down_proj``'s input smoothing into ``up_proj``: ``up' = up / s_down``).

The torch path works in row blocks of about ``block_bytes`` of float32, in place, so the
peak extra memory is one block (16 MiB on CPU, up to 512 MiB on an accelerator) whatever the
size of the tensor (FlashRL's formula materialises several full-size float32 temporaries
instead). On CPU a numba kernel fuses everything per row (see :mod:`._cpu_kernels`); on an
accelerator a compiled one-kernel form does (:mod:`.fused`). Divisions by a constant divide
by a device tensor (:mod:`.device_math`), so the bits do not depend on the device.

FP8 (:func:`quantize_fp8_rows`) follows compressed-tensors FP8 W8A8 ("float-quantized",
E4M3 ``float8_e4m3fn``, symmetric), as consumed by vLLM's ``CompressedTensorsW8A8Fp8``
and vLLM-Ascend 0.23's ``W8A8FP8_DYNAMIC``:

    scale   = amax / 448      per output row ("channel", [out, 1]) or per tensor ("tensor", [1])
    w_fp8   = float8_e4m3fn(clamp(w * s_col * g_row / scale + 0, -448, 448))   (round to nearest even)

(the ``+ 0`` is compressed-tensors' zero point: it turns -0.0 into +0.0, which matters for
bit identity in E4M3). A zero scale becomes float32 eps, as in compressed-tensors 0.17.
"""

from __future__ import annotations

import torch

from . import device_math

# the INT8 format's constants (defined in .formats, which the CPU kernel imports too)
from .formats import MIN_SCALE, QMAX  # noqa: F401

DEFAULT_BLOCK_BYTES = device_math.CPU_BLOCK_BYTES  # CPU; accelerators: device_math.block_bytes_for


def _block_rows(n_cols: int, block_bytes: int) -> int:
    return max(1, block_bytes // max(1, 4 * n_cols))


def _int8_outputs(weight, out, scale_out):
    n, k = weight.shape
    if out is None:
        out = torch.empty((n, k), dtype=torch.int8, device=weight.device)
    elif out.shape != (n, k) or out.dtype != torch.int8:
        raise ValueError(f"out must be int8 {tuple(weight.shape)}, got {out.dtype} {tuple(out.shape)}")
    if scale_out is None:
        scale_out = torch.empty((n, 1), dtype=torch.float32, device=weight.device)
    elif scale_out.numel() != n:
        raise ValueError(f"scale_out must hold {n} scales, got {tuple(scale_out.shape)}")
    return out, scale_out


def _factors(weight, col_smooth, row_gain):
    n, k = weight.shape
    col = None if col_smooth is None else col_smooth.to(device=weight.device, dtype=torch.float32).reshape(1, k)
    gain = None if row_gain is None else row_gain.to(device=weight.device, dtype=torch.float32).reshape(n, 1)
    return col, gain


@torch.no_grad()
def quantize_int8_rows(weight: torch.Tensor, col_smooth: torch.Tensor | None = None,
                       row_gain: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                       scale_out: torch.Tensor | None = None, block_bytes: int | None = None,
                       name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric INT8 quantization of a 2-D ``[out, in]`` weight.

    Returns ``(int8 [out, in], float32 scale [out, 1])``; writes into ``out`` /
    ``scale_out`` when given (e.g. straight into a parameter's storage). On CPU a fused
    numba kernel (one pass per row, row kept in cache) does the work; on an accelerator the
    compiled one-kernel form (:mod:`.fused`) where available, else the blocked torch version.
    All give identical bits (tested). A NaN/inf weight raises
    :class:`~.device_math.NonFiniteWeightError` naming ``name``.
    """
    if weight.dim() != 2:
        raise ValueError(f"quantize_int8_rows expects a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    if (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
            and (out is None or (out.device.type == "cpu" and out.is_contiguous()))
            and (scale_out is None or (scale_out.device.type == "cpu" and scale_out.is_contiguous()))):
        from . import _cpu_kernels
        out, scale_out = _cpu_kernels.quantize_int8_rows_cpu(weight, col_smooth, row_gain, out=out,
                                                             scale_out=scale_out)
    elif _fused_usable("int8_rows", weight, col_smooth, row_gain):
        out, scale_out = _int8_rows_fused(weight, col_smooth, row_gain, out, scale_out, block_bytes)
    else:
        out, scale_out = _int8_rows_eager(weight, col_smooth, row_gain, out, scale_out, block_bytes)
    device_math.require_finite(scale_out, "INT8 quantization", name)
    return out, scale_out


@torch.no_grad()
def quantize_int8_rows_torch(weight: torch.Tensor, col_smooth: torch.Tensor | None = None,
                             row_gain: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                             scale_out: torch.Tensor | None = None, block_bytes: int | None = None,
                             name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Device-agnostic blocked torch implementation of :func:`quantize_int8_rows` (eager ops)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_int8_rows expects a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    out, scale_out = _int8_rows_eager(weight, col_smooth, row_gain, out, scale_out, block_bytes)
    device_math.require_finite(scale_out, "INT8 quantization", name)
    return out, scale_out


def _int8_rows_eager(weight, col_smooth, row_gain, out, scale_out, block_bytes):
    n, k = weight.shape
    device = weight.device
    out, scale_out = _int8_outputs(weight, out, scale_out)
    scale_view = scale_out.view(n, 1)
    col, gain = _factors(weight, col_smooth, row_gain)
    rows = _block_rows(k, device_math.block_bytes_for(device, block_bytes))
    buf = torch.empty((min(rows, n), k), dtype=torch.float32, device=device)
    amax = torch.empty((min(rows, n),), dtype=torch.float32, device=device)
    qmax = device_math.constant(QMAX, weight)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        b = buf[: r1 - r0]
        a = amax[: r1 - r0]
        b.copy_(weight[r0:r1])
        if col is not None:
            b.mul_(col)
        if gain is not None:
            b.mul_(gain[r0:r1])
        torch.linalg.vector_norm(b, ord=float("inf"), dim=1, out=a)
        a.clamp_(min=MIN_SCALE * QMAX).div_(qmax)
        s = a.unsqueeze(1)
        b.div_(s).round_().clamp_(-128.0, 127.0)
        out[r0:r1].copy_(b)
        scale_view[r0:r1].copy_(s)
    return out, scale_out


def _rows_kernel(cols: int, has_col: bool, has_gain: bool) -> str:
    """What makes a separate compiled per-row kernel besides the dtype: the width, and which
    SmoothQuant factors are given. Both the kernel's cache key (:func:`_rows_fused`) and its
    first-use verdict (:func:`_fused_usable`) are keyed by it, so every kernel a weight runs
    is the one that was checked."""
    return (f"{cols} columns, {'with' if has_col else 'no'} col_smooth, "
            f"{'with' if has_gain else 'no'} row_gain")


def _fused_usable(kind: str, weight, col_smooth=None, row_gain=None) -> bool:
    """The compiled form of ``kind`` for this weight's dtype, width and factors is wanted on
    this device and passed its first-use check (:func:`_fused_matches_eager`)."""
    from . import fused
    cols, has_col, has_gain = weight.shape[1], col_smooth is not None, row_gain is not None
    return fused.usable(kind, weight,
                        lambda: _fused_matches_eager(kind, weight.device, weight.dtype, cols, has_col, has_gain),
                        _rows_kernel(cols, has_col, has_gain))


def _fused_matches_eager(kind: str, device, dtype, cols: int, has_col: bool, has_gain: bool) -> bool:
    """The first-use check of one compiled per-row kernel, on probes of its own width with the
    same factors given (:func:`.fused.probe_factors`): on the tie probe its codes and scales are
    the eager path's bits; on the NaN/inf probe exactly the rows holding a non-finite weight get
    a non-finite scale (the refusal)."""
    from . import fused
    col, gain = fused.probe_factors(device, cols=cols)
    col, gain = (col if has_col else None), (gain if has_gain else None)
    if kind == "int8_rows":
        def compiled_path(w):
            return _int8_rows_fused(w, col, gain, None, None, None)

        def eager_path(w):
            return _int8_rows_eager(w, col, gain, None, None, None)
    else:
        def compiled_path(w):
            return _fp8_rows_fused(w, col, gain, None, None, None)

        def eager_path(w):
            return _fp8_rows_eager(w, col, gain, "channel", None, None, None)
    ties = fused.probe_weight(device, dtype, cols=cols)
    if not all(map(fused.same_bits, compiled_path(ties), eager_path(ties))):
        return False
    bad = fused.nonfinite_probe(device, dtype, cols=cols)
    return fused.nonfinite_where_expected(compiled_path(bad)[1], bad, 1, cols)


def _int8_rows_fused(weight, col_smooth, row_gain, out, scale_out, block_bytes):
    return _rows_fused("int8_rows", weight, col_smooth, row_gain, _int8_outputs(weight, out, scale_out),
                       out is None and scale_out is None,
                       (device_math.constant(QMAX, weight, torch.float64, shape=(1,)),
                        device_math.constant(MIN_SCALE * QMAX, weight, shape=(1,))), block_bytes)


def _rows_fused(kind, weight, col_smooth, row_gain, outputs, whole: bool, scalars, block_bytes):
    """Run the compiled per-row formula ``kind`` (:mod:`.fused`) over the weight: one call when the
    result is returned (``whole``), else blocks of rows copied into ``outputs`` (codes, scales)."""
    from . import fused
    n, k = weight.shape
    out, scale_out = outputs
    col, gain = _factors(weight, col_smooth, row_gain)
    fn = fused.compiled(kind, (str(weight.dtype), _rows_kernel(k, col is not None, gain is not None)),
                        rows_args=(0, 2))
    if whole and n:
        return fn(weight, col, gain, *scalars)
    rows = max(1, device_math.block_bytes_for(weight.device, block_bytes) // max(1, k))  # 1-byte codes
    scale_view = scale_out.view(n, 1)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        codes, s = fn(weight[r0:r1], col, None if gain is None else gain[r0:r1], *scalars)
        out[r0:r1].copy_(codes)
        scale_view[r0:r1].copy_(s)
    return out, scale_out


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
FP8_STRATEGIES = ("channel", "tensor")


@torch.no_grad()
def quantize_fp8_rows(weight: torch.Tensor, col_smooth: torch.Tensor | None = None,
                      row_gain: torch.Tensor | None = None, *, strategy: str = "channel",
                      out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
                      block_bytes: int | None = None, name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric FP8 E4M3 quantization of a 2-D ``[out, in]`` weight (compressed-tensors layout).

    Returns ``(float8_e4m3fn [out, in], float32 scale)`` -- scale ``[out, 1]`` for
    ``strategy="channel"``, ``[1]`` for ``"tensor"``. Works in row blocks of about
    ``block_bytes`` of float32 (two passes for ``"tensor"``: the amax first), so the extra
    memory is one block whatever the size of the tensor; ``channel`` on an accelerator takes
    the compiled form (:mod:`.fused`) where available. A NaN/inf weight raises
    :class:`~.device_math.NonFiniteWeightError` naming ``name``.
    """
    if strategy not in FP8_STRATEGIES:
        raise ValueError(f"strategy must be one of {FP8_STRATEGIES}, got {strategy!r}")
    if weight.dim() != 2:
        raise ValueError(f"quantize_fp8_rows expects a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    if strategy == "channel" and _fused_usable("fp8_rows", weight, col_smooth, row_gain):
        out, scale_out = _fp8_rows_fused(weight, col_smooth, row_gain, out, scale_out, block_bytes)
    else:
        out, scale_out = _fp8_rows_eager(weight, col_smooth, row_gain, strategy, out, scale_out, block_bytes)
    device_math.require_finite(scale_out, "FP8 quantization", name)
    return out, scale_out


@torch.no_grad()
def quantize_fp8_rows_torch(weight: torch.Tensor, col_smooth: torch.Tensor | None = None,
                            row_gain: torch.Tensor | None = None, *, strategy: str = "channel",
                            out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
                            block_bytes: int | None = None, name: str | None = None):
    """The eager blocked torch path of :func:`quantize_fp8_rows` (never the compiled one)."""
    if strategy not in FP8_STRATEGIES:
        raise ValueError(f"strategy must be one of {FP8_STRATEGIES}, got {strategy!r}")
    if weight.dim() != 2:
        raise ValueError(f"quantize_fp8_rows expects a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    out, scale_out = _fp8_rows_eager(weight, col_smooth, row_gain, strategy, out, scale_out, block_bytes)
    device_math.require_finite(scale_out, "FP8 quantization", name)
    return out, scale_out


def _fp8_outputs(weight, strategy, out, scale_out):
    n, k = weight.shape
    if out is None:
        out = torch.empty((n, k), dtype=FP8_DTYPE, device=weight.device)
    elif tuple(out.shape) != (n, k) or out.dtype != FP8_DTYPE:
        raise ValueError(f"out must be float8_e4m3fn {tuple(weight.shape)}, got {out.dtype} {tuple(out.shape)}")
    n_scales = n if strategy == "channel" else 1
    if scale_out is None:
        scale_out = torch.empty((n, 1) if strategy == "channel" else (1,), dtype=torch.float32, device=weight.device)
    elif scale_out.numel() != n_scales or scale_out.dtype != torch.float32:
        raise ValueError(f"scale_out must be float32 with {n_scales} scale(s), got {scale_out.dtype} "
                         f"{tuple(scale_out.shape)}")
    return out, scale_out


def _fp8_rows_eager(weight, col_smooth, row_gain, strategy, out, scale_out, block_bytes):
    n, k = weight.shape
    device = weight.device
    out, scale_out = _fp8_outputs(weight, strategy, out, scale_out)
    col, gain = _factors(weight, col_smooth, row_gain)
    rows = _block_rows(k, device_math.block_bytes_for(device, block_bytes))
    buf = torch.empty((min(rows, n), k), dtype=torch.float32, device=device)
    eps = torch.finfo(torch.float32).eps
    fp8_max = device_math.constant(FP8_MAX, weight)

    def scaled(r0, r1):
        b = buf[: r1 - r0]
        b.copy_(weight[r0:r1])
        if col is not None:
            b.mul_(col)
        if gain is not None:
            b.mul_(gain[r0:r1])
        return b

    if strategy == "tensor":
        amax = torch.zeros((), dtype=torch.float32, device=device)
        for r0 in range(0, n, rows):
            amax = torch.maximum(amax, scaled(r0, min(n, r0 + rows)).abs().amax())
        s_all = amax / fp8_max
        s_all = torch.where(s_all == 0, torch.full_like(s_all, eps), s_all)
        scale_out.view(-1).copy_(s_all.reshape(1))
    scale_view = scale_out.view(-1, 1)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        b = scaled(r0, r1)
        if strategy == "channel":
            s = b.abs().amax(dim=1, keepdim=True).div_(fp8_max)
            s = torch.where(s == 0, torch.full_like(s, eps), s)
            scale_view[r0:r1].copy_(s)
        else:
            s = scale_view.reshape(1, 1)
        b.div_(s).add_(0.0).clamp_(-FP8_MAX, FP8_MAX)
        out[r0:r1].copy_(b)  # float32 -> float8_e4m3fn: round to nearest even
    return out, scale_out


def _fp8_rows_fused(weight, col_smooth, row_gain, out, scale_out, block_bytes):
    return _rows_fused("fp8_rows", weight, col_smooth, row_gain, _fp8_outputs(weight, "channel", out, scale_out),
                       out is None and scale_out is None,
                       (device_math.constant(FP8_MAX, weight, torch.float64, shape=(1,)),
                        device_math.constant(torch.finfo(torch.float32).eps, weight, shape=(1,))), block_bytes)


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale`` (scale [out, 1] or [1]; for checks)."""
    return q.float() * scale.float().reshape(-1, 1)


def dequantize_int8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale`` (for checks; not used on hot paths)."""
    return q.float() * scale.float().reshape(-1, 1)


def smooth_norm(norm_weight: torch.Tensor, col_smooth: torch.Tensor) -> torch.Tensor:
    """Fold input smoothing into the preceding norm: ``norm / s`` in the norm's dtype."""
    return (norm_weight.float() / col_smooth.to(norm_weight.device, torch.float32)).to(norm_weight.dtype)


def power_of_two(x: torch.Tensor) -> torch.Tensor:
    """Nearest power of two (in log2) of positive ``x``: smoothing by such factors is exact
    in any float format, so the profile can recover it exactly from the checkpoints."""
    return torch.exp2(torch.round(torch.log2(x.float().clamp_min(torch.finfo(torch.float32).tiny))))


def smoothquant_factors(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float = 0.5,
                        exact: bool = True) -> torch.Tensor:
    """SmoothQuant's per-input-channel factor ``s = amax|X|^a / amax|W|^(1-a)``.

    ``weights`` are the ``[out, in]`` consumers of the activation; with ``exact`` the
    factors are rounded to powers of two (see :func:`power_of_two`).
    """
    w_absmax = torch.stack([w.float().abs().amax(dim=0) for w in weights]).amax(dim=0)
    s = act_absmax.float().clamp_min(1e-5).pow(alpha) / w_absmax.clamp_min(1e-5).pow(1.0 - alpha)
    s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
    return power_of_two(s) if exact else s


def dead_input_columns(qweights: list[torch.Tensor]) -> torch.Tensor:
    """Input channels whose INT8 weights are zero in every consumer (FlashRL's
    ``int8_prune``): the norm feeding them can be zeroed so the channel no longer
    inflates the per-token activation scale."""
    mask = None
    for q in qweights:
        m = (q == 0).all(dim=0)
        mask = m if mask is None else mask & m
    return mask


def prune_norm(norm_weight: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    return norm_weight.masked_fill(dead.to(norm_weight.device), 0)


def flashrl_formula_int8(weight: torch.Tensor, input_scale, output_scale) -> torch.Tensor:
    """FlashRL's ``linear_quantize`` for int8, written naively in torch (the benchmark's
    baseline): full-size float temporaries, fixed (profiled) scales."""
    x = weight * output_scale * input_scale
    return torch.round(x).clamp(min=-128, max=127).to(torch.int8)
