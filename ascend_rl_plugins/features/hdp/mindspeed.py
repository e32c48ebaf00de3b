"""MindSpeed ring attention over the sub-ring of an HDP plan group.

MindSpeed's ``ringattn_context_parallel(q, k, v, n, cp_para, ...)`` runs ring attention over
what ``cp_para`` names: ``rank``/``cp_size`` (which zigzag chunks this rank holds, how
``cu_seqlens`` is divided), ``cp_global_ranks`` / ``cp_outer_ranks`` / ``cp_dkv_outer_ranks``
(the forward and backward rings) and ``cp_inner_ranks`` (the intra-window ring of its
two-level scheme). Under a plan, :func:`sub_ring_cp_para` returns a *copy* of ``cp_para``
for this rank's group: position and size in the group, the group's global ranks as the
outer rings, and an inner window of this rank alone (so the two-level scheme degenerates to
the plain ring over the group; the seed left the inner window at the full CP group's).
Point-to-point traffic keeps using the CP group's communicators (``cp_group`` and its
overlap group), which hold every member of the sub-ring. The dict MindSpeed built is not
mutated (the seed rewrote it in place).

``RingP2P.__init__``: even ring ranks send first and receive on the overlap group, odd ones
receive first on ``group`` and send on the overlap group. In a ring of odd length the last
rank is even as well, so ring rank 0 receives on the overlap group from a predecessor that
sends on ``group`` -- a send and a receive on different communicators, which never meet. A
ring of odd length arises only from a sub-ring (HDP groups of 3, 5, ... ranks), so the fix
is scoped to that case: an even ring rank whose predecessor is even receives on ``group``.
"""

from __future__ import annotations

from .layout import layout_of


def sub_ring_cp_para(cp_para: dict, layout) -> dict:
    """``cp_para`` for this rank's plan group (a new dict)."""
    ranks = list(cp_para["cp_global_ranks"])
    if len(ranks) != layout.cp_size:
        raise ValueError(f"cp_para names {len(ranks)} CP ranks, the HDP plan {layout.cp_size}")
    if int(cp_para["rank"]) != layout.cp_rank:
        raise ValueError(f"cp_para rank {cp_para['rank']} is not the plan's CP rank {layout.cp_rank}")
    members = [ranks[r] for r in layout.group]
    out = dict(cp_para)
    out.update(rank=layout.position, cp_size=layout.group_size, cp_global_ranks=members,
               cp_outer_ranks=members, cp_dkv_outer_ranks=members, cp_inner_ranks=[ranks[layout.cp_rank]])
    return out


def packed_layout(packed_seq_params):
    if packed_seq_params is None:
        return None
    return (layout_of(getattr(packed_seq_params, "cu_seqlens_q_padded", None))
            or layout_of(getattr(packed_seq_params, "cu_seqlens_q", None)))


def before_ringattn(instance, args, kwargs):
    """Before ``ringattn_context_parallel(q, k, v, n, cp_para, softmax_scale, attn_mask, dropout_p,
    packed_seq_params, shapes)``: the sub-ring ``cp_para`` when the packed params carry a plan."""
    packed = args[8] if len(args) > 8 else kwargs.get("packed_seq_params")
    layout = packed_layout(packed)
    if layout is None or layout.is_all_cp:
        return args, kwargs
    if len(args) > 4:
        args = tuple(args[:4]) + (sub_ring_cp_para(args[4], layout),) + tuple(args[5:])
    else:
        kwargs = dict(kwargs, cp_para=sub_ring_cp_para(kwargs["cp_para"], layout))
    return args, kwargs


def overlap_group_fix(ring_p2p, ring_global_ranks) -> None:
    """Receive on ``group`` on an even ring rank whose predecessor is even (odd rings)."""
    ranks = list(ring_global_ranks)
    if len(ranks) % 2 == 0:
        return
    prev_ring_rank = ranks.index(ring_p2p.prev)
    if ring_p2p.ring_rank % 2 == 0 and prev_ring_rank % 2 == 0:
        ring_p2p.group_for_send_recv_overlap = ring_p2p.group


def after_ring_p2p_init(result, instance, args, kwargs):
    ranks = args[0] if args else kwargs["ring_global_ranks"]
    overlap_group_fix(instance, ranks)
    return result
