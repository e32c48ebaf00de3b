"""Real engines and a real HF trainer for the rollout-mismatch test (run in child processes by
test_engine_mismatch.py; never imported by the pytest process).

``rollout_w4a16``: the tiny Qwen3 converted to W4A16 by this project's converter
(``flashrl.checkpoint.quantize_checkpoint_w4a16``, scope all), served by a real vLLM CPU
engine (compressed-tensors ``CompressedTensorsWNA16``, CPUWNA16 kernel). It samples the
rollout sequences, returns its prompt log-probs on them, the (codes, scales) vLLM loaded
(captured before the CPU kernel repacks them) and, per quantized linear, the weight the
engine really multiplies by (its ``apply`` on an identity matrix).

Where the installed vLLM build has no W4A16 matmul on this CPU (``rollout_w4a16(...,
forward=False)``: vLLM's AVX2 kernel library lacks ``cpu_gemm_wna16``), the W4A16 engine starts
without its warm-up forward, samples nothing and probes no effective weight; it still reports
its scheme and kernel, compares the (codes, scales) it loaded with ``int4.quantize`` of the BF16
checkpoint (the trainer's weights), and reloads the Megatron export (re-quantized codes only).

``rollout_bf16_and_trainer``: the BF16 tiny Qwen3 in a real vLLM engine (prompt log-probs on
the same sequences), then the HF transformers model (the trainer) in bf16, once as is and
once with every decoder linear replaced by ``quant.int4.fake_quantize`` (the INT4 QAT
forward weight), computing the log-probs of the same tokens; and the trainer's weights as
``int4.quantize`` sees them, to compare with what the engine loaded.
"""

from __future__ import annotations

import os

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Config:", "for i in range(",
           "# Licensed under", "return self.", "if __name__ ==", "with open(path) as"]
SAMPLES_PER_PROMPT = 2
MAX_TOKENS = 48
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def fused_parts(fused_name: str) -> list[str]:
    """HF module names of the linears vLLM fuses into ``model.layers.<i>.<fused>``."""
    prefix, fused = fused_name.rsplit(".", 1)
    block = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
    return [f"{prefix}.{block}.{p}" for p in FUSED[fused]]


def _publish(path: str, obj) -> None:
    import json
    with open(path + ".tmp", "w") as fh:
        json.dump(obj, fh)
    os.replace(path + ".tmp", path)


def _wait_for(path: str, timeout: float = 800.0) -> None:
    """Another child process of the same test writes ``path`` (the engines start in parallel);
    ``path + ".failed"`` says it never will."""
    import time
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if os.path.exists(path + ".failed"):
            raise RuntimeError(f"the process that writes {path} failed")
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(0.5)


def failing_marks(*paths):
    """Decorator: when the function raises, leave ``<path>.failed`` for the waiting processes."""
    import functools

    def wrap(fn):
        @functools.wraps(fn)
        def inner(workdir, *args):
            try:
                return fn(workdir, *args)
            except BaseException:
                for p in paths:
                    open(os.path.join(workdir, p) + ".failed", "w").close()
                raise
        return inner
    return wrap


def _model(llm):
    engine = llm.llm_engine
    executor = getattr(engine, "model_executor", None)
    if executor is None:
        executor = engine.engine_core.engine_core.model_executor
    return executor.driver_worker.worker.model_runner.model


def _llm(model_dir: str):
    from vllm import LLM
    return LLM(model=model_dir, enforce_eager=True, max_model_len=256, max_num_seqs=8, dtype="bfloat16",
               seed=0, gpu_memory_utilization=0.5)


