"""Issue 44: the first-use verification of the compiled (accelerator) quantizers covers every
compiled kernel a weight runs -- its own dtype, width and SmoothQuant factors -- and the refusal
of NaN/inf weights.

The accelerator's compiler is a double (:mod:`.compiled_kernel_double`): the formulas run
eagerly, wrong for the variant a test names; the CPU stands in for an accelerator
(``fused.wanted`` says yes). Everything else -- the probes, the eager paths, the verdicts -- is
the real code."""

import pytest

torch = pytest.importorskip("torch")

from ascend_rl_plugins.quant import block_fp8, fused, int4, quant  # noqa: E402
from ascend_rl_plugins.quant.device_math import NonFiniteWeightError  # noqa: E402
from tests.quant.compiled_kernel_double import EagerCompiler  # noqa: E402

ROWS_KINDS = ("int8_rows", "fp8_rows")


@pytest.fixture
def compiler(monkeypatch):
    """``compiler(**how)`` installs an :class:`EagerCompiler` as the accelerator's compiler on a
    CPU that stands in for an accelerator; ``compiler.flag(value)`` sets
    ASCEND_RL_FLASHRL_DEVICE_FUSED (flags are parsed once per process)."""
    from ascend_rl_plugins import flags

    def install(**how):
        double = EagerCompiler(**how)
        monkeypatch.setattr(fused, "compiled", double.compiled)
        return double

    def flag(value):
        monkeypatch.setenv("ASCEND_RL_FLASHRL_DEVICE_FUSED", value)
        flags.reset_cache()

    monkeypatch.setattr(fused, "wanted", lambda device: fused.mode() != "off")
    monkeypatch.delenv("ASCEND_RL_FLASHRL_DEVICE_FUSED", raising=False)
    flags.reset_cache()
    fused.STATE.reset()
    install.flag = flag
    yield install
    monkeypatch.delenv("ASCEND_RL_FLASHRL_DEVICE_FUSED", raising=False)
    flags.reset_cache()
    fused.STATE.reset()


