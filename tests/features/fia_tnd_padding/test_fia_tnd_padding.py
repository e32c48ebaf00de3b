"""FIA TND padding (vLLM-Ascend 0.13 only; 0.23 fixed upstream).

Real code: ``pad_fia_tnd`` and the wrapper; vLLM-Ascend 0.13's own
``_update_attn_fia_params`` and ``_pad_attention_seq_params`` compiled from its source.
Doubles (tests/doubles/torch_npu_double.py): ``torch.npu`` stream/graph-update calls and
``torch_npu.npu_fused_infer_attention_score`` (records what the FIA op would receive); graph
params, forward context and metadata as plain objects.
"""

from __future__ import annotations

import types

import pytest
import wrapt
from hypothesis import given, strategies as st

from ascend_rl_plugins.features import fia_tnd_padding as feature
from ascend_rl_plugins.patching.core import REGISTRY
from tests.doubles.torch_npu_double import FusedInferAttentionScoreDouble, TorchNpuNamespaceDouble
from tests.features.upstream_source import (calls_in, compile_functions, decision, method, module_path, parse,
                                            top_level)

PATCH = REGISTRY.patches["fia_tnd_padding.update_attn_fia_params"]  # the framework installs PATCH.impl


@st.composite
def batches(draw):
    step = draw(st.integers(1, 4))
    q_lens = draw(st.lists(st.integers(1, step), max_size=12))
    ends, total = [], 0
    for n in q_lens:
        total += n
        ends.append(total)
    kv = draw(st.lists(st.integers(0, 4096), min_size=len(ends), max_size=len(ends)))
    runtime_shape = max(1, total + draw(st.integers(0, 40)))  # graph sizes are >= 1
    return ends, kv, runtime_shape, step


@given(batches())
def test_padding_reaches_the_token_count_and_keeps_the_real_requests(batch):
    q, kv, runtime_shape, step = batch
    q_before, kv_before = list(q), list(kv)
    new_q, new_kv = feature.pad_fia_tnd(q, kv, runtime_shape, step)
    assert (q, kv) == (q_before, kv_before), "inputs must not be mutated"
    assert new_q[:len(q)] == q and new_kv[:len(kv)] == kv
    assert new_q[-1] == runtime_shape
    assert len(new_kv) == len(new_q)
    assert all(x == 0 for x in new_kv[len(kv):])
    prev = q[-1] if q else 0
    for end in new_q[len(q):]:
        assert 1 <= end - prev <= step  # decode-shaped dummy requests
        prev = end
    if q and q[-1] == runtime_shape:
        assert new_q is q  # already padded: untouched


def test_padding_examples():
    assert feature.pad_fia_tnd([1, 2, 3], [5, 6, 7], 6) == ([1, 2, 3, 4, 5, 6], [5, 6, 7, 0, 0, 0])
    assert feature.pad_fia_tnd([2, 4], [9, 9], 9, step=2) == ([2, 4, 6, 8, 9], [9, 9, 0, 0, 0])
    assert feature.pad_fia_tnd([], [], 2) == ([1, 2], [0, 0])
    with pytest.raises(ValueError, match="step"):
        feature.pad_fia_tnd([1], [1], 4, step=0)


# -- the real vLLM-Ascend 0.13 update function, run against doubles -------------------------

def _upstream_update(graph_params):
    path = module_path("recipe", "vllm_ascend", "vllm_ascend.compilation.acl_graph")
    npu = TorchNpuNamespaceDouble()
    fia = FusedInferAttentionScoreDouble()
    ns = {"torch": types.SimpleNamespace(npu=npu),
          "torch_npu": types.SimpleNamespace(npu_fused_infer_attention_score=fia),
          "get_graph_params": lambda: graph_params, "get_draft_graph_params": lambda: graph_params,
          "Optional": None}
    compile_functions(path, ["_pad_attention_seq_params", "_update_attn_fia_params"], ns)
    return ns, fia


class _Metadata:  # the two fields the update reads (AscendMetadata in va 0.13)
    def __init__(self, q, kv):
        self.actual_seq_lengths_q = q
        self.seq_lens_list = kv


def _scenario():
    runtime_shape, layers = 8, 2
    shared = _Metadata([1, 2, 3], [17, 5, 9])  # layers share one metadata object
    attn_metadata = {f"layer.{i}": shared for i in range(layers)}
    param = tuple(f"p{i}" for i in range(13))
    graph_params = types.SimpleNamespace(attn_params={runtime_shape: [param] * layers},
                                         handles={runtime_shape: ["h0", "h1"]},
                                         events={runtime_shape: [types.SimpleNamespace(record=lambda s: None)] * layers},
                                         workspaces={})
    forward_context = types.SimpleNamespace(is_draft_model=False, attn_metadata=attn_metadata)
    return runtime_shape, shared, graph_params, forward_context