def _prompt_logprobs(llm, sequences: list) -> list:
    """The engine's log-prob of every token of each sequence given its prefix (None first)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], sp, use_tqdm=False)
    return [[None if d is None else d[tok].logprob for tok, d in zip(seq, o.prompt_logprobs)]
            for seq, o in zip(sequences, outs)]


def w4a16_dir(workdir: str, group: int) -> str:
    from ascend_rl_plugins.devtools import tiny_qwen3
    from ascend_rl_plugins.features.flashrl.checkpoint import quantize_checkpoint_w4a16
    out = os.path.join(workdir, f"w4a16_g{group}")
    if not os.path.isfile(os.path.join(out, "config.json")):
        quantize_checkpoint_w4a16(tiny_qwen3.cached(), out, group_size=group, scope="all", preset="ct")
    return out


def _effective_weights(model, loaded: dict | None = None, forward: bool = True) -> dict:
    """Per quantized fused linear: the weight the engine's kernel multiplies by (its ``apply``
    on an identity matrix, ``[out, in]``; None without ``forward``: no W4A16 matmul here) and,
    with ``loaded``, the (packed, scale) vLLM's loader put in the layer."""
    import torch
    layers = {}
    with torch.inference_mode():
        for li, layer in enumerate(model.model.layers):
            for fused in FUSED:
                mod = getattr(layer.self_attn, fused, None) or getattr(layer.mlp, fused)
                in_features = int(mod.input_size_per_partition)
                eye = torch.eye(in_features, dtype=torch.bfloat16)
                rec = {"effective": mod.quant_method.apply(mod, eye).t().contiguous() if forward else None,
                       "scheme": type(mod.scheme).__name__,
                       "kernel": type(getattr(mod.scheme, "kernel", None)).__name__}
                if loaded is not None:
                    rec["packed"], rec["scale"] = loaded[id(mod)]
                layers[f"model.layers.{li}.{fused}"] = rec
    return layers


