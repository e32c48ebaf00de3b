"""Double of ``ringattn_context_parallel`` (MindSpeed 028de58, same signature).

What it mirrors: the entry point MindSpeed's context-parallel attention calls with a
``cp_para`` dict, and how that dict drives the ring -- ``rank`` and ``cp_size`` say which
load-balanced chunks of every packed sequence this rank holds (chunks ``rank`` and
``2*cp_size - 1 - rank`` of ``cu_seqlens_q_padded // cp_size`` per sequence), the ring is
``cp_outer_ranks`` (default ``cp_global_ranks``) over ``cp_group`` and
``cp_group_for_send_recv_overlap`` through ``RingP2P``. What it computes: forward-only causal
attention of packed ``[tokens, heads, dim]`` q/k/v, every K/V block gathered around the ring
(``cp_size - 1`` exchanges), exact softmax -- not MindSpeed's fused NPU kernels, online
softmax, two-level windows or backward.
"""

import math

import torch

from mindspeed.core.context_parallel.utils import RingP2P

LAST_RINGS = []  # the RingP2P objects of the last call (tests inspect what they posted)


def _local_positions(cu_seqlens_padded, cp_size, rank):
    rows, pos = [], []
    bounds = cu_seqlens_padded.tolist()
    for i in range(len(bounds) - 1):
        full = bounds[i + 1] - bounds[i]
        chunk = full // (2 * cp_size)
        for c in (rank, 2 * cp_size - 1 - rank) if cp_size > 1 else (0,):
            width = chunk if cp_size > 1 else full
            start = c * chunk if cp_size > 1 else 0
            rows.extend([i] * width)
            pos.extend(range(start, start + width))
    return torch.tensor(rows), torch.tensor(pos)


def ringattn_context_parallel(q, k, v, n, cp_para, softmax_scale=None, attn_mask=None, dropout_p=0.,
                              packed_seq_params=None, shapes=None):
    rank, cp_size = cp_para["rank"], cp_para["cp_size"]
    ring_ranks = cp_para.get("cp_outer_ranks", cp_para["cp_global_ranks"])
    ring = RingP2P(ring_ranks, cp_para["cp_group"], cp_para.get("cp_group_for_send_recv_overlap"))
    LAST_RINGS[:] = [ring]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    cu = packed_seq_params.cu_seqlens_q_padded
    q_rows, q_pos = _local_positions(cu, cp_size, rank)
    kv = torch.stack([k, v]).contiguous()
    blocks = [(rank, kv)]
    for step in range(1, cp_size):
        received = torch.empty_like(kv)
        ring.async_send_recv(kv, received)
        ring.wait()
        kv = received
        blocks.append(((rank - step) % cp_size, kv))
    keys, values, allowed = [], [], []
    for origin, block in blocks:
        k_rows, k_pos = _local_positions(cu, cp_size, origin)
        keys.append(block[0])
        values.append(block[1])
        allowed.append((q_rows[:, None] == k_rows[None, :]) & (k_pos[None, :] <= q_pos[:, None]))
    scores = torch.einsum("qhd,khd->hqk", q, torch.cat(keys)) * scale
    scores = scores.masked_fill(~torch.cat(allowed, dim=1)[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), torch.cat(values))
