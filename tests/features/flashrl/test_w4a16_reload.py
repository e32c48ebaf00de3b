"""W4A16 (group-wise INT4, compressed-tensors pack-quantized) rollout with online re-quantization
and in-place reload, in a real vLLM 0.23 CPU engine.

Engine 1 gets A's BF16 path with ``ASCEND_RL_FLASHRL=<fn: w4a16 config>`` and serves W4A16(A)
through vLLM's real ``CompressedTensorsWNA16`` scheme and ``CPUWNA16LinearKernel`` (W4A16 mode,
``VLLM_CPU_INT4_W4A8=0``). BF16 B arrives through verl 0.9.1's real bucketed update path when
its source is unpacked next to the current stack (flashrl's session hook; fused layers split
between buckets), else through ``model.load_weights`` (online ``quantize_pack``, written
straight into the kernel's post-processed storage); then BF16 A through ``model.load_weights``. Engine 2 loads
the offline W4A16(B) checkpoint with stock vLLM (its own post-processing). Checked: A->B->A
restores tokens and log-probs exactly, B equals engine 2 (outputs and every processed tensor,
bit for bit), online codes/scales equal the offline checkpoint's, no data pointer changes,
torch-allocator peak of a reload <= 1.1x the largest BF16 tensor, a partial fused update is
refused. vLLM 0.13's CPU build has no W4A16 kernel: there only the engine-start refusal runs.

Where the installed vLLM 0.23 build has no W4A16 matmul on this CPU (``torch.ops._C.cpu_gemm_wna16``
is absent from vLLM's AVX2 kernel library), flashrl refuses a ``fn: w4a16`` engine at its start
(checked on any x86 machine with the AVX2-only CPU simulated). The reload engines then start
without their warm-up forward, that refusal doubled, and generate nothing: the output
comparisons skip, naming the missing op; scheme and kernel, the
online codes and scales against the offline checkpoint, every processed tensor against the
direct engine's, the storage, the memory peak and the refusals are checked all the same.
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
SCENARIO = "tests.features.flashrl.w4a16_engine_scenario"
W4A16_MATMUL = ("cpu_gemm_wna16", "vLLM 0.23's CPUWNA16LinearKernel W4A16 matmul (every forward of a W4A16 engine)")


def _matmul_missing() -> str | None:
    """Why W4A16 engines cannot run a forward with this vLLM build on this CPU, or None."""
    from tests.support.cpu_isa import missing_vllm_cpu_op
    return missing_vllm_cpu_op(*W4A16_MATMUL)


@pytest.fixture(scope="module")
def artifacts(tiny_model_path, tmp_path_factory):
    from . import w4a16_engine_scenario
    wd = str(tmp_path_factory.mktemp("flashrl_w4a16"))
    return wd, w4a16_engine_scenario.build_artifacts(wd)


@pytest.fixture(scope="module")
def engines(artifacts):
    if running_stack() != "current":
        pytest.skip("vLLM 0.13's CPU build has no W4A16 kernel (no CPUWNA16LinearKernel; its one CPU "
                    "mixed-precision kernel, Dynamic4bitLinearKernel, takes signed int4 weights with dynamic "
                    "activations, not W4A16's uint4b8), so no W4A16 engine can start on the recipe stack")
    wd, paths = artifacts
    # every generation is greedy (engine_scenario._generate)
    base = dict(ENGINE_ENV, **GREEDY_ENGINE_ENV, ASCEND_RL_AUTOLOAD="0", OMP_NUM_THREADS="1", VLLM_CPU_INT4_W4A8="0")
    jobs = {"reload": dict(base, ASCEND_RL_FLASHRL=paths["config"]), "direct": base}
    from .test_engine_reload import verl_source
    verl_src = verl_source()
    no_forward = _matmul_missing()
    with ThreadPoolExecutor(2) as pool:
        futures = {role: pool.submit(run_scenario, SCENARIO, "run", role, paths, wd,
                                     verl_src if role == "reload" else None, no_forward is None,
                                     env=env, timeout=1200)
                   for role, env in jobs.items()}
        results = {role: f.result() for role, f in futures.items()}
    from safetensors.torch import load_file
    results["reload_state"] = load_file(os.path.join(wd, "w4_reload_state.safetensors"))
    results["direct_state"] = load_file(os.path.join(wd, "w4_direct_state.safetensors"))
    results["paths"] = paths
    results["verl"] = verl_src is not None
    results["no_forward"] = no_forward
    return results


def test_blocked_layout_equals_vllms_cpuwna16_post_processing():
    """The direct repack (bit moves) equals what vLLM's CPUWNA16 W4A16 post-processing builds
    from the same checkpoint tensor (vLLM's own pack/unpack helpers, both stacks)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        pack_quantized_values_into_int32, unpack_quantized_values_into_int32)
    from vllm.scalar_type import scalar_types

    from ascend_rl_plugins.quant._cpu_kernels import wna16_blocked_cpu
    wt = scalar_types.uint4b8
    g = torch.Generator().manual_seed(0)
    for out, inp in ((32, 64), (96, 256), (512, 128)):
        packed = torch.randint(-2**31, 2**31 - 1, (out, inp // 8), dtype=torch.int32, generator=g)
        w = unpack_quantized_values_into_int32(packed.t(), wt, 0)  # (the kernel: weights.t(), unpack dim 0)
        w = pack_quantized_values_into_int32(w, wt, 1)
        want = w.view(inp, -1, 2).permute(1, 0, 2).reshape(-1, inp * 2).contiguous()
        got = torch.full_like(want, 7)
        wna16_blocked_cpu(packed, got)
        assert torch.equal(got, want), (out, inp)


def test_w4a16_checkpoint_is_served_by_vllms_cpu_w4a16_kernel(engines):
    r, d = engines["reload"], engines["direct"]
    assert r["served"] == engines["paths"]["w4_a"] and r["wrapped"]
    assert r["scheme"] == d["scheme"] == "CompressedTensorsWNA16"
    assert r["kernel"] == d["kernel"] == "CPUWNA16LinearKernel"
    assert r["use_w4a8"] is False and d["use_w4a8"] is False
    assert r["spec"] == [engines["paths"]["group_size"], "ct"]


def test_reloaded_engine_generates_what_the_engine_started_on_the_weights_generates(engines):
    """Greedy tokens, sampled and prompt log-probs, exactly: B reloaded = the direct engine on
    W4A16(B); A->B->A restores A's; a refused partial update leaves A's."""
    if engines["no_forward"]:
        pytest.skip(engines["no_forward"])
    r, d = engines["reload"], engines["direct"]
    assert r["out_a"] != d["out"]  # A and B differ, so the reload has something to show
    assert r["out_b"] == d["out"]
    assert r["out_a2"] == r["out_a"]
    assert r["out_after_partial"] == r["out_a"]


def test_online_quantization_equals_offline_checkpoint_and_processed_state_equals_direct_engine(engines):
    r, d = engines["reload"], engines["direct"]
    if engines["verl"]:  # B came through verl 0.9.1's bucketed path: one session over several buckets
        assert r["verl_errors"] == [] and r["stats"]["session"] and r["stats"]["calls"] > 1
        assert r["stats"]["spanned"], "no fused layer was split between buckets"
        assert r["open_session"] is False
    assert r["n_quantized"] == 14 and r["quant_mismatch"] == []
    assert r["stats"]["closed"] == 8  # 2 layers x (qkv, o, gate_up, down), each through the direct repack
    a, b = engines["reload_state"], engines["direct_state"]
    assert set(a) == set(b)
    from .engine_scenario import bits_equal
    assert [k for k in a if not bits_equal(a[k], b[k])] == []
    assert any(k.endswith("weight_packed") for k in a)


def test_reload_a_restores_everything_in_the_same_storage(engines):
    r = engines["reload"]
    assert r["state_a_diff"] == []
    assert r["n_wna16_params"] == 16
    assert r["ptr_changed_b"] == [] and r["ptr_changed_a"] == []


def test_reload_peak_memory_is_within_a_tenth_over_the_largest_tensor(engines):
    r = engines["reload"]
    # the A reload (the B reload keeps every quantized tensor for the bit-exactness check)
    assert 0 < r["peak_a"] <= 1.1 * r["largest_bf16"], (r["peak_a"], r["largest_bf16"])
    assert r["peak_a"] <= 1.1 * r["largest_quantized_bf16"], (r["peak_a"], r["largest_quantized_bf16"])


def test_partial_fused_update_is_refused_and_engine_unchanged(engines):
    r = engines["reload"]
    assert r["partial_error"] and "ReloadError" in r["partial_error"] and "partly sent" in r["partial_error"]
    assert r["state_after_partial_diff"] == []  # every processed tensor as it was


def test_w4a16_engine_start_refusals(artifacts):
    """Recipe (vLLM 0.13): fn w4a16 refused at engine start, naming the flag and the alternatives.
    Current (vLLM 0.23): refused when CPUWNA16 would run its W4A8 mode (AMX CPUs, vLLM's default),
    and when the trainer's group size flag differs from the checkpoint's."""
    wd, paths = artifacts
    env = dict(ENGINE_ENV, ASCEND_RL_AUTOLOAD="0")
    if running_stack() == "recipe":
        (err,) = run_scenario(SCENARIO, "start_errors", paths["bf16_a"], [paths["config"]], env=env, timeout=600)
        assert err and err.startswith("ConfigError"), err
        for part in ("ASCEND_RL_FLASHRL", "fn='w4a16'", "no W4A16 kernel", "Supported here instead: int8"):
            assert part in err, (part, err)
        return
    from ascend_rl_plugins.features.flashrl.fp8_support import _amx
    extra = [{"VLLM_CPU_INT4_W4A8": "1"},
             {"VLLM_CPU_INT4_W4A8": "0", "ASCEND_RL_FLASHRL_INT4_GROUP_SIZE": "128"}]
    # without the W4A16 matmul the engines start without their warm-up forward (the refusals
    # come from the configuration and the weight processing, not from a forward)
    w4a8_err, group_err = run_scenario(SCENARIO, "start_errors", paths["bf16_a"], [paths["config"]] * 2, extra,
                                       _matmul_missing() is None, env=env, timeout=900)
    if _amx():
        assert w4a8_err and w4a8_err.startswith("ConfigError") and "VLLM_CPU_INT4_W4A8=0" in w4a8_err, w4a8_err
    else:
        assert w4a8_err is None, w4a8_err  # no AMX: vLLM runs W4A16 anyway
    assert group_err and group_err.startswith("ConfigError"), group_err
    for part in ("ASCEND_RL_FLASHRL_INT4_GROUP_SIZE=128", f"group size {paths['group_size']}", "--group-size 128"):
        assert part in group_err, (part, group_err)


def test_w4a16_refused_at_engine_start_without_the_cpu_matmul(artifacts):
    """An AVX2-only x86 CPU (simulated: vLLM loads its real ``_C_AVX2`` library, which has no
    ``cpu_gemm_wna16``): a ``fn: w4a16`` engine is refused when it is configured, naming the
    missing op, the CPU it needs and INT8 W8A8 instead -- not started to fail at its warm-up
    forward with vLLM's AttributeError."""
    if running_stack() != "current":
        pytest.skip("vLLM 0.13 has no CPUWNA16LinearKernel: fn w4a16 is refused before any kernel library is "
                    "asked (test_w4a16_engine_start_refusals)")
    wd, paths = artifacts
    env = dict(ENGINE_ENV, ASCEND_RL_AUTOLOAD="0", VLLM_CPU_INT4_W4A8="0", ARP_TEST_CPU_ISA="avx2")
    (err,) = run_scenario(SCENARIO, "start_errors", paths["bf16_a"], [paths["config"]], env=env, timeout=900)
    assert err and err.startswith("ConfigError"), err
    for part in ("fn='w4a16'", "torch.ops._C.cpu_gemm_wna16", "AVX-512", "_C_AVX2", "int8 W8A8"):
        assert part in err, (part, err)


def test_w4a16_flags_and_config_are_validated(tiny_model_path):
    from ascend_rl_plugins import flags
    from ascend_rl_plugins.features import flashrl
    from ascend_rl_plugins.features.flashrl.config import ConfigError, RolloutConfig
    with pytest.raises(flags.FlagError, match="ASCEND_RL_FLASHRL_INT4_GROUP_SIZE"):
        flashrl.INT4_GROUP_SIZE.read({"ASCEND_RL_FLASHRL_INT4_GROUP_SIZE": "96"})
    with pytest.raises(flags.FlagError, match="ASCEND_RL_FLASHRL_INT4_PRESET"):
        flashrl.INT4_PRESET.read({"ASCEND_RL_FLASHRL_INT4_PRESET": "gptq"})
    assert flashrl.INT4_GROUP_SIZE.read({"ASCEND_RL_FLASHRL_INT4_GROUP_SIZE": "128"}) == "128"
    with pytest.raises(ConfigError, match="needs 'model' \\(the local W4A16 checkpoint"):
        RolloutConfig(fn="w4a16").validate("cfg")
    with pytest.raises(ConfigError, match="takes no profile"):
        RolloutConfig(fn="w4a16", model=tiny_model_path, profile="p.pt").validate("cfg")
    cfg = RolloutConfig(fn="w4a16", model=tiny_model_path)
    cfg.validate("cfg")
    assert cfg.is_int4 and cfg.is_quantized and not cfg.is_fp8
