"""INT4 (W4A16) group-wise quantizer: compressed-tensors bit identity, kernel == torch,
pack/unpack, slime preset, in-place outputs, spec validation. No engine."""

import pytest

torch = pytest.importorskip("torch")
from hypothesis import assume, given, settings, strategies as st  # noqa: E402

from ascend_rl_plugins.quant import int4 as I  # noqa: E402

F32_EPS = 2.0 ** -23
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# magnitudes each dtype can hold with room for amax / 7.5 (fp16: 6.5e4 max, 6e-8 min)
MAGNITUDES = {torch.bfloat16: [1e-30, 1e-6, 1e-3, 1.0, 300.0, 1e30],
              torch.float16: [1e-4, 1e-2, 1.0, 300.0, 6e3],
              torch.float32: [1e-30, 1e-6, 1.0, 300.0, 1e30]}


@st.composite
def weights(draw, dtypes=tuple(DTYPES), max_rows=12, max_groups=4, lead=False):
    """A ``[.., out, in]`` weight with the edge cases mixed in: all-zero groups, exact .5
    ties (multiples of 0.5 with a 7.5 in the group: the scale is exactly 1), per-row
    magnitudes from tiny to huge, negative zeros."""
    dtype = draw(st.sampled_from(dtypes))
    group = draw(st.sampled_from(I.GROUP_SIZES))
    rows = draw(st.integers(1, max_rows))
    cols = group * draw(st.integers(1, max_groups))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    g = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["randn", "ties", "mixed"]))
    if kind == "ties":
        w = torch.randint(-15, 16, (rows, cols), generator=g).float() / 2
        w.view(rows, -1, group)[:, :, 0] = 7.5 * torch.where(torch.rand(rows, cols // group, generator=g) < 0.5, -1, 1)
        w = w * 2.0 ** draw(st.integers(-4, 4))
    else:
        mags = torch.tensor(MAGNITUDES[dtype])
        pick = torch.randint(0, len(mags), (rows, 1), generator=g)
        w = torch.randn(rows, cols, generator=g) * mags[pick]
        if kind == "mixed":  # outliers inside groups
            w = w * torch.where(torch.rand(rows, cols, generator=g) < 0.02, 50.0, 1.0)
    zero_groups = torch.rand(rows, cols // group, generator=g) < draw(st.sampled_from([0.0, 0.3]))
    w.view(rows, -1, group)[zero_groups] = 0.0
    w[torch.rand(rows, cols, generator=g) < 0.01] = -0.0
    w = w.to(dtype)
    assume(bool(torch.isfinite(w).all()))
    if lead:
        experts = draw(st.integers(1, 3))
        w = torch.stack([w.roll(e, dims=0) for e in range(experts)])
    return w, group


def _ct():
    """compressed-tensors' own W4A16 math (vLLM pins a copy in each stack venv): the oracle."""
    try:
        import compressed_tensors
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
        from compressed_tensors.quantization.utils import calculate_qparams
    except ImportError as exc:
        pytest.skip(f"compressed-tensors is not importable here ({exc}); it comes with vLLM in the stack venvs")
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    except ImportError:
        from compressed_tensors.compressors.quantized_compressors.pack_quantized import pack_to_int32
    version = tuple(int(x) for x in compressed_tensors.__version__.split(".")[:2])
    return QuantizationArgs, calculate_qparams, quantize, dequantize, pack_to_int32, version


def _oracle(w, group):
    """(codes, scale, packed, dequantized) as compressed-tensors computes them for its W4A16
    preset (int4, symmetric, group strategy) on a 2-D weight: min/max observed per group in
    the weight dtype, ``calculate_qparams``, ``quantize(..., dtype=int8)``, ``pack_to_int32``."""
    QuantizationArgs, calculate_qparams, quantize, dequantize, pack_to_int32, _ = _ct()
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    grouped = w.reshape(w.shape[0], -1, group)
    scale, zp = calculate_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), args)
    codes = quantize(w, scale, zp, args, dtype=torch.int8)
    deq = dequantize(codes, scale, zp, args)
    return codes, scale, pack_to_int32(codes, 4), deq


@settings(max_examples=80, deadline=None)
@given(wg=weights(dtypes=(torch.bfloat16, torch.float16, torch.float32)))
def test_ct_preset_is_bit_identical_to_compressed_tensors(wg):
    w, group = wg
    spec = I.Int4Spec(group, "ct")
    codes_o, scale_o, packed_o, deq_o = _oracle(w, group)
    codes, scale = I.quantize(w, spec)
    packed, scale2 = I.quantize_pack(w, spec)
    assert scale.dtype == scale_o.dtype == w.dtype
    keep = torch.ones_like(scale, dtype=torch.bool)
    if _ct()[-1] < (0, 17):
        # compressed-tensors 0.12 (vLLM 0.13) clamps every scale to >= float32 eps; 0.17
        # (and this quantizer) only replace a zero scale: groups below 7.5 * 2**-23 differ
        tiny = (w.reshape(w.shape[0], -1, group).abs().amax(-1) / 7.5) < F32_EPS
        keep = ~tiny
        zero = (w.reshape(w.shape[0], -1, group) == 0).all(-1)
        assert torch.all(codes.view(w.shape[0], -1, group)[zero] == 0)
        assert torch.all(codes_o.view(w.shape[0], -1, group)[zero] == 0)
    assert torch.equal(scale[keep], scale_o[keep])
    assert torch.equal(codes.view(w.shape[0], -1, group)[keep], codes_o.view(w.shape[0], -1, group)[keep])
    if bool(keep.all()):
        assert torch.equal(packed, packed_o)
        assert torch.equal(scale2, scale_o)
        assert torch.equal(I.dequantize(codes, scale, spec), deq_o)
        assert torch.equal(I.fake_quantize(w, spec), deq_o.to(w.dtype))
    # compressed-tensors' own pack of our codes is our pack
    assert torch.equal(I.pack(codes), _ct()[4](codes, 4))


@settings(max_examples=60, deadline=None)
@given(wg=weights(dtypes=(torch.bfloat16, torch.float32), lead=False), preset=st.sampled_from(I.PRESETS),
       block=st.sampled_from([1, 256, 1 << 20]))
def test_kernel_and_torch_paths_are_bit_identical(wg, preset, block):
    w, group = wg
    spec = I.Int4Spec(group, preset)
    before = w.clone()
    codes_k, scale_k = I.quantize(w, spec)  # numba kernel (CPU, bf16/fp32)
    codes_t, scale_t = I.quantize_torch(w, spec, block_bytes=block)
    assert torch.equal(w, before)  # the input is never modified
    packed_k, scale_pk = I.quantize_pack(w, spec)
    packed_t, scale_pt = I.quantize_pack_torch(w, spec, block_bytes=block)
    assert torch.equal(codes_k, codes_t) and torch.equal(scale_k, scale_t)
    assert torch.equal(packed_k, packed_t) and torch.equal(scale_pk, scale_t) and torch.equal(scale_pt, scale_t)
    assert torch.equal(packed_k, I.pack(codes_t))
    assert torch.equal(I.scales(w, spec), scale_t)
    fq = I.fake_quantize(w, spec)  # fused kernel
    assert fq.dtype == w.dtype and torch.equal(fq, I.fake_quantize_torch(w, spec))
    assert torch.equal(fq, I.dequantize(codes_t, scale_t, spec).to(w.dtype))


@settings(max_examples=25, deadline=None)
@given(wg=weights(dtypes=(torch.bfloat16,), lead=True, max_rows=6), preset=st.sampled_from(I.PRESETS))
def test_moe_3d_weights_match_per_expert(wg, preset):
    w, group = wg
    spec = I.Int4Spec(group, preset)
    packed, scale = I.quantize_pack(w, spec)
    assert packed.shape == w.shape[:-1] + (w.shape[-1] // 8,)
    for e in range(w.shape[0]):
        p_e, s_e = I.quantize_pack_torch(w[e], spec)
        assert torch.equal(packed[e], p_e) and torch.equal(scale[e], s_e)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 9), cols=st.integers(0, 70), seed=st.integers(0, 10_000), lead=st.integers(0, 2))
