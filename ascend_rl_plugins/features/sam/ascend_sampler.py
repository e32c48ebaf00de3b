"""Recovered-token sampling for model-free drafts (SAM, n-gram) under vLLM-Ascend 0.23's
"reduce sampling", without a per-token Python loop.

Why: vLLM-Ascend's PyTorch rejection sampler (used wherever Triton is unavailable) is
vectorized except in one place that every SAM/n-gram draft goes through when reduce
sampling is on (target probabilities restricted to a candidate set, ``target_indices``):
zeroing each draft token among its candidates loops over the draft tokens in Python and
compares a device scalar per token (one host sync per draft token per step). The Qwen3
RL recipe replaced vLLM-Ascend's loop-based sampler by tensor code for a ~10x cut in its
overhead (its figure); vLLM-Ascend 0.13/0.23 have since vectorized the rest themselves
(checked statically in ``tests/features/sam/test_ascend_sampler.py``), so this is the
remaining piece.

Both functions below compute exactly what vLLM-Ascend's ``sample_recovered_tokens_pytorch``
and ``sample_recovered_tokens_blockwise_pytorch`` compute for ``IS_NGRAM`` with
``enable_reduce_sampling`` (same arithmetic in the same order, so the same bits); the
test runs the real upstream functions, compiled from vLLM-Ascend's source, side by side.
"""

from __future__ import annotations

PLACEHOLDER = -1  # vllm.v1.sample.rejection_sampler.PLACEHOLDER_TOKEN_ID
_TINY = 1e-10
_NEG = -1e10


def _request_of_token(cu_num_draft_tokens, num_tokens, device):
    """Request index of every flattened draft token (0 for tokens past the last request)."""
    import torch
    t = torch.arange(num_tokens, device=device)
    req = torch.searchsorted(cu_num_draft_tokens, t, right=True)
    req = torch.where(req < cu_num_draft_tokens.shape[0], req, torch.zeros_like(req))
    return t, req


def _pick(output_token_ids, weights, q, req, target_indices):
    """argmax over candidates of weights / q (q == 0 or inf never wins), as a global token id."""
    import torch
    qv = q[req]
    bad = (qv == 0) | torch.isinf(qv)
    safe = torch.where(bad, torch.full_like(qv, _TINY), qv)
    score = torch.where(bad, torch.full_like(weights, _NEG), weights / safe)
    best = torch.argmax(score, dim=1)
    rows = torch.arange(best.shape[0], device=best.device)
    output_token_ids[:] = target_indices[rows, best]


def _without_drafts(target_probs, draft_token_ids, target_indices):
    """target_probs with each row's draft token zeroed among its candidates (a placeholder,
    -1, matches no candidate index)."""
    return target_probs.masked_fill(target_indices == draft_token_ids[:, None], 0)


def recovered_tokens_ngram_reduced(output_token_ids, cu_num_draft_tokens, draft_token_ids,
                                   target_probs, q, target_indices):
    """``sample_recovered_tokens_pytorch(..., IS_NGRAM=True, enable_reduce_sampling=True)``."""
    n = output_token_ids.shape[0]
    if n == 0:
        return
    _, req = _request_of_token(cu_num_draft_tokens, n, output_token_ids.device)
    _pick(output_token_ids, _without_drafts(target_probs, draft_token_ids, target_indices), q,
          req, target_indices)


def recovered_tokens_ngram_reduced_blockwise(output_token_ids, cu_num_draft_tokens,
                                             draft_token_ids, target_probs, q, target_indices):
    """``sample_recovered_tokens_blockwise_pytorch(..., IS_NGRAM=True,
    enable_reduce_sampling=True)``: the residual is scaled by the probability that the block
    was accepted up to this position (a draft without probabilities counts as p = 1)."""
    import torch
    n = output_token_ids.shape[0]
    if n == 0:
        return
    device = output_token_ids.device
    t, req = _request_of_token(cu_num_draft_tokens, n, device)
    starts = torch.cat([torch.zeros(1, dtype=cu_num_draft_tokens.dtype, device=device),
                        cu_num_draft_tokens[:-1]])
    pos = t - starts[req]
    spec_len = int((cu_num_draft_tokens - starts).max().item())
    # target probability of each draft token (its candidate slot, 0 when absent) over p_draft = 1
    ratio = torch.where(target_indices == draft_token_ids[:, None], target_probs,
                        torch.zeros((), dtype=target_probs.dtype, device=device)).sum(dim=1)
    grid = torch.ones(cu_num_draft_tokens.shape[0], spec_len, device=device, dtype=torch.float32)
    grid[req, pos] = ratio
    prefix = torch.ones(cu_num_draft_tokens.shape[0], spec_len + 1, device=device,
                        dtype=torch.float32)
    for k in range(spec_len):  # over draft positions (k <= num_speculative_tokens), not tokens
        prefix[:, k + 1] = (prefix[:, k] * grid[:, k]).clamp(max=1.0)
    scale = prefix[req, pos][:, None]
    residual = torch.clamp(scale * _without_drafts(target_probs, draft_token_ids, target_indices),
                           min=0.0)
    _pick(output_token_ids, residual, q, req, target_indices)
