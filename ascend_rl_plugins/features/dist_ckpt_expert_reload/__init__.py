"""Dist-ckpt expert reload: verl's ``load_mcore_dist_weights`` really loads factory-built tensors.

verl loads a Megatron distributed checkpoint into its model with
``dist_checkpointing.load(model.sharded_state_dict(), path)`` and throws the returned state
dict away (``verl.utils.model.load_mcore_dist_weights``, verl 0.6.1 and 0.9.1). That works for a
plain ``ShardedTensor``, which is loaded in place into the parameter it was built from, but not
for a ``ShardedTensorFactory`` whose sub-tensors are copies: legacy ``GroupedMLP`` (Megatron-Core's
``moe_grouped_gemm`` without TransformerEngine, MindSpeed's path) splits ``weight1``/``weight2``
into per-expert transposed ``.contiguous()`` pieces, and the merged result comes back only in
the returned dict. Those parameters keep whatever they held before the load -- for a GroupedMLP
MoE model, every expert weight.

Two wrappers. ``load_mcore_dist_weights`` marks "loading verl model weights" for its duration
(a context variable); inside it, and only there, Megatron-Core's ``dist_checkpointing.load``
first records, for every ``ShardedTensor`` / ``ShardedTensorFactory`` of the sharded state dict
it is given, the tensor the entry was built from, and after the load copies back into that
tensor, in place, every loaded tensor that lives in other storage -- by position in the state
dict, never by name. A shape or dtype mismatch raises :class:`ExpertReloadError` naming the
checkpoint key. Every other caller of ``dist_checkpointing.load`` (checkpoint managers that
use the returned dict) is untouched. README.md beside this file: why, flags, verified where.

Remove when: verl copies the state dict returned by ``dist_checkpointing.load`` into the model
(or loads it with ``load_state_dict``) in ``load_mcore_dist_weights`` (not in 0.9.1).
"""

from __future__ import annotations

import contextvars

from ... import flags
from ...patching import Feature, Verified
from .copyback import ExpertReloadError  # noqa: F401  (public: the error a bad copy raises)

ENABLE = flags.define(
    "ASCEND_RL_DIST_CKPT_EXPERT_RELOAD", "bool", True,
    "After verl's load_mcore_dist_weights loads a Megatron distributed checkpoint, copy every tensor "
    "that a sharded-state-dict factory merged into new storage (GroupedMLP expert weights) back into "
    "its parameter.", aliases=("USE_ALLTOALL_OVERLAP",), feature="dist_ckpt_expert_reload")

FEATURE = Feature(
    "dist_ckpt_expert_reload",
    "verl's load_mcore_dist_weights copies factory-merged tensors (GroupedMLP experts) into the model.",
    flag=ENABLE, replaces="the recipe's verl patch 0001-verl-feature-enable_alltoall_overlap",
    verified=Verified(
        cpu_runtime="real verl load_mcore_dist_weights (0.6.1 and 0.9.1) on a real Megatron-Core "
                    "GroupedMLP MoE model (0.12.1 and 0.16.1), 2 gloo processes, EP2 and ETP2, checkpoint "
                    "written by dist_checkpointing.save: stock leaves the expert weights unloaded, "
                    "patched every parameter is bit-identical"),
    stacks="recipe, current")

VERL_RANGE = ">=0.6,<0.10"
MEGATRON_RANGE = ">=0.12,<0.17"
REMOVE_WHEN = ("verl copies the state dict returned by dist_checkpointing.load into the model in "
               "load_mcore_dist_weights")

_LOADING_MODEL_WEIGHTS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "ascend_rl_dist_ckpt_expert_reload", default=False)


@FEATURE.wrap("verl.utils.model:load_mcore_dist_weights", dist="verl", versions=VERL_RANGE, order=50,
              params=("parallel_model", "dist_weight_path"), name="dist_ckpt_expert_reload.load_mcore_dist_weights",
              reason="load_mcore_dist_weights discards the state dict dist_checkpointing.load returns, so "
                     "tensors a sharded-state-dict factory merged (GroupedMLP expert weights) never reach "
                     "the model; marks the call so that the load below copies them back",
              replaces="recipe verl 0001 (copies keys containing 'mlp.experts.weight' under "
                       "USE_ALLTOALL_OVERLAP=1)",
              remove_when=REMOVE_WHEN)
def _mark_model_weight_load(wrapped, instance, args, kwargs):
    token = _LOADING_MODEL_WEIGHTS.set(True)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _LOADING_MODEL_WEIGHTS.reset(token)


@FEATURE.wrap("megatron.core.dist_checkpointing.serialization:load", dist="megatron-core",
              versions=MEGATRON_RANGE, order=50, params=("sharded_state_dict", "checkpoint_dir"),
              name="dist_ckpt_expert_reload.dist_checkpointing_load",
              reason="inside verl's load_mcore_dist_weights only: copy every loaded tensor that is not "
                     "in the storage of the tensor its sharded-state-dict entry was built from back "
                     "into that tensor",
              remove_when=REMOVE_WHEN)
def _copy_back_after_load(wrapped, instance, args, kwargs):
    if not _LOADING_MODEL_WEIGHTS.get():
        return wrapped(*args, **kwargs)
    from .copyback import copy_back, entry_targets
    sharded_state_dict = args[0] if args else kwargs.get("sharded_state_dict")
    targets = entry_targets(sharded_state_dict)  # before the load: it replaces factories in place
    result = wrapped(*args, **kwargs)
    copy_back(targets, result[0] if isinstance(result, tuple) else result)
    return result