def _weight(cols, dtype=torch.bfloat16, rows=256, bad=None):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)) * 0.02
    if bad is not None:
        w[rows // 3, cols // 2] = bad
    return w.to(dtype)


def _factors(w, given) -> dict:
    """SmoothQuant factors for ``w`` by keyword: ``col_smooth`` and/or ``row_gain`` as named in
    ``given``."""
    gen = torch.Generator().manual_seed(7)
    size = {"col_smooth": w.shape[1], "row_gain": w.shape[0]}
    return {name: torch.rand(size[name], generator=gen) + 0.5 for name in given}


# what makes a per-row kernel of its own, and a double wrong for exactly that kernel
# (the kernel's inputs: weight, col_smooth or None, row_gain or None, constants)
ROWS_VARIANTS = {
    "width": (256, (), lambda tensors: tensors[0].shape[1] == 256),
    "col_smooth": (128, ("col_smooth",), lambda tensors: tensors[1] is not None),
    "row_gain": (128, ("row_gain",), lambda tensors: tensors[2] is not None),
}


@pytest.mark.parametrize("kind", ROWS_KINDS)
@pytest.mark.parametrize("variant", sorted(ROWS_VARIANTS))
def test_each_per_row_kernel_is_verified_with_its_own_width_and_factors(compiler, kind, variant, caplog):
    """A 128-column weight without factors verifies its kernel; a kernel that is wrong only at
    another width, or only with a factor given, is caught at its own first use -- not covered by
    the first verdict (which, keyed by (kind, device type, dtype) and probed at 1024 columns
    without factors, it used to be)."""
    cols, given, wrong_if = ROWS_VARIANTS[variant]
    compiler(wrong_if=wrong_if)
    plain = _weight(128)
    assert quant._fused_usable(kind, plain)
    w = _weight(cols)
    with caplog.at_level("WARNING", logger="ascend_rl_plugins.flashrl"):
        assert not quant._fused_usable(kind, w, **_factors(w, given))
    assert quant._fused_usable(kind, plain)                 # the right kernel keeps its verdict
    warned = [r.getMessage() for r in caplog.records if "is not used on cpu" in r.getMessage()]
    assert len(warned) == 1 and f"{cols} columns" in warned[0], warned
    assert all(("with " + f if f in given else "no " + f) in warned[0] for f in ("col_smooth", "row_gain"))


@pytest.mark.parametrize("variant", sorted(ROWS_VARIANTS))
def test_a_weight_is_never_quantized_by_a_kernel_its_verification_did_not_run(compiler, variant):
    """Through the entry point: FP8 rows (the one whose accelerator path the CPU can take) gives
    the eager path's bits even when the compiler is wrong for exactly this weight's kernel."""
    cols, given, wrong_if = ROWS_VARIANTS[variant]
    compiler(wrong_if=wrong_if)
    quant.quantize_fp8_rows(_weight(128))                   # verifies the plain kernel first
    w = _weight(cols)
    got = quant.quantize_fp8_rows(w, **_factors(w, given))
    want = quant.quantize_fp8_rows_torch(w, **_factors(w, given))
    assert fused.same_bits(got[1], want[1]), int((got[1] != want[1]).sum())
    assert fused.same_bits(got[0], want[0])


USABLE = {
    "int8_rows": lambda w: quant._fused_usable("int8_rows", w),
    "fp8_rows": lambda w: quant._fused_usable("fp8_rows", w),
    "int4": lambda w: int4._fused_usable(w, int4.Int4Spec(32, "ct")),
    "block_fp8": lambda w: block_fp8._fused_usable(w, 128, 128, "one_graph"),
}


@pytest.mark.parametrize("quantizer", ["int4", "block_fp8"])
def test_int4_and_block_fp8_kernels_are_verified_at_the_weight_width(compiler, quantizer):
    """INT4 and block FP8 compile a kernel per width too: a kernel wrong only at 256 columns is
    caught when a 256-column weight first needs it, after the 128-column kernel passed."""
    compiler(wrong_if=lambda tensors: tensors[0].shape[-1] == 256)
    assert USABLE[quantizer](_weight(128))
    assert not USABLE[quantizer](_weight(256))
    assert USABLE[quantizer](_weight(128))


@pytest.mark.parametrize("quantizer", sorted(USABLE))
def test_a_compiler_whose_max_skips_nan_fails_the_first_use_check(compiler, quantizer):
    """The probes include a NaN, a +inf and a -inf: kernels that would give a NaN weight a finite
    scale (so the entry points would not refuse it) are not used."""
    compiler(max_skips_nan=True)
    assert not USABLE[quantizer](_weight(256))
    fused.STATE.reset()
    compiler()                                               # the same kernels, NaN propagated
    assert USABLE[quantizer](_weight(256))


def test_a_nan_weight_is_refused_even_where_the_compiler_skips_nan(compiler):
    """Under ``auto`` the refusal falls back to the eager path, which refuses the NaN weight
    naming it; under ``on`` the unusable compiled form is an error, not a silent quantization."""
    compiler(max_skips_nan=True)
    with pytest.raises(NonFiniteWeightError, match="layers.0.mlp.up_proj.weight"):
        quant.quantize_fp8_rows(_weight(256, bad=float("nan")), name="layers.0.mlp.up_proj.weight")
    fused.STATE.reset()
    compiler.flag("on")
    with pytest.raises(fused.FusedUnavailable, match="non-finite"):
        quant.quantize_fp8_rows(_weight(256, bad=float("nan")), name="layers.0.mlp.up_proj.weight")


@pytest.mark.parametrize("bad_dtype, other", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_a_verdict_for_one_dtype_is_never_reused_for_another(compiler, bad_dtype, other):
    """The kernels of each dtype are their own: a compiler wrong only for ``bad_dtype`` is
    refused there at first use and still used for ``other`` afterwards (each has its own check)."""
    compiler(wrong_if=lambda tensors: tensors[0].dtype == bad_dtype)
    for kind in ROWS_KINDS:
        assert not quant._fused_usable(kind, _weight(128, bad_dtype))
        assert quant._fused_usable(kind, _weight(128, other))
    assert not USABLE["int4"](_weight(128, bad_dtype)) and USABLE["int4"](_weight(128, other))


def test_the_probes_hold_what_the_checks_rely_on():
    """The tie probe at any width keeps INT8 scale 3 and .5 ties in its tie rows, with the probe
    factors too; the NaN/inf probe puts one non-finite weight in three different rows, groups
    and 128 x 128 blocks."""
    for cols in (128, 384, 4096):
        w = fused.probe_weight(torch.device("cpu"), torch.float32, cols=cols)
        col, gain = fused.probe_factors(torch.device("cpu"), cols=cols)
        for x in (w, w * col * gain.reshape(-1, 1)):
            q = x[:9] / (x[:9].abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-30)
            assert int(((q - q.floor()) == 0.5).sum()) >= 8 * cols // 4, cols
        bad = ~torch.isfinite(fused.nonfinite_probe(torch.device("cpu"), torch.float32, rows=384, cols=cols))
        assert int(bad.sum()) == 3 and int(bad.any(dim=1).sum()) == 3
        assert int(bad.reshape(3, 128, cols // 128, 128).any(dim=3).any(dim=1).sum()) == 3
