"""FlashRL's ``ascend-rl selftest`` rows (``device_checks``) can fail: on a CPU every bit-identity
row compares the entry point and the eager torch path with an independent CPU reference (a numba
kernel, or a numpy formula for fp16), never a function with itself. Run on the CPU, as CI does."""

import functools

import pytest

torch = pytest.importorskip("torch")

from ascend_rl_plugins import selftest  # noqa: E402
from ascend_rl_plugins.features.flashrl import device_checks  # noqa: E402
from ascend_rl_plugins.quant import int4, quant  # noqa: E402

CPU = torch.device("cpu")
SHAPE = (128, 256)     # whole 128-blocks, g32/g64/g128 groups; the edge-block row adds partial ones


def _ctx():
    return selftest.SelftestContext(device=CPU, quick=True, reps=1)


def _flip_first_byte(result):
    """``result`` (a tensor or a tuple whose first item is the codes) with one bit of its first
    element flipped: the smallest corruption a byte-for-byte comparison must see."""
    first = result[0] if isinstance(result, tuple) else result
    first.view(-1).view(torch.uint8)[0] ^= 1
    return result


def _corrupted(fn, *args, **kwargs):
    return _flip_first_byte(fn(*args, **kwargs))


def _broken(fn):
    """``fn`` with its result corrupted (a partial of a module-level function, so the case can
    still tell which function it runs)."""
    return functools.partial(_corrupted, fn)


def _all_cases():
    cases = [(p.identity_case(), torch.bfloat16) for p in device_checks.paths()]
    cases += device_checks.extra_identity_cases()
    from ascend_rl_plugins.features.int4_qat.device_check import fake_quant_identity_case
    cases += [(fake_quant_identity_case(preset), torch.bfloat16) for preset in ("ct", "slime")]
    return cases


def _row(case, dtype, seed):
    shape = (SHAPE[0] - 37, SHAPE[1] + 96) if "edge" in case.name else SHAPE
    return device_checks.identity_row("flashrl", case, device_checks._weight(shape, dtype, CPU, seed=seed))


def test_every_identity_row_fails_when_its_entry_point_or_its_torch_path_is_broken():
    cases = _all_cases()
    assert len(cases) == 13
    for seed, (case, dtype) in enumerate(cases):
        clean = _row(case, dtype, seed)
        assert clean.ok, (case.name, clean.detail)
        assert clean.detail.startswith("vs ") and "on the CPU" in clean.detail, clean.detail
        bad_ours = _row(device_checks.IdentityCase(case.name, _broken(case.ours), case.eager, case.reference),
                        dtype, seed)
        assert bad_ours.ok is False and "entry point !=" in bad_ours.detail, (case.name, bad_ours.detail)
        bad_eager = _row(device_checks.IdentityCase(case.name, case.ours, _broken(case.eager), case.reference),
                         dtype, seed)
        assert bad_eager.ok is False and "eager torch path !=" in bad_eager.detail, (case.name, bad_eager.detail)


# What the entry point and the eager path share on a CPU (so a comparison of one with the other,
# or of the entry point with itself on a CPU copy, cannot see it broken), and the rows that must
# then fail.
SHARED_CODE = {
    "the FP8 rows entry point": (quant, "quantize_fp8_rows", {"FP8 rows, channel (W8A8 FP8 reload)",
                                                              "FP8 rows, tensor"}),
    "the FP8 rows torch path": (quant, "_fp8_rows_eager", {"FP8 rows, channel (W8A8 FP8 reload)",
                                                           "FP8 rows, tensor"}),
    "the INT4 torch path (fp16 takes it)": (int4, "_quantize_torch_unchecked", {"INT4 codes, ct g64, fp16"}),
}


@pytest.mark.parametrize("broken", sorted(SHARED_CODE))
def test_cpu_identity_checks_fail_when_code_shared_by_both_paths_is_broken(monkeypatch, broken):
    module, attribute, must_fail = SHARED_CODE[broken]
    original = getattr(module, attribute)

    def corrupted(*args, **kwargs):
        return _flip_first_byte(original(*args, **kwargs))
    monkeypatch.setattr(module, attribute, corrupted)
    rows = device_checks.identity_checks(_ctx(), SHAPE, SHAPE)
    passed = sorted(r.check for r in rows if r.ok is not False
                    and any(r.check.startswith(f"bit identity: {name} (") for name in must_fail))
    assert sum(r.check.startswith(f"bit identity: {name} (") for r in rows for name in must_fail) == len(must_fail)
    assert not passed, f"{broken} corrupted, yet these rows passed: {passed}"


def _another_int8(w):
    return quant.quantize_int8_rows(w)


def test_a_case_comparing_a_function_with_itself_cannot_be_made():
    from ascend_rl_plugins.quant import _cpu_kernels
    with pytest.raises(ValueError, match="ours and reference are the same function"):
        device_checks.IdentityCase("x", quant.quantize_int8_rows, quant.quantize_int8_rows_torch,
                                   quant.quantize_int8_rows)
    with pytest.raises(ValueError, match="ours and eager are the same function"):   # through partial
        device_checks.IdentityCase("x", functools.partial(quant.quantize_fp8_rows, strategy="tensor"),
                                   functools.partial(quant.quantize_fp8_rows, strategy="tensor"),
                                   device_checks.block_fp8_kernel)
    with pytest.raises(TypeError, match="lambda"):
        device_checks.IdentityCase("x", lambda w: quant.quantize_fp8_rows(w, strategy="tensor"),
                                   quant.quantize_fp8_rows_torch, device_checks.block_fp8_kernel)
    with pytest.raises(ValueError, match="same function"):
        device_checks.QuantPath("x", quant.quantize_int8_rows, quant.quantize_int8_rows_torch,
                                quant.quantize_int8_rows, None, lambda n, k: n * k)
    # different functions (even one that calls another) are accepted
    device_checks.IdentityCase("x", _another_int8, quant.quantize_int8_rows_torch,
                               _cpu_kernels.quantize_int8_rows_cpu)