def test_real_update_receives_padded_lists_with_the_wrapper_and_unpadded_without():
    runtime_shape, shared, graph_params, forward_context = _scenario()
    ns, fia = _upstream_update(graph_params)
    ns["_update_attn_fia_params"]("stream", forward_context, runtime_shape, None, None)
    unpatched = [(c["actual_seq_lengths"], c["actual_seq_lengths_kv"]) for c in fia.calls]
    assert unpatched == [([1, 2, 3], [17, 5, 9])] * 2  # the bug: ends at 3, graph has 8 tokens

    fia.calls.clear()
    wrapped = wrapt.FunctionWrapper(ns["_update_attn_fia_params"], PATCH.impl)
    ns["_update_attn_fia_params"] = wrapped
    spec = types.SimpleNamespace(speculative_config=None)
    wrapped("stream", forward_context, runtime_shape, None, spec)
    patched = [(c["actual_seq_lengths"], c["actual_seq_lengths_kv"]) for c in fia.calls]
    assert patched == [([1, 2, 3, 4, 5, 6, 7, 8], [17, 5, 9, 0, 0, 0, 0, 0])] * 2
    assert all(c["input_layout"] == "TND" for c in fia.calls)
    # the engine's metadata object is untouched
    assert shared.actual_seq_lengths_q == [1, 2, 3] and shared.seq_lens_list == [17, 5, 9]


def test_speculative_step_and_keyword_call_and_draft_model_is_left_to_upstream():
    runtime_shape, shared, graph_params, forward_context = _scenario()
    shared.actual_seq_lengths_q, shared.seq_lens_list = [2, 4], [10, 11]
    ns, fia = _upstream_update(graph_params)
    wrapped = wrapt.FunctionWrapper(ns["_update_attn_fia_params"], PATCH.impl)
    config = types.SimpleNamespace(speculative_config=types.SimpleNamespace(num_speculative_tokens=1))
    wrapped(update_stream="s", forward_context=forward_context, runtime_shape=runtime_shape,
            draft_attn_metadatas=None, vllm_config=config)
    assert fia.calls[0]["actual_seq_lengths"] == [2, 4, 6, 8]
    assert fia.calls[0]["actual_seq_lengths_kv"] == [10, 11, 0, 0]
    # draft model: upstream pads itself; the wrapper passes everything through unchanged
    seen = []
    passthrough = wrapt.FunctionWrapper(lambda *a, **k: seen.append((a, k)), PATCH.impl)
    draft_context = types.SimpleNamespace(is_draft_model=True, attn_metadata={})
    passthrough("s", draft_context, runtime_shape, ["draft"], config)
    assert seen == [(("s", draft_context, runtime_shape, ["draft"], config), {})]


def test_hook_point_in_vllm_ascend_0_13():
    path = module_path("recipe", "vllm_ascend", "vllm_ascend.compilation.acl_graph")
    tree = parse(path)
    fn = top_level(tree, "_update_attn_fia_params")
    assert tuple(a.arg for a in fn.args.args) == feature._PARAMS
    # update_attn_params reaches it through the module global (no from-import copy)
    assert "_update_attn_fia_params" in calls_in(top_level(tree, "update_attn_params"))
    # the main-model branch reads the metadata lists unpadded (what the patch is for)
    src = open(path, encoding="utf-8").read()
    assert "actual_seq_lengths_q = attn_metadata[key].actual_seq_lengths_q" in src


def test_applies_on_vllm_ascend_0_13_and_is_not_needed_on_0_23(flag_env):
    """0.23 pads the main model's lists itself (the model runner inserts a padding request)."""
    flag_env(ASCEND_RL_FIA_TND_PADDING=1)
    assert decision(PATCH, "recipe").apply
    d = decision(PATCH, "current")
    assert not d.apply and d.verdict(PATCH) == (f"not needed: {d.version_why}", False)
    fix = method(parse(module_path("current", "vllm_ascend", "vllm_ascend.worker.model_runner_v1")),
                 "NPUModelRunner", "_pad_query_start_loc_for_fia")
    assert [a.arg for a in fix.args.args][:3] == ["self", "query_start_loc", "num_tokens_padded"]
