"""`ascend-rl flashrl quantize --fn w4a16 | fp8-block`: checkpoint layout, round trips, the
configs parsed by the installed vLLM, and one real vLLM 0.23 CPU engine serving the W4A16
checkpoint (in a child process; ``serve_w4a16`` below is the scenario it runs).

vLLM 0.13's CPU backend serves no W4A16 on x86, so the engine test is skipped there. Where the
installed vLLM 0.23 build has no W4A16 matmul on this CPU (``torch.ops._C.cpu_gemm_wna16`` is
absent from vLLM's AVX2 kernel library), the engine starts without its warm-up forward and the
test checks what needs no matmul -- vLLM selects its W4A16 scheme and kernel for the checkpoint
and holds the checkpoint's codes and scales in the kernel's layout -- then skips the generation
part, naming the missing op. Block
FP8 is not served by vLLM's CPU backend without AMX (the engine engineer's tests cover the
refusal); here its layout, round trip and vLLM's parsing of the config are tested.
"""

import json
import os

import pytest

torch = pytest.importorskip("torch")

from ascend_rl_plugins.features.flashrl import checkpoint, profile  # noqa: E402
from ascend_rl_plugins.quant import block_fp8, int4  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Config:"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def moe_model():
    pytest.importorskip("transformers")
    from ascend_rl_plugins.devtools import tiny_qwen3
    return tiny_qwen3.cached(moe=True)


def _config(d):
    with open(os.path.join(d, "config.json")) as fh:
        return json.load(fh)


def _cli(*args):
    from ascend_rl_plugins import cli
    return cli.main(["flashrl", "quantize", *args])