def test_pack_unpack_round_trip(rows, cols, seed, lead):
    g = torch.Generator().manual_seed(seed)
    shape = (lead,) * bool(lead) + (rows, cols)
    codes = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    packed = I.pack(codes)
    assert packed.dtype == torch.int32 and packed.shape == shape[:-1] + (-(-cols // 8),)
    assert torch.equal(I.unpack(packed, cols), codes)
    # nibble layout: column 8j + i at bits 4i..4i+3, offset +8
    if rows and cols:
        word = int(packed.reshape(-1, packed.shape[-1])[0, 0]) & 0xFFFFFFFF
        first = codes.reshape(-1, cols)[0, :8].tolist()
        assert word == sum(((c + 8) & 0xF) << (4 * i) for i, c in enumerate(first))


@settings(max_examples=40, deadline=None)
@given(wg=weights(dtypes=(torch.bfloat16, torch.float32)))
def test_slime_preset_formula(wg):
    """scale = bf16(float32 amax / 7) stored in bf16; codes = rint(float32 w / float32 scale) in [-7, 7];
    the QAT weight (fake_quantize) is exactly codes * scale as the rollout dequantizes it."""
    w, group = wg
    spec = I.Int4Spec(group, "slime")
    codes, scale = I.quantize(w, spec)
    assert scale.dtype == torch.bfloat16 and codes.dtype == torch.int8
    assert int(codes.min()) >= -7 and int(codes.max()) <= 7
    amax = w.float().reshape(w.shape[0], -1, group).abs().amax(-1)
    expect = (amax / 7.0).to(torch.bfloat16)
    expect = torch.where(expect == 0, torch.full_like(expect, torch.finfo(torch.bfloat16).eps), expect)
    assert torch.equal(scale, expect)
    q = (w.float().reshape(w.shape[0], -1, group) / scale.float().unsqueeze(-1)).round().clamp(-7, 7)
    assert torch.equal(codes, q.reshape(w.shape).to(torch.int8))
    deq = I.dequantize(codes, scale, spec)
    assert deq.dtype == torch.bfloat16
    assert torch.equal(I.fake_quantize(w, spec), deq.to(w.dtype))
    # the same packed checkpoint dequantizes to the same weights (trainer == rollout)
    packed, scale_p = I.quantize_pack(w, spec)
    assert torch.equal(I.dequantize(I.unpack(packed, w.shape[-1]), scale_p, spec), deq)


def test_in_place_outputs_keep_storage():
    spec = I.Int4Spec(32, "ct")
    w = torch.randn(64, 128).to(torch.bfloat16)
    codes = torch.empty(64, 128, dtype=torch.int8)
    scale = torch.empty(64, 4, dtype=torch.bfloat16)
    packed = torch.full((64, 16), 7, dtype=torch.int32)
    ptrs = (codes.data_ptr(), scale.data_ptr(), packed.data_ptr())
    c, s = I.quantize(w, spec, out_codes=codes, out_scale=scale)
    assert c is codes and s is scale
    p, s2 = I.quantize_pack(w, spec, out_packed=packed, out_scale=torch.empty_like(scale))
    assert p is packed and (codes.data_ptr(), scale.data_ptr(), packed.data_ptr()) == ptrs
    assert torch.equal(packed, I.pack(codes)) and torch.equal(s2, scale)
    # non-contiguous destinations take the torch path, same bits
    big = torch.empty(64, 32, dtype=torch.int32)
    p2, _ = I.quantize_pack(w, spec, out_packed=big[:, ::2], out_scale=torch.empty_like(scale))
    assert torch.equal(p2, packed)
    with pytest.raises(ValueError, match="out_packed"):
        I.quantize_pack(w, spec, out_packed=torch.empty(64, 15, dtype=torch.int32))
    with pytest.raises(ValueError, match="out_scale"):
        I.quantize(w, spec, out_scale=torch.empty(64, 4, dtype=torch.float32))


def test_spec_validation_and_shape_errors():
    with pytest.raises(ValueError, match=r"preset.*\('ct', 'slime'\)"):
        I.Int4Spec(128, "gptq")
    with pytest.raises(ValueError, match=r"group_size.*\(32, 64, 128\)"):
        I.Int4Spec(48)
    with pytest.raises(ValueError, match="multiple of group_size=128"):
        I.quantize(torch.randn(4, 96), I.Int4Spec())
    with pytest.raises(ValueError, match=r"\[\.\.\., out, in\]"):
        I.quantize(torch.randn(128), I.Int4Spec())
    assert I.Int4Spec() == I.Int4Spec(128, "ct")


def test_grad_weight_is_not_modified_and_fake_quantize_builds_no_graph():
    w = torch.randn(8, 64, requires_grad=True)
    fq = I.fake_quantize(w, I.Int4Spec(32, "slime"))
    assert not fq.requires_grad and fq.dtype == w.dtype
    ste = w + (fq - w).detach()
    ste.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))
