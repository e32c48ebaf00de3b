"""Child-process scenario of ``tests/test_every_feature.py``: a real Megatron-Core GPTModel
built, run forward and backward, in a process where every feature is switched on (one rank
of a gloo group, as the CPU Megatron harness needs)."""

from __future__ import annotations


def megatron_model_with_every_feature_on() -> dict:
    """Activate (the environment switches everything on), build a GPTModel, one
    forward/backward; return the loss and the states of the patches on Megatron-Core."""
    import math

    import ascend_rl_plugins
    from ascend_rl_plugins.patching.core import REGISTRY
    from tests.support.megatron import megatron_model

    ascend_rl_plugins.activate("test: every feature on")
    with megatron_model(layers=1) as h:
        loss = h.loss(h.tokens(batch=2, seed=0))
        loss.backward()
        value = float(loss.detach())
    megatron = {p.name: p.outcome.state for p in REGISTRY.patches.values() if p.dist == "megatron-core"}
    return {"loss": value, "finite": math.isfinite(value), "megatron_patches": megatron,
            "failed": {p.name: p.outcome.reason for p in REGISTRY.patches.values()
                       if p.outcome.state == "failed"}}


def vllm_engine_with_every_feature_on(model_path: str) -> dict:
    """A real vLLM engine (in-process engine core, as verl 0.6's rollout runs it) started with
    every feature switched on, the plugin loaded by vLLM's own general-plugin loader; one
    greedy generation. Returns the tokens generated and the states of the vLLM patches."""
    from vllm import LLM, SamplingParams

    import ascend_rl_plugins
    llm = LLM(model=model_path, enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0)
    out = llm.generate(["hello world"], SamplingParams(max_tokens=8, temperature=0))
    states = {s["patch"]: s["state"] for s in ascend_rl_plugins.status() if s["target"].startswith("vllm.")}
    return {"tokens": len(out[0].outputs[0].token_ids), "activated_by": ascend_rl_plugins.plugin.activated_by(),
            "applied": sorted(p for p, s in states.items() if s == "applied"),
            "failed": {s["patch"]: s["reason"] for s in ascend_rl_plugins.status() if s["state"] == "failed"}}
