"""cpu_rms_norm: vLLM 0.13's CPU RMSNorm on a strided view (Qwen3's q/k norm) is wrong
without the patch and right with it, and a real engine then agrees with Hugging Face
transformers (the shared in-process engine, tests/features/shared_engine.py; on vLLM 0.23,
where the patch is out of range, the engine agrees on its own)."""

from __future__ import annotations

import pytest

from tests.features.shared_engine import part
from tests.support.stacks import running_stack


def test_wrapper_hands_the_kernel_a_contiguous_copy_of_strided_cpu_input():
    torch = pytest.importorskip("torch")
    from ascend_rl_plugins.features.cpu_rms_norm import contiguous_rms_norm_input
    seen = []

    def kernel(x, weight, variance_epsilon):
        seen.append(x)
        return x
    fused = torch.randn(3, 8)
    strided = fused[:, :4].view(3, 2, 2)
    weight = torch.ones(2)
    contiguous_rms_norm_input(kernel, None, (strided, weight, 1e-6), {})
    contiguous_rms_norm_input(kernel, None, (), {"x": strided, "weight": weight, "variance_epsilon": 1e-6})
    for got in seen:
        assert got.is_contiguous() and torch.equal(got, strided)
    dense = torch.randn(3, 4)
    contiguous_rms_norm_input(kernel, None, (dense, weight, 1e-6), {})
    assert seen[-1] is dense  # contiguous input: no copy


@pytest.fixture(scope="module")
def engine(shared_engine):
    return part(shared_engine, "cpu_rms_norm")


@pytest.mark.skipif(running_stack() != "recipe", reason="the patch targets vLLM 0.13 (the recipe stack)")
def test_real_kernel_on_a_strided_view_is_right_only_with_the_patch(engine):
    assert engine["state"] == "applied"
    assert engine["kernel_error"]["patched"] < 1e-5
    # the upstream bug this patch exists for; once this fails, the patch can go
    assert engine["kernel_error"]["pristine"] > 1e-2


def test_engine_greedy_tokens_agree_with_transformers(engine):
    assert engine["vllm"] == engine["hf"]
