"""The mismatch the INT4 QAT feature removes, measured on real engines (vLLM 0.23 CPU).

Tiny Qwen3 (random weights), W4A16 by this project's converter (group 128, scope all, preset
ct). The rollout engine (vLLM, W4A16) samples 16 sequences of 48 response tokens; on the same
tokens we compare
  (a) the BF16 trainer (HF transformers, bf16)          vs the W4A16 rollout,
  (b) the fake-quant trainer (HF, every decoder linear = quant.int4.fake_quantize)
                                                        vs the W4A16 rollout,
  (c) the BF16 trainer                                  vs a BF16 rollout engine (the floor:
      kernel numerics only).
(b) must be far below (a) and at the level of (c). And inside the engine: the (codes, scales)
vLLM loaded equal int4.quantize of the trainer's weights, and the weights the engine's kernel
multiplies by equal the fake-quant trainer's weights bit for bit -- where vLLM loaded its ``_C``
library; its ``_C_AVX512`` library (AVX-512 without BF16) rounds to bf16 by truncation, and the
kernel's weights are then checked against the truncated product of the same codes and scales.

Where the installed vLLM 0.23 build has no W4A16 matmul on this CPU (``torch.ops._C.cpu_gemm_wna16``
is absent from vLLM's AVX2 kernel library) the W4A16 engine can neither sample nor apply its
kernel: it starts without its warm-up forward, and what needs no matmul is still checked (scheme
and kernel; the codes and scales it loaded, and re-quantized from the Megatron QAT export, against
``int4.quantize``); the log-prob comparisons and effective weights skip, naming the missing op.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from ascend_rl_plugins.features.rollout_mismatch.metric import mismatch
from tests.support.child import ENGINE_ENV, REPO, run_group, run_scenario
from tests.support.stacks import vllm_version

pytestmark = pytest.mark.engine

GROUP = 128
# VLLM_CPU_INT4_W4A8=0: CPUWNA16 keeps activations in bf16 (its W4A8 mode on AMX CPUs quantizes them)
ENV = dict(ENGINE_ENV, ASCEND_RL_AUTOLOAD="0", NUMBA_NUM_THREADS="2", VLLM_CPU_INT4_W4A8="0")
MEGATRON_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "ASCEND_RL_AUTOLOAD": "0",
                "NUMBA_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    v = vllm_version()
    if v is None:
        pytest.skip("vLLM is not installed in this interpreter")
    if tuple(int(x) for x in v.split(".")[:2]) < (0, 23):
        pytest.skip(f"vLLM {v}: its CPU backend serves no compressed-tensors W4A16 checkpoint on x86 "
                    "(flashrl: tests/features/flashrl/test_convert_low_precision.py); "
                    "the W4A16 rollout runs on the current stack (vLLM 0.23)")
    pytest.importorskip("transformers")
    from tests.support.cpu_isa import missing_vllm_cpu_op
    no_forward = missing_vllm_cpu_op("cpu_gemm_wna16", "vLLM 0.23's CPUWNA16LinearKernel W4A16 matmul (the W4A16 "
                                                       "rollout's sampling and log-probs)")
    work = str(tmp_path_factory.mktemp("mismatch"))
    export_path = os.path.join(work, "megatron_qat_export.pt")
    scenario = "tests.features.rollout_mismatch.engine_scenario"
    # three processes at once (they wait for each other's files): the Megatron QAT trainer's
    # export, the W4A16 engine (samples, then reloads the export), the BF16 engine + HF trainer
    with ThreadPoolExecutor(3) as pool:
        megatron = pool.submit(run_group, "tests.features.int4_qat.engine_export", "export", 1, export_path,
                               GROUP, env=MEGATRON_ENV, timeout=900)
        w4 = pool.submit(run_scenario, scenario, "rollout_w4a16", work, GROUP, export_path, no_forward is None,
                         env=ENV, timeout=900)
        # without W4A16 sampling there are no sequences for the BF16 engine and trainer to score
        rest = None if no_forward else pool.submit(run_scenario, scenario, "rollout_bf16_and_trainer", work, GROUP,
                                                   env=ENV, timeout=900)
        results = {"work": work, "export_path": export_path, "megatron": megatron.result()[0],
                   "no_forward": no_forward, **w4.result(), **(rest.result() if rest else {})}
    return results


def _needs_the_w4a16_matmul(runs, checked: str = "") -> None:
    """Skip the rest of the calling test where the W4A16 engine could run no forward."""
    if runs["no_forward"]:
        pytest.skip(runs["no_forward"] + (f"; checked without it: {checked}" if checked else ""))


def _kernel_rounding(runs) -> str:
    """How the vLLM CPU kernel library the W4A16 engine loaded rounds its fp32 results to bf16:
    "nearest" (``_C``: AVX-512 BF16 / AMX CPUs) or "truncate" (``_C_AVX512``)."""
    from tests.support.cpu_isa import VLLM_CPU_LIBRARIES
    assert runs["kernel_library"] in VLLM_CPU_LIBRARIES, runs["kernel_library"]
    return VLLM_CPU_LIBRARIES[runs["kernel_library"]]


def _response(runs, key):
    """Response-token log-probs (the tokens RL trains on) of ``key``, one list per sequence."""
    return [lp[s["prompt_len"]:] for s, lp in zip(runs["sequences"], runs[key])]


def _flat(rows):
    return [x for row in rows for x in row]


CLIP = 0.02   # a tight clip range: the tiny random model's next-token distributions are nearly flat,
              # so its log-prob deltas are small (a real model's are larger; PPO's 0.2 would see none here)


def _stats(runs, trainer, rollout):
    return mismatch(_flat(_response(runs, trainer)), _flat(_response(runs, rollout)), clip=CLIP)


def test_after_a_reload_the_engine_holds_the_megatron_qat_trainers_weights_bit_for_bit(runs):
    """Megatron-Core QAT trainer (int4_qat, scope all, a training step) -> its exported master
    weights -> flashrl's in-place W4A16 reload into the running engine: the engine's re-quantized
    (codes, scales) are int4.quantize of the exported weights, and the weights its kernel
    multiplies by are the ones the Megatron linears multiplied by in their QAT forward."""
    import torch
    from ascend_rl_plugins.quant import int4
    m = runs["megatron"]
    assert set(m["patch_states"].values()) == {"applied"}, m
    assert m["output_layer_plain"] and m["n_hf"] == 3 + 2 * 11, m
    assert runs["reload_spec"] == [GROUP, "ct"] and runs["reloaded"] == 14, runs["reload_spec"]
    exported = torch.load(runs["export_path"], weights_only=False)
    engine = torch.load(os.path.join(os.path.dirname(runs["export_path"]), "engine_after_reload.pt"),
                        weights_only=False)
    spec = int4.Int4Spec(group_size=GROUP, preset="ct")
    wrong = []
    for name, (packed, scale) in engine["quantized"].items():
        codes, want_scale = int4.quantize(exported["hf"][name], spec)
        if not (torch.equal(packed, int4.pack(codes)) and torch.equal(scale, want_scale)):
            wrong.append(name)
    assert wrong == [] and len(engine["quantized"]) == 14, wrong
    _needs_the_w4a16_matmul(runs, "the engine re-quantized the Megatron QAT export to int4.quantize's codes "
                                  "and scales")
    assert sorted(engine["effective"]) == sorted(exported["forward"])
    if _kernel_rounding(runs) == "nearest":
        want = exported["forward"]
    else:   # the kernel multiplies by the truncated product of the same codes and scales
        from tests.features.rollout_mismatch.engine_scenario import fused_parts, truncated_dequantize
        want = {}
        for name in engine["effective"]:
            parts = [exported["hf"][p + ".weight"] for p in fused_parts(name)]
            codes, scale = int4.quantize(torch.cat(parts, dim=0), spec)
            want[name] = truncated_dequantize(codes, scale, GROUP)
    differ = [n for n, w in engine["effective"].items() if not (w.dtype == want[n].dtype and torch.equal(w, want[n]))]
    assert differ == [], (runs["kernel_library"], differ)
    # and the reload changed the engine: the Megatron weights are not the served checkpoint's
    before = torch.load(os.path.join(os.path.dirname(runs["export_path"]), "engine_w4a16_layers.pt"),
                        weights_only=False)
    assert all(not torch.equal(before[n]["effective"], w) for n, w in engine["effective"].items())


def test_the_rollout_really_ran_w4a16(runs):
    assert runs["schemes"] == ["CompressedTensorsWNA16"], runs["schemes"]
    assert len(runs["kernels"]) == 1 and runs["kernels"][0] != "NoneType", runs["kernels"]
    assert runs["quantized_linears"] == 14 and runs["engine_layers_checked"] == 8, runs


def test_the_engine_holds_the_trainers_codes_and_scales(runs):
    assert runs["codes_mismatch"] == [], runs["codes_mismatch"]


def test_the_engine_multiplies_by_the_fake_quant_trainers_weights_bit_for_bit(runs):
    _needs_the_w4a16_matmul(runs)
    if _kernel_rounding(runs) == "nearest":
        assert runs["effective_mismatch"] == [], runs["effective_mismatch"]
        return
    # the trainer's codes and scales, exactly; only the kernel library's bf16 rounding differs
    assert runs["effective_truncated_mismatch"] == [], runs["effective_truncated_mismatch"]
    pytest.skip(f"vLLM loaded its {runs['kernel_library']} CPU kernel library (no AVX-512 BF16 on this CPU): it "
                "converts fp32 to bf16 by truncation, so its kernel multiplies by trunc(codes x scale), not the "
                "fake-quant trainer's round-to-nearest bf16 (up to 1 bf16 ulp apart); checked instead: the "
                "kernel's weights are exactly that truncation of the trainer's codes and scales")


def test_fake_quant_trainer_removes_the_quantization_mismatch(runs):
    _needs_the_w4a16_matmul(runs)
    a = _stats(runs, "trainer_bf16", "rollout_w4a16")
    b = _stats(runs, "trainer_fq", "rollout_w4a16")
    c = _stats(runs, "trainer_bf16", "rollout_bf16")
    print("\n(a) BF16 trainer vs W4A16 rollout:", json.dumps(a))
    print("(b) fake-quant trainer vs W4A16 rollout:", json.dumps(b))
    print("(c) BF16 trainer vs BF16 rollout:", json.dumps(c))
    print("mean rollout log-prob of the response tokens:",
          sum(_flat(_response(runs, "rollout_w4a16"))) / a["tokens"])
    assert a["tokens"] == b["tokens"] == c["tokens"] == 16 * 48
    # the quantization mismatch is real: far above the kernel-numerics floor
    assert a["abs_delta_mean"] > 5 * c["abs_delta_mean"], (a, c)
    # (b) far below (a): the margin is 5x, on every summary that measures size
    for key in ("abs_delta_mean", "abs_delta_median", "abs_delta_trimmed_mean", "abs_delta_p99", "k3",
                "share_outside_clip"):
        assert b[key] < 0.2 * a[key], (key, a[key], b[key])
    # (b) at the BF16-vs-BF16 level: within 3x of it plus a small absolute allowance
    assert b["abs_delta_mean"] <= 3 * c["abs_delta_mean"] + 0.01, (b, c)
    assert b["share_outside_clip"] <= 3 * c["share_outside_clip"] + 0.01, (b, c)


def test_the_cli_reads_jsonl_and_reports_the_same_numbers(runs, tmp_path):
    _needs_the_w4a16_matmul(runs)
    paths = {}
    for key in ("trainer_bf16", "rollout_w4a16"):
        paths[key] = tmp_path / f"{key}.jsonl"
        paths[key].write_text("".join(json.dumps(row) + "\n" for row in _response(runs, key)))
    out = subprocess.run([sys.executable, "-m", "ascend_rl_plugins", "mismatch", "--trainer",
                          str(paths["trainer_bf16"]), "--rollout", str(paths["rollout_w4a16"]), "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == pytest.approx(mismatch(_flat(_response(runs, "trainer_bf16")),
                                                            _flat(_response(runs, "rollout_w4a16"))))
