"""HDP: hybrid data parallelism inside the context-parallel group, planned per micro-batch.

With a fixed CP size every packed sequence is split over every CP rank and pays ring
communication and padding for it, also the short ones. HDP regroups the CP ranks for each
micro-batch: a plan (``planner.py``, with the cost model of ``cost_model.py``) partitions the
CP ranks into groups and gives each sequence a group; long sequences are split over a group,
short ones run whole on one rank. This package is the runtime that executes such a plan on
stock verl / Megatron-Core / MindSpeed:

- ``verl.utils.seqlen_balancing.rearrange_micro_batches`` (:mod:`.microbatch`): the planner
  forms the micro-batches (at least verl's DP-synced count) and each carries its plan.
- ``verl.models.mcore.util.preprocess_packed_seqs`` / ``postprocess_packed_seqs``
  (:mod:`.verl_packing`): a rank packs only its group's rows in the group's zigzag chunks;
  the plan's layout rides on the returned ``PackedSeqParams``' ``cu_seqlens``; the post step
  does one all-gather and rebuilds the other ranks' layouts from the plan.
- RoPE (:mod:`.rope`): Megatron-Core 0.12's ``_apply_rotary_pos_emb_thd`` with the group's
  size and position; 0.16's ``apply_rotary_pos_emb`` with the group's process group as
  ``cp_group``.
- MindSpeed's ring attention (:mod:`.mindspeed`): a sub-ring ``cp_para``, and the
  overlap-group fix ``RingP2P`` needs for rings of odd length.
- Unsupported model configurations (MTP, the sequence-level MoE auxiliary loss) fall back to
  fixed CP with one logged line (``GPTModel`` construction is checked).

The layout is attached to the micro-batch (its ``cu_seqlens`` tensors), never kept in a process
global that recompute could read for the wrong micro-batch. README.md beside this file: why,
flags, what ran where, and what only an NPU can show.

Remove when: Megatron-Core's hybrid context parallelism (0.16: power-of-two groups,
TransformerEngine only) or verl's dynamic context parallelism covers MindSpeed's ring
attention and arbitrary group sizes.
"""

from __future__ import annotations

from ... import flags
from ...patching import Feature, Verified
from ...patching.fallback import fall_back
from .guard import GUARD


ENABLE = flags.define(
    "ASCEND_RL_HDP", "bool", False,
    "Hybrid data parallelism inside the CP group: per micro-batch, a cost-model plan regroups the CP "
    "ranks so long sequences are split over a group and short ones run whole on one rank (verl "
    "packed sequences, Megatron-Core RoPE, MindSpeed ring attention).",
    aliases=("USE_HDP",), feature="hdp")
GROUP_POLICY = flags.define(
    "ASCEND_RL_HDP_GROUP_POLICY", "enum", "contiguous",
    "Which rank groups the planner may form: 'contiguous' (runs of consecutive CP ranks, any size) or "
    "'pow2' (power-of-two sizes only, like Megatron-Core's hybrid_context_parallel).",
    choices=("contiguous", "pow2"), feature="hdp")
COST_MODEL = flags.define(
    "ASCEND_RL_HDP_COST_MODEL", "path", "",
    "JSON cost model the planner uses (empty: the shipped default_cost_model.json, which is not "
    "calibrated on Ascend hardware; calibrate on the NPU cluster, see the README).", feature="hdp")
PLAN_DUMP = flags.define(
    "ASCEND_RL_HDP_PLAN_DUMP", "path", "",
    "Debugging: append every micro-batch's plan as one JSON line to <path>.rank<global rank> "
    "(empty: no dump).", feature="hdp")

FEATURE = Feature(
    "hdp", "Hybrid data parallelism inside the CP group, planned per micro-batch.", flag=ENABLE,
    replaces="the recipe's Megatron 0002, MindSpeed 0002 and verl 0010/0015 HDP patches",
    verified=Verified(
        cpu_runtime="4 gloo processes, float64: Megatron-Core's real THD RoPE (0.12.1 "
                    "_apply_rotary_pos_emb_thd, 0.16.1 apply_rotary_pos_emb with the group's process "
                    "group) + this package's sub-ring attention: loss and gradients equal a single-process "
                    "no-CP reference (<= 1e-12) for all-CP, pure-DP, odd and mixed plans; verl 0.6.1 / 0.9.1 "
                    "preprocess/postprocess_packed_seqs wrappers bit-identical to upstream for the all-CP "
                    "plan and exact for mixed plans; rearrange_micro_batches forms planned micro-batches "
                    "carrying their plan; recompute after a later micro-batch keeps its own plan",
        doubles="MindSpeed ring attention entry and RingP2P (tests/doubles/mindspeed_double): the "
                "sub-ring cp_para and the odd-ring overlap-group fix on a 3-rank gloo ring",
        static="MindSpeed 028de58: ringattn_context_parallel, RingP2P.__init__ and the cp_para keys "
               "the rewrite sets"),
    stacks="recipe (+ MindSpeed); current: its hook points resolve, but verl 0.9.1's trainer forwards "
           "through its model engine (preprocess_thd_engine), which HDP does not cover: no effect there")

