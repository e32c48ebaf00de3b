"""Static target resolution: reads real upstream source, never imports it."""

import os
import sys

import pytest

from ascend_rl_plugins.doctor import cache_dir, stack_roots
from ascend_rl_plugins.patching.static import locate_module, resolve_static


def _stack(name):
    if not os.path.isdir(os.path.join(cache_dir(), "stacks", name, "src")):
        pytest.skip(f"stack {name} not built (bash .ci/stack.sh {name})")
    return stack_roots(name)[1]


def test_installed_vllm_targets_resolve_without_importing_vllm():
    pytest.importorskip("vllm")  # installed; but the check below must not import it
    before = set(sys.modules)
    r = resolve_static("vllm.v1.engine.llm_engine:LLMEngine.step")
    assert r.found and r.kind == "function" and r.params == ("self",)
    assert not any(m == "vllm" or m.startswith("vllm.") for m in set(sys.modules) - before)


def test_inherited_method_and_from_import_reexport_are_followed():
    pytest.importorskip("vllm")
    r = resolve_static("vllm.v1.worker.cpu_model_runner:CPUModelRunner.propose_draft_token_ids")
    assert r.found and r.file.endswith("gpu_model_runner.py") and any("inherits" in v for v in r.via)
    r = resolve_static("vllm.v1.worker.gpu_model_runner:NgramProposer")
    assert r.found and r.kind == "class" and r.file.endswith("ngram_proposer.py")


def test_missing_members_say_why():
    pytest.importorskip("vllm")
    r = resolve_static("vllm.v1.engine.llm_engine:LLMEngine.no_such_method")
    assert not r.found and "no member 'no_such_method'" in r.why
    r = resolve_static("vllm.v1.no_such_module:x")
    assert not r.found and "not found" in r.why


@pytest.mark.parametrize("stack", ["recipe", "current"])
def test_vllm_ascend_source_is_read_statically(stack):
    roots = _stack(stack)
    r = resolve_static("vllm_ascend.worker.worker:NPUWorker.sleep", roots)
    assert r.found and "vllm_ascend" in r.file
    # The reference map: spec_decode/interface.py exists in 0.13 and is gone in 0.23.
    r = resolve_static("vllm_ascend.spec_decode.interface:Proposer", roots)
    assert r.found == (stack == "recipe")


def test_locate_module_does_not_execute_parent_packages(tmp_path):
    pkg = tmp_path / "explodes"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('executed')\n")
    (pkg / "sub" / "__init__.py").write_text("raise RuntimeError('executed')\n")
    (pkg / "sub" / "mod.py").write_text("class A:\n    def f(self, x):\n        pass\n")
    assert locate_module("explodes.sub.mod", [str(tmp_path)]).endswith("mod.py")
    r = resolve_static("explodes.sub.mod:A.f", [str(tmp_path)])
    assert r.found and r.params == ("self", "x")


@pytest.mark.parametrize("stack", ["recipe", "current"])
def test_names_imported_from_the_standard_library_resolve_in_a_stack(stack):
    roots = _stack(stack)
    r = resolve_static("vllm.model_executor.layers.rotary_embedding.common:find_spec", roots)
    assert r.found and any("importlib.util" in v for v in r.via)
