"""moe_reshard on real vLLM CPU engines: a tiny Qwen3-MoE receives resharded weights in place and
then generates the same greedy tokens, with the same parameters bit for bit, as an engine started
on those weights.

Real: vLLM's engine and Qwen3-MoE model (0.13 on the recipe stack, 0.23 on current), the
executor's ``reshard_experts`` (a one-rank reshard on the process group vLLM initialized), verl
0.6.1's ``vLLMAsyncRollout.update_weights`` (recipe; the rollout object holds the real vLLM model
runner), this feature's update_weights patch reverted (stock) and applied. Two engine processes
(started on W0 and reloaded with W1, started on W1) run side by side.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version

import pytest

from tests.support.child import ENGINE_ENV, GREEDY_ENGINE_ENV, run_scenario
from tests.support.stacks import running_stack

MODULE = "tests.features.moe_reshard.engine_scenario"
# the engines generate greedily only (engine_scenario._generate)
ENV = dict(ENGINE_ENV, **GREEDY_ENGINE_ENV, ASCEND_RL_AUTOLOAD="0", OMP_NUM_THREADS="1")


def _verl_06() -> bool:
    try:
        return version("verl").startswith("0.6.")
    except PackageNotFoundError:
        return False


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    try:
        version("vllm")
    except PackageNotFoundError:
        pytest.skip("vLLM is not installed in this interpreter (.ci/stack.sh installs it)")
    out = str(tmp_path_factory.mktemp("moe-reshard-engine"))
    paths = run_scenario(MODULE, "prepare", out, env=ENV, timeout=600)
    with ThreadPoolExecutor(2) as pool:
        jobs = {role: pool.submit(run_scenario, MODULE, "run", role, paths, out, env=ENV, timeout=900)
                for role in ("reload", "direct")}
        got = {role: job.result() for role, job in jobs.items()}
    got["compare"] = run_scenario(MODULE, "compare", out, ["stock", "patched", "narrowed"], env=ENV)
    return got


def test_the_engines_ran_the_cpu_moe_path_the_installed_build_offers(engines):
    """vLLM 0.23: the prepacked kernel where the loaded library has prepack_moe_weight, else the
    torch fallback (AVX2-only x86), which runs because cpu_fused_moe_fallback is applied."""
    if running_stack() != "current":
        pytest.skip("vLLM 0.13 (recipe) has no CPUFusedMOE path choice to check")
    from tests.support.cpu_isa import vllm_cpu_ops
    kernel = vllm_cpu_ops()["prepack_moe_weight"]
    for role in ("reload", "direct"):
        r = engines[role]
        assert len(r["moe_paths"]) == 2, r["moe_paths"]
        if kernel:
            assert set(r["moe_paths"]) == {"forward_grouped_gemm"}, (role, r["moe_paths"])
        else:
            assert set(r["moe_paths"]) == {"forward_torch"}, (role, r["moe_paths"])
            assert r["fallback_fix"] == "applied", (role, r["fallback_fix"])


def _tokens(outs):
    return [o["tokens"] for o in outs]


def test_the_update_changes_what_the_engine_generates(engines):
    assert _tokens(engines["reload"]["before"]) != _tokens(engines["direct"]["out"])


def test_the_reshard_delivers_every_expert_exactly_once_unchanged(engines):
    r = engines["reload"]["reshard"]
    assert r["expert_names"] == r["hf_expert_names"]  # 2 layers x 8 experts x 3, each once
    assert len(r["expert_names"]) == 48 and r["experts_equal"]
    assert engines["reload"]["expert_map"] == list(range(8))


def test_every_worker_reports_its_rollout_rank_and_expert_map_over_collective_rpc(engines):
    want = [{"rank": 0, "tp": 1, "dp": 1, "expert_parallel": False, "expert_map": list(range(8))}]
    assert engines["reload"]["rpc"] == want and engines["direct"]["rpc"] == want


def test_resharded_weights_generate_the_same_tokens_as_an_engine_started_on_them(engines):
    ref = engines["direct"]["out"]
    assert _tokens(engines["reload"]["patched"]) == _tokens(ref)
    assert [o["logprobs"] for o in engines["reload"]["patched"]] == [o["logprobs"] for o in ref]


def test_every_parameter_is_bit_identical_to_the_engine_started_on_the_weights(engines):
    assert engines["compare"]["patched"] == {"missing": [], "different": []}


@pytest.mark.skipif(not _verl_06(), reason="verl 0.6.1's vLLMAsyncRollout.update_weights exists only on the "
                                           "recipe stack (verl 0.9.1 syncs through its vLLM worker extension)")
def test_verl_update_weights_runs_post_load_processing_only_with_the_patch(engines):
    r = engines["reload"]
    assert r["patch_state"] == "applied" and r["patch_state_after_apply"] == "applied"
    assert r["stock_post_load_calls"] == 0
    assert r["patched_post_load_calls"] == {str(i): 1 for i in range(r["moe_layers"])}
    # on this CPU build the unquantized MoE does not repack, so stock's values are also right here;
    # on vLLM-Ascend they are not (w13/w2 transposes) -- README, "What only an NPU shows"
    assert _tokens(r["stock"]) == _tokens(engines["direct"]["out"])


@pytest.mark.skipif(not _verl_06(), reason="the pre-narrowed loader is exercised on the recipe stack's vLLM 0.13 "
                                           "(vLLM 0.23 keeps kernel-format parameters between reloads)")
def test_pre_narrowed_expert_slices_land_where_vllms_loader_puts_them(engines):
    assert engines["compare"]["narrowed"] == {"missing": [], "different": []}
    assert _tokens(engines["reload"]["narrowed"]) == _tokens(engines["direct"]["out"])
