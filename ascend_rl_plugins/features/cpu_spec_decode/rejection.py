"""Vectorized PyTorch rejection sampling (greedy and random) for CPU speculative decoding.

vLLM 0.13's rejection sampler is written as Triton kernels launched per request, which do
not run on a CPU-only host. This is the same algorithm (Leviathan et al., 2023: accept a
draft token with probability min(1, p_target / p_draft); on the first rejection emit a
token from the residual distribution; if all drafts pass, emit the bonus token) written
as whole-batch tensor operations: the drafts of all requests are laid out in a padded
[batch, max_spec_len] grid and the first rejection of each row is found with a cumulative
product, so there is no per-request Python loop. The same code serves as the vectorized
sampler offered to vLLM-Ascend (its sampler there loops over requests in Python).

Output layout matches vLLM: int32 [batch, max_spec_len + 1], PLACEHOLDER (-1) padded.
"""

from __future__ import annotations

import torch

PLACEHOLDER_TOKEN_ID = -1
GREEDY_TEMPERATURE = 0


def _grid(num_draft_tokens, max_spec_len: int, device):
    """Row/column of every flat draft token, and the [B, S] validity mask."""
    counts = torch.as_tensor(num_draft_tokens, dtype=torch.long, device=device)
    batch = counts.numel()
    req = torch.repeat_interleave(torch.arange(batch, device=device), counts)
    starts = torch.cumsum(counts, 0) - counts
    col = torch.arange(req.numel(), device=device) - starts[req]
    valid = torch.arange(max_spec_len, device=device)[None, :] < counts[:, None]
    return counts, req, col, valid


def _scatter(values: torch.Tensor, req, col, batch: int, width: int, fill) -> torch.Tensor:
    out = torch.full((batch, width), fill, dtype=values.dtype, device=values.device)
    out[req, col] = values
    return out


def _accept_prefix(accepted: torch.Tensor) -> torch.Tensor:
    """Number of leading True per row."""
    return torch.cumprod(accepted.to(torch.int32), dim=1).sum(dim=1)


def recovered_token_ids(num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                        generators: dict, req, device) -> torch.Tensor:
    """Sample from the residual max(p_target - p_draft, 0) (p_draft = one-hot of the draft
    when there are no draft probabilities) by the exponential race argmax(p / q),
    one q ~ Exp(1) per request and vocabulary entry (as vLLM does)."""
    batch = len(num_draft_tokens)
    vocab = target_probs.shape[-1]
    q = torch.empty((batch, vocab), dtype=torch.float32, device=device)
    q.exponential_()
    for i, gen in generators.items():
        if i < batch and num_draft_tokens[i] > 0:
            q[i].exponential_(generator=gen)
    if draft_probs is None:
        residual = target_probs.clone()
        residual.scatter_(1, draft_token_ids.long()[:, None], 0.0)
    else:
        residual = (target_probs - draft_probs).clamp_min_(0.0)
    return (residual / q[req]).argmax(dim=-1)


def rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens, max_spec_len: int,
                     cu_num_draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, bonus_token_ids: torch.Tensor,
                     sampling_metadata, uniform_probs_fn=None) -> torch.Tensor:
    """Whole-batch rejection sampling; the argument list is vLLM 0.13's ``rejection_sample``."""
    device = target_probs.device
    batch = len(num_draft_tokens)
    out = torch.full((batch, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32,
                     device=device)
    if batch == 0:
        return out
    counts, req, col, valid = _grid(num_draft_tokens, max_spec_len, device)
    rows = torch.arange(batch, device=device)
    bonus = bonus_token_ids.reshape(batch).to(torch.int32)
    draft = _scatter(draft_token_ids.to(torch.int32), req, col, batch, max_spec_len, -1)

    def finish(accepted_grid: torch.Tensor, emitted_grid: torch.Tensor, row_mask):
        n_acc = _accept_prefix(accepted_grid & valid)  # [B]
        width = torch.arange(max_spec_len, device=device)[None, :]
        keep = (width <= n_acc[:, None]) & valid  # accepted drafts + the first rejection
        res = torch.where(keep, emitted_grid, torch.full_like(emitted_grid, PLACEHOLDER_TOKEN_ID))
        full = torch.cat([res, torch.full((batch, 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32,
                                          device=device)], dim=1)
        all_ok = n_acc == counts
        full[rows[all_ok], counts[all_ok]] = bonus[all_ok]
        out[row_mask] = full[row_mask]

    all_greedy = bool(getattr(sampling_metadata, "all_greedy", True))
    all_random = bool(getattr(sampling_metadata, "all_random", False))
    if all_greedy:
        is_greedy = torch.ones(batch, dtype=torch.bool, device=device)
    else:
        is_greedy = sampling_metadata.temperature[:batch] == GREEDY_TEMPERATURE
    if not all_random:
        argmax = _scatter(target_probs.argmax(dim=-1).to(torch.int32), req, col, batch,
                          max_spec_len, -1)
        finish(draft == argmax, argmax, is_greedy)
        if all_greedy:
            return out
    # random sampling rows
    num_tokens = draft_token_ids.shape[0]
    if uniform_probs_fn is not None:
        uniform = uniform_probs_fn(num_tokens, list(num_draft_tokens),
                                   sampling_metadata.generators, device)
    else:
        uniform = torch.rand(num_tokens, dtype=torch.float64, device=device)
    flat_ids = draft_token_ids.long()
    tok = torch.arange(num_tokens, device=device)
    target_p = target_probs[tok, flat_ids].to(torch.float64)
    if draft_probs is None:
        ok = target_p >= uniform
    else:
        draft_p = draft_probs[tok, flat_ids].to(torch.float64)
        ok = (draft_p > 0) & (target_p >= uniform * draft_p)
    recovered = recovered_token_ids(list(num_draft_tokens), draft_token_ids, draft_probs,
                                    target_probs, sampling_metadata.generators, req, device)
    accepted = _scatter(ok, req, col, batch, max_spec_len, False)
    emitted_flat = torch.where(ok, draft_token_ids.to(torch.int32), recovered.to(torch.int32))
    emitted = _scatter(emitted_flat, req, col, batch, max_spec_len, -1)
    finish(accepted, emitted, ~is_greedy)
    return out


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """[a, b, c] with cu=[2, 5, 6] -> [a, a, b, b, b, c], ``replace_from`` -> ``replace_to``."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    out = torch.repeat_interleave(x, counts)
    if out.numel() != num_tokens:
        raise ValueError(f"expand_batch_to_tokens: counts sum to {out.numel()}, expected {num_tokens}")
    return out
