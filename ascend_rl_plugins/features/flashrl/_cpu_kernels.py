"""numba kernels for the CPU fast path of :mod:`.quant` (same arithmetic, fused).

Each output row is read once (bf16 bits widened to float32 by a shift), scaled, reduced
to its absolute maximum and rounded while it is still in L1; rows run in parallel. The
float32 operations and their order are the torch path's, so the results are identical.
"""

from __future__ import annotations

import numba as nb
import numpy as np
import torch

from .quant import MIN_SCALE, QMAX


@nb.njit(inline="always")
def _quantize_row(f, col, g, out_row, min_amax):
    k = f.shape[0]
    qmax = np.float32(127.0)
    amax = np.float32(0.0)
    for c in range(k):
        v = f[c] * col[c] * g
        f[c] = v
        a = abs(v)
        if a > amax:
            amax = a
    if not amax >= min_amax:
        amax = min_amax
    s = amax / qmax
    lo = np.float32(-128.0)
    for c in range(k):
        q = np.rint(f[c] / s)
        if q > qmax:
            q = qmax
        elif q < lo:
            q = lo
        out_row[c] = np.int8(q)
    return s


@nb.njit(parallel=True, cache=True)
def _quantize_bf16(bits, col, gain, out, scale, min_amax):
    n, k = bits.shape
    for r in nb.prange(n):
        u = np.empty(k, np.uint32)
        for c in range(k):
            u[c] = np.uint32(bits[r, c]) << np.uint32(16)
        scale[r] = _quantize_row(u.view(np.float32), col, gain[r], out[r], min_amax)


@nb.njit(parallel=True, cache=True)
def _quantize_f32(w, col, gain, out, scale, min_amax):
    n, k = w.shape
    for r in nb.prange(n):
        f = w[r].copy()
        scale[r] = _quantize_row(f, col, gain[r], out[r], min_amax)


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
    col = (torch.ones(k, dtype=torch.float32) if col_smooth is None
           else col_smooth.detach().to("cpu", torch.float32).reshape(k).contiguous())
    gain = (torch.ones(n, dtype=torch.float32) if row_gain is None
            else row_gain.detach().to("cpu", torch.float32).reshape(n).contiguous())
    w = weight.detach().contiguous()
    min_amax = np.float32(MIN_SCALE * QMAX)
    if w.dtype == torch.bfloat16:
        _quantize_bf16(w.view(torch.int16).numpy().view(np.uint16), col.numpy(), gain.numpy(),
                       out.numpy(), scale_out.view(-1).numpy(), min_amax)
    else:
        _quantize_f32(w.numpy(), col.numpy(), gain.numpy(), out.numpy(), scale_out.view(-1).numpy(), min_amax)
    return out, scale_out
