"""A Megatron-Core QAT trainer shaped like the tiny Qwen3, for the engine reload check (run in a
1-process gloo group by tests/features/rollout_mismatch/test_engine_mismatch.py; never imported
by the pytest process).

Real: a bf16 GPTModel from the CPU harness with the tiny Qwen3's shapes (2 layers, hidden 128,
2 heads / 1 query group of 64, ffn 256, vocab 512), int4_qat on (scope all), one training step
(SGD on the master weights) and one forward in which every weight the Megatron linears
*really* multiply by is recorded (Megatron-Core's ``linear_with_grad_accumulation_and_async_allreduce``
seen from inside). Written out: the master weights in Hugging Face names (what verl exports to
the rollout) and the recorded forward weights by vLLM's fused layer names (vLLM's ``qkv_proj``
rows are ``[q; k; v]`` and ``gate_up_proj`` ``[gate; up]``, as Megatron's ``linear_qkv`` with
one query group and ``linear_fc1``).
"""

from __future__ import annotations

import functools
import importlib

from tests.features.int4_qat.scenario import _set_flags

ARCH = dict(layers=2, hidden=128, heads=2, query_groups=1, kv_channels=64, ffn_hidden=256, vocab=512,
            seq_len=16)
VLLM_NAMES = {"self_attention.linear_qkv": "qkv_proj", "self_attention.linear_proj": "o_proj",
              "mlp.linear_fc1": "gate_up_proj", "mlp.linear_fc2": "down_proj"}


def hf_weights(canonical: dict, arch: dict) -> dict:
    """Megatron canonical (1 query group) -> Hugging Face Qwen3 names."""
    q_rows = arch["heads"] * arch["kv_channels"]
    kv = arch["kv_channels"]
    out = {"model.embed_tokens.weight": canonical["embedding.word_embeddings.weight"],
           "model.norm.weight": canonical["decoder.final_layernorm.weight"],
           "lm_head.weight": canonical["output_layer.weight"]}
    for layer in range(arch["layers"]):
        m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        qkv = canonical[m + "self_attention.linear_qkv.weight"]
        gate, up = canonical[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out.update({
            h + "input_layernorm.weight": canonical[m + "input_layernorm.weight"],
            h + "self_attn.q_proj.weight": qkv[:q_rows], h + "self_attn.k_proj.weight": qkv[q_rows:q_rows + kv],
            h + "self_attn.v_proj.weight": qkv[q_rows + kv:],
            h + "self_attn.q_norm.weight": canonical[m + "self_attention.q_layernorm.weight"],
            h + "self_attn.k_norm.weight": canonical[m + "self_attention.k_layernorm.weight"],
            h + "self_attn.o_proj.weight": canonical[m + "self_attention.linear_proj.weight"],
            h + "post_attention_layernorm.weight": canonical[m + "pre_mlp_layernorm.weight"],
            h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up,
            h + "mlp.down_proj.weight": canonical[m + "mlp.linear_fc2.weight"]})
    return out


def export(out_path: str, group: int) -> dict:
    try:
        return _export(out_path, group)
    except BaseException:
        open(out_path + ".done.failed", "w").close()   # the engine process stops waiting
        raise


def _export(out_path: str, group: int) -> dict:
    import torch

    import ascend_rl_plugins
    from ascend_rl_plugins.features.int4_qat import FEATURE
    from tests.support.megatron import megatron_model

    _set_flags("all", group)
    for patch in FEATURE.patches:
        if patch.dist == "megatron-core":
            importlib.import_module(patch.module)
    ascend_rl_plugins.activate()
    states = {p.name: p.outcome.state for p in FEATURE.patches if p.dist == "megatron-core"}
    from megatron.core.tensor_parallel import layers as mc_layers

    with megatron_model(dtype="bfloat16", seed=7, **ARCH) as h:
        # one training step on the masters (the QAT gradient), as a trainer would before an update
        h.loss(h.tokens(batch=2, seed=5)).backward()
        with torch.no_grad():
            for p in h.model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.5)
                    p.grad = None
        # record what each Megatron linear multiplies by in a QAT forward
        current, seen = [], {}
        original = mc_layers.linear_with_grad_accumulation_and_async_allreduce

        @functools.wraps(original)   # (it reads its own attributes through its global name)
        def recording(input, weight, *args, **kwargs):
            if current:
                seen[current[-1]] = weight.detach().clone()
            return original(input, weight, *args, **kwargs)

        def enter(name):
            def hook(module, args):
                current.append(name)
            return hook

        def leave(module, args, output):
            current.pop()

        hooks = []
        for name, module in h.model.named_modules():
            if type(module).__name__ in ("ColumnParallelLinear", "RowParallelLinear"):
                hooks.append(module.register_forward_pre_hook(enter(name)))
                hooks.append(module.register_forward_hook(leave))
        mc_layers.linear_with_grad_accumulation_and_async_allreduce = recording
        try:
            h.forward(h.tokens(batch=1, seed=6))
        finally:
            mc_layers.linear_with_grad_accumulation_and_async_allreduce = original
            for hook in hooks:
                hook.remove()
        masters = h.to_canonical({n: p.detach().clone() for n, p in h.model.named_parameters()})
        forward = {}
        for name, weight in seen.items():
            for mc, vllm in VLLM_NAMES.items():
                if name.endswith(mc):
                    layer = name.split(".")[2]
                    forward[f"model.layers.{layer}.{vllm}"] = weight
        output_layer_plain = torch.equal(seen["output_layer"], masters["output_layer.weight"])
    hf = {n: t.to(torch.bfloat16).contiguous() for n, t in hf_weights(masters, ARCH).items()}
    torch.save({"hf": hf, "forward": forward}, out_path)
    open(out_path + ".done", "w").close()   # the engine process waits for this
    return {"patch_states": states, "recorded": sorted(seen), "output_layer_plain": output_layer_plain,
            "n_hf": len(hf)}
