"""Group-wise symmetric INT4 weight quantization (W4A16) for rollout and QAT.

Why this module exists: slime's trainer fake-quant (float32 scale ``amax / 7``, divide)
and its rollout quantizer (``amax * (1/7)`` stored in bf16, multiply) do not produce the
same INT4 weights, so the policy that is trained is not the policy that is rolled out.
Here there is ONE quantizer, and it always computes the *stored* scale first and the
codes from that stored scale, so ``codes * scale`` (what the rollout kernel multiplies
back) is reproducible anywhere, and :func:`fake_quantize` (the QAT forward weight) is
bit-equal to what the engine dequantizes.

Presets (``Int4Spec.preset``):

``"ct"`` -- bit-identical to compressed-tensors' W4A16 preset (int4, symmetric, group
    strategy), i.e. what ``llm-compressor`` writes and vLLM's ``CompressedTensorsWNA16``
    reads::

        amax[r, g]  = max |w[r, g*G:(g+1)*G]|                  (in the weight dtype: exact)
        scale[r, g] = dtype(amax / 7.5)                         (stored in the weight dtype)
        scale       = finfo(dtype).eps where scale == 0         (as compressed-tensors 0.17)
        code        = clamp(round_half_even(dtype(w / scale)), -8, 7)

    i.e. the quotient is rounded to the model dtype (bf16/fp16) *before* rounding to an
    integer, exactly like compressed-tensors' ``x / scale`` on bf16 tensors. The only
    difference from compressed-tensors 0.12 (the copy vLLM 0.13 pins) is the zero/tiny
    scale floor: 0.12 clamps every scale to at least float32 eps (2**-23), 0.17 (the copy
    vLLM 0.23 pins; followed here) only replaces an exact zero by the eps of the scale
    dtype. They differ only for groups whose |max| is below 7.5 * 2**-23 ~ 9e-7 (every
    weight of the group that small); for an all-zero group both give zero codes (the stored
    scale differs, the dequantized weights do not).

``"slime"`` -- slime's INT4 formulas (``OPEN_TRAINING_INT4_*``) made self-consistent::

        scale = bfloat16(float32(amax) / 7)                       (slime's rollout stores bf16)
        code  = clamp(round_half_even(float32(w) / float32(scale)), -7, 7)

Layout (both presets): codes ``int8 [out, in]``; scales ``[out, in / G]``; packed
``int32 [out, in / 8]`` in compressed-tensors' ``pack-quantized`` layout (``weight_packed``):
each code is offset by +8 to an unsigned nibble and 8 consecutive input columns go into
one int32, column ``8j + i`` at bits ``4i .. 4i+3`` (least significant first, packed along
the input dimension). Leading dimensions (MoE ``[experts, out, in]``) are kept.

On CPU, bf16/float32 weights go through fused numba kernels (:mod:`._int4_kernels`):
one pass per group, no full-size temporaries; the torch path (any device, any float
dtype; fp16 always takes it) is bit-identical to them (tested). On an accelerator, bf16 and
float32 weights take the compiled one-kernel form of the same math (:mod:`.fused`), checked
against the torch path at first use. Divisions by a constant divide by a device tensor
(:mod:`.device_math`), so no path depends on how a device divides by a host scalar. A NaN
or infinite weight is refused (:class:`~.device_math.NonFiniteWeightError`, naming the
tensor) by every entry point. ``torch`` is imported lazily so importing the feature stays
cheap.
"""

from __future__ import annotations

import sys

from . import device_math
# the INT4 format's names (defined in .formats, which the CPU kernels import too), here where
# this module's users look for them
from .formats import GROUP_SIZES, NUM_BITS, PACK_FACTOR, PRESETS, Int4Spec, _check, _prepare_out, _Shape  # noqa: F401

DEFAULT_BLOCK_BYTES = device_math.CPU_BLOCK_BYTES  # torch path on CPU; accelerators: block_bytes_for


def _use_kernel(weight, *outs) -> bool:
    import torch
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return False
    return all(o is None or (o.device.type == "cpu" and o.is_contiguous()) for o in outs)


# ---------------------------------------------------------------- torch path (reference)

def _scales_torch(w2, spec: Int4Spec, groups: int):
    """Scales of a 2-D ``[rows, cols]`` weight, in the stored dtype (see module docstring)."""
    import torch
    g = w2.reshape(w2.shape[0], groups, spec.group_size)
    divisor = device_math.constant(spec.divisor, w2)  # a device tensor: IEEE division everywhere
    if spec.preset == "ct":
        amax = g.abs().amax(dim=-1)  # exact in the weight dtype
        s = amax / divisor  # rounded once to the weight dtype (torch divides in float32)
    else:
        amax = g.float().abs().amax(dim=-1)
        s = (amax / divisor).to(torch.bfloat16)
    return torch.where(s == 0, torch.full_like(s, torch.finfo(s.dtype).eps), s)


