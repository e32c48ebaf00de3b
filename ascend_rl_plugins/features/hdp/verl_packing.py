"""verl's packed-sequence pre/post-processing (``verl.models.mcore.util``) under an HDP plan.

``preprocess_packed_seqs`` packs every row of the micro-batch, split into the CP group's
zigzag chunks; ``postprocess_packed_seqs`` all-gathers every rank's packed output over the
CP group and puts the rows back. With a plan:

- pre: a rank packs only the rows of its plan group, each padded for the group's size and
  split into the group's zigzag chunks (:mod:`.layout`); the layout is attached to the
  returned ``PackedSeqParams``' ``cu_seqlens`` tensors, so RoPE, attention and the
  post-processing of *this* micro-batch (also when recomputed) read it from there.
- post: ONE ``all_gather`` over the CP group of each rank's packed output (padded to the
  longest; every rank's length is known from the plan), then every rank's tokens are put
  back at the (row, column) the plan and the attention mask say -- one vectorized scatter,
  on the device of the output (the seed hard-coded ``'cuda'`` and gathered three times).
  As upstream, only this rank's own slice keeps its autograd graph.

Where the plan comes from: a micro-batch formed by the planner carries it (attribute set by
:func:`attach_plan` on its attention-mask tensor, and remembered under its rows' lengths by
:mod:`.microbatch` for when the tensor was copied to the device; both in :mod:`.plan_handoff`); otherwise it is the
planner's plan for the micro-batch's row lengths -- a pure function of the lengths, the CP/TP sizes, the group
policy and the cost model, identical on every CP rank, memoized. A plan whose groups are
one group of all CP ranks packs exactly what upstream packs (the tests compare bit for bit).
"""

from __future__ import annotations

import functools

from ...patching.fallback import fall_back
from .layout import HdpLayout, attach, layout_of
from .plan_handoff import PLAN_ATTRIBUTE, attach_plan, recall  # noqa: F401 - attach_plan: the writer, as before


@functools.lru_cache(maxsize=256)
def planned_groups(lengths: tuple[int, ...], cp_size: int, tp: int, policy: str, cost_model_path: str):
    """(groups, group_of per row) the planner gives one micro-batch of rows with ``lengths``: a
    pure function of its arguments, so every CP rank derives the same; the plain CP grouping
    when the planner would rather split the rows into several micro-batches (verl has fixed
    the micro-batch count already)."""
    from . import cost_model as cm
    from . import planner

    model = cm.CostModel.load(cost_model_path or None)
    budget = sum(lengths) + len(lengths) * 2 * cp_size * tp  # room for every row on one rank
    result = planner.plan(list(lengths), cp_size=cp_size, max_tokens_per_rank=budget, min_micro_batches=1,
                          group_policy=policy, cost_model=model, tp=tp)
    if len(result.micro_batches) != 1:
        fall_back("hdp", "fixed context parallelism for a micro-batch",
                  f"the planner wanted {len(result.micro_batches)} micro-batches for its {len(lengths)} rows "
                  f"(verl fixed the micro-batch count already)",
                  cause="the planner wanted more micro-batches than verl formed")
        return (tuple(range(cp_size)),), (0,) * len(lengths)
    mb = result.micro_batches[0]
    group_of = [0] * len(lengths)
    for entry, row in enumerate(mb.sequences):
        group_of[row] = int(mb.group_of[entry])
    return tuple(tuple(sorted(g)) for g in mb.groups), tuple(group_of)


def layout_for(attention_mask, cp_rank: int, cp_size: int, tp: int, policy: str = "contiguous",
               cost_model_path: str = "") -> HdpLayout:
    """This rank's layout of the micro-batch whose attention mask is given: from the plan the
    micro-batch carries (its rows are the plan's ``sequences``, in order), else planned from
    the rows' lengths."""
    lengths = tuple(int(x) for x in attention_mask.sum(dim=-1).tolist())
    plan = getattr(attention_mask, PLAN_ATTRIBUTE, None)
    if plan is not None:
        if len(plan.group_of) != len(lengths):
            raise ValueError(f"the HDP plan attached to this micro-batch has {len(plan.group_of)} rows, "
                             f"the micro-batch {len(lengths)}")
        groups = tuple(tuple(sorted(int(r) for r in g)) for g in plan.groups)
        group_of = tuple(int(x) for x in plan.group_of)
    else:
        remembered = recall(lengths, cp_size, tp)  # formed by the planner, tensor copied since
        groups, group_of = remembered or planned_groups(lengths, cp_size, tp, policy, cost_model_path)
    if sum(len(g) for g in groups) != cp_size:
        raise ValueError(f"HDP plan groups {groups} do not partition the CP group of size {cp_size}")
    return HdpLayout(lengths, groups, group_of, cp_rank, tp)


def _compacted_index(attention_mask):
    """(flat valid columns in row order, start of each row in it): the k-th real token of row
    ``r`` sits at column ``cols[starts[r] + k]``."""
    import torch

    lengths = attention_mask.sum(dim=-1)
    cols = attention_mask.nonzero(as_tuple=True)[1]
    starts = torch.zeros_like(lengths)
    starts[1:] = torch.cumsum(lengths, 0)[:-1]
    return cols, starts


