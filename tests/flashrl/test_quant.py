"""Quantization math: exactness, format compatibility, smoothing, pruning (no engine)."""

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings, strategies as st  # noqa: E402

from ascend_rl_plugins.features.flashrl import quant as Q  # noqa: E402


def _weight(seed, n, k, dtype, zero_rows=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * scale
    if zero_rows:
        w[:zero_rows] = 0
    return w.to(dtype)


def _factors(seed, size, pow2=True):
    g = torch.Generator().manual_seed(seed + 1)
    if pow2:
        return torch.exp2(torch.randint(-3, 4, (size,), generator=g).float())
    return torch.rand(size, generator=g) * 4 + 0.05


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 90), seed=st.integers(0, 10_000),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), zero_rows=st.integers(0, 2),
       smooth=st.booleans(), gain=st.booleans(), pow2=st.booleans(),
       block=st.sampled_from([4, 64, 1 << 20]))
def test_cpu_kernel_and_torch_path_agree_bit_for_bit(n, k, seed, dtype, zero_rows, smooth, gain, pow2, block):
    w = _weight(seed, n, k, dtype, min(zero_rows, n))
    col = _factors(seed, k, pow2) if smooth else None
    row = _factors(seed + 7, n, pow2) if gain else None
    q1, s1 = Q.quantize_int8_rows(w, col, row)  # numba kernel on CPU
    q2, s2 = Q.quantize_int8_rows_torch(w, col, row, block_bytes=block)  # device-agnostic blocked torch
    assert torch.equal(q1, q2)
    assert torch.equal(s1, s2)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 60), seed=st.integers(0, 10_000),
       magnitude=st.sampled_from([1e-3, 1.0, 300.0]))
def test_per_channel_symmetric_properties(n, k, seed, magnitude):
    w = _weight(seed, n, k, torch.float32, scale=magnitude)
    q, s = Q.quantize_int8_rows(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (n, 1)
    assert int(q.abs().max()) <= 127
    amax = w.abs().amax(dim=1, keepdim=True)
    assert torch.equal(s, amax.clamp_min(Q.MIN_SCALE * Q.QMAX) / Q.QMAX)
    # the largest element of every non-zero row maps to +-127; error at most half a step
    nz = amax.view(-1) >= Q.MIN_SCALE * Q.QMAX  # (rows below the scale floor keep small codes)
    assert torch.all(q[nz].abs().amax(dim=1) == 127)
    assert torch.all((Q.dequantize_int8_rows(q, s) - w).abs() <= s * 0.5 * (1 + 1e-6))


def test_matches_compressed_tensors_reference_quantizer():
    ct_forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
    from compressed_tensors.quantization import QuantizationArgs
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    for seed in range(5):
        w = _weight(seed, 96, 80, torch.bfloat16)
        col = _factors(seed, 80)
        q, s = Q.quantize_int8_rows(w, col)
        ref = ct_forward.quantize(w.float() * col, s, torch.zeros_like(s, dtype=torch.int8), args, dtype=torch.int8)
        assert torch.equal(ref.to(torch.int8), q)


def test_smoothing_folded_into_norm_preserves_the_function():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 32, generator=g, dtype=torch.float64)
    norm = torch.rand(32, generator=g, dtype=torch.float64) + 0.5
    w = torch.randn(16, 32, generator=g, dtype=torch.float64)
    s = _factors(3, 32).double()
    plain = (x * norm) @ w.t()
    smoothed = (x * Q.smooth_norm(norm, s)) @ (w * s).t()
    assert torch.allclose(plain, smoothed, rtol=1e-5, atol=1e-5)  # smooth_norm computes in float32
    # power-of-two factors are exact in bf16: the norm round-trips bit for bit
    nb = norm.to(torch.bfloat16)
    assert torch.equal((Q.smooth_norm(nb, s).float() * s.float()).to(torch.bfloat16), nb)


def test_power_of_two_and_smoothquant_factors():
    x = torch.tensor([0.3, 1.0, 5.9, 1e-40])
    p = Q.power_of_two(x)
    assert torch.equal(p, torch.tensor([0.25, 1.0, 8.0, p[3].item()]))
    assert torch.equal(torch.log2(p[:3]), torch.round(torch.log2(p[:3])))
    act = torch.tensor([4.0, 1.0, 100.0])
    w = torch.tensor([[1.0, 1.0, 0.01], [2.0, 0.5, 0.02]])
    s = Q.smoothquant_factors(act, [w], alpha=0.5)
    assert torch.all(s > 0) and torch.equal(Q.power_of_two(s), s)
    assert s[2] > s[0]  # the outlier channel is smoothed most


def test_dead_columns_and_prune():
    q1 = torch.tensor([[0, 1, 0, 0], [0, 2, 0, 5]], dtype=torch.int8)
    q2 = torch.tensor([[0, 0, 3, 0]], dtype=torch.int8)
    dead = Q.dead_input_columns([q1, q2])
    assert dead.tolist() == [True, False, False, False]
    norm = torch.tensor([1.5, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    assert Q.prune_norm(norm, dead).tolist() == [0.0, 2.0, 3.0, 4.0]


def test_flashrl_formula_baseline_is_faithful():
    w = _weight(0, 8, 6, torch.bfloat16)
    s_in = _factors(0, 6).view(1, -1)
    q, s = Q.quantize_int8_rows(w, s_in.view(-1))
    # FlashRL's formula with the profiled scales (1/scale as output_scale) gives the same codes
    ref = Q.flashrl_formula_int8(w.float(), s_in, 1.0 / s)
    assert int((ref.int() - q.int()).abs().max()) <= 1


def test_out_buffers_are_written_in_place_and_validated():
    w = _weight(1, 10, 12, torch.bfloat16)
    out = torch.empty(10, 12, dtype=torch.int8)
    sc = torch.empty(10, 1)
    q, s = Q.quantize_int8_rows(w, out=out, scale_out=sc)
    assert q.data_ptr() == out.data_ptr() and s.data_ptr() == sc.data_ptr()
    with pytest.raises(ValueError, match="out must be int8"):
        Q.quantize_int8_rows(w, out=torch.empty(10, 11, dtype=torch.int8))
    with pytest.raises(ValueError, match="2-D"):
        Q.quantize_int8_rows_torch(torch.zeros(3))
