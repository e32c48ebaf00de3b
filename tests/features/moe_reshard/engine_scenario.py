"""Engine-side scenarios of the moe_reshard engine test (run in child processes by test_engine.py).

``prepare``: the tiny Qwen3-MoE ``W0`` (tiny_qwen3.cached(moe=True): 2 layers, 8 experts, top-2,
hidden 64, moe intermediate 32, so 2*I % 32 == 0 as vLLM 0.23's CPU MoE needs) and ``W1`` = W0
plus seeded noise on every tensor (a training step), written next to W0's config and tokenizer.

``run("direct", ...)``: a real vLLM CPU engine started on W1 -- the reference.

Both record the CPU MoE path vLLM chose: on vLLM 0.23 the prepacked grouped-GEMM kernel where
the loaded kernel library has it, else (AVX2-only x86) the torch fallback, which runs only with
the cpu_fused_moe_fallback feature (on by default, applied by vLLM's plugin loading).

``run("reload", ...)``: a real vLLM CPU engine started on W0 receives W1: the dense tensors by
name, the expert tensors from the real ``executor.reshard_experts`` (training layout TP1/EP1
SequentialMLP, rollout TP1 -- a one-rank reshard on the process group vLLM itself initialized).
On vLLM 0.13 with verl 0.6.1 installed (recipe) they go through verl's real
``vLLMAsyncRollout.update_weights`` (the object holds the real model runner): first with this
feature's update_weights patch reverted (stock), then with it applied; and the pre-narrowed
loader is checked by writing every expert again through ``vllm_side.load_pre_narrowed``. On
vLLM 0.23 (no verl 0.6.1) the update is bracketed by ``vllm_side.reload_session`` (vLLM's
layerwise reload API). Greedy tokens, logprobs and every parameter are recorded.
"""

from __future__ import annotations

import json
import os

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Config:"]
MAX_TOKENS = 16


def prepare(workdir: str) -> dict:

    import torch
    from safetensors.torch import load_file

    from ascend_rl_plugins.devtools import tiny_qwen3

    w0 = tiny_qwen3.cached(moe=True)
    w1 = os.path.join(workdir, "w1")
    if not os.path.exists(os.path.join(w1, "done")):
        os.makedirs(w1, exist_ok=True)
        a = load_file(os.path.join(w0, "model.safetensors"))
        g = torch.Generator().manual_seed(123)
        b = {}
        for name, t in sorted(a.items()):
            noise = torch.randn(t.shape, generator=g) * (0.05 if "norm" in name else 0.02)
            b[name] = (t.float() + noise).to(t.dtype)
        tiny_qwen3.write_moe_checkpoint(w1, b)
        tiny_qwen3.copy_model_files(w0, w1)
        open(os.path.join(w1, "done"), "w").close()
    return {"w0": w0, "w1": w1}


def _runner(llm):
    engine = llm.llm_engine
    executor = getattr(engine, "model_executor", None)
    if executor is None:
        executor = engine.engine_core.engine_core.model_executor
    return executor.driver_worker.worker.model_runner


def _generate(llm) -> list:
    from vllm import SamplingParams
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)
    out = []
    for o in llm.generate(PROMPTS, sp, use_tqdm=False):
        c = o.outputs[0]
        out.append({"tokens": list(c.token_ids),
                    "logprobs": [{str(k): v.logprob for k, v in d.items()} for d in c.logprobs]})
    return out


def moe_paths(model) -> list:
    """Per FusedMoE layer, the CPU MoE path vLLM chose: on vLLM 0.23 the bound forward of its
    ``CPUFusedMOE`` (``forward_grouped_gemm``: the prepacked kernel; ``forward_torch``: the torch
    fallback of a kernel library without ``prepack_moe_weight``, e.g. AVX2-only x86); on 0.13 the
    implementation's class."""
    paths = []
    for module in model.modules():
        impl = getattr(getattr(module, "quant_method", None), "cpu_fused_moe", None)
        if impl is not None:
            method = getattr(impl, "forward_method", None)
            paths.append(getattr(method, "__name__", None) or type(impl).__name__)
    return paths


