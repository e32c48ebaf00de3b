"""HDP on MindSpeed's ring-attention interface, against the MindSpeed double, 4 gloo processes.

Run on every rank at the end of parity_scenario.run (test_runtime_parity.py). The double
(tests/doubles/mindspeed_double: ``ringattn_context_parallel`` and ``RingP2P``, signatures
compared with MindSpeed 028de58) is put on ``sys.path`` in these child processes only.

1. The communicators each rank of a 3-rank ring (an HDP group of 3) would post its send and
   receive on, forward and backward, from stock ``RingP2P`` and with ``hdp.mindspeed_odd_ring``.
2. ``ringattn_context_parallel`` patched by ``hdp.mindspeed_ring_cp_para``, called with the
   ``cp_para`` MindSpeed's attention builds for the whole CP group of 4 and packed params
   carrying the plan ((0, 1, 2), (3,)): every rank's output equals causal attention of whole
   rows; the caller's ``cp_para`` is left as it was. The 3-rank ring really exchanges K/V on
   gloo, so without the odd-ring fix this part would hang.
"""

from __future__ import annotations

import math
import sys

from tests.features.hdp.parity_scenario import HEAD_DIM, HEADS, LEFT_PAD, PLANS, ROWS, SEQ_LEN

RING = [0, 1, 2]


def _sides(ring_p2p, group, overlap) -> dict:
    """Where this rank's send and receive go, by communicator name."""
    name = {id(group): "group", id(overlap): "overlap"}
    even = ring_p2p.ring_rank % 2 == 0
    send_on = ring_p2p.group if even else ring_p2p.group_for_send_recv_overlap
    recv_on = ring_p2p.group_for_send_recv_overlap if even else ring_p2p.group
    return {"next": ring_p2p.next, "prev": ring_p2p.prev, "send_on": name[id(send_on)], "recv_on": name[id(recv_on)]}


def _protocol(utils, group, overlap) -> dict:
    import torch.distributed as dist
    if dist.get_rank() not in RING:
        return {}
    return {"forward": _sides(utils.RingP2P(RING, group, overlap), group, overlap),
            "backward": _sides(utils.RingP2P(RING, group, overlap, is_backward=True), group, overlap)}


def run(double_root: str) -> dict:
    import torch
    import torch.distributed as dist

    if double_root not in sys.path:
        sys.path.insert(0, double_root)
    from mindspeed.core.context_parallel import utils
    from mindspeed.core.context_parallel.ring_context_parallel import ring_context_parallel as ring_mod

    from ascend_rl_plugins.features import hdp
    from ascend_rl_plugins.features.hdp.layout import HdpLayout
    from ascend_rl_plugins.features.hdp.verl_packing import pack, packed_seq_params_for
    from ascend_rl_plugins.patching.core import REGISTRY

    torch.set_num_threads(1)
    rank = dist.get_rank()
    group = dist.group.WORLD
    overlap = dist.new_group([0, 1, 2, 3])  # MindSpeed's second CP communicator for send/recv overlap
    out = {"stock": _protocol(utils, group, overlap)}
    patches = [p for p in hdp.FEATURE.patches if p.name.startswith("hdp.mindspeed")]
    REGISTRY.activate(only=patches)
    out["patch_states"] = {p.name: p.outcome.state for p in patches}
    out["patched"] = _protocol(utils, group, overlap)

    groups, group_of = PLANS["odd_and_single"]
    layout = HdpLayout(ROWS, groups, group_of, rank)
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(3, len(ROWS), SEQ_LEN, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    mask = torch.zeros(len(ROWS), SEQ_LEN, dtype=torch.bool)
    for i, (n, left) in enumerate(zip(ROWS, LEFT_PAD)):
        mask[i, left:left + n] = True
    q, k, v = (pack(t, mask, layout)[0] for t in qkv)
    params = packed_seq_params_for(layout, q.device)
    cp_para = {"causal": True, "cp_group": group, "cp_size": 4, "rank": rank, "cp_global_ranks": [0, 1, 2, 3],
               "cp_group_for_send_recv_overlap": overlap, "cp_inner_ranks": [0, 1, 2, 3],
               "cp_outer_ranks": [0, 1, 2, 3], "cp_dkv_outer_ranks": [0, 1, 2, 3]}
    before = dict(cp_para)
    got = ring_mod.ringattn_context_parallel(q, k, v, HEADS, cp_para, 1 / math.sqrt(HEAD_DIM), None, 0.0, params)
    out["cp_para_unchanged"] = cp_para == before
    out["ring_used"] = {"ring_rank": ring_mod.LAST_RINGS[0].ring_rank, "next": ring_mod.LAST_RINGS[0].next,
                        "prev": ring_mod.LAST_RINGS[0].prev}

    # reference: whole rows, causal softmax, at this rank's (row, position) tokens
    rows, pos = layout.positions()
    worst = 0.0
    for i in set(rows):
        n = ROWS[i]
        cols = torch.nonzero(mask[i]).squeeze(1)
        qi, ki, vi = (t[i][cols] for t in qkv)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vi)
        for j, (r, p) in enumerate(zip(rows, pos)):
            if r == i and p < n:
                worst = max(worst, float((got[j] - ref[p]).abs().max()))
    out["max_error"] = worst
    out["tokens"] = len(rows)
    for p in patches:
        REGISTRY.revert(p)
    return out