def _codes_torch(w2, s2, spec: Int4Spec, groups: int):
    """int8 codes of a 2-D block from its stored scales (float codes, not yet cast)."""
    g = w2.reshape(w2.shape[0], groups, spec.group_size)
    if spec.preset == "ct":
        q = g / s2.unsqueeze(-1)  # quotient rounded to the weight dtype, as compressed-tensors
    else:
        q = g.float() / s2.float().unsqueeze(-1)
    return q.round_().clamp_(spec.qmin, spec.qmax).reshape(w2.shape[0], -1)


def _blocks(rows: int, cols: int, block_bytes: int):
    step = max(1, block_bytes // max(1, 4 * cols))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def quantize_torch(weight, spec: Int4Spec, *, out_codes=None, out_scale=None,
                   block_bytes: int | None = None, name: str | None = None):
    """Device-agnostic torch implementation of :func:`quantize` (row blocks of about
    ``block_bytes`` of float32, so the extra memory stays bounded)."""
    codes, scale = _quantize_torch_unchecked(weight, spec, out_codes, out_scale, block_bytes)
    device_math.require_finite(scale, "INT4 quantization", name)
    return codes, scale


def _quantize_torch_unchecked(weight, spec: Int4Spec, out_codes, out_scale, block_bytes):
    import torch
    sh = _check(weight, spec)
    w2 = weight.detach().reshape(sh.rows, sh.cols)
    sdt = spec.scale_dtype(weight.dtype)
    codes = out_codes if out_codes is not None else torch.empty(weight.shape, dtype=torch.int8,
                                                                 device=weight.device)
    scale = out_scale if out_scale is not None else torch.empty(sh.lead + (sh.groups,), dtype=sdt,
                                                                device=weight.device)
    _prepare_out(codes, weight.shape, torch.int8, "out_codes")
    _prepare_out(scale, sh.lead + (sh.groups,), sdt, "out_scale")
    c2 = codes.view(sh.rows, sh.cols)
    s2 = scale.view(sh.rows, sh.groups)
    with torch.no_grad():
        for r0, r1 in _blocks(sh.rows, sh.cols, device_math.block_bytes_for(weight.device, block_bytes)):
            s = _scales_torch(w2[r0:r1], spec, sh.groups)
            s2[r0:r1].copy_(s)
            c2[r0:r1].copy_(_codes_torch(w2[r0:r1], s, spec, sh.groups))
    return codes, scale


# ---------------------------------------------------------------- public API

def scales(weight, spec: Int4Spec, *, name: str | None = None):
    """The stored per-group scales ``[..., out, in / G]``.

    dtype: ``ct`` -> ``weight.dtype`` (the model dtype, as compressed-tensors stores
    ``weight_scale``); ``slime`` -> bf16 (what slime's rollout stores). Zero scales are
    replaced by the eps of that dtype (codes of such a group are all zero anyway).
    """
    import torch
    sh = _check(weight, spec)
    with torch.no_grad():
        s = _scales_torch(weight.detach().reshape(sh.rows, sh.cols), spec, sh.groups)
    device_math.require_finite(s, "INT4 quantization", name)
    return s.reshape(sh.lead + (sh.groups,))


def quantize(weight, spec: Int4Spec, *, out_codes=None, out_scale=None, name: str | None = None):
    """``(codes int8 [..., out, in], scale [..., out, in / G])``; codes are computed from
    the STORED scale. ``out_codes`` / ``out_scale`` are written in place when given (e.g.
    a parameter's storage). CPU bf16/float32 -> fused numba kernel; accelerator bf16/float32
    -> compiled kernel (:mod:`.fused`) where verified; otherwise torch."""
    if _use_kernel(weight, out_codes, out_scale):
        from . import _int4_kernels
        codes, scale = _int4_kernels.quantize_cpu(weight, spec, out_codes=out_codes, out_scale=out_scale)
        device_math.require_finite(scale, "INT4 quantization", name)
        return codes, scale
    if _fused_usable(weight, spec):
        return _fused_blocks(weight, spec, "codes", out_codes, out_scale, name)
    return quantize_torch(weight, spec, out_codes=out_codes, out_scale=out_scale, name=name)