def truncated_dequantize(codes, scale, group: int):
    """``codes * scale`` as vLLM's CPU kernel libraries without the AVX-512 BF16 instruction
    (``_C_AVX512``, ``_C_AVX2``) return it: the exact product in fp32 (a 4-bit code times a bf16
    scale needs at most 12 significant bits), converted to bf16 by dropping its low 16 bits
    (truncation toward zero) where ``int4.dequantize`` rounds to nearest even."""
    import torch
    exact = (codes.float().reshape(codes.shape[0], -1, group) * scale.float().unsqueeze(-1)).reshape(codes.shape)
    return (exact.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def _codes_mismatch(engine_layers: dict, masters: dict, spec) -> list:
    """Engine layers whose loaded (packed, scale) are not ``int4.quantize`` of the trainer's
    master weights of their parts (``masters``: HF linear name -> weight)."""
    import torch
    from ascend_rl_plugins.quant import int4
    wrong = []
    for name, rec in engine_layers.items():
        parts = fused_parts(name)
        codes, scale = int4.quantize(torch.cat([masters[p] for p in parts], dim=0), spec)
        if not (torch.equal(int4.pack(codes), rec["packed"]) and scale.dtype == rec["scale"].dtype
                and torch.equal(scale, rec["scale"])):
            wrong.append(name)
    return wrong


def reload_megatron_export(llm, export_path: str, forward: bool = True) -> dict:
    """flashrl's in-place W4A16 reload of the Megatron QAT trainer's exported (master) weights;
    the engine's re-quantized (packed, scale) and (with ``forward``) effective weights afterwards."""
    import torch
    from ascend_rl_plugins.features.flashrl import reload as rl
    model = _model(llm)
    state = rl.state_of(model)
    if state is None:
        return {"reload_error": "flashrl's reload state is not installed on the engine model"}
    exported = torch.load(export_path, weights_only=False)
    state.keep_quantized = True
    model.load_weights(list(exported["hf"].items()))
    quantized = {k: (p.clone(), s.clone()) for k, (p, s) in state.last_quantized.items()}
    state.keep_quantized = False
    state.last_quantized = None
    after = _effective_weights(model, forward=forward)
    torch.save({"quantized": quantized,
                "effective": {k: v["effective"] for k, v in after.items()} if forward else None},
               os.path.join(os.path.dirname(export_path), "engine_after_reload.pt"))
    return {"reload_spec": [state.int4_spec.group_size, state.int4_spec.preset], "reloaded": len(quantized)}


@failing_marks("sequences.json")
def rollout_w4a16(workdir: str, group: int, export_path: str | None = None, forward: bool = True) -> dict:
    """Serve W4A16 through flashrl (the BF16 path + ``ASCEND_RL_FLASHRL`` naming the W4A16
    checkpoint, as verl would start it), sample, score, probe; then, with ``export_path``,
    reload the Megatron QAT trainer's weights in place and probe again. Without ``forward``
    (no W4A16 matmul in this vLLM build): no warm-up, no sampling, no effective weights; the
    loaded codes and scales are compared here with the BF16 checkpoint's."""
    import torch
    from ascend_rl_plugins import flags
    from ascend_rl_plugins.devtools import tiny_qwen3
    from ascend_rl_plugins.features.flashrl import config as flashrl_config
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import \
        compressed_tensors_wNa16 as wna16

    loaded: dict = {}
    scheme_cls = wna16.CompressedTensorsWNA16
    original = scheme_cls.process_weights_after_loading

    def capture(self, layer):   # what vLLM's loader put in the layer, before the kernel repacks it
        loaded[id(layer)] = (layer.weight_packed.detach().clone(), layer.weight_scale.detach().clone())
        return original(self, layer)

    served = w4a16_dir(workdir, group)
    cfg = os.path.join(workdir, "flashrl_w4a16.yaml")
    flashrl_config.write_config(cfg, flashrl_config.RolloutConfig(fn="w4a16", model=served), append=False)
    os.environ["ASCEND_RL_FLASHRL"] = cfg
    os.environ["ASCEND_RL_FLASHRL_INT4_GROUP_SIZE"] = str(group)   # = the trainer's ASCEND_RL_INT4_QAT_GROUP_SIZE
    flags.reset_cache()
    if not forward:
        from tests.features.flashrl.w4a16_engine_scenario import without_warm_up_forward
        without_warm_up_forward()
    scheme_cls.process_weights_after_loading = capture
    try:
        llm = _llm(tiny_qwen3.cached())
    finally:
        scheme_cls.process_weights_after_loading = original
    model = _model(llm)
    if not forward:
        from ascend_rl_plugins.quant import int4
        from ascend_rl_plugins.features.flashrl.profile import read_tensors
        layers = _effective_weights(model, loaded, forward=False)
        masters = {n[: -len(".weight")]: t for n, t in read_tensors(tiny_qwen3.cached()).items()
                   if n.endswith(".weight") and ".layers." in n and n.rsplit(".", 2)[-2] in LINEARS}
        out = {"served": llm.llm_engine.model_config.model,
               "schemes": sorted({v["scheme"] for v in layers.values()}),
               "kernels": sorted({v["kernel"] for v in layers.values()}),
               "quantized_linears": len(masters), "engine_layers_checked": len(layers),
               "codes_mismatch": _codes_mismatch(layers, masters, int4.Int4Spec(group_size=group, preset="ct"))}
        if export_path:
            _wait_for(export_path + ".done")
            out.update(reload_megatron_export(llm, export_path, forward=False))
        return out
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    requests = [(i, j, ids) for i, ids in enumerate(prompts) for j in range(SAMPLES_PER_PROMPT)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=1.0, seed=1000 * i + j,
                             ignore_eos=True) for i, j, _ in requests]
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for _, _, ids in requests], params, use_tqdm=False)
    sequences = [{"prompt_len": len(ids), "tokens": list(ids) + list(o.outputs[0].token_ids)}
                 for (_, _, ids), o in zip(requests, outs)]
    logprobs = _prompt_logprobs(llm, [s["tokens"] for s in sequences])

    layers = _effective_weights(model, loaded)
    torch.save(layers, os.path.join(workdir, "engine_w4a16_layers.pt"))
    _publish(os.path.join(workdir, "sequences.json"), sequences)   # the BF16 engine waits for them
    from tests.support.cpu_isa import loaded_vllm_cpu_library
    out = {"sequences": sequences, "rollout_w4a16": logprobs, "served": llm.llm_engine.model_config.model,
           "kernel_library": loaded_vllm_cpu_library(),
           "schemes": sorted({v["scheme"] for v in layers.values()}),
           "kernels": sorted({v["kernel"] for v in layers.values()})}
    if export_path:
        _wait_for(export_path + ".done")
        out.update(reload_megatron_export(llm, export_path))
    return out


