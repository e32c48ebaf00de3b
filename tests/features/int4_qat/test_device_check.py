"""int4_qat's ``ascend-rl selftest`` rows (``device_check``) can fail on a CPU: the fake
quantization QAT runs is compared with the numba kernel called directly (and the bit-identity rows
with the eager torch path too), not with ``fake_quantize`` on a CPU copy -- on a CPU, the same call
twice."""

import pytest

torch = pytest.importorskip("torch")

from ascend_rl_plugins import selftest  # noqa: E402
from ascend_rl_plugins.quant import int4  # noqa: E402
from ascend_rl_plugins.features.int4_qat import device_check  # noqa: E402

CPU_QUICK = selftest.SelftestContext(device=torch.device("cpu"), quick=True, reps=1)


@pytest.fixture
def broken_fake_quantize(monkeypatch):
    """``int4.fake_quantize`` (the QAT entry point) with one bit of its first element flipped."""
    original = int4.fake_quantize

    def corrupted(*args, **kwargs):
        out = original(*args, **kwargs)
        out.view(-1).view(torch.uint8)[0] ^= 1
        return out
    monkeypatch.setattr(int4, "fake_quantize", corrupted)


def test_bit_identity_rows_fail_when_the_fake_quantization_is_broken(broken_fake_quantize, monkeypatch):
    # the timed rows are not what this test is about: skip their work
    monkeypatch.setattr(device_check, "_forward_cost", lambda ctx, w, x, spec: (1e-3, 1e-2))
    monkeypatch.setattr(device_check, "_step_cache", lambda *a: selftest.CheckResult("int4_qat", "cache", True))
    rows = device_check.run(CPU_QUICK)
    identity = [r for r in rows if r.check.startswith("bit identity")]
    assert len(identity) == 2
    assert [r.ok for r in identity] == [False, False], [(r.check, r.ok, r.detail) for r in identity]


def test_the_step_cache_row_fails_when_the_fake_quantization_is_broken(broken_fake_quantize):
    w = (torch.randn(256, 512, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)
    row = device_check._step_cache(CPU_QUICK, w, int4.Int4Spec(128, "ct"), 1e-3, 1e-2)
    assert row.ok is False, (row.check, row.detail)
