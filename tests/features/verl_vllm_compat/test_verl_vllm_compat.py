"""verl_vllm_compat: verl 0.6.1's vLLM rollout imports on vLLM 0.13.

Real (recipe stack, one child process shared with rollout_progress_bar and
rollout_engine_options: verl_rollout_scenario.py): verl 0.6.1's rollout and async-server
imports, stock, with the LoRA alias only, and with every patch; a real vLLMRollout built and
generating; the alias reverted. In-process: the alias module and the gates, without vLLM.
Statically: the imports verl 0.6.1 makes, where vLLM 0.13 keeps those names, and verl 0.9.1's fix.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types

import pytest

from ascend_rl_plugins.features import verl_vllm_compat as feature
from tests.features.upstream_source import module_path, parse, top_level
from tests.features.verl_vllm_compat.verl_rollout import stage


@pytest.fixture(scope="module")
def compat():
    return stage("compat")


def test_stock_verl_rollout_does_not_import_on_vllm_013(compat):
    assert compat["stock_spmd_error"] == "ModuleNotFoundError: No module named 'vllm.lora.models'"


def test_lora_alias_lets_the_rollout_import_and_the_async_server_needs_the_moved_utils(compat):
    assert compat["lora_only_state"] == "applied"
    assert compat["lora_only_spmd_error"] is None
    assert compat["lora_only_async_error"].startswith(
        "ImportError: cannot import name 'FlexibleArgumentParser' from 'vllm.utils'")


def test_with_the_feature_both_import_and_see_the_moved_objects(compat):
    assert compat["spmd_error"] is None and compat["async_error"] is None
    assert compat["states"] == {"verl_vllm_compat.lora_models_module": "applied",
                                "verl_vllm_compat.utils_moved_names": "applied"}
    assert compat["same_lora_class"] and compat["verl_holds_lora_class"] and compat["alias_in_sys_modules"]
    assert compat["same_parser"] and compat["async_server_tcp_uri"]


def test_a_real_rollout_builds_and_generates():
    got = stage("engine")["patched"]
    assert got["shape"] == [2, 24]


def test_reverting_takes_the_module_path_away_again():
    got = stage("revert")
    assert got["alias_gone"] and got["reimport_error"] == "ModuleNotFoundError: No module named 'vllm.lora.models'"


def test_alias_module_resolves_lazily_and_stays_a_plain_module(monkeypatch):
    home = types.ModuleType("home_module_double_for_alias")
    home.Thing = object()
    alias = feature.alias_module("old.place", home.__name__)
    assert home.__name__ not in sys.modules  # nothing imported by making the alias
    monkeypatch.setitem(sys.modules, home.__name__, home)
    assert alias.Thing is home.Thing and "Thing" in dir(alias)
    assert not hasattr(alias, "__path__") and not hasattr(alias, "__file__")
    with pytest.raises(AttributeError):
        alias.Missing  # noqa: B018 - the lookup under test
    monkeypatch.setitem(sys.modules, "old.place", alias)
    assert importlib.util.find_spec("old.place").name == "old.place"  # __spec__ set: no ValueError


def test_gates_follow_the_flag_and_vllms_layout(flag_env, monkeypatch):
    on_disk = {"vllm.lora.models": False, "vllm.lora.lora_model": True,
               "vllm.utils.argparse_utils": True, "vllm.utils.network_utils": True}
    monkeypatch.setattr(feature, "_on_disk", lambda m: on_disk[m])
    assert feature.lora_models_moved() and feature.utils_names_moved()
    on_disk.update({"vllm.lora.models": True, "vllm.lora.lora_model": False, "vllm.utils.argparse_utils": False})
    assert not feature.lora_models_moved() and not feature.utils_names_moved()  # older vLLM: nothing to provide
    on_disk.update({"vllm.lora.models": False, "vllm.lora.lora_model": True, "vllm.utils.argparse_utils": True})
    flag_env(ASCEND_RL_VERL_VLLM_COMPAT="0")
    assert not feature.lora_models_moved() and not feature.utils_names_moved()


def _imports_from(tree, module):
    return {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == module for a in n.names}


def test_what_verl_06_imports_is_where_vllm_013_moved_it():
    assert "LoRAModel" in _imports_from(parse(module_path("recipe", "verl", "verl.utils.vllm.utils")),
                                        "vllm.lora.models")
    assert {"FlexibleArgumentParser", "get_tcp_uri"} <= _imports_from(
        parse(module_path("recipe", "verl", "verl.workers.rollout.vllm_rollout.vllm_async_server")),
        "vllm.utils")
    with pytest.raises(FileNotFoundError):
        module_path("recipe", "vllm", "vllm.lora.models")
    top_level(parse(module_path("recipe", "vllm", "vllm.lora.lora_model")), "LoRAModel")
    for name, home in feature.MOVED_UTILS.items():
        top_level(parse(module_path("recipe", "vllm", home)), name)
    utils = parse(module_path("recipe", "vllm", "vllm.utils"))
    top_level(utils, "__getattr__")  # the hook the patch wraps
    assert not any(isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name in feature.MOVED_UTILS for n in utils.body)


def test_verl_09_imports_lora_model_from_its_new_home_first():
    """fixed_upstream: verl 0.9.1 tries vllm.lora.lora_model, then vllm.lora.models."""
    tree = parse(module_path("current", "verl", "verl.utils.vllm.utils"))
    tries = [n for n in tree.body if isinstance(n, ast.Try)]
    assert any(_imports_from(ast.Module(body=t.body, type_ignores=[]), "vllm.lora.lora_model") for t in tries)
