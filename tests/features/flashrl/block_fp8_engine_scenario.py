"""Artifacts and engine-side scenario for the block-FP8 (128x128) flashrl reload test (child processes).

``build_artifacts`` (no engine): a tiny BF16 Qwen3 "A" whose every linear shard is a multiple of
128 rows (hidden 256, intermediate 512, head_dim 128: q 256, k 128, v 128 rows), an updated copy
"B" (A plus noise), block-FP8 checkpoints of A and B written offline by the project's converter
(``checkpoint.quantize_checkpoint_fp8_block(fmt="fp8")``, what ``ascend-rl flashrl quantize --fn
fp8-block`` runs: ``weight`` float8_e4m3fn + float32 ``weight_scale_inv``, ``quant_method: fp8``,
``weight_block_size: [128, 128]``), and a FlashRL config naming fp8-block(A) with ``fn: fp8_block``.
"""

from __future__ import annotations

import json
import os

from .engine_scenario import _generate, _model, _processed_state, bits_equal
from .w4a16_engine_scenario import make_llm, stream, torch_peak_extra

MODEL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1, head_dim=128)


def build_artifacts(workdir: str) -> dict:

    import torch
    from safetensors.torch import save_file

    from ascend_rl_plugins.devtools import tiny_qwen3
    from ascend_rl_plugins.features.flashrl import checkpoint, config, profile

    a_dir = tiny_qwen3.cached(**MODEL)
    paths = {k: os.path.join(workdir, k) for k in ("bf16_b", "fp8_a", "fp8_b")}
    paths["bf16_a"] = a_dir
    paths["config"] = os.path.join(workdir, "flashrl_fp8_block.yaml")
    if os.path.exists(os.path.join(workdir, "done.json")):
        return paths
    a = profile.read_tensors(a_dir)
    g = torch.Generator().manual_seed(321)
    b = {n: (t.float() + torch.randn(t.shape, generator=g) * (0.05 if "norm" in n else 0.02)).to(t.dtype)
         for n, t in a.items()}
    os.makedirs(paths["bf16_b"], exist_ok=True)
    save_file(b, os.path.join(paths["bf16_b"], "model.safetensors"), metadata={"format": "pt"})
    tiny_qwen3.copy_model_files(a_dir, paths["bf16_b"])
    checkpoint.quantize_checkpoint_fp8_block(a_dir, paths["fp8_a"], fmt="fp8", scope="all")
    checkpoint.quantize_checkpoint_fp8_block(paths["bf16_b"], paths["fp8_b"], fmt="fp8", scope="all")
    config.write_config(paths["config"], config.RolloutConfig(fn="fp8_block", model=paths["fp8_a"]), append=False)
    with open(os.path.join(workdir, "done.json"), "w") as fh:
        json.dump(paths, fh)
    return paths


def run(role: str, paths: dict, out_dir: str) -> dict:
    """role "reload": serve fp8-block(A) (flashrl swaps it in for A's BF16 path), reload BF16 B
    online, then BF16 A. role "direct": serve fp8-block(B) with stock vLLM."""
    from safetensors.torch import save_file

    llm = make_llm(paths["bf16_a"] if role == "reload" else paths["fp8_b"])
    model = _model(llm)
    layer = model.model.layers[0].mlp.gate_up_proj
    res = {"served": llm.llm_engine.model_config.model, "method": type(layer.quant_method).__name__,
           "kernel": type(getattr(layer.quant_method, "fp8_linear", None)).__name__,
           "weight_dtype": str(layer.weight.dtype)}
    if role == "direct":
        res["out"] = _generate(llm)
        save_file(_processed_state(model), os.path.join(out_dir, "bfp8_direct_state.safetensors"))
        return res
    from ascend_rl_plugins.features.flashrl import reload as rl
    state = rl.state_of(model)
    res["wrapped"] = state is not None
    res["n_block_fp8"] = sum(r.kind == "block_fp8" for r in state.records.values())
    res["out_a"] = _generate(llm)
    state_a = _processed_state(model)
    ptrs0 = {n: p.data_ptr() for n, p in model.named_parameters()}
    stream_a, stream_b = stream(paths["bf16_a"]), stream(paths["bf16_b"])
    res["largest_bf16"] = max(t.numel() * t.element_size() for _, t in stream_b)
    res["peak_b"] = torch_peak_extra(lambda: model.load_weights(stream_b))
    res["out_b"] = _generate(llm)
    save_file(_processed_state(model), os.path.join(out_dir, "bfp8_reload_state.safetensors"))
    res["ptr_changed_b"] = sorted(n for n, p in model.named_parameters() if p.data_ptr() != ptrs0.get(n))
    res["peak_a"] = torch_peak_extra(lambda: model.load_weights(stream_a))
    res["out_a2"] = _generate(llm)
    now = _processed_state(model)
    res["state_a_diff"] = sorted(k for k in state_a if not bits_equal(state_a[k], now[k]))
    res["ptr_changed_a"] = sorted(n for n, p in model.named_parameters() if p.data_ptr() != ptrs0.get(n))
    res["n_params"] = len(ptrs0)
    return res
