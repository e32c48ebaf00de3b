"""HCCL op-expansion mode for the tensor-parallel process group only.

vLLM-Ascend builds every group's torch_npu ``ProcessGroupHCCL.Options`` in
``create_hccl_pg_options`` from ``get_hccl_config_for_pg_options(group_name)``, looked up as a
module global; the wrapper adds ``hccl_op_expansion_mode`` (the value of
ASCEND_RL_HCCL_TP_OP_EXPANSION_MODE) to a copy of the TP group's dict, keeping its buffer size,
and leaves every other group untouched. README.md beside this file: why, flags, verified where.

Remove when: vLLM-Ascend lets users configure HCCL options per group (or sets the mode for TP).
"""

from __future__ import annotations

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_HCCL_TP_OP_EXPANSION", "bool", False,
    "Give vLLM-Ascend's TP process group an explicit HCCL op-expansion mode "
    "(ASCEND_RL_HCCL_TP_OP_EXPANSION_MODE); other groups are untouched.",
    feature="hccl_tp_expansion")
MODE = flags.define(
    "ASCEND_RL_HCCL_TP_OP_EXPANSION_MODE", "int", 3,
    "hccl_op_expansion_mode for the TP group: 0 follow HCCL_OP_EXPANSION_MODE, 1 host CPU, "
    "2 device AI CPU, 3 device AI Vector cores (the Qwen3 RL recipe's value).",
    minimum=0, maximum=3, feature="hccl_tp_expansion")

FEATURE = Feature(
    "hccl_tp_expansion", "HCCL op-expansion mode for the TP process group only.", flag=ENABLE,
    replaces="Qwen3 RL recipe vLLM-Ascend patch 0003-vllm_ascend-bugfix-set_hccl_op_expansion_mode",
    verified=Verified(
        doubles="the real vLLM-Ascend create_hccl_pg_options/get_hccl_config_for_pg_options "
                "(compiled from each version's source) with the patch applied by the registry "
                "and each mode flag value; a torch_npu Options double",
        static="hook point in vLLM-Ascend 0.13 and 0.23"),
    stacks="recipe, current (vLLM-Ascend not importable on CPU)")

TP_GROUP_NAME = "tp"
CONFIG_KEY = "hccl_op_expansion_mode"


def with_tp_op_expansion(config: dict | None, group_name: str, mode: int) -> dict | None:
    """The group's HCCL config with the expansion mode added for the TP group.

    Returns a new dict (vLLM-Ascend 0.23 adds ``group_name`` to the returned dict in
    place); ``None`` (MC2 groups: no pg options at all) and other groups pass through."""
    if group_name != TP_GROUP_NAME or config is None:
        return config
    return {**config, CONFIG_KEY: mode}


@FEATURE.wrap("vllm_ascend.utils:get_hccl_config_for_pg_options", dist="vllm-ascend",
              versions=">=0.13,<0.24", order=60, params=("group_name",),
              name="hccl_tp_expansion.get_hccl_config_for_pg_options",
              reason="TP all-gathers time out on A3 without AIV op expansion; the mode must be "
                     "set for the TP group only, through its pg options",
              replaces="recipe vLLM-Ascend patch 0003 (edits the config map, drops the TP buffer size)",
              remove_when="vLLM-Ascend exposes per-group HCCL options or sets the mode for TP")
def _tp_op_expansion(wrapped, instance, args, kwargs):
    config = wrapped(*args, **kwargs)
    group_name = args[0] if args else kwargs.get("group_name")
    return with_tp_op_expansion(config, group_name, MODE.value)
