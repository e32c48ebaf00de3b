"""cpu_rms_norm's checks on the shared in-process engine (see tests/features/shared_engine.py).

The engine's greedy next token must equal Hugging Face transformers' on the same tiny
Qwen3 (whose q/k norm is the strided case); on vLLM 0.13 (the patch applied) the CPU kernel
is also run directly, patched and pristine, on a strided view.
"""

from __future__ import annotations

PATCH = "cpu_rms_norm.contiguous_rms_norm_input"
PROMPTS = [([5, 6, 7, 8, 9] * 8)[:40], list(range(10, 50)), ([300, 301, 302, 303] * 10)[:38]]


def before_engine(ctx) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(ctx.model, dtype=torch.float32)
    with torch.no_grad():
        greedy = [int(hf(torch.tensor([p])).logits[0, -1].argmax()) for p in PROMPTS]
    return {"hf": greedy}


def strided_error(rms_norm) -> float:
    """Max abs error of ``rms_norm`` on a per-head view of a column slice of a fused qkv
    output (as Qwen3's attention normalizes q), against the formula."""
    import torch
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, 4 * 64, generator=g)
    q = qkv[:, : 2 * 64].view(7, 2, 64)
    w = torch.randn(64, generator=g)
    want = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    return float((rms_norm(q, w, 1e-6) - want).abs().max())


def with_engine(ctx) -> dict:
    from vllm import SamplingParams
    from vllm.model_executor.layers import layernorm

    from ascend_rl_plugins.patching.core import REGISTRY
    patch = REGISTRY.patches[PATCH]
    outs = ctx.llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    out = {"vllm": [o.outputs[0].token_ids[0] for o in outs], "state": patch.outcome.state}
    if patch.outcome.state == "applied":
        out["kernel_error"] = {"patched": strided_error(layernorm.rms_norm),
                               "pristine": strided_error(patch.original)}
    return out
