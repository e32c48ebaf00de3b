"""numba kernels for the CPU fast path of :mod:`.int4` (same arithmetic as its torch path, fused).

Each group of ``G`` input columns is read twice while it is in L1: once for its absolute
maximum (on the float32 bit patterns with the sign cleared: an integer max vectorizes; the
unsigned order is the float order, and a NaN, whose bits exceed infinity's, wins like
torch's ``amax`` propagates it), once to divide by the stored
scale, round and either store int8 codes or OR 8 nibbles into an int32 word. Nothing of
the size of the weight is allocated (the torch formula materialises several float32
copies of it).

Bit identity with the torch path rests on doing the same float32 operations in the same
order and rounding to bf16 where torch does: torch evaluates ``bf16 / x`` as a float32
division followed by one round-to-nearest-even to bf16, which :func:`_round_bf16`
reproduces on the bit pattern. A NaN or infinite weight makes its group's scale NaN/inf (the
integer max lets NaN bits win), which the callers check and refuse.
"""

from __future__ import annotations

import numba as nb
import numpy as np
import torch
from numba import types
from numba.extending import overload

_CHUNKS = 4 * nb.config.NUMBA_NUM_THREADS
_BF16_EPS = np.float32(2.0 ** -7)  # torch.finfo(torch.bfloat16).eps
_F32_EPS = np.float32(2.0 ** -23)  # torch.finfo(torch.float32).eps


def _as_float32(x):
    """A weight element as float32: bf16 bit patterns (uint16) are widened by a shift."""


@overload(_as_float32, inline="always")
def _as_float32_impl(x):
    if isinstance(x, types.Integer):
        return lambda x: np.uint32(np.uint32(x) << np.uint32(16)).view(np.float32)
    return lambda x: np.float32(x)


def _store_bf16_exact(arr, i, j, s):
    """Store a float32 value that is already bf16-exact into a bf16 (uint16 bits) or float32 array."""


@overload(_store_bf16_exact, inline="always")
def _store_bf16_exact_impl(arr, i, j, s):
    if isinstance(arr.dtype, types.Integer):
        def impl(arr, i, j, s):
            arr[i, j] = np.uint16(np.float32(s).view(np.uint32) >> np.uint32(16))
        return impl

    def impl_f(arr, i, j, s):
        arr[i, j] = s
    return impl_f


@nb.njit(inline="always")
def _round_bf16(f):
    """float32 -> nearest bf16 (ties to even), returned as float32 (torch's conversion)."""
    b = np.float32(f).view(np.uint32)
    b = np.uint32((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))
    return b.view(np.float32)


@nb.njit(inline="always")
def _group_scale(w, r, c0, g, divisor, round_scale, eps):
    """The stored scale of one group: float32 amax / divisor, rounded to bf16 when the
    scale is stored in bf16, a zero scale replaced by the eps of the stored dtype."""
    am = np.uint32(0)
    for c in range(c0, c0 + g):
        am = max(am, np.float32(_as_float32(w[r, c])).view(np.uint32) & np.uint32(0x7FFFFFFF))
    s = np.uint32(am).view(np.float32) / divisor
    if round_scale:
        s = _round_bf16(s)
    if s == 0:
        s = eps
    return s


_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: x + M - M rounds |x| <= 2**22 to an integer, ties to even


@nb.njit(inline="always")
def _group_codes(w, r, c0, g, s, round_q, qmin, qmax, buf):
    """Codes of one group into ``buf`` (float32 integers): divide by the stored scale, round
    the quotient to bf16 when torch does (ct on bf16), clamp, round half to even.

    Clamping before rounding gives the same integers as rounding first (the bounds are
    integers), and keeps the magic-number rounding in its exact range; the loop is
    branch-free so LLVM vectorizes it."""
    for c in range(g):
        q = _as_float32(w[r, c0 + c]) / s
        if round_q:
            q = _round_bf16(q)
        q = min(max(q, qmin), qmax)
        buf[c] = (q + _MAGIC) - _MAGIC


@nb.njit(inline="always")
def _group_nibbles(w, r, c0, g, s, round_q, qmin, qmax, nib):
    """Like :func:`_group_codes` but stores each code + 8 as a byte (0..15) in ``nib``."""
    for c in range(g):
        q = _as_float32(w[r, c0 + c]) / s
        if round_q:
            q = _round_bf16(q)
        q = min(max(q, qmin), qmax)
        nib[c] = np.uint8(np.int32((q + _MAGIC) - _MAGIC) + np.int32(8))


