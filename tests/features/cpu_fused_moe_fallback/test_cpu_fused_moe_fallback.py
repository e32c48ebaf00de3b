"""cpu_fused_moe_fallback: vLLM 0.23's CPU fused-MoE torch fallback -- what an AVX2-only x86 CPU
runs -- fails in every forward without the patch and serves a tiny Qwen3-MoE correctly with it.

The engine is forced onto the fallback on any x86 machine by making vLLM load its real AVX2
kernel library (engine_scenario.py); on the recipe stack (vLLM 0.13) the patch is out of range
and its fallback builds its activation outside the forward, so there is nothing to run.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.child import ENGINE_ENV, GREEDY_ENGINE_ENV, run_scenario
from tests.support.stacks import running_stack

SCENARIO = "tests.features.cpu_fused_moe_fallback.engine_scenario"
pytestmark = pytest.mark.skipif(running_stack() != "current",
                                reason="the patch targets vLLM 0.23 (the current stack); vLLM 0.13's CPU MoE "
                                       "fallback builds its SiluAndMul once, at weight processing")


@pytest.fixture(scope="module")
def runs():
    pytest.importorskip("transformers")
    from ascend_rl_plugins.devtools import tiny_qwen3
    model = tiny_qwen3.cached(moe=True)
    env = dict(ENGINE_ENV, ASCEND_RL_AUTOLOAD="0", OMP_NUM_THREADS="1")
    with ThreadPoolExecutor(2) as pool:
        engine = pool.submit(run_scenario, SCENARIO, "fallback_engine", model, env=dict(env, **GREEDY_ENGINE_ENV),
                             timeout=900)  # greedy requests only
        hf = pool.submit(run_scenario, SCENARIO, "reference", model, env=env, timeout=600)
        return {"engine": engine.result(), "hf": hf.result()}


def test_the_engine_really_ran_the_torch_fallback_with_the_patch_applied(runs):
    e = runs["engine"]
    assert e["state"] == "applied", e["state"]
    assert e["prepack_moe_weight"] is False  # vLLM's AVX2 library: no grouped-GEMM MoE kernel
    assert e["moe_paths"] == ["forward_torch", "forward_torch"], e["moe_paths"]  # 2 MoE layers


def test_the_fallback_serves_what_transformers_computes(runs):
    e, hf = runs["engine"], runs["hf"]
    assert e["tokens"] == hf["tokens"]
    # float32 on both sides: only summation order differs
    assert max(abs(a - b) for a, b in zip(e["logprobs"], hf["logprobs"])) < 1e-3, (e["logprobs"], hf["logprobs"])


def test_without_the_patch_the_fallback_fails_in_the_forward(runs):
    # the upstream bug this patch exists for; once this fails, the patch can go
    err = runs["engine"]["unpatched_error"]
    assert err and "Current vLLM config is not set" in err, err


def test_the_patched_table_changes_only_the_silu_entry_and_needs_no_config(runs):
    t = runs["engine"]["table"]
    assert t["upstream_silu_error"] and "Current vLLM config is not set" in t["upstream_silu_error"]
    assert t["patched_silu_max_error"] == 0.0  # silu(x[:d]) * x[d:], the same arithmetic
    assert t["same_keys"] and t["other_entries_are_vllms"]
