"""rope_registry: vLLM's ApplyRotaryEmb must not pick flash_attn's Triton kernel on NPU.

Real code: vLLM's ApplyRotaryEmb and a real engine (the shared in-process engine,
tests/features/shared_engine.py, rope_registry/engine_checks.py), the patch, importlib.
Doubles: ``torch.npu`` and a ``flash_attn`` package (tests/doubles/flash_attn_double).
"""

from __future__ import annotations

import ast
import sys
import types

import pytest

from ascend_rl_plugins.features import rope_registry
from tests.features.rope_registry.engine_checks import FLASH_ATTN_DOUBLE
from tests.features.shared_engine import part
from tests.features.upstream_source import STACKS, method, module_path, parse


@pytest.fixture(scope="module")
def engine(shared_engine):
    return part(shared_engine, "rope_registry")


def test_flash_attn_kernel_is_not_picked_on_npu(engine):
    assert engine["non_npu_patched"] is True, "the patch must not change the choice off NPU"
    assert engine["npu_patched"] is False
    # the same construction without the patch does pick it: the test has teeth
    assert engine["npu_unpatched"] is True


def test_real_engine_builds_its_rotary_embedding_without_flash_attn(engine):
    """The engine builds the tiny Qwen3 while the torch.npu double and the flash_attn double
    are visible. vLLM 0.13 has no platform guard, so without the patch its rotary embedding
    would take the flash_attn kernel; vLLM 0.23 excludes the CPU platform itself, so there
    this holds even unpatched (the construction test above covers 0.23)."""
    assert engine["state"] == "applied"
    assert engine["instances"] >= 1
    assert engine["flash_attn_picked"] == [False] * engine["instances"]


def test_only_the_rotary_module_global_is_replaced(engine):
    """``importlib.util.find_spec`` itself and vLLM's other ``from importlib.util import
    find_spec`` copies keep the real function in the patched engine process."""
    assert engine["importlib_untouched"] is True
    assert engine["other_copy_untouched"] is True


def test_replacement_defers_to_importlib_for_everything_else(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(npu=object()))
    assert rope_registry.find_spec_hiding_flash_attn_on_npu("flash_attn") is None
    assert rope_registry.find_spec_hiding_flash_attn_on_npu("flash_attn.ops") is None
    assert rope_registry.find_spec_hiding_flash_attn_on_npu("json") is not None
    # vllm-ascend's own FA3 package (flash_attn_npu_v3) must stay visible
    (tmp_path / "flash_attn_npu_v3.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert rope_registry.find_spec_hiding_flash_attn_on_npu("flash_attn_npu_v3") is not None
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace())  # no torch.npu
    monkeypatch.syspath_prepend(FLASH_ATTN_DOUBLE)
    assert rope_registry.find_spec_hiding_flash_attn_on_npu("flash_attn") is not None


@pytest.mark.parametrize("stack", STACKS)
def test_hook_point_is_a_module_global_find_spec_in_both_vllm_versions(stack):
    """vLLM's rotary common module imports ``find_spec`` into its own namespace and
    ApplyRotaryEmb.__init__ calls it by that name with "flash_attn"."""
    tree = parse(module_path(stack, "vllm", "vllm.model_executor.layers.rotary_embedding.common"))
    assert any(isinstance(n, ast.ImportFrom) and n.module == "importlib.util"
               and any(a.name == "find_spec" and a.asname is None for a in n.names) for n in tree.body)
    init = method(tree, "ApplyRotaryEmb", "__init__")
    calls = [n for n in ast.walk(init) if isinstance(n, ast.Call) and ast.unparse(n.func) == "find_spec"]
    assert [ast.literal_eval(c.args[0]) for c in calls] == ["flash_attn"]