REMOVE_WHEN = ("Megatron-Core / verl context parallelism regroups CP ranks per micro-batch for arbitrary "
               "group sizes with MindSpeed's ring attention (Megatron-Core 0.16's hybrid_context_parallel "
               "is TransformerEngine-only with power-of-two groups; verl 0.9.1's dynamic_context_parallel "
               "needs a Megatron-LM dev-branch API)")
MEGATRON_HCP = "https://github.com/NVIDIA/Megatron-LM (megatron/core: hybrid_context_parallel, 0.16)"
ROPE_UTILS = "megatron.core.models.common.embeddings.rope_utils"
VERL_UTIL = "verl.models.mcore.util"

_fallback: dict[str, str] = {}  # configuration-level (per process), set once when a model is built


def unsupported_reason(config) -> str:
    """Why HDP cannot run for a model with this TransformerConfig ('' when it can)."""
    if getattr(config, "mtp_num_layers", None):
        return "multi-token prediction (MTP) layers pack their own shifted sequences over the whole CP group"
    balancing = getattr(config, "moe_router_load_balancing_type", None)
    kinds = balancing if isinstance(balancing, (list, tuple)) else [balancing]
    if any(k == "seq_aux_loss" for k in kinds) and getattr(config, "num_moe_experts", None):
        return "the sequence-level MoE auxiliary loss reduces per-sequence statistics over the whole CP group"
    return ""


def enabled() -> bool:
    """HDP runs for this process: the flag is on, no model configuration ruled it out, and the
    guard has not measured it slower than fixed CP."""
    return bool(ENABLE.value) and not _fallback and not GUARD.fell_back


def check_cost_model_flag() -> str:
    """The cost-model path, refused with the variable's name when it names no readable model."""
    path = COST_MODEL.value or ""
    if not path:
        return ""
    import os
    if not os.path.isfile(path):
        raise flags.FlagError(f"{COST_MODEL.name}={path!r}: no such file; accepted: the path of a JSON cost model "
                              "(empty for the shipped default)")
    from .cost_model import CostModel
    try:
        CostModel.load(path)
    except Exception as exc:  # re-raised with the variable's name
        raise flags.FlagError(f"{COST_MODEL.name}={path!r}: not a cost model ({exc})") from exc
    return path


def _check_model(result, instance, args, kwargs):
    if ENABLE.value:
        check_cost_model_flag()
    config = getattr(instance, "config", None)
    reason = unsupported_reason(config) if config is not None else ""
    if reason and not _fallback:
        _fallback["reason"] = reason
        fall_back("hdp", "fixed context parallelism", reason)
    return result


# order 40: int4_qat.gpt_output_layer (order 60) also runs after GPTModel.__init__; the two are
# independent (this one only reads the config), so the check simply runs first.
FEATURE.after("megatron.core.models.gpt.gpt_model:GPTModel.__init__", _check_model,
              name="hdp.model_support", order=40, dist="megatron-core", versions=">=0.12,<0.17",
              params=("self", "config"),
              reason="HDP must not run for configurations whose per-sequence reductions span the CP group "
                     "(MTP, sequence-level MoE aux loss); detected when the model is built",
              remove_when=REMOVE_WHEN)


def _rope_0_12(wrapped, instance, args, kwargs):
    from .rope import wrap_rope_thd_0_12
    return wrap_rope_thd_0_12(wrapped, instance, args, kwargs)


def _rope_0_16(wrapped, instance, args, kwargs):
    from .rope import wrap_apply_rope_0_16
    return wrap_apply_rope_0_16(wrapped, instance, args, kwargs)


