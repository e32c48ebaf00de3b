"""Block FP8 (128x128) rollout with online re-quantization and in-place reload, in a real vLLM 0.23
CPU engine on an AMX CPU (vLLM's ``CPUFp8BlockScaledMMKernel``).

Engine 1 gets A's BF16 path with ``ASCEND_RL_FLASHRL=<fn: fp8_block config>`` and serves the
converter-written fp8-block(A) through vLLM's real ``Fp8LinearMethod`` (VNNI-prepacked weights).
BF16 B is reloaded through ``model.load_weights`` (quantized with ``block_fp8.quantize``, packed
with vLLM's ``convert_weight_packed`` strip by strip, written into the engine's storage), then BF16
A. Engine 2 loads the offline fp8-block(B) with stock vLLM. Checked: every processed tensor after
reloading B is bit-equal to engine 2's, same greedy tokens and log-probs; A->B->A restores the
initial tensors, tokens and log-probs exactly; no data pointer changes; torch-allocator peak of a
reload <= 1.1x the largest BF16 tensor. Skipped where vLLM does not serve block FP8 on this CPU.
"""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.child import ENGINE_ENV, GREEDY_ENGINE_ENV, run_scenario
from tests.support.stacks import running_stack

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(running_stack() is None,
                                 reason="needs the recipe (vLLM 0.13) or current (vLLM 0.23) stack")]
SCENARIO = "tests.features.flashrl.block_fp8_engine_scenario"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    if running_stack() != "current":
        pytest.skip("vLLM 0.13's CPU build has no block-FP8 kernel (CPUFp8BlockScaledMMKernel is in vLLM 0.23), "
                    "so no block-FP8 engine can start on the recipe stack")
    from ascend_rl_plugins.features.flashrl.fp8_support import block_fp8_support
    ok, why = block_fp8_support()
    if not ok:
        pytest.skip(f"vLLM does not serve block FP8 on this CPU: {why}")
    from . import block_fp8_engine_scenario
    wd = str(tmp_path_factory.mktemp("flashrl_block_fp8"))
    paths = block_fp8_engine_scenario.build_artifacts(wd)
    # every generation is greedy (engine_scenario._generate)
    base = dict(ENGINE_ENV, **GREEDY_ENGINE_ENV, ASCEND_RL_AUTOLOAD="0", OMP_NUM_THREADS="1")
    jobs = {"reload": dict(base, ASCEND_RL_FLASHRL=paths["config"]), "direct": base}
    with ThreadPoolExecutor(2) as pool:
        futures = {role: pool.submit(run_scenario, SCENARIO, "run", role, paths, wd, env=env, timeout=1200)
                   for role, env in jobs.items()}
        results = {role: f.result() for role, f in futures.items()}
    from safetensors.torch import load_file
    results["reload_state"] = load_file(os.path.join(wd, "bfp8_reload_state.safetensors"))
    results["direct_state"] = load_file(os.path.join(wd, "bfp8_direct_state.safetensors"))
    results["paths"] = paths
    return results


def test_engine_serves_block_fp8_on_vllms_cpu_kernel(engines):
    r, d = engines["reload"], engines["direct"]
    assert r["served"] == engines["paths"]["fp8_a"] and r["wrapped"]
    for res in (r, d):
        assert res["method"] == "Fp8LinearMethod" and res["kernel"] == "CPUFp8BlockScaledMMKernel", res
        assert res["weight_dtype"] == "torch.float8_e4m3fn"
    assert r["n_block_fp8"] == 2 * 4  # 2 layers x (qkv, o, gate_up, down)


def test_reload_b_equals_stock_engine_on_offline_b(engines):
    from .engine_scenario import bits_equal
    r, d = engines["reload"], engines["direct"]
    got, want = engines["reload_state"], engines["direct_state"]
    assert set(got) == set(want)
    diff = sorted(k for k in want if not bits_equal(got[k], want[k]))
    assert diff == [], diff
    assert r["out_b"] == d["out"]
    assert r["out_b"] != r["out_a"]  # the update changed the model


def test_reload_a_restores_initial_state_exactly(engines):
    r = engines["reload"]
    assert r["state_a_diff"] == []
    assert r["out_a2"] == r["out_a"]


def test_no_data_pointer_changes_and_bounded_memory(engines):
    r = engines["reload"]
    assert r["ptr_changed_b"] == [] and r["ptr_changed_a"] == [] and r["n_params"] > 0
    for key in ("peak_b", "peak_a"):
        assert r[key] <= 1.1 * r["largest_bf16"], (key, r[key], r["largest_bf16"])