def pack(input_ids, attention_mask, layout: HdpLayout):
    """This rank's packed tokens ``[1, local tokens, ...]`` (zeros at padding), vectorized."""
    import torch

    device = input_ids.device
    rows_t, pos_t = layout.token_index(device=device)
    lengths = attention_mask.sum(dim=-1).to(device=device, dtype=torch.long)
    real = pos_t < lengths[rows_t]
    cols, starts = _compacted_index(attention_mask.to(device))
    out = torch.zeros([len(rows_t)] + list(input_ids.shape[2:]), dtype=input_ids.dtype, device=device)
    src_cols = cols[starts[rows_t[real]] + pos_t[real]]
    out[real] = input_ids[rows_t[real], src_cols]
    return out.unsqueeze(0)


def packed_seq_params_for(layout: HdpLayout, device):
    """``PackedSeqParams`` of this rank's rows, with the layout attached to its cu_seqlens."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(layout.cu_seqlens_padded(), dtype=torch.int32, device=device)
    max_len = max((layout.padded_length(r) for r in layout.rows), default=0)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, max_seqlen_q=max_len, cu_seqlens_kv=cu,
                             max_seqlen_kv=max_len, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu)
    attach([cu], layout)
    return params


def preprocess(input_ids, attention_mask, layout: HdpLayout, pre_process: bool = True):
    """HDP ``preprocess_packed_seqs``: (packed input or ``input_ids`` unchanged, params)."""
    if not layout.rows:
        raise RuntimeError(f"{layout.describe()}: this rank has no rows in the micro-batch (the plan "
                           "left a group idle)")
    params = packed_seq_params_for(layout, input_ids.device)
    if not pre_process:
        return input_ids, params
    return pack(input_ids, attention_mask, layout), params


def postprocess(output, layout: HdpLayout, attention_mask, batch_size: int, seq_len: int, cp_group):
    """HDP ``postprocess_packed_seqs``: ``[batch, seq_len, ...]`` from every rank's packed output,
    with one all_gather over ``cp_group``; this rank's slice keeps its graph."""
    import torch
    import torch.distributed as dist

    device = output.device
    sizes = [layout.local_tokens(r) for r in range(layout.cp_size)]
    if output.shape[1] != sizes[layout.cp_rank]:
        raise RuntimeError(f"{layout.describe()}: packed output has {output.shape[1]} tokens, the plan "
                           f"says {sizes[layout.cp_rank]}")
    longest = max(sizes)
    tail = list(output.shape[2:])
    mine = output[0]
    if layout.cp_size > 1:
        send = torch.zeros([longest] + tail, dtype=output.dtype, device=device)
        send[: sizes[layout.cp_rank]] = mine.detach()
        gathered = [torch.empty_like(send) for _ in sizes]
        dist.all_gather(gathered, send, group=cp_group)
        pieces = [mine if r == layout.cp_rank else gathered[r][: sizes[r]] for r in range(layout.cp_size)]
    else:
        pieces = [mine]
    index = [layout.token_index(r, device=device) for r in range(layout.cp_size)]
    values = torch.cat(pieces)
    rows_t = torch.cat([rows for rows, _ in index])
    pos_t = torch.cat([pos for _, pos in index])
    mask = attention_mask.to(device)
    lengths = mask.sum(dim=-1).to(torch.long)
    real = pos_t < lengths[rows_t]
    cols, starts = _compacted_index(mask)
    target = rows_t[real] * seq_len + cols[starts[rows_t[real]] + pos_t[real]]
    flat = torch.zeros([batch_size * seq_len] + tail, dtype=output.dtype, device=device)
    flat = flat.index_put((target,), values[real])
    return flat.view([batch_size, seq_len] + tail)


# -- the patches' bodies ------------------------------------------------------------------

def _sizes():
    from megatron.core import parallel_state as mpu
    return (mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank(),
            mpu.get_tensor_model_parallel_world_size())


def wrap_preprocess(policy_flag, cost_model_flag, enabled, dump=None):
    """The wrapper of ``preprocess_packed_seqs(input_ids, attention_mask, pre_process=True, ...)``."""

    def _wrapper(wrapped, instance, args, kwargs):
        names = ("input_ids", "attention_mask", "pre_process", "use_fp8_padding")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        if not enabled():
            return wrapped(*args, **kwargs)
        cp_size, cp_rank, tp = _sizes()
        if cp_size <= 1:
            return wrapped(*args, **kwargs)
        if bound.get("use_fp8_padding"):
            fall_back("hdp", "fixed context parallelism for a micro-batch", "FP8 THD padding is not planned by HDP")
            return wrapped(*args, **kwargs)
        layout = layout_for(bound["attention_mask"], cp_rank, cp_size, tp, policy_flag.value,
                            cost_model_flag.value or "")
        if dump is not None:
            dump(layout)
        return preprocess(bound["input_ids"], bound["attention_mask"], layout, bound.get("pre_process", True))

    return _wrapper


def wrap_postprocess(wrapped, instance, args, kwargs):
    """The wrapper of ``postprocess_packed_seqs(output, packed_seq_params, attention_mask,
    batch_size, seq_len, post_process=True)``: HDP when the params carry a layout."""
    names = ("output", "packed_seq_params", "attention_mask", "batch_size", "seq_len", "post_process")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    params = bound.get("packed_seq_params")
    layout = layout_of(getattr(params, "cu_seqlens_q_padded", None))
    if layout is None or not bound.get("post_process", True):
        return wrapped(*args, **kwargs)
    from megatron.core import parallel_state as mpu
    return postprocess(bound["output"], layout, bound["attention_mask"], bound["batch_size"], bound["seq_len"],
                       mpu.get_context_parallel_group())
