"""hccl_tp_expansion: the HCCL op-expansion mode for the TP process group only.

Real code: the declared patch, installed by the framework's registry into a
``vllm_ascend.utils`` module that holds, for each vLLM-Ascend version, the upstream
``create_hccl_pg_options`` / ``get_hccl_config_for_pg_options`` / ``get_default_buffer_config``
compiled from that version's source; the mode flag read from the environment. Doubles:
``torch_npu`` (only ``ProcessGroupHCCL.Options``, tests/doubles/torch_npu_double.py) and
``calculate_dp_buffer_size`` (a constant: it needs a vLLM config).
"""

from __future__ import annotations

import os
import sys
import types

import pytest
from hypothesis import given, strategies as st

from ascend_rl_plugins import flags
from ascend_rl_plugins.features import hccl_tp_expansion as feature
from ascend_rl_plugins.patching.core import REGISTRY
from tests.doubles.torch_npu_double import make_torch_npu_double
from tests.features.upstream_source import (STACKS, calls_in, compile_functions, has_top_level, module_path,
                                            parse, python_files, top_level)

PATCH = REGISTRY.patches["hccl_tp_expansion.get_hccl_config_for_pg_options"]
MODE_FLAG = "ASCEND_RL_HCCL_TP_OP_EXPANSION_MODE"
KEY = "hccl_op_expansion_mode"
GROUPS = ("tp", "dp", "pp", "world")

group_names = st.sampled_from(["tp", "dp", "pp", "ep", "mc2", "dynamic_eplb", "world", "anonymous"])
configs = st.one_of(st.none(), st.dictionaries(st.sampled_from(["hccl_buffer_size", "group_name", "x"]),
                                               st.integers(0, 4096), max_size=3))


@given(configs, group_names, st.integers(0, 3))
def test_only_the_tp_group_gets_the_mode_and_nothing_else_changes(config, group, mode):
    before = None if config is None else dict(config)
    result = feature.with_tp_op_expansion(config, group, mode)
    assert config == before, "the input dict must not be mutated"
    if group == "tp" and config is not None:
        assert result == {**config, KEY: mode}
        assert result is not config
    else:
        assert result is config


def _upstream_utils(stack: str) -> types.ModuleType:
    """A ``vllm_ascend.utils`` module holding the real upstream functions of ``stack``."""
    path = module_path(stack, "vllm_ascend", "vllm_ascend.utils")
    tree = parse(path)
    module = types.ModuleType("vllm_ascend.utils")
    module.__file__ = path
    module.torch_npu = make_torch_npu_double()
    module.calculate_dp_buffer_size = lambda: 512
    consts = [c for c in ("_DEFAULT_BUFFER_SIZE", "_DYNAMIC_EPLB_BUFFER_SIZE") if has_top_level(tree, c)]
    compile_functions(path, consts + ["get_default_buffer_config", "get_hccl_config_for_pg_options",
                                      "create_hccl_pg_options"], module.__dict__)
    return module


@pytest.fixture(params=STACKS)
def upstream(request, monkeypatch):
    """The stack's upstream ``vllm_ascend.utils``, importable under its real name, with the
    declared patch applied by the registry (as activation does once the module is imported);
    reverted afterwards."""
    module = _upstream_utils(request.param)
    package = types.ModuleType("vllm_ascend")
    package.__path__ = []
    package.utils = module
    monkeypatch.setitem(sys.modules, "vllm_ascend", package)
    monkeypatch.setitem(sys.modules, "vllm_ascend.utils", module)
    pristine = {g: module.create_hccl_pg_options(g).hccl_config for g in GROUPS}
    assert REGISTRY.apply(PATCH), PATCH.outcome
    try:
        yield module, pristine
    finally:
        REGISTRY.revert(PATCH)


@pytest.mark.forked  # the registry and sys.modules are process-global
@pytest.mark.parametrize("mode", [None, 0, 1, 2])  # None: flag unset (default 3)
def test_the_mode_flag_reaches_the_tp_pg_options_through_the_wrapper(upstream, flag_env, mode):
    """Finding 6a: the wrapper must pass ASCEND_RL_HCCL_TP_OP_EXPANSION_MODE's value, not a
    fixed mode; the value is read from the environment, as on a cluster."""
    module, pristine = upstream
    flag_env(**{MODE_FLAG: mode})
    assert KEY not in pristine["tp"]  # upstream does not set it
    patched = {g: module.create_hccl_pg_options(g).hccl_config for g in GROUPS}
    assert patched["tp"] == {**pristine["tp"], KEY: 3 if mode is None else mode}
    assert patched["tp"]["hccl_buffer_size"] == module._DEFAULT_BUFFER_SIZE  # kept, unlike the seed
    for group in GROUPS[1:]:
        assert patched[group] == pristine[group]
    # MC2 groups get no pg options at all, before and after
    assert module.get_hccl_config_for_pg_options("mc2") is None


@pytest.mark.forked
def test_reverting_the_patch_restores_the_upstream_options(upstream):
    module, pristine = upstream
    REGISTRY.revert(PATCH)
    assert {g: module.create_hccl_pg_options(g).hccl_config for g in GROUPS} == pristine


@pytest.mark.parametrize("stack", STACKS)
def test_hook_point_is_the_module_global_used_by_create_hccl_pg_options(stack):
    path = module_path(stack, "vllm_ascend", "vllm_ascend.utils")
    tree = parse(path)
    fn = top_level(tree, "get_hccl_config_for_pg_options")
    assert [a.arg for a in fn.args.args] == ["group_name"]
    assert "get_hccl_config_for_pg_options" in calls_in(top_level(tree, "create_hccl_pg_options"))
    # nobody holds a from-import copy that a rebinding would have to chase
    copies = []
    for file in python_files(os.path.dirname(os.path.dirname(path))):
        with open(file, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        if "import get_hccl_config_for_pg_options" in text or \
                ("from vllm_ascend.utils import" in text and "get_hccl_config_for_pg_options," in text):
            copies.append(file)
    assert copies == []
    # the patch_distributed module builds every group's options through it
    pd = parse(module_path(stack, "vllm_ascend", "vllm_ascend.patch.worker.patch_distributed"))
    assert any(c.endswith("create_hccl_pg_options") for c in calls_in(pd))


def test_mode_flag_rejects_values_outside_0_to_3():
    with pytest.raises(flags.FlagError, match=MODE_FLAG):
        feature.MODE.read({MODE_FLAG: "4"})
    assert feature.MODE.read({MODE_FLAG: "2"}) == 2
    assert feature.MODE.read({}) == 3
