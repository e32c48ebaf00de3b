"""RoPE registry: the real ApplyRotaryEmb must not pick flash_attn's Triton kernel on NPU.

Real code: vLLM's ApplyRotaryEmb (both stacks), the patch, importlib. Doubles: ``torch.npu``
(a bare module attribute, which is all the patch and vLLM's branch look at) and a
``flash_attn`` package (tests/engine_patches/doubles/flash_attn_double) that makes
``find_spec("flash_attn")`` succeed. On vLLM 0.23 the CPU platform is excluded upstream, so
``current_platform.is_cpu`` is made to answer False, as the NPU platform does.
"""

from __future__ import annotations

import os

import pytest

from helpers import run_python, vllm_version

pytestmark = pytest.mark.skipif(vllm_version() is None, reason="vLLM is not installed in this interpreter")

FLASH_ATTN_DOUBLE = os.path.join(os.path.dirname(__file__), "doubles", "flash_attn_double")

SCRIPT = r"""
import sys, types
sys.path.insert(0, FLASH_ATTN_DOUBLE)
from ascend_rl_plugins import plugin
plugin.activate("test")
from ascend_rl_plugins.patching.core import REGISTRY
import torch
import vllm.model_executor.layers.rotary_embedding.common as common
from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb
if hasattr(common, "current_platform"):  # vLLM >= 0.14 excludes the CPU platform itself
    common.current_platform.is_cpu = lambda: False

from vllm.config import VllmConfig, set_current_vllm_config
config = VllmConfig()

def picks_flash_attn():
    with set_current_vllm_config(config):  # CustomOp construction reads it in vLLM 0.23
        return ApplyRotaryEmb().apply_rotary_emb_flash_attn is not None

patch = REGISTRY.patches["rope_registry.find_spec"]
out = {"state": patch.outcome.state}
out["non_npu_patched"] = picks_flash_attn()          # a CUDA host keeps vLLM's choice
torch.npu = types.ModuleType("torch_npu_double")     # what torch_npu registers
out["npu_patched"] = picks_flash_attn()
REGISTRY.revert(patch)
out["npu_unpatched"] = picks_flash_attn()
emit(out)
"""


def test_flash_attn_kernel_is_not_picked_on_npu():
    result = run_python(SCRIPT.replace("FLASH_ATTN_DOUBLE", repr(FLASH_ATTN_DOUBLE)),
                        env={"VLLM_LOGGING_LEVEL": "ERROR"})
    assert result["non_npu_patched"] is True, "the patch must not change the choice off NPU"
    assert result["npu_patched"] is False
    assert result["state"] == "applied"
    # the same construction without the patch does pick it: the test has teeth
    assert result["npu_unpatched"] is True


def test_only_the_rotary_module_global_is_rebound():
    """rebind=False: other modules' `from importlib.util import find_spec` copies stay."""
    from ascend_rl_plugins import plugin
    plugin.load_features()
    from ascend_rl_plugins.patching.core import REGISTRY
    patch = REGISTRY.patches["rope_registry.find_spec"]
    assert patch.rebind is False
    assert patch.kind == "replace"


def test_replacement_defers_to_importlib_for_everything_else(monkeypatch, tmp_path):
    import sys
    import types

    from ascend_rl_plugins.features import rope_registry
    fake_torch = types.SimpleNamespace(npu=object())
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    assert rope_registry.find_spec_hiding_flash_attn_on_npu("flash_attn") is None
    assert rope_registry.find_spec_hiding_flash_attn_on_npu("flash_attn.ops") is None
    assert rope_registry.find_spec_hiding_flash_attn_on_npu("json") is not None
    # vllm-ascend's own FA3 package (flash_attn_npu_v3) must stay visible
    (tmp_path / "flash_attn_npu_v3.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert rope_registry.find_spec_hiding_flash_attn_on_npu("flash_attn_npu_v3") is not None
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace())
    monkeypatch.syspath_prepend(FLASH_ATTN_DOUBLE)
    assert rope_registry.find_spec_hiding_flash_attn_on_npu("flash_attn") is not None


def test_real_engine_builds_its_rotary_embedding_without_flash_attn(engine_result):
    """A real CPU engine (conftest) builds the tiny Qwen3 while a torch.npu double and the
    flash_attn double are visible. vLLM 0.13 has no platform guard, so without the patch
    its rotary embedding would take the flash_attn kernel; vLLM 0.23 excludes the CPU
    platform itself, so there this engine check holds even unpatched (the construction
    test above covers 0.23 by making the platform answer 'not CPU')."""
    rope = engine_result["rope"]
    assert rope["instances"] >= 1
    assert rope["flash_attn_picked"] == [False] * rope["instances"]
    assert rope["state"] == "applied"


@pytest.mark.parametrize("stack", ["recipe", "current"])
def test_hook_point_is_a_module_global_find_spec_in_both_vllm_versions(stack):
    """Static conformance: vLLM's rotary common module imports ``find_spec`` into its own
    namespace and ApplyRotaryEmb.__init__ calls it by that name with "flash_attn"."""
    import ast

    from upstream_source import method, module_path, parse
    path = module_path(stack, "vllm", "vllm.model_executor.layers.rotary_embedding.common")
    tree = parse(path)
    assert any(isinstance(n, ast.ImportFrom) and n.module == "importlib.util"
               and any(a.name == "find_spec" and a.asname is None for a in n.names) for n in tree.body)
    init = method(tree, "ApplyRotaryEmb", "__init__")
    calls = [n for n in ast.walk(init) if isinstance(n, ast.Call) and ast.unparse(n.func) == "find_spec"]
    assert [ast.literal_eval(c.args[0]) for c in calls] == ["flash_attn"]
