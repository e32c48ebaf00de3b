"""int4_qat's non-finite check (``ASCEND_RL_INT4_QAT_FINITE_CHECK``): a NaN/inf weight is refused,
naming the layer, either in its forward (``immediate``) or -- without a synchronization per
layer -- before the optimizer step (``step``, the default).

On CPU the bf16/float32 quantizers are numba kernels that check at once; the deferred paths run
here through the torch path (float16 weights always take it) and through the compiled quantizer
itself (inductor's CPU backend; on an accelerator it is the one QAT runs)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ascend_rl_plugins import flags  # noqa: E402
from ascend_rl_plugins.quant import fused, int4  # noqa: E402
from ascend_rl_plugins.quant.device_math import NonFiniteWeightError  # noqa: E402
from ascend_rl_plugins.features.int4_qat import finite_checks  # noqa: E402
from ascend_rl_plugins.features.int4_qat.fake_quant import linear_fake_quant  # noqa: E402

SPEC = int4.Int4Spec(128, "ct")


@pytest.fixture
def finite_check(monkeypatch):
    def set_mode(mode):
        monkeypatch.setenv("ASCEND_RL_INT4_QAT_FINITE_CHECK", mode)
        flags.reset_cache()
    finite_checks.reset()
    yield set_mode
    finite_checks.reset()
    monkeypatch.delenv("ASCEND_RL_INT4_QAT_FINITE_CHECK", raising=False)
    flags.reset_cache()


def _weight(bad=None, dtype=torch.float16):
    w = (torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.02).to(dtype)
    if bad is not None:
        w[5, 200] = bad
    return w


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_step_mode_refuses_before_the_optimizer_step_naming_the_layer(finite_check, bad):
    finite_check("step")
    good = linear_fake_quant(_weight(), SPEC, "layers.0.linear_fc1")
    linear_fake_quant(_weight(bad), SPEC, "layers.1.linear_fc2")      # no error yet: nothing read back
    assert finite_checks.CHECKS.pending() == 2 and finite_checks.CHECKS.stats.reads == 0
    assert fused.same_bits(good, int4.fake_quantize_torch(_weight(), SPEC))
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    param.grad = torch.ones(3)
    with pytest.raises(NonFiniteWeightError, match=r"layers\.1\.linear_fc2.*1 of 2 fake-quantized weights"):
        optimizer.step()
    assert torch.equal(param.detach(), torch.zeros(3))               # the step was not applied
    assert finite_checks.CHECKS.pending() == 0 and finite_checks.CHECKS.stats.reads == 1


def test_step_mode_reads_every_verdict_in_one_go_and_passes_finite_weights(finite_check):
    finite_check("step")
    for i in range(5):
        linear_fake_quant(_weight(), SPEC, f"layers.{i}.linear_fc1")
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.ones(3)
    torch.optim.SGD([param], lr=1.0).step()
    assert finite_checks.CHECKS.stats.deferred == 5 and finite_checks.CHECKS.stats.reads == 1
    assert torch.equal(param.detach(), -torch.ones(3))


def test_pending_verdicts_are_read_when_too_many_wait(finite_check, monkeypatch):
    """Forwards without an optimizer step (reference / old log-probs) still get checked."""
    finite_check("step")
    monkeypatch.setattr(finite_checks, "MAX_PENDING", 3)
    linear_fake_quant(_weight(), SPEC, "a")
    linear_fake_quant(_weight(float("nan")), SPEC, "b")
    with pytest.raises(NonFiniteWeightError, match="'b'"):
        linear_fake_quant(_weight(), SPEC, "c")


def test_immediate_mode_refuses_in_the_forward(finite_check):
    finite_check("immediate")
    with pytest.raises(NonFiniteWeightError, match=r"layers\.1\.linear_fc2"):
        linear_fake_quant(_weight(float("nan")), SPEC, "layers.1.linear_fc2")
    assert finite_checks.CHECKS.stats.deferred == 0


def test_cpu_kernels_check_at_once_even_in_step_mode(finite_check):
    finite_check("step")
    with pytest.raises(NonFiniteWeightError, match="layers.3"):
        linear_fake_quant(_weight(float("nan"), torch.bfloat16), SPEC, "layers.3")


@pytest.mark.parametrize("bad", [None, float("nan"), float("-inf")])
def test_the_compiled_quantizer_gives_its_verdict_without_reading_it(bad):
    """``_fused_fake`` (the accelerator path) hands over a 0-dim device bool made in its kernel,
    and its weight equals the torch path's bit for bit."""
    fused.STATE.reset()
    verdicts = []
    w = _weight(bad, torch.bfloat16)
    out = int4._fused_fake(w, SPEC, "w", lambda ok, name: verdicts.append((ok, name)))
    (ok, name), = verdicts
    assert ok.dim() == 0 and ok.dtype == torch.bool and name == "w"
    assert bool(ok) == (bad is None)
    if bad is None:
        assert fused.same_bits(out, int4.fake_quantize_torch(w, SPEC))
        with pytest.raises(NonFiniteWeightError):
            int4._fused_fake(_weight(float("nan"), torch.bfloat16), SPEC, "w", None)
    fused.STATE.reset()
