"""The colocated (verl 0.9 ``naive``) path's configuration rules, in-process: which experts a
trainer rank's vLLM worker hosts under verl's rollout keys, which configurations are refused (a
vote against, so every rank falls back together), and that a dense model or a call outside a
colocated sync takes the stock export with no collective. The path itself, on verl's real
``MegatronEngine`` over 4 gloo ranks, is test_verl09_mcore_engine.py's."""

from __future__ import annotations

import pytest

from ascend_rl_plugins.features.moe_reshard.verl09_colocated import ColocatedRollout, current, patched_export, scope


def rollout(rank: int, **keys) -> ColocatedRollout:
    config = {"name": "vllm", "tensor_model_parallel_size": 1, "data_parallel_size": 1,
              "pipeline_model_parallel_size": 1, "expert_parallel_size": None, "engine_kwargs": {"vllm": {}}}
    config.update(keys)
    return ColocatedRollout.from_config(config, rank)


@pytest.mark.parametrize("keys, rank, hosted", [
    (dict(tensor_model_parallel_size=2, expert_parallel_size=2), 1, (4, 5, 6, 7)),
    (dict(tensor_model_parallel_size=2, expert_parallel_size=2,
          engine_kwargs={"vllm": {"expert_placement_strategy": "round_robin"}}), 1, (1, 3, 5, 7)),
    (dict(tensor_model_parallel_size=2, data_parallel_size=2, expert_parallel_size=4), 3, (6, 7)),
    (dict(), 0, tuple(range(8))),                                  # TP 1 without EP: every expert
])
def test_a_rank_hosts_what_vllms_placement_rule_gives_its_rank_in_the_replica(keys, rank, hosted):
    r = rollout(rank, **keys)
    assert r.reason == "" and r.expert_map(8) == hosted


@pytest.mark.parametrize("keys, says", [
    (dict(engine_kwargs={"vllm": {"enable_eplb": True}}), "enable_eplb"),
    (dict(pipeline_model_parallel_size=2), "pipeline_model_parallel_size=2"),
    (dict(tensor_model_parallel_size=2), "without expert parallelism"),
    (dict(tensor_model_parallel_size=2, expert_parallel_size=2, engine_kwargs={"vllm": {"expert_placement_strategy":
                                                                                      "random"}}), "'random'"),
    (dict(disaggregation={"enabled": True}), "disaggregated"),
    (dict(name="sglang"), "vLLM workers only"),
])
def test_configurations_the_colocated_reshard_does_not_serve_are_a_reason(keys, says):
    assert says in rollout(0, **keys).reason


def test_outside_a_colocated_sync_or_for_a_dense_model_the_export_is_stock_with_no_collective():
    from types import SimpleNamespace
    stock = (iter([("model.embed_tokens.weight", None)]), None)
    moe = SimpleNamespace(tf_config=SimpleNamespace(num_moe_experts=8))
    dense = SimpleNamespace(tf_config=SimpleNamespace(num_moe_experts=None))
    assert patched_export(lambda: stock, moe, (), {}) is stock               # no scope: no vote, no group needed
    with scope(rollout(0)):
        assert current() == rollout(0)
        assert patched_export(lambda: stock, dense, (), {}) is stock
    assert current() is None