@pytest.mark.parametrize("group", [64, 128])
def test_w4a16_checkpoint_layout_and_round_trip(tiny_model_path, tmp_path, group, capsys):
    out = str(tmp_path / "w4")
    assert _cli("-m", tiny_model_path, "-o", out, "--fn", "w4a16", "--group-size", str(group)) == 0
    assert "W4A16" in capsys.readouterr().out
    src = profile.read_tensors(tiny_model_path)
    q = profile.read_tensors(out)
    qc = _config(out)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["group_size"] == group  # the top-level key vLLM-Ascend reads
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"], w["symmetric"]) == (4, "int", "group", group,
                                                                                           True)
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"] and qc["ignore"] == ["lm_head"]
    spec = int4.Int4Spec(group, "ct")
    linears = checkpoint.linear_shapes(src)
    assert len(linears) == 14
    for name, shape in linears.items():
        base = name[: -len(".weight")]
        assert name not in q
        packed, scale = q[base + ".weight_packed"], q[base + ".weight_scale"]
        assert packed.dtype == torch.int32 and tuple(packed.shape) == (shape[0], shape[1] // 8)
        assert scale.dtype == torch.bfloat16 and tuple(scale.shape) == (shape[0], shape[1] // group)
        assert q[base + ".weight_shape"].tolist() == list(shape)
        # what the engine dequantizes is exactly the QAT forward weight of the BF16 tensor
        deq = int4.dequantize(int4.unpack(packed, shape[1]), scale, spec)
        assert torch.equal(deq, int4.fake_quantize(src[name], spec))
    for name, t in src.items():
        if name not in linears:
            assert torch.equal(q[name], t), name
    assert os.path.exists(os.path.join(out, "tokenizer.json"))


def test_w4a16_scope_experts_quantizes_routed_experts_only(moe_model, tmp_path):
    out = str(tmp_path / "w4e")
    assert _cli("-m", moe_model, "-o", out, "--fn", "w4a16", "--group-size", "32", "--scope", "experts",
                "--preset", "slime") == 0
    src = profile.read_tensors(moe_model)
    q = profile.read_tensors(out)
    qc = _config(out)["quantization_config"]
    spec = int4.Int4Spec(32, "slime")
    experts = [n for n in src if checkpoint.is_expert_linear(n) and n.endswith("_proj.weight")]
    assert experts
    for name in experts:
        base = name[: -len(".weight")]
        p, s = int4.quantize_pack(src[name], spec)
        assert torch.equal(q[base + ".weight_packed"], p) and torch.equal(q[base + ".weight_scale"], s)
    kept = [n for n in src if n not in experts]
    for name in kept:
        assert torch.equal(q[name], src[name]), name
    ignore = set(qc["ignore"])
    assert "lm_head" in ignore and "model.layers.0.self_attn.q_proj" in ignore and "model.layers.1.mlp.gate" in ignore
    assert not any(".experts." in i for i in ignore)


def test_cli_rejects_bad_combinations(tiny_model_path, moe_model, tmp_path, capsys):
    # down_proj's input (moe_intermediate_size 32) is not a multiple of 64
    assert _cli("-m", moe_model, "-o", str(tmp_path / "x"), "--fn", "w4a16", "--group-size", "64") == 2
    assert "multiple of group_size=64" in capsys.readouterr().err
    assert _cli("-m", tiny_model_path, "-o", str(tmp_path / "y"), "--fn", "int8", "--scope", "experts") == 2
    assert "--scope experts applies to --fn w4a16 / fp8-block only" in capsys.readouterr().err
    assert _cli("-m", tiny_model_path, "-o", str(tmp_path / "z"), "--fn", "w4a16", "--scope", "experts") == 2
    assert "no linear matches scope='experts'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _cli("-m", tiny_model_path, "-o", str(tmp_path / "w"), "--fn", "w4a16", "--group-size", "48")


@pytest.mark.parametrize("fmt", ["fp8", "ct"])
def test_fp8_block_checkpoint_layout_and_round_trip(tiny_model_path, tmp_path, fmt):
    out = str(tmp_path / f"fp8_{fmt}")
    assert _cli("-m", tiny_model_path, "-o", out, "--fn", "fp8-block", "--fp8-format", fmt) == 0
    src = profile.read_tensors(tiny_model_path)
    q = profile.read_tensors(out)
    qc = _config(out)["quantization_config"]
    if fmt == "fp8":
        assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
        assert qc["activation_scheme"] == "dynamic" and "lm_head" in qc["ignored_layers"]
        suffix = ".weight_scale_inv"
    else:
        w = qc["config_groups"]["group_0"]["weights"]
        assert qc["format"] == "float-quantized" and w["strategy"] == "block" and w["block_structure"] == [128, 128]
        suffix = ".weight_scale"
    for name, shape in checkpoint.linear_shapes(src).items():
        wq, s = q[name], q[name[: -len(".weight")] + suffix]
        assert wq.dtype == torch.float8_e4m3fn and tuple(wq.shape) == shape
        assert s.dtype == torch.float32 and tuple(s.shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
        q_ref, s_ref = block_fp8.quantize(src[name])
        assert torch.equal(wq.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
        d = block_fp8.dequantize(wq, s, dtype=torch.float32)
        sfull = s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
        assert torch.all((d - src[name].float()).abs() <= src[name].float().abs() * 2 ** -4 + sfull * 2 ** -10)
    assert q["lm_head.weight"].dtype == torch.bfloat16


def test_installed_vllm_parses_the_written_configs(tiny_model_path, tmp_path):
    """The installed vLLM (0.13 or 0.23) reads our quantization_config blocks as intended."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig)
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    ct = CompressedTensorsConfig.from_config(checkpoint.w4a16_quantization_config(64, ["lm_head"]))
    (args,) = [scheme["weights"] for scheme in ct.target_scheme_map.values()]
    strategy = str(getattr(args.strategy, "value", args.strategy))  # enum or str, by version
    assert (args.num_bits, args.group_size, args.symmetric, strategy) == (4, 64, True, "group")
    assert ct.ignore == ["lm_head"]
    fp8 = Fp8Config.from_config(checkpoint.fp8_block_quantization_config("fp8", ["lm_head"]))
    assert fp8.weight_block_size == [128, 128] and fp8.is_checkpoint_fp8_serialized
    ctb = CompressedTensorsConfig.from_config(checkpoint.fp8_block_quantization_config("ct", ["lm_head"]))
    (wargs,) = [scheme["weights"] for scheme in ctb.target_scheme_map.values()]
    assert str(getattr(wargs.strategy, "value", wargs.strategy)) == "block"
    assert list(wargs.block_structure) == [128, 128]


# -- one real engine (vLLM 0.23 CPU) ------------------------------------------------------

def serve_w4a16(model_dir: str, forward: bool = True) -> dict:
    """Child-process scenario: load ``model_dir`` (W4A16) in a vLLM CPU engine; report the linear
    kernels vLLM chose and whether every processed ``weight_packed`` / ``weight_scale`` is the
    checkpoint's, in the W4A16 kernel's layout; with ``forward``, greedy ``MAX_TOKENS`` tokens per
    prompt (without: the engine starts without its warm-up forward and generates nothing)."""
    from vllm import LLM, SamplingParams

    from tests.features.flashrl.engine_scenario import _model
    from tests.features.flashrl.w4a16_engine_scenario import without_warm_up_forward
    if not forward:
        without_warm_up_forward()
    llm = LLM(model=model_dir, enforce_eager=True, max_model_len=256, max_num_seqs=4, dtype="bfloat16", seed=0,
              gpu_memory_utilization=0.5)
    model = _model(llm)
    kernels = sorted({type(getattr(m, "scheme", None)).__name__ + "/" +
                      type(getattr(getattr(m, "scheme", None), "kernel", None)).__name__
                      for m in model.modules() if hasattr(m, "scheme")})
    res = {"kernels": kernels, "outputs": None, **_processed_against_checkpoint(model, model_dir)}
    if not forward:
        return res
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1)
    outs = []
    for o in llm.generate(PROMPTS, sp, use_tqdm=False):
        c = o.outputs[0]
        outs.append({"prompt_ids": list(o.prompt_token_ids), "tokens": list(c.token_ids),
                     "logprobs": [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]})
    res["outputs"] = outs
    return res


def _processed_against_checkpoint(model, model_dir: str) -> dict:
    """Per W4A16 linear of the engine (fused as vLLM fuses them: ``packed_modules_mapping``):
    its processed ``weight_packed`` must be the checkpoint's packed codes of its parts in the
    CPUWNA16 W4A16 layout (flashrl's ``wna16_blocked_cpu``, equal to vLLM's own post-processing:
    ``test_w4a16_reload.py``), its ``weight_scale`` the checkpoint's scales, transposed."""
    from ascend_rl_plugins.quant._cpu_kernels import wna16_blocked_cpu
    ckpt = profile.read_tensors(model_dir)
    fused = dict(getattr(model, "packed_modules_mapping", {}))
    checked, mismatch = 0, []
    for name, module in model.named_modules():
        if not hasattr(module, "weight_packed"):
            continue
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{p}" for p in fused.get(leaf, [leaf])]
        packed = torch.cat([ckpt[p + ".weight_packed"] for p in parts], dim=0).contiguous()
        scale = torch.cat([ckpt[p + ".weight_scale"] for p in parts], dim=0)
        want = wna16_blocked_cpu(packed, torch.empty_like(module.weight_packed.data))
        got_scale = module.weight_scale.data
        if not (torch.equal(module.weight_packed.data, want) and got_scale.dtype == scale.dtype
                and torch.equal(got_scale, scale.t())):
            mismatch.append(name)
        checked += 1
    return {"processed_checked": checked, "processed_mismatch": mismatch}


def _reference_logits(w4_dir: str, src_dir: str, ids: list[int], quantized: bool = True):
    """Float32 HF forward of the model whose linears are the checkpoint's dequantized INT4
    weights (decoded here with :func:`int4.unpack` / :func:`int4.dequantize`), or of the
    original BF16 model (``quantized=False``, the negative control)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    state = {}
    if quantized:
        qc = _config(w4_dir)["quantization_config"]
        spec = int4.Int4Spec(qc["group_size"], "ct")
        q = profile.read_tensors(w4_dir)
        for name, t in q.items():
            if name.endswith(".weight_packed"):
                base = name[: -len(".weight_packed")]
                shape = q[base + ".weight_shape"].tolist()
                state[base + ".weight"] = int4.dequantize(int4.unpack(t, shape[1]), q[base + ".weight_scale"], spec)
            elif not name.endswith((".weight_scale", ".weight_shape")):
                state[name] = t
    else:
        state = profile.read_tensors(src_dir)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src_dir)).float()
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.engine
def test_vllm_023_cpu_serves_the_w4a16_checkpoint(tiny_model_path, tmp_path):
    from tests.support import stacks
    from tests.support.child import ENGINE_ENV, GREEDY_ENGINE_ENV, run_scenario
    stack = stacks.running_stack()
    if stack is None:
        pytest.skip("needs the recipe (vLLM 0.13) or current (vLLM 0.23) stack")
    if stack == "recipe":
        pytest.skip("vLLM 0.13's CPU backend serves no W4A16 on x86 (its only CPU int4 kernel, "
                    "Dynamic4bitLinearKernel, is Arm-only; CPUWNA16LinearKernel came later); the checkpoint "
                    "is served on the current stack (vLLM 0.23)")
    from tests.support.cpu_isa import missing_vllm_cpu_op
    no_matmul = missing_vllm_cpu_op("cpu_gemm_wna16", "vLLM 0.23's CPUWNA16LinearKernel W4A16 matmul "
                                                      "(every forward of the W4A16 engine)")
    out = str(tmp_path / "w4")
    assert _cli("-m", tiny_model_path, "-o", out, "--fn", "w4a16", "--group-size", "64") == 0
    res = run_scenario("tests.features.flashrl.test_convert_low_precision", "serve_w4a16", out, no_matmul is None,
                       # W4A16 on every CPU (on AMX, vLLM's default is W4A8: int8 activations); greedy
                       env=dict(ENGINE_ENV, **GREEDY_ENGINE_ENV, ASCEND_RL_AUTOLOAD="0", VLLM_CPU_INT4_W4A8="0"),
                       timeout=900)
    assert any("WNA16" in k for k in res["kernels"]), res["kernels"]
    # 2 layers x (qkv, o, gate_up, down): vLLM holds the checkpoint's codes and scales, in the
    # layout its W4A16 kernel multiplies by
    assert res["processed_checked"] == 8 and res["processed_mismatch"] == [], res
    if no_matmul:
        pytest.skip(f"{no_matmul}; checked without a forward: vLLM serves the checkpoint with its W4A16 scheme "
                    f"and kernel and holds the checkpoint's codes and scales in the kernel's layout")
    worst_bf16 = 0.0
    for o in res["outputs"]:
        assert len(o["tokens"]) == MAX_TOKENS
        ids = o["prompt_ids"] + o["tokens"]
        ref = _reference_logits(out, tiny_model_path, ids)
        bf16 = _reference_logits(out, tiny_model_path, ids, quantized=False)
        start = len(o["prompt_ids"]) - 1
        for i, (tok, lp) in enumerate(zip(o["tokens"], o["logprobs"])):
            row = ref[start + i]
            # the engine's greedy token is the reference's argmax (up to bf16-activation noise
            # between near-tied logits) and its logprob matches the float32 reference
            # (measured: equal argmax everywhere, |logprob diff| <= 0.007)
            assert float(row.max() - row[tok]) < 0.02, (i, tok, int(row.argmax()))
            assert abs(float(row[tok]) - lp) < 0.03, (i, float(row[tok]), lp)
            worst_bf16 = max(worst_bf16, abs(float(bf16[start + i][tok]) - lp))
    # negative control: the unquantized model's logprobs are measurably different, so the
    # comparison above does see the INT4 weights
    assert worst_bf16 > 0.03, worst_bf16
