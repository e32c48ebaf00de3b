"""npugraph_ex static-kernel typo: proven fixed upstream (or absent) in both vLLM-Ascend
versions by reading their sources; the never-applied replacement equals 0.23's function.
All checks here run on real upstream source (AST, and 0.23's function compiled from it)."""

from __future__ import annotations

import ast
import os
import types

import pytest
from hypothesis import given, strategies as st

from ascend_rl_plugins.features import npugraph_ex as feature
from ascend_rl_plugins.patching import versions
from upstream_source import STACKS, compile_functions, module_path, parse, source_root, top_level

MISSPELT = {"num_speculative_token", "max_num_seq", "cudagraph_capture_size"}
CORRECT = {"num_speculative_tokens", "max_num_seqs", "cudagraph_capture_sizes"}
PATCH = feature.FEATURE.patches[0]


def _attribute_names(root: str) -> set[str]:
    names = set()
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                try:
                    tree = parse(os.path.join(dirpath, name))
                except SyntaxError:
                    continue
                names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    return names


@pytest.mark.parametrize("stack", STACKS)
def test_no_vllm_ascend_source_reads_the_misspelt_attributes(stack):
    used = _attribute_names(os.path.join(source_root(stack, "vllm_ascend"), "vllm_ascend"))
    assert not (used & MISSPELT), sorted(used & MISSPELT)


def test_0_13_has_no_static_kernel_batch_size_computation():
    path = module_path("recipe", "vllm_ascend", "vllm_ascend.compilation.compiler_interface")
    tree = parse(path)
    with pytest.raises(LookupError):
        top_level(tree, "_compute_decode_cudagraph_batch_sizes")
    compile_fn = top_level(tree, "npugraph_ex_compile")
    attrs = {n.attr for n in ast.walk(compile_fn) if isinstance(n, ast.Attribute)}
    assert "_aclnn_static_shape_kernel" in attrs  # it only switches the static kernel on
    assert not (attrs & (MISSPELT | CORRECT))


def test_0_23_reads_the_correct_attributes():
    path = module_path("current", "vllm_ascend", "vllm_ascend.compilation.compiler_interface")
    fn = top_level(parse(path), "_compute_decode_cudagraph_batch_sizes")
    attrs = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
    assert CORRECT <= attrs


configs = st.builds(
    lambda spec, seqs, sizes: types.SimpleNamespace(
        speculative_config=None if spec is None else types.SimpleNamespace(num_speculative_tokens=spec),
        scheduler_config=types.SimpleNamespace(max_num_seqs=seqs),
        compilation_config=types.SimpleNamespace(cudagraph_capture_sizes=sorted(set(sizes)))),
    st.one_of(st.none(), st.integers(0, 4)), st.integers(1, 64), st.lists(st.integers(1, 512), max_size=20))


@pytest.fixture(scope="module")
def upstream_0_23():
    path = module_path("current", "vllm_ascend", "vllm_ascend.compilation.compiler_interface")
    return compile_functions(path, ["_compute_decode_cudagraph_batch_sizes"], {})["_compute_decode_cudagraph_batch_sizes"]


def test_replacement_equals_the_fixed_upstream_function(upstream_0_23):
    @given(configs)
    def check(config):
        assert feature.decode_graph_batch_sizes(config) == upstream_0_23(config)
    check()


def test_declared_with_an_empty_range_and_reported_fixed_upstream():
    spec = versions.parse_specifier(PATCH.versions_text)
    for v in ("0.9.0", "0.11.0", "0.13.0", "0.13.0rc1", "0.18.0", "0.23.0", "0.23.0.post1", "1.0.0"):
        assert not versions.in_range(v, spec), v
    assert PATCH.fixed_upstream and "0.23" in PATCH.fixed_upstream
