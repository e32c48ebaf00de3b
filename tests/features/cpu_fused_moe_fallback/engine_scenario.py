"""Child-process scenarios of the cpu_fused_moe_fallback tests (run by test_cpu_fused_moe_fallback.py).

``fallback_engine``: this process answers torch's ISA probes as an AVX2-only CPU
(tests/support/cpu_isa.py), so vLLM 0.23 loads its real ``_C_AVX2`` library, which has no
``prepack_moe_weight``, and ``CPUFusedMOE`` takes its torch fallback on any x86 machine, as it
does on the AVX2-only CI machines. The tiny Qwen3-MoE runs in float32 in an in-process engine
with vLLM's default torch.compile (on CPU the MoE layer is traced, not an opaque op, so the
patched table is looked up by Dynamo too); the feature's patch is applied by vLLM's own plugin
loading (``vllm.general_plugins``). Recorded:
which MoE path every layer took, the patch state, the engine's greedy next token and its
log-prob on a few prompts, the activation table's entries against vLLM's own, and, after the
patch is reverted in the same process, what the next generate raises.

``reference``: Hugging Face transformers' float32 forward of the same model on the same prompts.
"""

from __future__ import annotations

PATCH = "cpu_fused_moe_fallback.static_silu_activation"
PROMPTS = [[5, 6, 7, 8, 9] * 6, list(range(10, 40)), [300, 301, 302, 303] * 8]


def _model(llm):
    engine = llm.llm_engine
    executor = getattr(engine, "model_executor", None)
    if executor is None:
        executor = engine.engine_core.engine_core.model_executor
    return executor.driver_worker.worker.model_runner.model


def _moe_paths(model) -> list:
    """Per FusedMoE layer: the bound forward of vLLM's CPUFusedMOE (forward_torch = the fallback)."""
    paths = []
    for module in model.modules():
        impl = getattr(getattr(module, "quant_method", None), "cpu_fused_moe", None)
        if impl is not None:
            paths.append(getattr(getattr(impl, "forward_method", None), "__name__", type(impl).__name__))
    return paths


def table_entries() -> dict:
    """Outside any vLLM config context (as inside a forward): vLLM's own SiLU entry, and the
    patched table's, on the same input; which other entries are vLLM's very objects."""
    import torch
    import torch.nn.functional as F
    from vllm.model_executor.layers.fused_moe import cpu_fused_moe
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from ascend_rl_plugins.features.cpu_fused_moe_fallback import table_with_static_silu
    upstream = cpu_fused_moe._CPU_MOE_ACT_FN
    x = torch.randn(5, 2 * 16, generator=torch.Generator().manual_seed(0))
    want = F.silu(x[..., :16]) * x[..., 16:]
    out: dict = {}
    try:
        upstream[MoEActivation.SILU](x)
        out["upstream_silu_error"] = None
    except Exception as exc:  # noqa: BLE001 - the test asserts which error
        out["upstream_silu_error"] = f"{type(exc).__name__}: {exc}"[:300]
    table = table_with_static_silu(upstream)
    out["patched_silu_max_error"] = float((table[MoEActivation.SILU](x) - want).abs().max())
    out["same_keys"] = sorted(str(k.value) for k in table) == sorted(str(k.value) for k in upstream)
    out["other_entries_are_vllms"] = all(table[k] is upstream[k] for k in upstream if k is not MoEActivation.SILU)
    return out


def fallback_engine(model_dir: str) -> dict:
    from tests.support import cpu_isa
    cpu_isa.simulate_avx2_only()  # before vLLM loads its kernels

    import torch
    from vllm import LLM, SamplingParams

    from ascend_rl_plugins.patching.core import REGISTRY
    res = {"table": table_entries()}
    llm = LLM(model=model_dir, max_model_len=128, max_num_seqs=4, dtype="float32", seed=0,
              gpu_memory_utilization=0.5)
    res["prepack_moe_weight"] = hasattr(torch.ops._C, "prepack_moe_weight")
    patch = REGISTRY.patches[PATCH]
    res["state"] = patch.outcome.state
    res["moe_paths"] = _moe_paths(_model(llm))
    sp = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    res["tokens"] = [o.outputs[0].token_ids[0] for o in outs]
    res["logprobs"] = [o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob for o in outs]
    REGISTRY.revert(patch)  # vLLM's own table again: the upstream behaviour
    try:
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], sp, use_tqdm=False)
        res["unpatched_error"] = None
    except Exception as exc:  # noqa: BLE001 - the test asserts which error
        res["unpatched_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return res


def reference(model_dir: str) -> dict:
    """Hugging Face transformers, float32: the greedy next token and its log-prob per prompt."""
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokens, logprobs = [], []
    with torch.no_grad():
        for p in PROMPTS:
            lp = torch.log_softmax(hf(torch.tensor([p])).logits[0, -1].float(), dim=-1)
            tokens.append(int(lp.argmax()))
            logprobs.append(float(lp.max()))
    return {"tokens": tokens, "logprobs": logprobs}