FEATURE.wrap(f"{ROPE_UTILS}:_apply_rotary_pos_emb_thd", _rope_0_12, name="hdp.rope_thd", dist="megatron-core",
             versions=">=0.12,<0.13", order=50,
             params=("t", "cu_seqlens", "freqs", "rotary_interleaved", "multi_latent_attention", "mscale"),
             reason="stock THD RoPE takes the global CP size/rank for every packed sequence; under a plan "
                    "a rank's sequences are split over its group (size, position)",
             replaces="recipe Megatron 0002 (reads the groups from a process global)",
             remove_when=REMOVE_WHEN, upstream=MEGATRON_HCP)
def _rope_fused_0_12(wrapped, instance, args, kwargs):
    from .rope import wrap_apply_rope_0_12
    return wrap_apply_rope_0_12(wrapped, instance, args, kwargs)


FEATURE.wrap(f"{ROPE_UTILS}:apply_rotary_pos_emb", _rope_fused_0_12, name="hdp.rope_unfused", dist="megatron-core",
             versions=">=0.12,<0.13", order=50, params=("t", "freqs", "config", "cu_seqlens", "mscale"),
             reason="0.12's fused THD RoPE kernel is called with the global CP size and rank; under a split plan "
                    "the THD RoPE runs unfused, with the group's numbers",
             remove_when=REMOVE_WHEN, upstream=MEGATRON_HCP)
FEATURE.wrap(f"{ROPE_UTILS}:apply_rotary_pos_emb", _rope_0_16, name="hdp.rope_cp_group", dist="megatron-core",
             versions=">=0.16,<0.17", order=50,
             params=("t", "freqs", "config", "cu_seqlens", "mscale", "cp_group"),
             reason="RoPE takes cp_size/cp_rank from cp_group; under a plan that must be the group's process "
                    "group (also for TransformerEngine's fused THD kernel)",
             remove_when=REMOVE_WHEN, upstream=MEGATRON_HCP)


def _preprocess(wrapped, instance, args, kwargs):
    from . import verl_packing
    return verl_packing.wrap_preprocess(GROUP_POLICY, COST_MODEL, enabled, _dump)(wrapped, instance, args, kwargs)


def _postprocess(wrapped, instance, args, kwargs):
    from . import verl_packing
    return verl_packing.wrap_postprocess(wrapped, instance, args, kwargs)


FEATURE.wrap(f"{VERL_UTIL}:preprocess_packed_seqs", _preprocess, name="hdp.verl_preprocess", dist="verl",
             versions=">=0.6,<0.10", order=50, params=("input_ids", "attention_mask", "pre_process"),
             reason="packs every row split over the whole CP group; under a plan a rank packs its group's "
                    "rows in the group's chunks and the layout rides on PackedSeqParams",
             replaces="recipe verl 0010 (swaps module globals inside gptmodel_forward, process-global groups)",
             remove_when=REMOVE_WHEN)
FEATURE.wrap(f"{VERL_UTIL}:postprocess_packed_seqs", _postprocess, name="hdp.verl_postprocess", dist="verl",
             versions=">=0.6,<0.10", order=50,
             params=("output", "packed_seq_params", "attention_mask", "batch_size", "seq_len", "post_process"),
             reason="rebuilds rows assuming every rank holds every row's chunks; under a plan the rows come "
                    "from their groups (one all-gather, layouts recomputed from the plan)",
             replaces="recipe verl 0010 (three all-gathers over the CP group, device='cuda')",
             remove_when=REMOVE_WHEN)


def _rearrange(wrapped, instance, args, kwargs):
    from .microbatch import wrap_rearrange
    return wrap_rearrange(enabled, GROUP_POLICY, COST_MODEL)(wrapped, instance, args, kwargs)


FEATURE.wrap("verl.utils.seqlen_balancing:rearrange_micro_batches", _rearrange, name="hdp.verl_micro_batches",
             dist="verl", versions=">=0.6,<0.10", order=50,
             params=("batch", "max_token_len", "dp_group", "num_batches_divided_by", "same_micro_num_in_dp"),
             reason="verl balances micro-batches by token count alone; the HDP planner forms them knowing "
                    "how each is grouped (at least verl's DP-synced count) and attaches the plan",
             replaces="recipe verl 0010/0015 (bin-packing with max_token_len = total / K)",
             remove_when=REMOVE_WHEN)


