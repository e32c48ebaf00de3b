"""Causal attention of packed sequences over a sub-ring of CP ranks (CPU / any backend).

Each rank of a group of size ``g`` holds, for every sequence of the group, the zigzag chunks
``p`` and ``2g - 1 - p`` of its queries, keys and values (:mod:`.layout`). Keys and values
travel ``g - 1`` steps around the group's ring (``isend`` to the next rank, ``irecv`` from
the previous one, on the group's own process group); each arriving block is merged into the
running result with the online-softmax rule (running max, running sum, rescaled
accumulator). Causality and sequence boundaries come from the token positions, which every
rank derives from the plan for the block's origin -- only keys and values move.

The ring shift is an autograd function (backward sends the gradient the opposite way), so
the gradients of every rank's queries, keys and values are exact without a hand-written
backward. This is the reference implementation the MindSpeed ``cp_para`` rewrite
(:mod:`.mindspeed`) is held to, and what the CPU parity test runs; on an NPU MindSpeed's
fused ring attention does the work.
"""

from __future__ import annotations

import math


def _ring_shift_function():
    import torch
    import torch.distributed as dist

    class RingShift(torch.autograd.Function):
        """Send ``x`` to ``next_rank``, return what ``prev_rank`` sent (same shape)."""

        @staticmethod
        def forward(ctx, x, next_rank, prev_rank, group):
            ctx.ring = (next_rank, prev_rank, group)
            return _exchange(x.contiguous(), next_rank, prev_rank, group)

        @staticmethod
        def backward(ctx, grad):
            next_rank, prev_rank, group = ctx.ring
            return _exchange(grad.contiguous(), prev_rank, next_rank, group), None, None, None

    def _exchange(x, send_to, recv_from, group):
        out = torch.empty_like(x)
        ops = [dist.isend(x, send_to, group=group), dist.irecv(out, recv_from, group=group)]
        for op in ops:
            op.wait()
        return out

    return RingShift


_RING_SHIFT = None


def ring_shift(x, next_rank: int, prev_rank: int, group):
    global _RING_SHIFT
    if _RING_SHIFT is None:
        _RING_SHIFT = _ring_shift_function()
    return _RING_SHIFT.apply(x, next_rank, prev_rank, group)


def sub_ring_attention(q, k, v, layout, group_global_ranks, process_group, softmax_scale=None):
    """Causal attention of this rank's packed ``q``/``k``/``v`` (``[tokens, heads, dim]``) over
    the ring of its plan group.

    ``layout``: this rank's :class:`~.layout.HdpLayout` for the micro-batch;
    ``group_global_ranks``: the group's global ranks in position order; ``process_group``:
    the group's process group (:func:`.groups.sub_group`). Returns ``[tokens, heads, dim]``.
    Padding tokens come after a row's real tokens, so no real query attends to them."""
    import torch

    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    group = layout.group
    g, p = len(group), layout.position
    device = q.device

    def token_meta(cp_rank):
        return layout.token_index(cp_rank, device=device)

    q_rows, q_pos = token_meta(layout.cp_rank)
    kv = torch.stack([k, v])
    running_max = running_sum = acc = None
    nxt = group_global_ranks[(p + 1) % g]
    prv = group_global_ranks[(p - 1) % g]
    for step in range(g):
        if step:
            kv = ring_shift(kv, nxt, prv, process_group)
        origin = group[(p - step) % g]
        k_rows, k_pos = token_meta(origin)
        # padding sits at the end of a row, so causality alone keeps it from real queries
        allowed = (q_rows[:, None] == k_rows[None, :]) & (k_pos[None, :] <= q_pos[:, None])
        scores = torch.einsum("qhd,khd->hqk", q, kv[0]) * scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        # step 0 is the rank's own block: every query sees at least itself, so the running
        # max is finite from then on and later fully masked rows contribute exp(-inf) = 0
        block_max = scores.amax(dim=-1).detach()
        new_max = block_max if running_max is None else torch.maximum(running_max, block_max)
        weights = torch.exp(scores - new_max[..., None])
        block_sum = weights.sum(dim=-1)
        block_out = torch.einsum("hqk,khd->hqd", weights, kv[1])
        if running_max is None:
            running_sum, acc = block_sum, block_out
        else:
            correction = torch.exp(running_max - new_max)
            running_sum = running_sum * correction + block_sum
            acc = acc * correction[..., None] + block_out
        running_max = new_max
    out = acc / running_sum[..., None]
    return out.permute(1, 0, 2)
