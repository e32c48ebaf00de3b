"""vLLM's own rejection-sampling functions on CPU tensors, with cpu_spec_decode's patches and
after reverting them (run in a child process by test_vllm_sampler_on_cpu.py).

The targets are one-hot (0.13 takes probabilities, 0.23 logits: a one-hot of 60, i.e.
probability ~1e-26 elsewhere), so even the random path's outcome is certain: a draft token
is accepted exactly where the target is that token, and a rejected one is replaced by the
target's token; the expected output needs no random numbers.
"""

from __future__ import annotations

from types import SimpleNamespace

PLACEHOLDER = -1
VOCAB = 16
# request 0 greedy, requests 1 and 2 random; (draft tokens, target token per position)
REQUESTS = [([3, 5], [3, 6]), ([1, 2, 4], [1, 2, 4]), ([7], [0])]
BONUS = [9, 10, 11]
TEMPERATURE = [0.0, 1.0, 1.0]
TOP_K = [5, 0, 3]  # int32, as vLLM keeps it
EXPECTED = [[3, 6, PLACEHOLDER, PLACEHOLDER], [1, 2, 4, 10],
            [0, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER]]
EXPECTED_TOP_K = [5, 5, 0, 0, 0, 3]


def _outcome(fn):
    try:
        return {"ok": True, "value": fn()}
    except Exception as exc:  # what stock vLLM does on CPU without the patch
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def _sample(rs, takes_logits: bool):
    import torch
    counts = [len(d) for d, _ in REQUESTS]
    drafts = torch.tensor([t for d, _ in REQUESTS for t in d], dtype=torch.int32)
    target = torch.zeros(len(drafts), VOCAB)
    target[torch.arange(len(drafts)), torch.tensor([t for _, ts in REQUESTS for t in ts])] = \
        60.0 if takes_logits else 1.0
    cu = torch.cumsum(torch.tensor(counts, dtype=torch.int32), 0, dtype=torch.int32)
    meta = SimpleNamespace(all_greedy=False, all_random=False, temperature=torch.tensor(TEMPERATURE),
                           generators={}, top_k=None, top_p=None)
    bonus = torch.tensor(BONUS, dtype=torch.int32).view(-1, 1)
    out = rs.rejection_sample(drafts, counts, max(counts), cu, None, target, bonus, meta)
    return out.tolist()


def _expand(rs):
    import torch
    cu = torch.cumsum(torch.tensor([len(d) for d, _ in REQUESTS]), 0, dtype=torch.int32)
    return rs.expand_batch_to_tokens(torch.tensor(TOP_K, dtype=torch.int32), cu, int(cu[-1])).tolist()


def _bind_cpu_kernels() -> None:
    """What vLLM 0.23's CPU model runner does at start: point the sampler at the CPU kernel
    shims (0.13's CPU runner has no such step: it refuses speculative decoding)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    bind = getattr(CPUModelRunner, "_postprocess_triton", None)
    if bind is not None:
        bind(None)  # uses module globals only


def run() -> dict:
    import inspect

    from ascend_rl_plugins import plugin
    from ascend_rl_plugins.features import cpu_spec_decode
    from ascend_rl_plugins.patching.core import REGISTRY
    plugin.activate("test")
    from vllm.v1.sample import rejection_sampler as rs
    takes_logits = "target_logits" in inspect.signature(rs.rejection_sample).parameters
    out = {}
    for state in ("patched", "unpatched"):
        if state == "unpatched":
            for p in cpu_spec_decode.FEATURE.patches:
                REGISTRY.revert(p)
        _bind_cpu_kernels()
        out[state] = {"sample": _outcome(lambda: _sample(rs, takes_logits)),
                      "expand": _outcome(lambda: _expand(rs)),
                      "applied": sorted(p.name for p in cpu_spec_decode.FEATURE.patches
                                        if p.outcome.state == "applied")}
    return out
