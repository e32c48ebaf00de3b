"""npugraph_ex static-kernel typo: proven fixed upstream (or absent) in both vLLM-Ascend
versions by reading their sources; the decision engine never applies the patch on either
stack, even when its flag is set explicitly; and the never-applied replacement equals
0.23's function (compiled from its source), so widening the range would be safe."""

from __future__ import annotations

import ast
import os
import types

import pytest
from hypothesis import given, strategies as st

from ascend_rl_plugins.features import npugraph_ex as feature
from ascend_rl_plugins.patching.core import REGISTRY
from tests.features.upstream_source import (STACKS, compile_functions, decision, module_path, parse,
                                            python_files, source_root, top_level)

MISSPELT = {"num_speculative_token", "max_num_seq", "cudagraph_capture_size"}
CORRECT = {"num_speculative_tokens", "max_num_seqs", "cudagraph_capture_sizes"}
PATCH = REGISTRY.patches["npugraph_ex.decode_graph_batch_sizes"]
COMPILER = "vllm_ascend.compilation.compiler_interface"


def _attribute_names(root: str) -> set[str]:
    names = set()
    for path in python_files(root):
        try:
            tree = parse(path)
        except SyntaxError:
            continue
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    return names


@pytest.mark.parametrize("stack", STACKS)
def test_no_vllm_ascend_source_reads_the_misspelt_attributes(stack):
    used = _attribute_names(os.path.join(source_root(stack, "vllm_ascend"), "vllm_ascend"))
    assert not (used & MISSPELT), sorted(used & MISSPELT)


def test_0_13_has_no_static_kernel_batch_size_computation():
    tree = parse(module_path("recipe", "vllm_ascend", COMPILER))
    with pytest.raises(LookupError):
        top_level(tree, "_compute_decode_cudagraph_batch_sizes")
    attrs = {n.attr for n in ast.walk(top_level(tree, "npugraph_ex_compile")) if isinstance(n, ast.Attribute)}
    assert "_aclnn_static_shape_kernel" in attrs  # it only switches the static kernel on
    assert not (attrs & (MISSPELT | CORRECT))


def test_0_23_reads_the_correct_attributes():
    fn = top_level(parse(module_path("current", "vllm_ascend", COMPILER)), "_compute_decode_cudagraph_batch_sizes")
    assert CORRECT <= {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}


@pytest.mark.parametrize("stack", STACKS)
def test_never_applied_and_reported_not_needed_even_when_switched_on(stack, flag_env):
    flag_env(ASCEND_RL_NPUGRAPH_EX_FIX=1)
    d = decision(PATCH, stack)
    assert d.flag_on and not d.apply
    verdict, problem = d.verdict(PATCH)
    assert verdict.startswith("not needed") and "fixed upstream" in verdict
    assert not problem


configs = st.builds(
    lambda spec, seqs, sizes: types.SimpleNamespace(
        speculative_config=None if spec is None else types.SimpleNamespace(num_speculative_tokens=spec),
        scheduler_config=types.SimpleNamespace(max_num_seqs=seqs),
        compilation_config=types.SimpleNamespace(cudagraph_capture_sizes=sorted(set(sizes)))),
    st.one_of(st.none(), st.integers(0, 4)), st.integers(1, 64), st.lists(st.integers(1, 512), max_size=20))


@pytest.fixture(scope="module")
def upstream_0_23():
    path = module_path("current", "vllm_ascend", COMPILER)
    return compile_functions(path, ["_compute_decode_cudagraph_batch_sizes"], {})["_compute_decode_cudagraph_batch_sizes"]


def test_replacement_equals_the_fixed_upstream_function(upstream_0_23):
    @given(configs)
    def check(config):
        assert feature.decode_graph_batch_sizes(config) == upstream_0_23(config)
    check()
