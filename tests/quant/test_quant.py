"""Quantization math: exactness, format compatibility, smoothing, pruning (no engine)."""

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings, strategies as st  # noqa: E402

from ascend_rl_plugins.quant import quant as Q  # noqa: E402


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
    # (w / s is rounded to float32 before round-half-even: a quotient a hair above k + 0.5 can
    # land on k + 0.5 exactly and round to k, e.g. 60.50000054 -> 60.5 -> 60, so allow |w| * 2**-21)
    assert torch.all((Q.dequantize_int8_rows(q, s) - w).abs() <= s * 0.5 * (1 + 1e-6) + w.abs() * 2 ** -21)


def _compressed_tensors():
    """compressed-tensors' own quantizer (vLLM pins a copy in each stack venv): the oracle."""
    try:
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import quantize
        from compressed_tensors.quantization.utils import calculate_qparams
    except ImportError as exc:
        pytest.skip(f"compressed-tensors is not importable here ({exc}); it comes with vLLM in the stack venvs")
    return QuantizationArgs, quantize, calculate_qparams


def _smoothed(w, col, row):
    """The input both quantizers see: ``w * s_col * g_row`` in float32, in that order."""
    x = w.float()
    if col is not None:
        x = x * col.view(1, -1)
    if row is not None:
        x = x * row.view(-1, 1)
    return x


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 90), seed=st.integers(0, 10_000),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), zero_rows=st.integers(0, 2),
       smooth=st.booleans(), gain=st.booleans(), block=st.sampled_from([4, 64, 1 << 20]),
       magnitude=st.sampled_from([1e-3, 1.0, 300.0]))
def test_int8_paths_equal_compressed_tensors_reference(n, k, seed, dtype, zero_rows, smooth, gain, block,
                                                       magnitude):
    """The torch path (what an NPU runs) and the CPU kernel, each against compressed-tensors'
    own ``quantize`` (symmetric int8, channel strategy): identical codes for the scale this
    project writes, ``amax / 127`` per row. (compressed-tensors' ``calculate_qparams`` would
    use ``amax / 127.5`` and reach -128; any per-channel scale is a valid W8A8 checkpoint,
    and 127 keeps the codes symmetric.)"""
    QuantizationArgs, quantize, _ = _compressed_tensors()
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    w = _weight(seed, n, k, dtype, min(zero_rows, n), scale=magnitude)
    col = _factors(seed, k) if smooth else None
    row = _factors(seed + 7, n) if gain else None
    x = _smoothed(w, col, row)
    want_scale = x.abs().amax(dim=1, keepdim=True).clamp_min(Q.MIN_SCALE * 127.0) / 127.0
    for path in (lambda: Q.quantize_int8_rows_torch(w, col, row, block_bytes=block),
                 lambda: Q.quantize_int8_rows(w, col, row)):
        q, s = path()
        assert torch.equal(s, want_scale)
        ref = quantize(x, s, torch.zeros_like(s, dtype=torch.int8), args, dtype=torch.int8)
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


# -- FP8 E4M3 (compressed-tensors FP8 W8A8) ------------------------------------------------

def _bits(t):
    return t.view(torch.uint8)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), k=st.integers(1, 70), seed=st.integers(0, 10_000),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), zero_rows=st.integers(0, 2),
       smooth=st.booleans(), gain=st.booleans(), strategy=st.sampled_from(["channel", "tensor"]),
       block=st.sampled_from([4, 64, 1 << 20]), magnitude=st.sampled_from([1e-4, 1.0, 1e3]))
def test_fp8_properties_and_block_size_invariance(n, k, seed, dtype, zero_rows, smooth, gain, strategy, block,
                                                  magnitude):
    w = _weight(seed, n, k, dtype, min(zero_rows, n), scale=magnitude)
    col = _factors(seed, k) if smooth else None
    row = _factors(seed + 7, n) if gain else None
    q, s = Q.quantize_fp8_rows(w, col, row, strategy=strategy, block_bytes=block)
    q2, s2 = Q.quantize_fp8_rows(w, col, row, strategy=strategy)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == ((n, 1) if strategy == "channel" else (1,))
    assert torch.equal(_bits(q), _bits(q2)) and torch.equal(s, s2)
    x = w.float() * (1 if col is None else col.view(1, -1)) * (1 if row is None else row.view(-1, 1))
    amax = x.abs().amax(dim=1, keepdim=True) if strategy == "channel" else x.abs().amax().reshape(1)
    want = amax / Q.FP8_MAX
    want = torch.where(want == 0, torch.full_like(want, torch.finfo(torch.float32).eps), want)
    assert torch.equal(s, want)
    deq = Q.dequantize_fp8_rows(q, s)
    assert torch.isfinite(deq).all() and (deq.abs() <= amax.reshape(-1, 1) * (1 + 1e-6) + 1e-30).all()
    # E4M3 has 3 mantissa bits: relative error of a normal value at most 2**-4
    big = x.abs() >= s.reshape(-1, 1) * 2 ** -6 * 8
    assert ((deq - x).abs()[big] <= x.abs()[big] * 2 ** -4 * (1 + 1e-6)).all()


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_fp8_matches_compressed_tensors_reference_quantizer(strategy):
    """FP8 (torch path only, on every device): scales from compressed-tensors'
    ``calculate_qparams`` and codes from its ``quantize``, bit for bit."""
    QuantizationArgs, quantize, calculate_qparams = _compressed_tensors()
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy)
    for seed in range(5):
        w = _weight(seed, 96, 80, torch.bfloat16, zero_rows=1, scale=0.05)
        w[2, :7] = -0.0  # compressed-tensors adds its zero point: -0.0 becomes +0.0
        col = _factors(seed, 80)
        row = _factors(seed + 7, 96) if seed % 2 else None
        q, s = Q.quantize_fp8_rows(w, col, row, strategy=strategy, block_bytes=5000)
        x = _smoothed(w, col, row)
        lo = x.amin(dim=1, keepdim=True) if strategy == "channel" else x.amin().reshape(1)
        hi = x.amax(dim=1, keepdim=True) if strategy == "channel" else x.amax().reshape(1)
        ref_s, _ = calculate_qparams(lo, hi, args)
        assert torch.equal(ref_s.reshape(s.shape), s)
        ref = quantize(x, s, torch.zeros_like(s), args, dtype=torch.float8_e4m3fn)
        assert torch.equal(_bits(ref), _bits(q))


