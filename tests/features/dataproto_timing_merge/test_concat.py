"""dataproto_timing_merge: verl's real ``DataProto.concat`` with per-worker ``timing``.

Real code: verl's ``DataProto`` (0.6.1 in the recipe stack, 0.9.1 in the current one) and its
collect path ``verl.single_controller.base.decorator._concat_data_proto_or_future``; the
declared patch applied by the framework's registry (``@pytest.mark.forked``: patches are
process-global). No doubles.
"""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from ascend_rl_plugins.features import dataproto_timing_merge as feature
from ascend_rl_plugins.patching.core import REGISTRY
from tests.features.data_rebalance.verl_env import import_verl

protocol, decorator = import_verl("verl.protocol", "verl.single_controller.base.decorator")

PATCH = REGISTRY.patches["dataproto_timing_merge.concat"]
CONFLICT = "Conflicting values for meta_info key"

# -- the merge rule (pure) -----------------------------------------------------------------

numbers = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False))
timing_dicts = st.dictionaries(st.sampled_from(["gen", "generation_timing/max", "generation_timing/min", "x"]),
                               numbers, max_size=4)


@given(st.lists(timing_dicts, min_size=1, max_size=5))
def test_merge_is_the_per_key_max_over_the_chunks_that_have_the_key(timings):
    merged = feature.merge_timings(timings)
    assert set(merged) == set().union(*timings)
    for key, value in merged.items():
        assert value == max(t[key] for t in timings if key in t)


@pytest.mark.parametrize("bad", [{"gen": "1.0"}, {"gen": True}, {"gen": [1.0]}, 3.0, None])
def test_merge_refuses_anything_but_dicts_of_numbers(bad):
    assert feature.merge_timings([{"gen": 1.0}, bad]) is None


# -- the real DataProto ---------------------------------------------------------------------

def _chunks(timings, extra=None):
    """One DataProto per worker: a tensor batch, a non-tensor column, metrics and timing."""
    import numpy as np
    import torch
    out = []
    for rank, timing in enumerate(timings):
        meta = {"timing": timing, "eos_token_id": 2, "metrics": {"rank": rank}}
        meta.update((extra or {}).get(rank, {}))
        out.append(protocol.DataProto.from_dict(
            tensors={"responses": torch.arange(6, dtype=torch.int64).reshape(2, 3) + 10 * rank,
                     "log_probs": torch.randn(2, 3, generator=torch.Generator().manual_seed(rank))},
            non_tensors={"uid": np.array([f"r{rank}a", f"r{rank}b"], dtype=object)},
            meta_info=meta))
    return out


# two ranks' all-reduced timings that differ in the last bits (the numbers of verl-project/verl#4030)
T0 = {"generate_sequences": 73.94637298583984, "generation_timing/max": 75.57780456542969}
T1 = {"generate_sequences": 73.94638061523438, "generation_timing/max": 75.57780456542969, "only_here": 1.5}


@pytest.fixture
def unpatched():
    """verl's pristine ``DataProto.concat`` in this (forked) process. On verl >= 0.9 ``import
    verl`` loads ascend-rl through the ``verl.plugins`` entry point, and this patch is on by
    default, so it may already be applied: revert it (only this forked child is affected)."""
    DataProto = protocol.DataProto
    if PATCH.outcome.state == "applied":
        REGISTRY.revert(PATCH)
    assert type(vars(DataProto)["concat"]) is staticmethod
    return DataProto


@pytest.mark.forked
def test_without_the_patch_the_real_assert_fires(unpatched):
    """The test's teeth: verl's own concat refuses timings that differ in the last bits."""
    DataProto = unpatched
    with pytest.raises(AssertionError, match=CONFLICT):
        DataProto.concat(_chunks([T0, T1]))


@pytest.mark.forked  # the registry and the DataProto class are process-global
def test_different_timings_concat_with_the_max_merged(unpatched):
    import torch
    DataProto = unpatched
    reference = DataProto.concat(_chunks([T0, T0]))  # equal timings: verl's own result
    assert REGISTRY.apply(PATCH), PATCH.outcome
    chunks = _chunks([T0, T1])
    merged = DataProto.concat(chunks)
    assert merged.meta_info["timing"] == {"generate_sequences": T1["generate_sequences"],
                                          "generation_timing/max": T0["generation_timing/max"],
                                          "only_here": 1.5}
    # everything else is exactly what verl computes
    for key in reference.batch.keys():
        assert torch.equal(merged.batch[key], reference.batch[key])
    assert list(merged.non_tensor_batch["uid"]) == list(reference.non_tensor_batch["uid"])
    assert merged.meta_info["metrics"] == reference.meta_info["metrics"] == {"rank": [0, 1]}
    assert merged.meta_info["eos_token_id"] == 2
    # the callers' chunks are left as they were
    assert [c.meta_info["timing"] for c in chunks] == [T0, T1]


@pytest.mark.forked
def test_a_different_non_timing_key_still_raises(unpatched):
    DataProto = unpatched
    assert REGISTRY.apply(PATCH), PATCH.outcome
    with pytest.raises(AssertionError, match=CONFLICT + " 'eos_token_id'"):
        DataProto.concat(_chunks([T0, T1], extra={1: {"eos_token_id": 3}}))
    # a timing that is not a dict of numbers is left to verl's strict check
    with pytest.raises(AssertionError, match=CONFLICT + " 'timing'"):
        DataProto.concat(_chunks([T0, {"generate_sequences": "slow"}]))


@pytest.mark.forked
def test_verl_collect_path_merges_through_the_patched_staticmethod(unpatched):
    """What a worker group's collect function calls with the workers' outputs."""
    DataProto = unpatched
    _concat_data_proto_or_future = decorator._concat_data_proto_or_future
    assert REGISTRY.apply(PATCH), PATCH.outcome
    pristine = PATCH.original
    assert type(pristine) is staticmethod and vars(DataProto)["concat"] is not pristine
    out = _concat_data_proto_or_future(_chunks([T0, T1, T0]))
    assert len(out) == 6 and out.meta_info["timing"]["generate_sequences"] == T1["generate_sequences"]
    REGISTRY.revert(PATCH)
    assert vars(DataProto)["concat"] is pristine  # the very staticmethod verl defined
    with pytest.raises(AssertionError, match=CONFLICT):
        _concat_data_proto_or_future(_chunks([T0, T1]))


@pytest.mark.parametrize("stack", ["recipe", "current"])
def test_both_verl_versions_still_have_the_strict_assert(stack):
    """Static: ``DataProto.concat`` in verl 0.6.1 and 0.9.1 still asserts equality of every
    non-metrics meta_info key (the bug this patch works around is not fixed upstream)."""
    import ast

    from tests.features.upstream_source import method, module_path, parse
    node = method(parse(module_path(stack, "verl", "verl.protocol")), "DataProto", "concat")
    asserts = [ast.unparse(n.test) for n in ast.walk(node) if isinstance(n, ast.Assert)]
    assert "merged_meta_info[k] == v" in asserts
    assert any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
