"""HCCL op-expansion mode for the TP group.

Real code: the patch's wrapper and, for each vLLM-Ascend version, the upstream
``create_hccl_pg_options`` / ``get_hccl_config_for_pg_options`` / ``get_default_buffer_config``
compiled from that version's source. Double: ``torch_npu`` (only the ``Options`` class),
and ``calculate_dp_buffer_size`` (a constant; it needs a vLLM config).
"""

from __future__ import annotations

import os
import sys

import pytest
import wrapt
from hypothesis import given, strategies as st

from ascend_rl_plugins.features import hccl_tp_expansion as feature
from upstream_source import STACKS, calls_in, compile_functions, module_path, parse, top_level


def has_top_level(tree, name):
    try:
        top_level(tree, name)
        return True
    except LookupError:
        return False

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "doubles"))
from torch_npu_double import make_torch_npu_double  # noqa: E402

PATCH = feature.FEATURE.patches[0]  # the wrapper the framework installs is PATCH.impl
TARGET_MODULE = "vllm_ascend.utils"

group_names = st.sampled_from(["tp", "dp", "pp", "ep", "mc2", "dynamic_eplb", "world", "anonymous"])
configs = st.one_of(st.none(), st.dictionaries(st.sampled_from(["hccl_buffer_size", "group_name", "x"]),
                                               st.integers(0, 4096), max_size=3))


@given(configs, group_names, st.integers(0, 3))
def test_only_the_tp_group_gets_the_mode_and_nothing_else_changes(config, group, mode):
    before = None if config is None else dict(config)
    result = feature.with_tp_op_expansion(config, group, mode)
    assert config == before, "the input dict must not be mutated"
    if group == "tp" and config is not None:
        assert result == {**config, "hccl_op_expansion_mode": mode}
        assert result is not config
    else:
        assert result is config


def _upstream_namespace(stack: str) -> dict:
    path = module_path(stack, "vllm_ascend", "vllm_ascend.utils")
    tree = parse(path)
    namespace = {"torch_npu": make_torch_npu_double(), "calculate_dp_buffer_size": lambda: 512}
    consts = [c for c in ("_DEFAULT_BUFFER_SIZE", "_DYNAMIC_EPLB_BUFFER_SIZE") if has_top_level(tree, c)]
    return compile_functions(path, consts + ["get_default_buffer_config", "get_hccl_config_for_pg_options",
                                             "create_hccl_pg_options"], namespace)


@pytest.mark.parametrize("stack", STACKS)
def test_upstream_pg_options_with_the_wrapper_installed(stack):
    """The real upstream functions of each version, the wrapper installed where the
    framework puts it (the module global that create_hccl_pg_options looks up)."""
    ns = _upstream_namespace(stack)
    pristine = {g: ns["create_hccl_pg_options"](g).hccl_config for g in ("tp", "dp", "pp", "world")}
    assert "hccl_op_expansion_mode" not in pristine["tp"]  # upstream does not set it: teeth
    ns["get_hccl_config_for_pg_options"] = wrapt.FunctionWrapper(ns["get_hccl_config_for_pg_options"],
                                                                 PATCH.impl)
    patched = {g: ns["create_hccl_pg_options"](g).hccl_config for g in ("tp", "dp", "pp", "world")}
    assert patched["tp"] == {**pristine["tp"], "hccl_op_expansion_mode": 3}
    assert patched["tp"]["hccl_buffer_size"] == ns["_DEFAULT_BUFFER_SIZE"]  # kept, unlike the seed
    for group in ("dp", "pp", "world"):
        assert patched[group] == pristine[group]
    # MC2 groups get no pg options at all, before and after
    assert ns["get_hccl_config_for_pg_options"]("mc2") is None


@pytest.mark.parametrize("stack", STACKS)
def test_hook_point_is_the_module_global_used_by_create_hccl_pg_options(stack):
    path = module_path(stack, "vllm_ascend", "vllm_ascend.utils")
    tree = parse(path)
    fn = top_level(tree, "get_hccl_config_for_pg_options")
    assert [a.arg for a in fn.args.args] == ["group_name"]
    assert "get_hccl_config_for_pg_options" in calls_in(top_level(tree, "create_hccl_pg_options"))
    # nobody holds a from-import copy that a rebinding would have to chase
    root = os.path.dirname(os.path.dirname(path))
    copies = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
                if "import get_hccl_config_for_pg_options" in text or \
                        ("get_hccl_config_for_pg_options" in text and "from vllm_ascend.utils import" in text
                         and "get_hccl_config_for_pg_options," in text):
                    copies.append(name)
    assert copies == []
    # the patch_distributed module builds every group's options through it
    pd = parse(module_path(stack, "vllm_ascend", "vllm_ascend.patch.worker.patch_distributed"))
    assert any(c.endswith("create_hccl_pg_options") for c in calls_in(pd))


def test_patch_declaration():
    assert PATCH.target == f"{TARGET_MODULE}:get_hccl_config_for_pg_options"
    assert PATCH.dist == "vllm-ascend" and PATCH.versions_text == ">=0.13,<0.24"
    assert PATCH.feature.flag.name == "ASCEND_RL_HCCL_TP_OP_EXPANSION"


def test_mode_flag_rejects_values_outside_0_to_3():
    from ascend_rl_plugins import flags
    with pytest.raises(flags.FlagError, match="ASCEND_RL_HCCL_TP_OP_EXPANSION_MODE"):
        feature.MODE.read({"ASCEND_RL_HCCL_TP_OP_EXPANSION_MODE": "4"})
    assert feature.MODE.read({"ASCEND_RL_HCCL_TP_OP_EXPANSION_MODE": "2"}) == 2
    assert feature.MODE.read({}) == 3
