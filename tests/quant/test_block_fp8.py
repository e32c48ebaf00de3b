"""128x128 block FP8: compressed-tensors bit identity (float32 input), kernel == torch,
partial edge blocks, dequantize round trip, in-place outputs. No engine."""

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings, strategies as st  # noqa: E402

from ascend_rl_plugins.quant import block_fp8 as B  # noqa: E402

F32_EPS = 2.0 ** -23


def bits(t):
    """FP8 tensors compared as bytes (no float8 equality kernel on CPU)."""
    return t.view(torch.uint8)


def _weight(seed, n, k, dtype, magnitude=1.0, zero_block=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * magnitude
    w = w * torch.where(torch.rand(n, k, generator=g) < 0.01, 40.0, 1.0)
    if zero_block:
        w[: min(n, 128), : min(k, 128)] = 0.0
    w[torch.rand(n, k, generator=g) < 0.01] = -0.0
    return w.to(dtype)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 300), seed=st.integers(0, 10_000),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), magnitude=st.sampled_from([1e-20, 1e-3, 1.0, 1e4, 1e30]),
       zero_block=st.booleans(), block=st.sampled_from([(128, 128), (64, 32), (1, 128)]),
       block_bytes=st.sampled_from([1, 100_000, 16 << 20]))
def test_kernel_and_torch_paths_are_bit_identical(n, k, seed, dtype, magnitude, zero_block, block, block_bytes):
    w = _weight(seed, n, k, dtype, magnitude, zero_block)
    before = w.clone()
    q1, s1 = B.quantize(w, block)  # numba kernel on CPU
    q2, s2 = B.quantize_torch(w, block, block_bytes=block_bytes)
    assert torch.equal(w, before)  # the input is never modified
    assert q1.dtype == torch.float8_e4m3fn and s1.dtype == torch.float32
    assert s1.shape == (-(-n // block[0]), -(-k // block[1]))
    assert torch.equal(bits(q1), bits(q2)) and torch.equal(s1, s2)
    assert torch.all(bits(q1)[w == 0] == 0)  # zeros (also -0.0) are +0 (tiny negatives may round to -0)
    assert not bool((bits(q1) & 0x7F == 0x7F).any())  # no NaN


@settings(max_examples=20, deadline=None)
@given(nb=st.integers(1, 2), kb=st.integers(1, 3), seed=st.integers(0, 10_000),
       magnitude=st.sampled_from([1e-3, 1.0, 300.0]), zero_block=st.booleans())
def test_bit_identical_to_compressed_tensors_block_fp8(nb, kb, seed, magnitude, zero_block):
    """compressed-tensors' FP8_BLOCK math (the copy vLLM pins) on the float32 weight: scale
    = amax / 448 per 128x128 block, ``quantize(..., dtype=float8_e4m3fn)``."""
    try:
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import quantize
        from compressed_tensors.quantization.utils import calculate_qparams
    except ImportError as exc:
        pytest.skip(f"compressed-tensors is not importable here ({exc})")
    w = _weight(seed, 128 * nb, 128 * kb, torch.bfloat16, magnitude, zero_block).float()
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128])
    blocks = w.reshape(nb, 128, kb, 128).transpose(1, 2)
    scale, zp = calculate_qparams(blocks.amin(dim=(-2, -1)), blocks.amax(dim=(-2, -1)), args)
    q_ct = quantize(w, scale, zp, args, dtype=torch.float8_e4m3fn)
    q, s = B.quantize(w)
    nonzero = blocks.abs().amax(dim=(-2, -1)) > 0
    # all-zero blocks: compressed-tensors 0.12 clamps the scale to >= eps, 0.13+ replaces 0 by
    # eps; either way the codes are zero
    assert torch.equal(s[nonzero], scale[nonzero])
    assert torch.equal(bits(q), bits(q_ct))


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 300), seed=st.integers(0, 10_000))
def test_partial_edge_blocks_equal_zero_padding(n, k, seed):
    """An edge block's scale covers only the elements that exist, i.e. the same as
    quantizing the zero-padded weight and cropping (vLLM / DeepGEMM's convention)."""
    w = _weight(seed, n, k, torch.bfloat16)
    padded = torch.zeros(-(-n // 128) * 128, -(-k // 128) * 128, dtype=w.dtype)
    padded[:n, :k] = w
    q, s = B.quantize(w)
    qp, sp = B.quantize(padded)
    nonzero = sp != F32_EPS
    assert torch.equal(s[nonzero], sp[nonzero])
    assert torch.equal(bits(q), bits(qp[:n, :k]))


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 300), seed=st.integers(0, 10_000),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_dequantize_round_trip(n, k, seed, dtype):
    w = _weight(seed, n, k, dtype)
    q, s = B.quantize(w)
    d = B.dequantize(q, s, dtype=torch.float32)
    # E4M3 has 3 mantissa bits: relative error <= 2**-4 for normals, absolute <= 2**-10 * scale
    # for subnormals (|w / scale| < 2**-6)
    sfull = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    err = (d - w.float()).abs()
    assert torch.all(err <= w.float().abs() * 2 ** -4 + sfull * 2 ** -10)
    # re-quantizing the dequantized weight gives the same codes and scales (stable fixed point)
    q2, s2 = B.quantize(d)
    # (as values: a tiny negative that rounded to -0 comes back as an exact zero, stored +0)
    assert torch.equal(s2, s) and torch.equal(q2.float(), q.float())
    assert B.dequantize(q, s).dtype == torch.bfloat16


def test_in_place_outputs_and_errors():
    w = _weight(0, 200, 300, torch.bfloat16)
    out = torch.empty(200, 300, dtype=torch.float8_e4m3fn)
    sc = torch.empty(2, 3, dtype=torch.float32)
    ptr = out.data_ptr()
    q, s = B.quantize(w, out_weight=out, out_scale_inv=sc)
    assert q is out and s is sc and out.data_ptr() == ptr
    q2, s2 = B.quantize_torch(w)
    assert torch.equal(bits(q), bits(q2)) and torch.equal(s, s2)
    with pytest.raises(ValueError, match="out_scale_inv"):
        B.quantize(w, out_scale_inv=torch.empty(2, 2))
    with pytest.raises(ValueError, match="2-D"):
        B.quantize(torch.randn(3, 4, 5))