def pack(codes):
    """int8 codes ``[..., in]`` -> int32 ``[..., ceil(in / 8)]`` (compressed-tensors
    ``pack_to_int32(codes, 4)``: offset +8, 8 nibbles per int32, least significant first;
    a partial last word is padded with zero nibbles).

    The nibbles are laid out as bytes, 8 per int64 (little endian), and folded in three
    shift/or/mask steps (bytes -> nibble pairs -> 16 bits -> 32 bits): three whole-tensor
    ops on an eighth of the elements instead of eight strided ones."""
    import torch
    if codes.dtype != torch.int8:
        raise ValueError(f"pack expects int8 codes, got {codes.dtype}")
    if sys.byteorder != "little":  # pragma: no cover
        raise RuntimeError("pack assumes a little-endian host")
    cols = codes.shape[-1]
    words = -(-cols // PACK_FACTOR)
    nib = ((codes + 8) & 0xF).view(torch.uint8)
    if words * PACK_FACTOR != cols:
        nib = torch.nn.functional.pad(nib, (0, words * PACK_FACTOR - cols))
    if nib.numel() == 0:
        return torch.zeros(codes.shape[:-1] + (words,), dtype=torch.int32, device=codes.device)
    x = nib.contiguous().view(torch.int64)  # [..., words]; every value < 2**60: shifts stay positive
    x = (x | (x >> 4)) & 0x00FF00FF00FF00FF
    x = (x | (x >> 8)) & 0x0000FFFF0000FFFF
    x = (x | (x >> 16)) & 0xFFFFFFFF
    x = torch.where(x >= 2 ** 31, x - 2 ** 32, x)  # the int32 with these bits
    return x.to(torch.int32).reshape(codes.shape[:-1] + (words,))


def unpack(packed, in_features: int):
    """int32 ``[..., words]`` -> int8 codes ``[..., in_features]`` (inverse of :func:`pack`)."""
    import torch
    if packed.dtype != torch.int32:
        raise ValueError(f"unpack expects int32, got {packed.dtype}")
    if not 0 <= in_features <= packed.shape[-1] * PACK_FACTOR:
        raise ValueError(f"in_features={in_features} does not fit in {packed.shape[-1]} int32 words")
    shifts = torch.arange(0, 32, NUM_BITS, dtype=torch.int32, device=packed.device)
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF
    codes = (nib - 8).to(torch.int8).reshape(packed.shape[:-1] + (packed.shape[-1] * PACK_FACTOR,))
    return codes[..., :in_features]


def dequantize(codes, scale, spec: Int4Spec):
    """``codes * scale`` in the scale's dtype (what the rollout kernel multiplies back; the
    same operation as compressed-tensors' ``_dequantize``: ``codes.to(scale.dtype) * scale``)."""
    g = spec.group_size
    cols = codes.shape[-1]
    if cols != scale.shape[-1] * g:
        raise ValueError(f"codes have {cols} columns but scale covers {scale.shape[-1]} groups of {g}")
    q = codes.to(scale.dtype).reshape(codes.shape[:-1] + (cols // g, g))
    return (q * scale.unsqueeze(-1)).reshape(codes.shape)


def fake_quantize(weight, spec: Int4Spec, *, name: str | None = None, defer_finite=None):
    """``dequantize(*quantize(weight))`` in ``weight.dtype``: the QAT forward weight,
    bit-equal to what the engine dequantizes from the packed checkpoint. No autograd graph
    is built (wrap it in a straight-through estimator: ``w + (fake_quantize(w) - w).detach()``).
    CPU -> fused numba kernel; accelerator -> compiled kernel (:mod:`.fused`) where verified.

    A non-finite weight raises :class:`~.device_math.NonFiniteWeightError` -- which on an
    accelerator costs a synchronization per call (the host waits for the device to say whether
    every scale is finite). ``defer_finite(all_finite, name)`` is how a caller that quantizes
    many weights in a row (QAT: every layer of every forward) takes that verdict as a 0-dim
    device bool instead and checks many at once (``int4_qat.finite_checks``); the host then
    runs ahead of the device as it does for the layer's matmul. On CPU the check is immediate
    (nothing to wait for)."""
    w = weight.detach()
    if _use_kernel(w):
        from . import _int4_kernels
        return _int4_kernels.fake_quantize_cpu(w, spec, name=name)
    if _fused_usable(w, spec):
        return _fused_fake(w, spec, name, defer_finite)
    return fake_quantize_torch(w, spec, name=name, defer_finite=defer_finite)


def fake_quantize_torch(weight, spec: Int4Spec, *, name: str | None = None, defer_finite=None):
    """Torch implementation of :func:`fake_quantize` (any device, any float dtype)."""
    import torch
    with torch.no_grad():
        codes, scale = _quantize_torch_unchecked(weight.detach(), spec, None, None, None)
        if defer_finite is None:
            device_math.require_finite(scale, "INT4 quantization", name)
        else:
            defer_finite(torch.isfinite(scale).all(), name)
        return dequantize(codes, scale, spec).to(weight.dtype)


def quantize_pack(weight, spec: Int4Spec, *, out_packed=None, out_scale=None, name: str | None = None):
    """``(packed int32 [..., out, in / 8], scale [..., out, in / G])`` -- bit-identical to
    ``pack(quantize(weight, spec)[0])`` -- the fused fast path used by reload (numba kernel
    on CPU for bf16/float32; the compiled kernel of :mod:`.fused` on an accelerator where
    verified; torch elsewhere). ``out_*`` are written in place when given."""
    if _use_kernel(weight, out_packed, out_scale):
        from . import _int4_kernels
        packed, scale = _int4_kernels.quantize_pack_cpu(weight, spec, out_packed=out_packed, out_scale=out_scale)
        device_math.require_finite(scale, "INT4 quantization", name)
        return packed, scale
    if _fused_usable(weight, spec):
        return _fused_blocks(weight, spec, "packed", out_packed, out_scale, name)
    return quantize_pack_torch(weight, spec, out_packed=out_packed, out_scale=out_scale, name=name)


def quantize_pack_torch(weight, spec: Int4Spec, *, out_packed=None, out_scale=None,
                        block_bytes: int | None = None, name: str | None = None):
    """Torch implementation of :func:`quantize_pack` (row blocks; any device)."""
    import torch
    sh = _check(weight, spec)
    sdt = spec.scale_dtype(weight.dtype)
    words = sh.cols // PACK_FACTOR
    packed = out_packed if out_packed is not None else torch.empty(sh.lead + (words,), dtype=torch.int32,
                                                                   device=weight.device)
    scale = out_scale if out_scale is not None else torch.empty(sh.lead + (sh.groups,), dtype=sdt,
                                                                device=weight.device)
    _prepare_out(packed, sh.lead + (words,), torch.int32, "out_packed")
    _prepare_out(scale, sh.lead + (sh.groups,), sdt, "out_scale")
    w2 = weight.detach().reshape(sh.rows, sh.cols)
    p2 = packed.view(sh.rows, words)
    s2 = scale.view(sh.rows, sh.groups)
    with torch.no_grad():
        for r0, r1 in _blocks(sh.rows, sh.cols, device_math.block_bytes_for(weight.device, block_bytes)):
            s = _scales_torch(w2[r0:r1], spec, sh.groups)
            s2[r0:r1].copy_(s)
            p2[r0:r1].copy_(pack(_codes_torch(w2[r0:r1], s, spec, sh.groups).to(torch.int8)))
    device_math.require_finite(scale, "INT4 quantization", name)
    return packed, scale


# ---------------------------------------------------------------- compiled path (accelerators)

def _int4_kernel(cols: int) -> str:
    """What makes a separate compiled INT4 kernel besides the dtype, ``spec`` and output: the
    width. Both the kernels' cache key (:func:`_compiled_formula`) and their first-use verdict
    (:func:`_fused_usable`) are keyed by it, so every kernel a weight runs is one that was checked."""
    return f"{cols} columns"


def _fused_usable(weight, spec: Int4Spec) -> bool:
    """bf16/float32 weight on an accelerator whose compiled INT4 kernels for this dtype, width
    and ``spec`` passed their first-use check (:func:`_fused_matches_eager`). A weight of a
    shape INT4 refuses raises that error here (the probe takes the weight's width)."""
    from . import fused
    cols = _check(weight, spec).cols
    return fused.usable(f"int4 {spec.preset} g{spec.group_size}", weight,
                        lambda: _fused_matches_eager(weight.device, weight.dtype, cols, spec), _int4_kernel(cols))


def _fused_matches_eager(device, dtype, cols: int, spec: Int4Spec) -> bool:
    """The first-use check of the compiled INT4 kernels (packed, codes, fake) of one width, on
    probes of that width: on the tie probe each gives the bits of :func:`quantize_pack_torch`,
    :func:`quantize_torch` and :func:`fake_quantize_torch`; on the NaN/inf probe exactly the
    groups holding a non-finite weight get a non-finite scale, and the fake quantization's
    in-kernel verdict says "not all finite" (the refusals)."""
    from . import fused
    ties = fused.probe_weight(device, dtype, cols=cols)
    if not (all(map(fused.same_bits, _fused_blocks(ties, spec, "packed", None, None, None),
                    quantize_pack_torch(ties, spec)))
            and all(map(fused.same_bits, _fused_blocks(ties, spec, "codes", None, None, None),
                        quantize_torch(ties, spec)))
            and fused.same_bits(_fused_fake(ties, spec, None, None), fake_quantize_torch(ties, spec))):
        return False
    bad = fused.nonfinite_probe(device, dtype, cols=cols)
    for output in ("packed", "codes"):
        fn, args = _compiled_formula(bad, spec, output)
        if not fused.nonfinite_where_expected(fn(bad, *args)[1], bad, 1, spec.group_size):
            return False
    fn, args = _compiled_formula(bad, spec, "fake")
    return not bool(fn(bad, *args)[1])


def _compiled_formula(weight, spec: Int4Spec, output: str):
    """``(compiled fn, its tensor arguments after the weight)``: :func:`.fused.int4_formula` for
    this weight's dtype and width, ``spec`` and ``output`` (also what the QAT self-test times)."""
    import torch
    from . import fused
    cols = weight.shape[-1]
    fn = fused.compiled("int4", (str(weight.dtype), _int4_kernel(cols)), group=spec.group_size,
                        ct=spec.preset == "ct", bf16_weight=weight.dtype == torch.bfloat16, qmin=float(spec.qmin),
                        output=output)
    return fn, (device_math.constant(spec.divisor, weight, torch.float64, shape=(1,)),
                device_math.constant(torch.finfo(spec.scale_dtype(weight.dtype)).eps, weight, shape=(1,)))


def _fused_fake(weight, spec: Int4Spec, name, defer_finite):
    """The compiled fake quantization in one call. Its second output is the 0-dim "every weight
    is finite" verdict, checked here (one synchronization) or handed to ``defer_finite``."""
    import torch
    _check(weight, spec)
    if not weight.numel():
        return torch.empty_like(weight)
    fn, args = _compiled_formula(weight, spec, "fake")
    out, all_finite = fn(weight.reshape(-1, weight.shape[-1]), *args)
    if defer_finite is not None:
        defer_finite(all_finite, name)
    elif not bool(all_finite):
        scales(weight, spec, name=name)       # raises, with how many scales are not finite
        device_math.refuse_nonfinite("INT4 quantization", name, "a scale is not finite")
    return out.reshape(weight.shape)


def _fused_blocks(weight, spec: Int4Spec, output: str, out_main, out_scale, name):
    """Run :func:`.fused.int4_formula` (output ``packed`` or ``codes``; ``fake`` is
    :func:`_fused_fake`) over the weight: in one call when the result is returned, else in row
    blocks whose temporary output is about the device block size, copied into ``out_main`` /
    ``out_scale``."""
    import torch
    sh = _check(weight, spec)
    w2 = weight.detach().reshape(sh.rows, sh.cols)
    sdt = spec.scale_dtype(weight.dtype)
    fn, args = _compiled_formula(weight, spec, output)
    width = sh.cols // PACK_FACTOR if output == "packed" else sh.cols
    main_dtype = torch.int32 if output == "packed" else torch.int8
    whole = out_main is None and out_scale is None
    if whole and sh.rows:
        main, scale = fn(w2, *args)
        main, scale = main.reshape(sh.lead + (width,)), scale.reshape(sh.lead + (sh.groups,))
    else:
        main = out_main if out_main is not None else torch.empty(sh.lead + (width,), dtype=main_dtype,
                                                                 device=weight.device)
        scale = out_scale if out_scale is not None else torch.empty(sh.lead + (sh.groups,), dtype=sdt,
                                                                    device=weight.device)
        _prepare_out(main, sh.lead + (width,), main_dtype, "out_packed" if output == "packed" else "out_codes")
        _prepare_out(scale, sh.lead + (sh.groups,), sdt, "out_scale")
        m2, s2 = main.view(sh.rows, width), scale.view(sh.rows, sh.groups)
        step = max(1, device_math.block_bytes_for(weight.device) // max(1, 4 * width))
        for r0 in range(0, sh.rows, step):
            r1 = min(sh.rows, r0 + step)
            a, b = fn(w2[r0:r1], *args)
            m2[r0:r1].copy_(a)
            s2[r0:r1].copy_(b)
    device_math.require_finite(scale, "INT4 quantization", name)
    return main, scale