def _timed_schedule(wrapped, instance, args, kwargs):
    from .guard import timed_schedule
    return timed_schedule(enabled)(wrapped, instance, args, kwargs)


SCHEDULES = "megatron.core.pipeline_parallel.schedules"
for _schedule in ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
                  "forward_backward_pipelining_with_interleaving"):
    FEATURE.wrap(f"{SCHEDULES}:{_schedule}", _timed_schedule, name=f"hdp.guard_{_schedule[len('forward_backward_'):]}",
                 dist="megatron-core", versions=">=0.12,<0.17", order=50,
                 params=("forward_step_func", "data_iterator", "model", "num_microbatches", "forward_only"),
                 reason="the measured guard: times the training step's forward/backward (synchronized over "
                        "the ranks) against what plain CP would take, and turns HDP off for the run when it is "
                        "measured slower (guard.py); get_forward_backward_func returns these module globals",
                 remove_when=REMOVE_WHEN)


def _ringattn(instance, args, kwargs):
    from .mindspeed import before_ringattn
    return before_ringattn(instance, args, kwargs)


def _ring_p2p_init(result, instance, args, kwargs):
    from .mindspeed import after_ring_p2p_init
    return after_ring_p2p_init(result, instance, args, kwargs)


MS_RING = "mindspeed.core.context_parallel.ring_context_parallel.ring_context_parallel"
FEATURE.before(f"{MS_RING}:ringattn_context_parallel", _ringattn, name="hdp.mindspeed_ring_cp_para",
               dist="mindspeed", versions=">=0.12,<0.17", order=50,
               params=("q", "k", "v", "n", "cp_para", "softmax_scale", "attn_mask", "dropout_p",
                       "packed_seq_params", "shapes"),
               reason="MindSpeed's ring attention runs over the ranks cp_para names; under a plan that is the "
                      "rank's group (position, size, rings), in a copy of cp_para",
               replaces="recipe MindSpeed 0002 (rewrites cp_para in place from a process global)",
               remove_when=REMOVE_WHEN)
FEATURE.after("mindspeed.core.context_parallel.utils:RingP2P.__init__", _ring_p2p_init,
              name="hdp.mindspeed_odd_ring", dist="mindspeed", versions=">=0.12,<0.17",
              params=("self", "ring_global_ranks", "group", "group_for_send_recv_overlap", "is_backward"),
              reason="in a ring of odd length ring rank 0 receives on the overlap group from an even "
                     "predecessor that sends on the main group: the pair never matches (hangs)",
              replaces="recipe MindSpeed 0002 (RingP2P.__init__ hunk)",
              remove_when="MindSpeed's RingP2P pairs send and receive communicators for rings of odd length")

FEATURE.does_not_apply(
    dist="megatron-core", versions=">=0.13", import_name="megatron.core",
    why="without MindSpeed, context-parallel attention on Megatron-Core 0.13+ is TransformerEngine's "
        "(TEDotProductAttention keeps the CP group it was built with); HDP regroups RoPE and verl's packing "
        "here but no sub-group attention is wired for TransformerEngine (not installable on this CPU host)")


def cost_model_advice() -> str:
    """What doctor says of the cost model in use ('' for a calibrated one)."""
    try:
        path = check_cost_model_flag()
    except flags.FlagError:
        return ""  # refused by name elsewhere (flag validation)
    from .cost_model import CostModel
    model = CostModel.load(path or None)
    if model.calibrated:
        return ""
    which = f"{COST_MODEL.name}={path}" if path else "the shipped default_cost_model.json"
    return (f"the HDP planner uses {which}, which is not calibrated on this hardware (assumed device "
            f"numbers): run `ascend-rl hdp calibrate --out <file>` on the training cluster and set "
            f"{COST_MODEL.name}=<file>")


FEATURE.advise(cost_model_advice)


def register_cli(subparsers) -> None:
    """``ascend-rl hdp calibrate``."""
    from .calibrate import register
    register(subparsers)


def _dump(layout) -> None:
    """Append this micro-batch's layout to the plan dump (ASCEND_RL_HDP_PLAN_DUMP)."""
    path = PLAN_DUMP.value
    if not path:
        return
    import json

    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(f"{path}.rank{rank}", "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"cp_rank": layout.cp_rank, "lengths": list(layout.lengths),
                             "groups": [list(g) for g in layout.groups], "group_of": list(layout.group_of),
                             "group": list(layout.group), "position": layout.position}) + "\n")