def test_fp8_validates_arguments():
    w = _weight(1, 6, 5, torch.bfloat16)
    with pytest.raises(ValueError, match="strategy"):
        Q.quantize_fp8_rows(w, strategy="block")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Q.quantize_fp8_rows(w, out=torch.empty(6, 5, dtype=torch.int8))
    with pytest.raises(ValueError, match="scale"):
        Q.quantize_fp8_rows(w, strategy="tensor", scale_out=torch.empty(6, 1))


# -- bounded exact int8 reductions (used around vLLM's post-processing) ---------------------

@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), k=st.integers(1, 700), seed=st.integers(0, 1000), dim=st.sampled_from([0, 1, -1, -2]),
       keepdim=st.booleans(), transposed=st.booleans(), as_kw=st.booleans())
def test_bounded_int_sum_is_bit_identical(n, k, seed, dim, keepdim, transposed, as_kw):
    from ascend_rl_plugins.features.flashrl import reload as R
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    x = w.t() if transposed else w
    want = x.sum(dim=dim, keepdim=keepdim, dtype=torch.float32)
    with R.BoundedIntSum():
        got = (x.sum(dim=dim, keepdim=keepdim, dtype=torch.float32) if as_kw
               else torch.sum(x, dim, keepdim, dtype=torch.float32))
        other = (x.float() + 1).sum()  # anything else passes through
    assert got.dtype == torch.float32 and got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(other, (x.float() + 1).sum())


def test_bounded_int_sum_slices_large_reductions():
    """Both exact paths -- the numba row sums (reduced dimension contiguous, vLLM's case) and
    the sliced torch reduction (any other layout, larger than one slice) -- give torch's
    result bit for bit; what they do not handle is left to torch (None)."""
    from ascend_rl_plugins.features.flashrl import reload as R
    g = torch.Generator().manual_seed(5)
    w = torch.randint(-128, 128, (4096, 512), generator=g, dtype=torch.int8)
    for x, dim, keepdim in ((w.t(), 0, True), (w, 0, True), (w, 0, False), (w.t().contiguous().t(), 1, False)):
        got = R._sliced_int_sum((x,), {"dim": dim, "keepdim": keepdim, "dtype": torch.float32})
        want = x.sum(dim=dim, keepdim=keepdim, dtype=torch.float32)
        assert got is not None and got.dtype == torch.float32 and torch.equal(got, want), (x.stride(), dim)
    assert w.numel() * 4 > R.SUM_SLICE_BYTES and w.stride(0) != 1  # (w, 0) took the sliced path
    assert R._sliced_int_sum((w.t(),), {"dim": 0, "dtype": torch.bfloat16}) is None  # only float32 results
    assert R._sliced_int_sum((w.float(),), {"dim": 0, "dtype": torch.float32}) is None  # only int8 inputs
    big_k = torch.zeros(2, 70_000, dtype=torch.int8)  # partial sums could exceed 2**24: left to torch
    assert R._sliced_int_sum((big_k,), {"dim": 1, "dtype": torch.float32}) is None


def test_bounded_int_sum_cpu_kernel_on_strided_rows():
    """The numba row-sum path takes any row stride (e.g. a column slice of a weight)."""
    from ascend_rl_plugins.features.flashrl import reload as R
    g = torch.Generator().manual_seed(3)
    w = torch.randint(-128, 128, (300, 520), generator=g, dtype=torch.int8)
    for x, dim in ((w[:, 7:500], 1), (w[:, 7:500].t(), 0), (w[5:290].t(), 0), (w[::2], 1)):
        with R.BoundedIntSum():
            got = x.sum(dim=dim, keepdim=True, dtype=torch.float32)
        assert torch.equal(got, x.sum(dim=dim, keepdim=True, dtype=torch.float32))