def _fallback_fix_state() -> str | None:
    """State of cpu_fused_moe_fallback's patch in this engine process (vLLM's plugin loading
    applies it), which the torch fallback needs on vLLM 0.23."""
    from ascend_rl_plugins.patching.core import REGISTRY
    patch = REGISTRY.patches.get("cpu_fused_moe_fallback.static_silu_activation")
    return None if patch is None else patch.outcome.state


def _save_state(model, path: str) -> None:
    from safetensors.torch import save_file
    save_file({n: p.detach().clone().contiguous() for n, p in model.named_parameters()}, path)


def _w1_stream(w1: str, config) -> tuple[list, list, dict]:
    """W1 as the trainer would send it: dense tensors by HF name, experts from the real reshard."""
    from safetensors.torch import load_file

    from ascend_rl_plugins.features.moe_reshard import executor
    from ascend_rl_plugins.features.moe_reshard.layout import (MoEShape, RolloutLayout, TrainingLayout,
                                                               hf_to_megatron, parse_hf_expert_name)

    tensors = load_file(os.path.join(w1, "model.safetensors"))
    dense = [(n, t) for n, t in tensors.items() if parse_hf_expert_name(n) is None]
    experts = {n: t for n, t in tensors.items() if parse_hf_expert_name(n) is not None}
    shape = MoEShape(num_layers=config.num_hidden_layers, num_experts=config.num_experts,
                     hidden=config.hidden_size, ffn_hidden=config.moe_intermediate_size)
    training = TrainingLayout(tp=1, expert_impl="sequential").with_world(1)
    local = hf_to_megatron(experts, shape, training, 0)
    got = [(n, t.clone()) for n, t in executor.reshard_experts(
        local, shape=shape, training=training, rollout=RolloutLayout(tp=1, dp=1), bucket_bytes=1 << 16)]
    info = {"megatron_names": len(local), "expert_names": sorted(n for n, _ in got),
            "hf_expert_names": sorted(experts),
            "experts_equal": all(t.equal(experts[n]) for n, t in got)}
    return dense, got, info


def run(role: str, paths: dict, out_dir: str) -> dict:
    import vllm
    from vllm import LLM

    model_dir = paths["w1"] if role == "direct" else paths["w0"]
    llm = LLM(model=model_dir, enforce_eager=True, max_model_len=256, max_num_seqs=4, dtype="bfloat16",
              seed=0, gpu_memory_utilization=0.5)
    runner = _runner(llm)
    model = runner.model
    res = {"vllm": vllm.__version__, "moe_paths": moe_paths(model), "fallback_fix": _fallback_fix_state()}
    from ascend_rl_plugins.features.moe_reshard import vllm_side
    res["rpc"] = llm.collective_rpc(vllm_side.worker_rollout_info)
    if role == "direct":
        res["out"] = _generate(llm)
        _save_state(model, os.path.join(out_dir, "direct.safetensors"))
        return res

    res["before"] = _generate(llm)
    res["expert_map"] = list(vllm_side.local_expert_map(model))
    dense, experts, res["reshard"] = _w1_stream(paths["w1"], llm.llm_engine.model_config.hf_config)
    weights = dense + experts
    try:
        from verl.workers.rollout.vllm_rollout.vllm_rollout_spmd import vLLMAsyncRollout
    except Exception as exc:  # verl 0.9.1 (current stack) has no such class
        res["verl_rollout"] = f"{type(exc).__name__}: {exc}"[:200]
        vLLMAsyncRollout = None
    if vLLMAsyncRollout is None:
        with vllm_side.reload_session(model, runner.vllm_config):
            model.load_weights(iter(weights))
        res["patched"] = _generate(llm)
        _save_state(model, os.path.join(out_dir, "patched.safetensors"))
        return res
    res.update(_through_verl(vLLMAsyncRollout, llm, runner, weights, out_dir))
    return res


