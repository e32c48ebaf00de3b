"""Issue 31: the quantizers' bits do not depend on the device, non-finite weights are refused,
and the compiled (accelerator) formulas are the torch paths' math.

The accelerator is simulated on CPU by :mod:`.cuda_division_double` (CUDA's host-scalar
division); the real device run is ``ascend-rl selftest`` (flashrl/README.md has its table)."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings, strategies as st  # noqa: E402

from ascend_rl_plugins.quant import block_fp8, fused, int4, quant  # noqa: E402
from ascend_rl_plugins.quant.device_math import NonFiniteWeightError, constant  # noqa: E402
from tests.quant.cuda_division_double import HostScalarReciprocalDivision  # noqa: E402
from tests.quant.test_int4 import weights  # noqa: E402

same = fused.same_bits


def _tied_rows(rows, cols, dtype, seed):
    """Random rows plus rows whose INT8 scale is exactly 3 with values on .5 ties (the probe)."""
    return fused.probe_weight(torch.device("cpu"), dtype, rows=rows, cols=cols) if seed == 0 else \
        (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dtype)


def test_the_double_reproduces_the_device_difference():
    """Canary: under the double, dividing by a host scalar (the old code) changes results, and
    dividing by a device tensor (the new code) does not -- so the tests below can fail."""
    x = torch.rand(1 << 16, generator=torch.Generator().manual_seed(1)) * 1000
    exact = x / constant(127.0, x)
    with HostScalarReciprocalDivision() as mode:
        host = x / 127.0
        tensor = x / constant(127.0, x)
    assert mode.rewritten == 1
    assert int((host != exact).sum()) > 100
    assert same(tensor, exact)
    w = fused.probe_weight(torch.device("cpu"), torch.bfloat16)
    old_style = w.float().abs().amax(dim=1)
    with HostScalarReciprocalDivision():
        old_scale = old_style.clone().div_(127.0)
    assert not same(old_scale, old_style / constant(127.0, old_style))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int8_and_fp8_torch_paths_equal_the_kernel_under_cuda_division(dtype, seed):
    w = _tied_rows(160, 384, dtype, seed)
    col = torch.rand(384, generator=torch.Generator().manual_seed(seed)) + 0.5
    ref_plain = quant.quantize_int8_rows(w)
    ref_smooth = quant.quantize_int8_rows(w, col)
    with HostScalarReciprocalDivision():
        plain = quant.quantize_int8_rows_torch(w, block_bytes=1 << 16)
        smooth = quant.quantize_int8_rows_torch(w, col)
        fp8 = {s: quant.quantize_fp8_rows_torch(w, strategy=s) for s in quant.FP8_STRATEGIES}
    assert all(map(same, plain, ref_plain)) and all(map(same, smooth, ref_smooth))
    for strategy, got in fp8.items():  # FP8 rows have no CPU kernel: the CPU torch path is the reference
        assert all(map(same, got, quant.quantize_fp8_rows_torch(w, strategy=strategy)))


@settings(max_examples=40, deadline=None)
@given(wg=weights(), preset=st.sampled_from(int4.PRESETS))
def test_int4_torch_paths_equal_the_cpu_reference_under_cuda_division(wg, preset):
    w, group = wg
    spec = int4.Int4Spec(group, preset)
    if preset == "slime" and w.dtype == torch.float16:
        return  # slime stores bf16 scales: fp16 weights are not a slime configuration
    ref_codes = int4.quantize(w, spec)        # numba kernel (bf16/float32) or the CPU torch path (fp16)
    ref_packed = int4.quantize_pack(w, spec)
    ref_fake = int4.fake_quantize(w, spec)
    with HostScalarReciprocalDivision():
        codes = int4.quantize_torch(w, spec)
        packed = int4.quantize_pack_torch(w, spec)
        fake = int4.fake_quantize_torch(w, spec)
    assert all(map(same, codes, ref_codes))
    assert all(map(same, packed, ref_packed))
    assert same(fake, ref_fake)


@pytest.mark.parametrize("shape", [(256, 384), (200, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_fp8_torch_path_equals_the_kernel_under_cuda_division(shape, dtype):
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 0.1).to(dtype)
    ref = block_fp8.quantize(w)
    with HostScalarReciprocalDivision():
        got = block_fp8.quantize_torch(w)
    assert all(map(same, got, ref))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_formulas_are_the_torch_paths_math(dtype):
    """The formulas :mod:`.fused` compiles for accelerators, run eagerly (and under the CUDA
    division double), give the torch paths' bits: a formula error cannot hide behind the
    compiler. (Compiled on a GPU they are checked at first use and by `ascend-rl selftest`.)"""
    dev = torch.device("cpu")
    w = fused.probe_weight(dev, dtype, rows=256, cols=512)
    d = lambda v, t=None: torch.full((), v, dtype=t or torch.float64)  # noqa: E731
    with HostScalarReciprocalDivision():
        int8 = fused.int8_rows_formula(w, None, None, d(quant.QMAX), d(quant.MIN_SCALE * quant.QMAX, torch.float32))
        fp8 = fused.fp8_rows_formula(w, None, None, d(quant.FP8_MAX), d(torch.finfo(torch.float32).eps, torch.float32))
        bfp8 = fused.block_fp8_formula(w, d(448.0), d(2.0 ** -23, torch.float32), 128, 128)[:2]
        bfp8_direct = fused.block_fp8_direct_formula(w, d(448.0), d(2.0 ** -23, torch.float32), 128, 128)[:2]
        scale, reciprocal = fused.block_scale_formula(w, d(448.0), d(2.0 ** -23, torch.float32), 128, 128)
        bfp8_split = (fused.block_fp8_apply_formula(w, reciprocal, 128, 128), scale)
        scale3, reciprocal3 = fused.block_scale_from_runs_formula(fused.block_runs_formula(w, 128), d(448.0),
                                                                  d(2.0 ** -23, torch.float32), 128)
        bfp8_three = (fused.block_fp8_apply_formula(w, reciprocal3, 128, 128), scale3)
    for form in (bfp8_direct, bfp8_split, bfp8_three):
        assert all(map(same, form, block_fp8.quantize(w)))
    assert all(map(same, int8, quant.quantize_int8_rows(w)))
    assert all(map(same, fp8, quant.quantize_fp8_rows_torch(w)))
    assert all(map(same, bfp8, block_fp8.quantize(w)))
    for preset in int4.PRESETS:
        for group in int4.GROUP_SIZES:
            spec = int4.Int4Spec(group, preset)
            sdt = spec.scale_dtype(dtype)
            args = (d(spec.divisor), d(torch.finfo(sdt).eps, torch.float32), group, preset == "ct",
                    dtype == torch.bfloat16, float(spec.qmin))
            assert all(map(same, fused.int4_formula(w, *args, "packed"), int4.quantize_pack(w, spec)))
            assert all(map(same, fused.int4_formula(w, *args, "codes"), int4.quantize(w, spec)))
            assert same(fused.int4_formula(w, *args, "fake")[0], int4.fake_quantize(w, spec))


def _float32_pairs(n: int, seed: int):
    """float32 dividends and divisors: random magnitudes over a wide exponent range, and pairs
    built so that the exact quotient lies within a few float32 ulps of a rounding midpoint
    (``a = float32(m * b)`` for a midpoint ``m``) -- where a reciprocal multiply that is not
    accurate enough would round the other way."""
    import numpy as np
    rng = np.random.default_rng(seed)
    b = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-40, 40, n)).astype(np.float32)
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-40, 40, n)).astype(np.float32)
    f = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-20, 20, n)).astype(np.float32)
    ulp = np.spacing(f).astype(np.float64)
    mid = f.astype(np.float64) + ulp / 2                       # a float32 rounding midpoint
    a_mid = (mid * b.astype(np.float64)).astype(np.float32)    # a / b within an ulp of it
    return np.concatenate([a, a_mid]), np.concatenate([b, b])


@pytest.mark.parametrize("seed", [0, 1])
def test_the_reciprocal_multiply_is_the_correctly_rounded_quotient(seed):
    """:func:`fused._times_reciprocal` (what the compiled formulas compute per element) equals the
    correctly rounded float32 quotient -- a float64 division of the float32 operands rounded
    once to float32 -- on 2 x 400,000 pairs, half of them next to a rounding midpoint. A
    float32 reciprocal multiply (what CUDA does for a host scalar) fails this."""
    import numpy as np
    a_np, b_np = _float32_pairs(400_000, seed)
    exact = (a_np.astype(np.float64) / b_np.astype(np.float64)).astype(np.float32)
    normal = np.abs(exact) >= np.finfo(np.float32).tiny             # the documented range
    a, b = torch.from_numpy(a_np[normal]), torch.from_numpy(b_np[normal])
    got = fused._times_reciprocal(a, fused._reciprocal(b))
    assert got.dtype == torch.float32
    assert same(got, torch.from_numpy(exact[normal]))
    float32_reciprocal = a * (1.0 / b)
    assert not same(float32_reciprocal, torch.from_numpy(exact[normal]))   # the test can fail


def test_the_compiled_formulas_take_their_constants_without_reading_them_back():
    """Dynamo turns a 0-dim float64 tensor argument into a Python float guarded by
    ``not isnan(t.item())``: a device-to-host read (a synchronization on an accelerator) at
    every call of a compiled quantizer. The compiled paths pass one-element tensors instead,
    so a warm call reads nothing back."""
    fused.STATE.reset()
    w = fused.probe_weight(torch.device("cpu"), torch.bfloat16, rows=64, cols=256)
    spec = int4.Int4Spec(128, "ct")
    fn, args = int4._compiled_formula(w, spec, "fake")
    fn(w, *args)                                   # compile
    reads = []
    original = torch.Tensor.item

    def counting_item(self):
        reads.append(self.shape)
        return original(self)
    try:
        torch.Tensor.item = counting_item
        out, _ = fn(w, *args)
    finally:
        torch.Tensor.item = original
    assert reads == []
    assert all(a.shape == (1,) for a in args)
    assert same(out, int4.fake_quantize_torch(w, spec))
    fused.STATE.reset()


def test_a_compiled_form_keeps_its_columns_static_after_another_width():
    """Each width's compiled form has its own code identity, so dynamo's automatic dynamic shapes
    never see two column counts for one form: after the first-use probe (1024 columns) a 2048-
    column weight still compiles with static columns (rows dynamic) -- with a shared code name it
    compiled with ``size=[None, None]``, and on an H200 block FP8 ran 13x slower that way."""
    import logging
    fused.STATE.reset()
    torch._dynamo.reset()
    guards = logging.getLogger("torch._dynamo.guards.__guards")   # dynamo's "guards" artifact log
    lines = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.extend(record.getMessage().splitlines())
    torch._logging.set_logs(guards=True)
    guards.addHandler(handler)
    try:
        for cols in (1024, 2048):
            w = fused.probe_weight(torch.device("cpu"), torch.bfloat16, rows=256, cols=cols)
            assert all(map(same, block_fp8._fused(w, 128, 128, None, None, "split"), block_fp8.quantize_torch(w)))
    finally:
        guards.removeHandler(handler)
        torch._logging.set_logs()
        fused.STATE.reset()
    shapes = [line.split("size=")[1].split("]")[0] + "]" for line in lines
              if "TENSOR_MATCH" in line and "L['w']" in line]
    assert shapes and "[None, 2048]" in shapes and "[None, None]" not in shapes, shapes


ENTRY_POINTS = {
    "int8 rows (kernel)": lambda w, name: quant.quantize_int8_rows(w, name=name),
    "int8 rows (torch)": lambda w, name: quant.quantize_int8_rows_torch(w, name=name),
    "fp8 rows channel": lambda w, name: quant.quantize_fp8_rows(w, name=name),
    "fp8 rows tensor": lambda w, name: quant.quantize_fp8_rows(w, strategy="tensor", name=name),
    "int4 quantize (kernel)": lambda w, name: int4.quantize(w, int4.Int4Spec(128, "ct"), name=name),
    "int4 quantize (torch)": lambda w, name: int4.quantize_torch(w, int4.Int4Spec(128, "slime"), name=name),
    "int4 pack (kernel)": lambda w, name: int4.quantize_pack(w, int4.Int4Spec(64, "ct"), name=name),
    "int4 pack (torch)": lambda w, name: int4.quantize_pack_torch(w, int4.Int4Spec(64, "ct"), name=name),
    "int4 fake (kernel)": lambda w, name: int4.fake_quantize(w, int4.Int4Spec(32, "slime"), name=name),
    "int4 fake (torch)": lambda w, name: int4.fake_quantize_torch(w, int4.Int4Spec(32, "ct"), name=name),
    "int4 scales": lambda w, name: int4.scales(w, int4.Int4Spec(128, "ct"), name=name),
    "block fp8 (kernel)": lambda w, name: block_fp8.quantize(w, name=name),
    "block fp8 (torch)": lambda w, name: block_fp8.quantize_torch(w, name=name),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_every_quantizer_refuses_non_finite_weights_naming_the_tensor(entry, bad, dtype):
    w = (torch.randn(256, 384, generator=torch.Generator().manual_seed(4)) * 0.02).to(dtype)
    w[131, 257] = bad
    with pytest.raises(NonFiniteWeightError, match="layers.3.mlp.down_proj.weight"):
        ENTRY_POINTS[entry](w, "layers.3.mlp.down_proj.weight")
    w[131, 257] = 0.0
    ENTRY_POINTS[entry](w, "layers.3.mlp.down_proj.weight")  # finite again: accepted


@pytest.mark.parametrize("fn", ["int8", "fp8_channel", "w4a16"])
def test_the_online_reload_quantizers_name_the_parameter(fn):
    from ascend_rl_plugins.features.flashrl.profile import Int4OnlineQuantizer, OnlineQuantizer, Profile
    name = "model.layers.7.self_attn.o_proj.weight"
    w = torch.randn(64, 256, dtype=torch.bfloat16)
    w[5, 9] = float("nan")
    if fn == "w4a16":
        q = Int4OnlineQuantizer(int4.Int4Spec(128, "ct"), lambda n, s: True)
    else:
        q = OnlineQuantizer(Profile(), fn=fn, is_quantized=lambda n, s: True)
    with pytest.raises(NonFiniteWeightError, match=name):
        list(q.push(name, w))


@pytest.fixture
def fused_flag(monkeypatch):
    """Set ASCEND_RL_FLASHRL_DEVICE_FUSED for one test (flags are parsed once per process)."""
    from ascend_rl_plugins import flags

    def set_to(value):
        monkeypatch.setenv("ASCEND_RL_FLASHRL_DEVICE_FUSED", value)
        flags.reset_cache()
    yield set_to
    monkeypatch.delenv("ASCEND_RL_FLASHRL_DEVICE_FUSED", raising=False)
    flags.reset_cache()
    fused.STATE.reset()


def test_a_compiled_form_that_disagrees_falls_back_with_one_warning(fused_flag, caplog):
    fused.STATE.reset()
    dev = torch.device("cpu")
    with caplog.at_level("WARNING", logger="ascend_rl_plugins.flashrl"):
        assert fused.verified("probe-kind", dev, torch.bfloat16, lambda: False) is False
        assert fused.verified("probe-kind", dev, torch.bfloat16, lambda: True) is False  # remembered
        assert fused.verified("broken-kind", dev, torch.bfloat16, lambda: 1 / 0) is False
    warnings = [r for r in caplog.records if "is not used on cpu" in r.getMessage()]
    assert len(warnings) == 2 and "differs from the eager torch path" in warnings[0].getMessage()
    fused_flag("on")
    fused.STATE.reset()
    with pytest.raises(fused.FusedUnavailable, match="ASCEND_RL_FLASHRL_DEVICE_FUSED=on"):
        fused.verified("probe-kind", dev, torch.bfloat16, lambda: False)
    fused.STATE.reset()


def test_the_compiled_form_is_wanted_only_on_accelerators(fused_flag):
    assert not fused.wanted(torch.device("cpu")) and not fused.wanted(torch.device("meta"))
    npu = SimpleNamespace(type="npu")  # torch.device("npu") needs torch_npu; wanted() reads .type only
    assert fused.wanted(torch.device("cuda")) and not fused.wanted(npu)
    fused_flag("off")
    assert not fused.wanted(torch.device("cuda"))
    fused_flag("on")
    assert fused.wanted(npu)


def test_device_block_size_follows_free_memory(monkeypatch):
    from ascend_rl_plugins.quant import device_math
    assert device_math.block_bytes_for(torch.device("cpu")) == 16 << 20
    assert device_math.block_bytes_for(torch.device("cpu"), 1 << 10) == 1 << 10
    monkeypatch.setattr(device_math, "free_device_bytes", lambda device: 80 << 30)
    assert device_math.block_bytes_for(torch.device("cuda")) == device_math.DEVICE_BLOCK_BYTES
    monkeypatch.setattr(device_math, "free_device_bytes", lambda device: 1 << 30)
    assert device_math.block_bytes_for(torch.device("cuda")) == 128 << 20


def test_every_compiled_block_fp8_variant_compiles_to_the_torch_paths_bits():
    """The compiled block-FP8 forms, really compiled (inductor's CPU backend here; on an
    accelerator each is also checked at first use), whole and in strips written in place."""
    fused.STATE.reset()
    w = fused.probe_weight(torch.device("cpu"), torch.bfloat16, rows=384, cols=1024)
    ref = block_fp8.quantize_torch(w)
    for variant in block_fp8.VARIANTS:
        assert all(map(same, block_fp8._fused(w, 128, 128, None, None, variant), ref)), variant
        out = (torch.empty_like(ref[0]), torch.empty_like(ref[1]))
        assert all(map(same, block_fp8._fused(w, 128, 128, *out, variant), ref)), variant
    fused.STATE.reset()


def test_the_fastest_verified_block_fp8_variant_is_chosen_once(monkeypatch):
    assert block_fp8.choose_variant([], lambda v: 1.0) is None
    assert block_fp8.choose_variant(["split"], lambda v: 1 / 0) == "split"      # nothing to time
    times = {"one_graph": 3.0, "direct": 1.0, "split": 2.0, "three_pass": 2.5}
    timed = []
    monkeypatch.setattr(block_fp8, "_fused_usable", lambda w, bn, bk, v="one_graph": v != "direct")
    monkeypatch.setattr(block_fp8, "_time_variant", lambda w, bn, bk, v: timed.append(v) or times[v])
    fused.STATE.reset()
    w = torch.zeros(256, 256, dtype=torch.bfloat16)
    assert block_fp8._variant(w, 128, 128) == "split"          # "direct" is faster but not verified
    assert block_fp8._variant(w, 128, 128) == "split" and timed == ["one_graph", "split", "three_pass"]  # once
    fused.STATE.reset()
    assert not fused.STATE.choices
