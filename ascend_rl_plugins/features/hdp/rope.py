"""RoPE for a packed sequence split over a sub-group of the CP ranks.

Megatron-Core's THD RoPE gives each rank the rotary frequencies of its two zigzag chunks,
computed from *one* (cp size, cp rank) for the whole packed micro-batch: 0.12 reads them
from ``parallel_state`` inside ``_apply_rotary_pos_emb_thd``, 0.16 from the ``cp_group``
that ``apply_rotary_pos_emb`` receives. Under an HDP plan a rank computes its group's rows
with the group's size and its position in it, so:

- Megatron-Core 0.12 (recipe): ``_apply_rotary_pos_emb_thd`` is wrapped; when the
  ``cu_seqlens`` it gets carries a layout (:mod:`.layout`), the frequencies of each row are
  taken with Megatron's own ``_get_thd_freqs_on_this_cp_rank(position, group_size, ...)``
  and applied with Megatron's ``_apply_rotary_pos_emb_bshd`` -- the same two functions the
  stock code calls, with the group's numbers instead of the global ones. MindSpeed's own
  ``apply_rotary_pos_emb`` reaches this through ``rope_utils._apply_rotary_pos_emb_thd``.
- Megatron-Core 0.16 (current): ``apply_rotary_pos_emb`` is wrapped; with a layout the
  ``cp_group`` argument becomes the group's process group, and everything else (the unfused
  path, and TransformerEngine's fused THD kernel, which takes ``cp_size``/``cp_rank`` from
  that group) is stock.

Without a layout both wrappers call the stock function unchanged.
"""

from __future__ import annotations

from .groups import global_ranks, sub_group
from .layout import layout_of


def _arg(args, kwargs, index, name, default=None):
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def rope_thd_for_group(t, cu_seqlens, freqs, group_size: int, position: int, *, rotary_interleaved=False,
                       multi_latent_attention=False, mscale=1.0):
    """THD RoPE of this rank's packed rows, each split over a group of ``group_size`` ranks of
    which this rank is ``position``; built from Megatron-Core 0.12's own helpers."""
    import torch
    from megatron.core.models.common.embeddings import rope_utils

    seqlens = ((cu_seqlens[1:] - cu_seqlens[:-1]) // group_size).tolist()
    pieces = torch.split(t, seqlens)
    freqs_packed = torch.cat([rope_utils._get_thd_freqs_on_this_cp_rank(position, group_size, x, freqs)
                              for x in pieces])
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1), freqs_packed, rotary_interleaved=rotary_interleaved,
        multi_latent_attention=multi_latent_attention, mscale=mscale).squeeze(1)


def wrap_rope_thd_0_12(wrapped, instance, args, kwargs):
    """``_apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention,
    mscale)`` of Megatron-Core 0.12 with the plan's group size and position."""
    cu_seqlens = _arg(args, kwargs, 1, "cu_seqlens")
    layout = layout_of(cu_seqlens)
    if layout is None:
        return wrapped(*args, **kwargs)
    return rope_thd_for_group(
        _arg(args, kwargs, 0, "t"), cu_seqlens, _arg(args, kwargs, 2, "freqs"), layout.group_size,
        layout.position, rotary_interleaved=_arg(args, kwargs, 3, "rotary_interleaved", False),
        multi_latent_attention=_arg(args, kwargs, 4, "multi_latent_attention", False),
        mscale=_arg(args, kwargs, 5, "mscale", 1.0))


def wrap_apply_rope_0_12(wrapped, instance, args, kwargs):
    """``apply_rotary_pos_emb(t, freqs, config, cu_seqlens, mscale)`` of Megatron-Core 0.12: with a
    split plan, THD RoPE runs unfused (through the patched ``_apply_rotary_pos_emb_thd``),
    because 0.12's fused THD kernel is given the global CP size and rank."""
    cu_seqlens = _arg(args, kwargs, 3, "cu_seqlens")
    layout = layout_of(cu_seqlens)
    config = _arg(args, kwargs, 2, "config")
    if layout is None or layout.is_all_cp or not getattr(config, "apply_rope_fusion", False):
        return wrapped(*args, **kwargs)
    from megatron.core.models.common.embeddings import rope_utils
    return rope_utils._apply_rotary_pos_emb_thd(
        _arg(args, kwargs, 0, "t"), cu_seqlens, _arg(args, kwargs, 1, "freqs"),
        rotary_interleaved=config.rotary_interleaved, multi_latent_attention=config.multi_latent_attention,
        mscale=_arg(args, kwargs, 4, "mscale", 1.0))


def group_process_group(layout, cp_group=None):
    """The process group of this rank's plan group; CP ranks are mapped to global ranks
    through ``cp_group`` (default: Megatron's context-parallel group)."""
    import torch.distributed as dist

    if cp_group is None:
        from megatron.core import parallel_state
        cp_group = parallel_state.get_context_parallel_group()
    ranks = dist.get_process_group_ranks(cp_group)
    return sub_group(global_ranks(layout.group, ranks))


def wrap_apply_rope_0_16(wrapped, instance, args, kwargs):
    """``apply_rotary_pos_emb(t, freqs, config, cu_seqlens, mscale, cp_group)`` of Megatron-Core
    0.16 with ``cp_group`` replaced by the plan group's process group."""
    cu_seqlens = _arg(args, kwargs, 3, "cu_seqlens")
    layout = layout_of(cu_seqlens)
    if layout is None:
        return wrapped(*args, **kwargs)
    names = ("t", "freqs", "config", "cu_seqlens", "mscale", "cp_group")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    bound["cp_group"] = group_process_group(layout, bound.get("cp_group"))
    return wrapped(**bound)