@nb.njit(inline="always")
def _pack_bytes(nib64, packed, r, w0):
    """8 nibble bytes (one uint64, little endian) -> one int32 word, least significant
    first: fold bytes into nibble pairs, pairs into 16 bits, 16 bits into 32 (vectorizes)."""
    for j in range(nib64.shape[0]):
        x = nib64[j]
        x = (x | (x >> np.uint64(4))) & np.uint64(0x00FF00FF00FF00FF)
        x = (x | (x >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
        x = (x | (x >> np.uint64(16))) & np.uint64(0x00000000FFFFFFFF)
        packed[r, w0 + j] = np.uint32(x)


@nb.njit(parallel=True, cache=True)
def _quantize_codes(w, scale, codes, g, divisor, round_scale, round_q, eps, qmin, qmax, chunks):
    n, k = w.shape
    chunks = max(1, min(n, chunks))
    for ci in nb.prange(chunks):
        nib = np.empty(g, np.uint8)
        for r in range(ci * n // chunks, (ci + 1) * n // chunks):
            for gi in range(k // g):
                c0 = gi * g
                s = _group_scale(w, r, c0, g, divisor, round_scale, eps)
                _store_bf16_exact(scale, r, gi, s)
                _group_nibbles(w, r, c0, g, s, round_q, qmin, qmax, nib)
                for c in range(g):
                    codes[r, c0 + c] = np.int8(np.int32(nib[c]) - np.int32(8))


@nb.njit(parallel=True, cache=True)
def _quantize_packed(w, scale, packed, g, divisor, round_scale, round_q, eps, qmin, qmax, chunks):
    n, k = w.shape
    chunks = max(1, min(n, chunks))
    for ci in nb.prange(chunks):
        nib = np.empty(g, np.uint8)
        nib64 = nib.view(np.uint64)
        for r in range(ci * n // chunks, (ci + 1) * n // chunks):
            for gi in range(k // g):
                c0 = gi * g
                s = _group_scale(w, r, c0, g, divisor, round_scale, eps)
                _store_bf16_exact(scale, r, gi, s)
                _group_nibbles(w, r, c0, g, s, round_q, qmin, qmax, nib)
                _pack_bytes(nib64, packed, r, c0 // 8)


@nb.njit(parallel=True, cache=True)
def _fake_quantize(w, out, g, divisor, round_scale, round_q, eps, qmin, qmax, round_deq, chunks, nonfinite):
    """``codes * scale`` (rounded to bf16 when the scale is bf16, as torch's bf16 multiply
    does) written in the weight's dtype: quantize and dequantize fused, no codes stored.
    ``nonfinite[chunk]`` counts the groups of the chunk whose scale is NaN or infinite."""
    n, k = w.shape
    chunks = max(1, min(n, chunks))
    for ci in nb.prange(chunks):
        buf = np.empty(g, np.float32)
        bad = 0
        for r in range(ci * n // chunks, (ci + 1) * n // chunks):
            for gi in range(k // g):
                c0 = gi * g
                s = _group_scale(w, r, c0, g, divisor, round_scale, eps)
                if not np.abs(s) < np.inf:
                    bad += 1
                _group_codes(w, r, c0, g, s, round_q, qmin, qmax, buf)
                for c in range(g):
                    d = buf[c] * s
                    if round_deq:
                        d = _round_bf16(d)
                    _store_bf16_exact(out, r, c0 + c, d)
        nonfinite[ci] = bad


def _params(weight, spec):
    """(divisor, round_scale, round_q, eps, qmin, qmax) of the torch path for this dtype."""
    ct = spec.preset == "ct"
    bf16 = weight.dtype == torch.bfloat16
    scale_bf16 = bf16 or not ct  # slime always stores bf16 scales
    return (np.float32(spec.divisor), scale_bf16, ct and bf16, _BF16_EPS if scale_bf16 else _F32_EPS,
            np.float32(spec.qmin), np.float32(spec.qmax))


def _source(weight, rows, cols):
    w = weight.detach()
    if not w.is_contiguous():
        w = w.contiguous()
    w = w.reshape(rows, cols)
    return w.view(torch.int16).numpy().view(np.uint16) if w.dtype == torch.bfloat16 else w.numpy()


def _scale_array(scale, rows, groups):
    s = scale.view(rows, groups)
    return s.view(torch.int16).numpy().view(np.uint16) if s.dtype == torch.bfloat16 else s.numpy()


def quantize_cpu(weight, spec, *, out_codes=None, out_scale=None):
    from .formats import _check, _prepare_out
    sh = _check(weight, spec)
    sdt = spec.scale_dtype(weight.dtype)
    codes = out_codes if out_codes is not None else torch.empty(weight.shape, dtype=torch.int8)
    scale = out_scale if out_scale is not None else torch.empty(sh.lead + (sh.groups,), dtype=sdt)
    _prepare_out(codes, weight.shape, torch.int8, "out_codes")
    _prepare_out(scale, sh.lead + (sh.groups,), sdt, "out_scale")
    if sh.rows and sh.cols:
        _quantize_codes(_source(weight, sh.rows, sh.cols), _scale_array(scale, sh.rows, sh.groups),
                        codes.view(sh.rows, sh.cols).numpy(), spec.group_size, *_params(weight, spec), _CHUNKS)
    return codes, scale


def quantize_pack_cpu(weight, spec, *, out_packed=None, out_scale=None):
    from .formats import PACK_FACTOR, _check, _prepare_out
    sh = _check(weight, spec)
    sdt = spec.scale_dtype(weight.dtype)
    words = sh.cols // PACK_FACTOR
    packed = out_packed if out_packed is not None else torch.empty(sh.lead + (words,), dtype=torch.int32)
    scale = out_scale if out_scale is not None else torch.empty(sh.lead + (sh.groups,), dtype=sdt)
    _prepare_out(packed, sh.lead + (words,), torch.int32, "out_packed")
    _prepare_out(scale, sh.lead + (sh.groups,), sdt, "out_scale")
    if sh.rows and sh.cols:
        _quantize_packed(_source(weight, sh.rows, sh.cols), _scale_array(scale, sh.rows, sh.groups),
                         packed.view(sh.rows, words).numpy().view(np.uint32), spec.group_size,
                         *_params(weight, spec), _CHUNKS)
    return packed, scale


# ---------------------------------------------------------------- block FP8 (E4M3)

@nb.njit(inline="always")
def _e4m3_bits(x):
    """float32 ``x`` with |x| <= 448 -> float8_e4m3fn bits, nearest even (torch's cast).

    Normal range (|x| >= 2**-6): round the float32 mantissa to 3 bits on the bit pattern
    and rebias the exponent (127 -> 7). Subnormals: ``rint(|x| * 2**9)`` is the mantissa
    (a carry to 8 lands on the smallest normal, whose bits are 8 as well). Both are
    computed and one is selected, so the loop has no branch and vectorizes."""
    b = np.float32(x).view(np.uint32)
    sign = (b >> np.uint32(24)) & np.uint32(0x80)
    a = b & np.uint32(0x7FFFFFFF)
    sub = np.uint32((np.uint32(a).view(np.float32) * np.float32(512.0) + _MAGIC) - _MAGIC)
    r = np.uint32(a + np.uint32(0x7FFFF) + ((a >> np.uint32(20)) & np.uint32(1)))
    normal = (r >> np.uint32(20)) - np.uint32(120 << 3)
    return np.uint8(sign | (sub if a < np.uint32(0x3C800000) else normal))


@nb.njit(parallel=True, cache=True)
def _block_fp8(w, out, scale, bn, bk):
    n, k = w.shape
    nb_ = (n + bn - 1) // bn
    kb = (k + bk - 1) // bk
    for t in nb.prange(nb_ * kb):
        i = t // kb
        j = t - i * kb
        r0 = i * bn
        r1 = min(n, r0 + bn)
        c0 = j * bk
        c1 = min(k, c0 + bk)
        am = np.uint32(0)
        for r in range(r0, r1):
            for c in range(c0, c1):
                am = max(am, np.float32(_as_float32(w[r, c])).view(np.uint32) & np.uint32(0x7FFFFFFF))
        s = np.uint32(am).view(np.float32) / np.float32(448.0)
        if s == 0:
            s = _F32_EPS
        scale[i, j] = s
        for r in range(r0, r1):
            for c in range(c0, c1):
                q = min(max(_as_float32(w[r, c]) / s, np.float32(-448.0)), np.float32(448.0))
                out[r, c] = _e4m3_bits(q + np.float32(0.0))  # + 0: -0.0 becomes +0.0


def block_fp8_cpu(weight, bn, bk, out_weight, out_scale_inv):
    n, k = weight.shape
    if n and k:
        _block_fp8(_source(weight, n, k), out_weight.view(torch.uint8).numpy(), out_scale_inv.numpy(), bn, bk)
    return out_weight, out_scale_inv


def fake_quantize_cpu(weight, spec, *, name=None):
    """``dequantize(*quantize(weight))`` in ``weight.dtype`` for CPU bf16/float32 weights, fused.
    A NaN/inf weight raises :class:`~.device_math.NonFiniteWeightError` naming ``name``."""
    from .device_math import refuse_nonfinite
    from .formats import _check
    sh = _check(weight, spec)
    out = torch.empty(weight.shape, dtype=weight.dtype)
    if sh.rows and sh.cols:
        divisor, scale_bf16, round_q, eps, qmin, qmax = _params(weight, spec)
        dst = out.view(sh.rows, sh.cols)
        dst = dst.view(torch.int16).numpy().view(np.uint16) if out.dtype == torch.bfloat16 else dst.numpy()
        nonfinite = np.zeros(max(1, min(sh.rows, _CHUNKS)), np.int64)
        _fake_quantize(_source(weight, sh.rows, sh.cols), dst, spec.group_size, divisor, scale_bf16, round_q, eps,
                       qmin, qmax, scale_bf16, _CHUNKS, nonfinite)
        if nonfinite.any():
            refuse_nonfinite("INT4 quantization", name, f"{int(nonfinite.sum())} of {sh.rows * sh.groups} groups")
    return out
