"""Micro-batch formation by the HDP planner (``verl.utils.seqlen_balancing.rearrange_micro_batches``).

verl cuts a mini-batch into K micro-batches balanced by token count, K synchronized over the
data-parallel group (max) and rounded up to a multiple of the virtual-pipeline size. With
HDP the planner forms the micro-batches instead, knowing how each will be grouped:

1. verl's own function runs first and gives its K (``K_verl``: the DP-synced, VPP-rounded
   count); the planner is asked for at least that many;
2. the planner's count is synchronized over the DP group (max) and, where a rank got fewer,
   it plans again with that minimum; if any rank still disagrees, or the count is not a
   multiple of the VPP size, or the planner refuses the input, every rank keeps verl's own
   micro-batches (one log line says why) -- the count is decided collectively, so ranks
   never diverge;
3. each micro-batch's attention-mask tensor carries its ``MicroBatchPlan`` and the plan's
   grouping is remembered under the rows' lengths, so ``preprocess_packed_seqs`` uses the
   same grouping also when the tensor is copied to the device (the memo is keyed by content,
   not "the current micro-batch": activation recompute and pipeline order cannot confuse it).
"""

from __future__ import annotations

from ...patching.fallback import fall_back
from .plan_handoff import attach_plan, recall, remember  # noqa: F401 - recall: the memo's reader, as before


def _sync_max(value: int, group) -> int:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.long)
    if dist.get_backend(group) != "gloo":
        from verl.utils.device import get_device_name
        t = t.to(get_device_name())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def form(lengths, k_verl: int, *, cp_size: int, tp: int, max_token_len: int, dp_group, same_in_dp: bool,
         divisible_by: int | None, policy: str, cost_model_path: str, allow_hdp: bool = True):
    """(HdpPlan, why not): the planner's micro-batches, or None and the reason to keep verl's.
    ``allow_hdp=False``: the planner's plain-CP micro-batches (the guard's CP probe)."""
    from . import cost_model as cm
    from . import planner
    from .layout import padded

    model = cm.CostModel.load(cost_model_path or None)
    cap = max([max_token_len // cp_size] + [padded(n, cp_size, tp) // cp_size for n in lengths])

    def attempt(k_min, k_max=None):
        try:
            return planner.plan(list(lengths), cp_size=cp_size, max_tokens_per_rank=cap, min_micro_batches=k_min,
                                max_micro_batches=k_max, group_policy=policy, cost_model=model, tp=tp,
                                allow_hdp=allow_hdp), ""
        except ValueError as exc:
            return None, f"the planner refused this batch ({exc})"

    result, why = attempt(k_verl)
    k = result.num_micro_batches if result is not None else k_verl
    if same_in_dp:
        k = _sync_max(k, dp_group)
    if divisible_by:
        k = -(-k // divisible_by) * divisible_by
    if result is not None and result.num_micro_batches != k:
        # exactly k: an HDP-native plan may have more micro-batches than its minimum, so a
        # minimum alone could still leave the data-parallel ranks with different counts
        result, why = attempt(k, k)
    ok = int(result is not None and result.num_micro_batches == k)
    if same_in_dp:
        ok = 1 - _sync_max(1 - ok, dp_group)  # all ranks agree, or all keep verl's
    if not ok:
        if not why:
            why = (f"the micro-batch count is not a multiple of the virtual pipeline size {divisible_by}"
                   if divisible_by and result is not None and result.num_micro_batches % divisible_by
                   else "the data-parallel ranks could not agree on a micro-batch count")
        return None, why
    return result, ""


def wrap_rearrange(enabled, policy_flag, cost_model_flag):
    """The wrapper of ``rearrange_micro_batches(batch, max_token_len, dp_group, num_batches_divided_by,
    same_micro_num_in_dp, min_num_micro_batch, use_dynamic_bsz_balance, ...)``."""

    def _wrapper(wrapped, instance, args, kwargs):
        micro_batches, partitions = wrapped(*args, **kwargs)
        if not enabled():
            return micro_batches, partitions
        try:
            from megatron.core import parallel_state as mpu
            if not mpu.model_parallel_is_initialized():
                return micro_batches, partitions
            cp_size, tp = mpu.get_context_parallel_world_size(), mpu.get_tensor_model_parallel_world_size()
        except ImportError:
            return micro_batches, partitions
        if cp_size <= 1:
            return micro_batches, partitions
        names = ("batch", "max_token_len", "dp_group", "num_batches_divided_by", "same_micro_num_in_dp")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        batch = bound["batch"]
        if batch["input_ids"].is_nested:
            return micro_batches, partitions
        lengths = [int(x) for x in batch["attention_mask"].sum(dim=1).tolist()]
        import torch.distributed as dist

        from .guard import GUARD, StepPlan
        result, why = form(lengths, len(partitions), cp_size=cp_size, tp=tp, max_token_len=int(bound["max_token_len"]),
                           dp_group=bound.get("dp_group"),
                           same_in_dp=bool(bound.get("same_micro_num_in_dp", True)) and dist.is_initialized(),
                           divisible_by=bound.get("num_batches_divided_by"), policy=policy_flag.value,
                           cost_model_path=cost_model_flag.value or "", allow_hdp=not GUARD.wants_cp_probe())
        if result is None:
            fall_back("hdp", "verl's own micro-batches", why)
            return micro_batches, partitions
        from verl.utils import tensordict_utils as tu

        out_batches, out_parts = [], []
        for mb in result.micro_batches:
            rows = [int(i) for i in mb.sequences]
            selected = tu.index_select_tensor_dict(batch, rows)
            attach_plan(selected["attention_mask"], mb)
            remember(tuple(lengths[i] for i in rows), cp_size, tp, tuple(tuple(sorted(g)) for g in mb.groups),
                     mb.group_of)
            out_batches.append(selected)
            out_parts.append(rows)
        GUARD.note_plan(StepPlan.of(result))
        return out_batches, out_parts

    return _wrapper