def _hf_logprobs(model, sequences: list) -> list:
    import torch
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logits = model(input_ids=ids).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            out.append([None] + [float(lp[t - 1, seq[t]]) for t in range(1, len(seq))])
    return out


def _fake_quantize_linears(model, spec) -> list:
    import torch
    from ascend_rl_plugins.quant.int4 import fake_quantize
    done = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in LINEARS and ".layers." in name:
                module.weight.copy_(fake_quantize(module.weight, spec))
                done.append(name)
    return done


def rollout_bf16_and_trainer(workdir: str, group: int) -> dict:
    """Started together with ``rollout_w4a16``: builds its BF16 engine, then waits for the
    W4A16 engine's sequences."""
    import gc
    import json

    import torch
    from ascend_rl_plugins.devtools import tiny_qwen3
    from ascend_rl_plugins.quant import int4

    bf16 = tiny_qwen3.cached()
    llm = _llm(bf16)
    _wait_for(os.path.join(workdir, "sequences.json"))
    with open(os.path.join(workdir, "sequences.json")) as fh:
        sequences = json.load(fh)
    seqs = [s["tokens"] for s in sequences]
    rollout_bf16 = _prompt_logprobs(llm, seqs)
    del llm
    gc.collect()

    from transformers import AutoModelForCausalLM
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16)
    model.eval()
    trainer_bf16 = _hf_logprobs(model, seqs)
    spec = int4.Int4Spec(group_size=group, preset="ct")
    masters = {n: m.weight.detach().clone() for n, m in model.named_modules()
               if n.rsplit(".", 1)[-1] in LINEARS and ".layers." in n}
    quantized = _fake_quantize_linears(model, spec)
    trainer_fq = _hf_logprobs(model, seqs)

    # the engine's view of the same weights: loaded (codes, scales) and effective weights
    engine = torch.load(os.path.join(workdir, "engine_w4a16_layers.pt"), weights_only=False)
    codes_mismatch = _codes_mismatch(engine, masters, spec)
    modules = dict(model.named_modules())
    effective_mismatch, truncated_mismatch, checked = [], [], 0
    for name, rec in engine.items():
        parts = fused_parts(name)
        fq = torch.cat([modules[p].weight.detach() for p in parts], dim=0)
        codes, scale = int4.quantize(torch.cat([masters[p] for p in parts], dim=0), spec)
        for want, wrong in ((fq, effective_mismatch), (truncated_dequantize(codes, scale, group), truncated_mismatch)):
            if not (rec["effective"].dtype == want.dtype and torch.equal(rec["effective"], want)):
                diff = (rec["effective"].float() - want.float()).abs()
                wrong.append(f"{name}: {int((diff > 0).sum())} of {diff.numel()} differ, max {float(diff.max()):.3g}")
        checked += 1
    return {"rollout_bf16": rollout_bf16, "trainer_bf16": trainer_bf16, "trainer_fq": trainer_fq,
            "quantized_linears": len(quantized), "engine_layers_checked": checked,
            "codes_mismatch": codes_mismatch, "effective_mismatch": effective_mismatch,
            "effective_truncated_mismatch": truncated_mismatch}