def _through_verl(rollout_cls, llm, runner, weights, out_dir) -> dict:
    """verl 0.6.1's real update_weights, stock (this feature's patch reverted) then patched; then
    every expert again through the pre-narrowed loader."""
    import asyncio
    from types import SimpleNamespace

    import ascend_rl_plugins
    from ascend_rl_plugins.features.moe_reshard import vllm_side
    from ascend_rl_plugins.patching.core import REGISTRY

    ascend_rl_plugins.activate()
    patch = REGISTRY.patches["moe_reshard.async_rollout_update_weights"]
    rollout = rollout_cls.__new__(rollout_cls)
    rollout.inference_engine = SimpleNamespace(worker=SimpleNamespace(model_runner=runner))
    model = runner.model
    res = {"patch_state": patch.outcome.state}
    calls = _count_post_processing(model)
    REGISTRY.revert(patch)
    asyncio.run(rollout_cls.update_weights(rollout, iter(weights)))
    res["stock_post_load_calls"] = sum(calls.values())
    res["stock"] = _generate(llm)
    _save_state(model, os.path.join(out_dir, "stock.safetensors"))
    REGISTRY.apply(patch)
    res["patch_state_after_apply"] = patch.outcome.state
    calls.clear()
    asyncio.run(rollout_cls.update_weights(rollout, iter(weights)))
    res["patched_post_load_calls"] = dict(calls)
    res["moe_layers"] = len(vllm_side.fused_moe_layers(model))
    res["patched"] = _generate(llm)
    _save_state(model, os.path.join(out_dir, "patched.safetensors"))
    # the pre-narrowed path (rollout TP1: the narrow is the whole tensor): zero the fused
    # weights, write every expert slice directly, post-process
    import torch
    layers = vllm_side.fused_moe_layers(model)
    with torch.no_grad():
        for layer in layers.values():
            layer.w13_weight.zero_()
            layer.w2_weight.zero_()
    for name, tensor in weights:
        if vllm_side.parse_expert_name(name):
            vllm_side.load_pre_narrowed(model, name, tensor, layers)
    vllm_side.post_load_process(model, runner.vllm_config)
    res["narrowed"] = _generate(llm)
    _save_state(model, os.path.join(out_dir, "narrowed.safetensors"))
    return res


def _count_post_processing(model) -> dict:
    """Count calls of each FusedMoE layer's real ``quant_method.process_weights_after_loading``
    (an instance attribute that calls the real method: vLLM 0.13's unquantized CPU MoE does not
    repack, so the call itself is what a CPU run can observe)."""
    from ascend_rl_plugins.features.moe_reshard import vllm_side
    calls: dict = {}
    for index, layer in vllm_side.fused_moe_layers(model).items():
        method = layer.quant_method
        real = method.process_weights_after_loading

        def counted(module, _real=real, _key=str(index)):
            calls[_key] = calls.get(_key, 0) + 1
            return _real(module)
        method.process_weights_after_loading = counted
    return calls


def compare(out_dir: str, names: list) -> dict:
    """Which parameters of each saved state differ (bitwise) from the direct engine's."""
    from safetensors.torch import load_file
    ref = load_file(os.path.join(out_dir, "direct.safetensors"))
    out = {}
    for name in names:
        path = os.path.join(out_dir, f"{name}.safetensors")
        if not os.path.exists(path):
            continue
        got = load_file(path)
        out[name] = {"missing": sorted(set(ref) - set(got)),
                     "different": sorted(k for k in ref if k in got and not (
                         got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape and got[k].equal(ref[k])))}
    with open(os.path.join(out_dir, "compare.json"), "w") as fh:
        json.dump(out, fh)
    return out
