"""numba kernels for the CPU fast path of :mod:`.quant` and flashrl's reload (same arithmetic, fused).

Quantization: each output row is read once (bf16 bits widened to float32 by a shift),
scaled and reduced to its absolute maximum in the same loop, then rounded while it is
still in L1. Rows are split into a few contiguous chunks, one scratch row per chunk (no
allocation per row). The float32 operations and their order are the torch path's
(``(w * col) * gain``, ``/ scale``, round half to even, clamp), so the results are
identical. The absolute maximum is taken on the float32 bit patterns with the sign bit
cleared: for non-NaN values their unsigned order is the float order, and an integer max
vectorizes where a float max reduction does not. A NaN's bits exceed infinity's, so a NaN
wins the max like torch's reduction propagates it: the row's scale is NaN and the caller
refuses the weight (``device_math.require_finite``).

Exact int8 reductions (:func:`int8_row_sums`): the sum of each row of an int8 matrix, in
int32, returned as float32 -- identical to torch's float32 sum as long as every partial
sum stays below 2**24 in magnitude (the caller checks).
"""

from __future__ import annotations

import numba as nb
import numpy as np
import torch
from numba import types
from numba.extending import overload

from .formats import MIN_SCALE, QMAX


@nb.njit(inline="always")
def _finish_row(f, am, out_row, min_amax):
    """Round the scaled row ``f`` (float32) to int8 with the scale of its |max| bits ``am``."""
    amax = np.uint32(am).view(np.float32)
    if amax < min_amax:  # a NaN stays NaN: the caller refuses the weight
        amax = min_amax
    s = amax / np.float32(QMAX)
    qmax = np.float32(127.0)
    lo = np.float32(-128.0)
    for c in range(f.shape[0]):
        q = np.rint(f[c] / s)
        if q > qmax:
            q = qmax
        elif q < lo:
            q = lo
        out_row[c] = np.int8(q)
    return s


def _as_float32(x):
    """A weight element as float32: bf16 bit patterns (uint16) are widened by a shift."""


@overload(_as_float32, inline="always")
def _as_float32_impl(x):
    if isinstance(x, types.Integer):
        return lambda x: np.uint32(np.uint32(x) << np.uint32(16)).view(np.float32)
    return lambda x: np.float32(x)


@nb.njit(parallel=True, cache=True)
def _quantize_rows(w, col, gain, out, scale, min_amax, chunks):
    """Quantize the rows of ``w`` (uint16 bf16 bits or float32), a few contiguous chunks of
    rows per thread with one scratch row each."""
    n, k = w.shape
    chunks = max(1, min(n, chunks))
    for ci in nb.prange(chunks):
        f = np.empty(k, np.float32)
        for r in range(ci * n // chunks, (ci + 1) * n // chunks):
            g = gain[r]
            am = np.uint32(0)
            for c in range(k):
                v = _as_float32(w[r, c]) * col[c] * g
                f[c] = v
                am = max(am, np.float32(v).view(np.uint32) & np.uint32(0x7FFFFFFF))
            scale[r] = _finish_row(f, am, out[r], min_amax)


@nb.njit(parallel=True, cache=True)
def _row_sums_int8(x, out, chunks):
    n, k = x.shape
    chunks = max(1, min(n, chunks))
    for ci in nb.prange(chunks):
        for r in range(ci * n // chunks, (ci + 1) * n // chunks):
            acc = np.int32(0)
            for c in range(k):
                acc += np.int32(x[r, c])
            out[r] = np.float32(acc)


# Row chunks per call: a few per numba thread (rows are independent; more chunks than threads
# is harmless if numba.set_num_threads lowers the count later).
_CHUNKS = 4 * nb.config.NUMBA_NUM_THREADS
_MIN_AMAX = np.float32(MIN_SCALE * QMAX)
_ONES: dict[int, np.ndarray] = {}


def _f32_vector(t, size: int) -> np.ndarray:
    """``t`` as a contiguous float32 numpy vector of ``size`` values (ones when None), without
    torch ops when it already is one (the profile's factors are): a reload quantizes a few
    hundred tensors, so per-call overhead counts."""
    if t is None:
        v = _ONES.get(size)
        if v is None:
            v = _ONES[size] = np.ones(size, np.float32)
        return v
    if t.device.type != "cpu" or t.dtype != torch.float32 or t.requires_grad:
        t = t.detach().to("cpu", torch.float32)
    if t.numel() != size:
        raise ValueError(f"expected {size} factors, got shape {tuple(t.shape)}")
    return np.ascontiguousarray(t.numpy().reshape(size))


def quantize_int8_rows_cpu(weight, col_smooth=None, row_gain=None, *, out=None, scale_out=None):
    n, k = weight.shape
    if out is None:
        out = torch.empty((n, k), dtype=torch.int8)
    elif out.shape != (n, k) or out.dtype != torch.int8:
        raise ValueError(f"out must be int8 {tuple(weight.shape)}, got {out.dtype} {tuple(out.shape)}")
    if scale_out is None:
        scale_out = torch.empty((n, 1), dtype=torch.float32)
    elif scale_out.numel() != n or scale_out.dtype != torch.float32:
        raise ValueError(f"scale_out must be float32 with {n} scales, got {scale_out.dtype} {tuple(scale_out.shape)}")
    col = _f32_vector(col_smooth, k)
    gain = _f32_vector(row_gain, n)
    w = weight.detach()
    if not w.is_contiguous():
        w = w.contiguous()
    if w.dtype == torch.bfloat16:
        src = w.view(torch.int16).numpy().view(np.uint16)
    else:
        src = w.numpy()
    _quantize_rows(src, col, gain, out.numpy(), scale_out.view(-1).numpy(), _MIN_AMAX, _CHUNKS)
    return out, scale_out


def int8_row_sums(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[i] = float32(sum_j x[i, j])`` for a CPU int8 ``x`` whose rows are contiguous
    (``x.stride(1) == 1``) and a contiguous float32 ``out`` of ``x.shape[0]`` elements."""
    _row_sums_int8(x.numpy(), out.view(-1).numpy(), _CHUNKS)
    return out


# -- W4A16: compressed-tensors pack-quantized -> vLLM's CPUWNA16 blocked layout ---------------

@nb.njit(parallel=True, cache=True)
def _wna16_blocked(p, f):
    """``p``: uint32 ``[out, in / 8]`` (compressed-tensors: input column ``8m + q`` of row ``o`` in
    nibble ``q`` of ``p[o, m]``). ``f``: uint32 ``[out / 16, 2 * in]``: word ``f[j, 2k + h]`` holds
    input column ``k`` of the 8 output rows ``16j + 8h + i`` (nibble ``i``). An 8x8 nibble
    transpose per (row block, word); pure bit moves, so exact."""
    blocks = p.shape[0] // 16
    words = p.shape[1]
    for j in nb.prange(blocks):
        for h in range(2):
            base = 16 * j + 8 * h
            for m in range(words):
                for q in range(8):
                    sh = np.uint32(4 * q)
                    v = np.uint32(0)
                    for i in range(8):
                        v |= ((p[base + i, m] >> sh) & np.uint32(15)) << np.uint32(4 * i)
                    f[j, 2 * (8 * m + q) + h] = v


def wna16_blocked_cpu(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the CPUWNA16 (W4A16, non-W4A8) layout of a contiguous int32 ``packed [out, in/8]``
    into the contiguous int32 ``out [out/16, 2*in]`` (the engine's own storage)."""
    _wna16_blocked(packed.numpy().view(np.uint32), out.numpy().view(np.uint32))
    return out
