"""cpu_spec_decode: vLLM's rejection sampler and its top-k/top-p expansion run on CPU tensors
with the patches, and do not without them (same process, patches reverted), on the stack
running the tests. The CPU runner's refusal (vLLM 0.13) is lifted for real by the SAM engine
tests (tests/features/sam/test_engine.py), which build speculative engines on CPU."""

from __future__ import annotations

import pytest

from tests.features.cpu_spec_decode import sampler_scenario as sc
from tests.support.child import run_scenario
from tests.support.stacks import running_stack

pytestmark = pytest.mark.skipif(running_stack() is None, reason="needs vLLM (recipe or current stack)")


@pytest.fixture(scope="module")
def outcomes():
    return run_scenario("tests.features.cpu_spec_decode.sampler_scenario", "run",
                        env={"ASCEND_RL_AUTOLOAD": "0", "VLLM_LOGGING_LEVEL": "ERROR"}, timeout=600)


def test_patched_sampler_gives_the_certain_outcome(outcomes):
    got = outcomes["patched"]
    assert got["sample"] == {"ok": True, "value": sc.EXPECTED}
    assert got["expand"] == {"ok": True, "value": sc.EXPECTED_TOP_K}


def test_each_patch_is_needed_on_its_stack(outcomes):
    patched, bare = outcomes["patched"], outcomes["unpatched"]
    assert bare["applied"] == []
    assert bare["sample"] != {"ok": True, "value": sc.EXPECTED}
    assert bare["expand"] != {"ok": True, "value": sc.EXPECTED_TOP_K}
    if running_stack() == "recipe":  # Triton kernels cannot launch on a CPU-only host
        needed = {"cpu_spec_decode.cpu_expand_batch_to_tokens", "cpu_spec_decode.pytorch_rejection_sampler"}
    else:  # the 0.23 CPU shim refuses USE_FP64_GUMBEL
        assert "USE_FP64_GUMBEL" in bare["sample"]["error"]
        needed = {"cpu_spec_decode.cpu_expand_batch_to_tokens", "cpu_spec_decode.recovered_tokens_fp64_gumbel"}
    assert needed <= set(patched["applied"])
