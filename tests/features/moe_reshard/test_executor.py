"""moe_reshard executor: real Megatron-Core MoE models on 4 and 8 gloo processes, resharded by
``reshard_experts`` (all_to_all_single, double-buffered) to vLLM rollout layouts; every rollout
rank must receive exactly the tensors its loader keeps, bit-identical to a single-process HF
reference built from the same canonical weights.

Real: Megatron-Core (0.12.1 / 0.16.1) GPTModel with SequentialMLP and legacy GroupedMLP experts
(tests/support/megatron.py), its parallel_state rank groups, torch.distributed gloo.
Pipeline stages (uneven, virtual) and TEGroupedMLP names, which the CPU harness cannot build, run
on the same groups with expert tensors cut by layout.hf_to_megatron (bf16).
Rollout layouts (what vLLM's fused-MoE loader keeps) come from layout.rollout_view, itself
checked against vLLM's loader source in test_layout.py.
"""

from __future__ import annotations

import pytest

from tests.support.child import run_group
from tests.support.stacks import require_installed

SCENARIO = "tests.features.moe_reshard.executor_scenario"
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "ASCEND_RL_AUTOLOAD": "0"}


@pytest.fixture(scope="module")
def world4():
    require_installed("torch", "megatron-core")
    return run_group(SCENARIO, "world4", 4, env=ENV, timeout=600)


@pytest.fixture(scope="module")
def world8():
    require_installed("torch", "megatron-core")
    return run_group(SCENARIO, "world8", 8, env=ENV, timeout=900)


def _check(ranks, trainings):
    for r in ranks:
        assert r["coord_mismatches"] == [], r["coord_mismatches"]
        seen = {c["training"] for c in r["cases"]}
        assert seen == trainings, seen
        for c in r["cases"]:
            where = f"rank {r['rank']} {c['training']} -> {c['rollout']}"
            assert c["mismatches"] == [], where
            assert c["same_multiset"] and c["yielded"] == c["expected"], where
            assert c["layer_order"], where
            assert c["received"] == c["minimum"], where
            assert c["projs"] or c["yielded"] == 0, where
    # every case delivers something somewhere (a rank may host no expert: the redundant map on 8)
    for i in range(len(ranks[0]["cases"])):
        assert sum(r["cases"][i]["yielded"] for r in ranks) > 0
    # the plan is the same on every rank
    for i in range(len(ranks[0]["cases"])):
        assert len({r["cases"][i]["digest"] for r in ranks}) == 1
    # the bucket forces several rounds (double buffering exercised)
    assert max(c["rounds"] for c in ranks[0]["cases"]) >= 3


def test_four_ranks_sequential_etp1_and_grouped_etp2_bit_identical(world4):
    _check(world4, {"sequential tp2 ep2 etp1 E8", "grouped tp1 ep2 etp2 E8",
                    "synthetic grouped tp1 pp2 vpp1 ep2 etp1", "synthetic te_grouped tp2 pp2 vpp2 ep1 etp2"})


def test_eight_ranks_sequential_etp2_and_grouped_etp1_bit_identical(world8):
    _check(world8, {"sequential tp2 ep4 etp2 E8", "grouped tp2 ep4 etp1 E8", "synthetic grouped tp2 pp2 vpp1 ep2 etp2"})


def test_redundant_expert_is_yielded_once_per_hosted_copy(world4):
    rank0 = world4[0]
    case = next(c for c in rank0["cases"] if c["rollout"] == "ep_redundant_uneven")
    # rank 0 hosts 2 linear experts + a moved one + one of rank 1's + its own first again: 5 slots
    # x 3 projections x 2 layers
    assert case["yielded"] == 5 * 3 * 2
    last = next(c for c in world4[-1]["cases"] if c["rollout"] == "ep_redundant_uneven")
    assert last["yielded"] == 1 * 3 * 2                                   # uneven: one expert left


def test_plan_error_is_raised_before_any_communication():
    """No process group exists here: an unplannable layout must fail in planning."""
    require_installed("torch", "megatron-core")
    import torch

    from ascend_rl_plugins.features.moe_reshard.executor import reshard_experts
    from ascend_rl_plugins.features.moe_reshard.layout import MoEShape, RolloutLayout, TrainingLayout
    from ascend_rl_plugins.features.moe_reshard.planner import PlanError

    shape = MoEShape(num_layers=1, num_experts=6, hidden=8, ffn_hidden=4, dtype_bytes=4)
    local = {"decoder.layers.0.mlp.experts.weight1": torch.zeros(8, 3 * 8)}
    with pytest.raises(PlanError, match="not divisible by training ep 4"):
        reshard_experts(local, shape=shape, training=TrainingLayout(tp=1, ep=4, expert_impl="grouped"),
                        rollout=RolloutLayout(1, 4), bucket_bytes=1 << 20, rank=0)


def test_round_k_plus_1_is_in_flight_while_round_k_is_yielded(monkeypatch):
    """Double buffering, observed on rank 0 of a 2-rank layout with the collective replaced by a
    recorder (no process group here; the payload is not checked -- the gloo runs above do that)."""
    require_installed("torch", "megatron-core")
    import torch
    import torch.distributed as dist

    from ascend_rl_plugins.features.moe_reshard.executor import reshard_experts
    from ascend_rl_plugins.features.moe_reshard.layout import MoEShape, RolloutLayout, TrainingLayout, hf_to_megatron, \
        hf_expert_name

    events = []

    class Work:
        def __init__(self, k):
            self.k = k

        def wait(self):
            events.append(("wait", self.k))

    def fake_all_to_all_single(out, inp, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        k = sum(1 for e in events if e[0] == "post")
        events.append(("post", k))
        out.zero_()
        return Work(k)

    monkeypatch.setattr(dist, "all_to_all_single", fake_all_to_all_single)
    shape = MoEShape(num_layers=4, num_experts=2, hidden=4, ffn_hidden=4, dtype_bytes=4)
    training = TrainingLayout(tp=1, ep=2, expert_impl="grouped")
    rollout = RolloutLayout.from_expert_maps(1, 2, [[1], [0]])       # every slice crosses
    hf = {hf_expert_name(l, e, p): torch.ones(4, 4) for l in range(4) for e in range(2)
          for p in ("gate_proj", "up_proj", "down_proj")}
    local = hf_to_megatron(hf, shape, training.with_world(2), 0)
    for name, _ in reshard_experts(local, shape=shape, training=training, rollout=rollout, bucket_bytes=64 * 3,
                                   rank=0):
        events.append(("yield", int(name.split(".")[2])))
    posts = [e for e in events if e[0] == "post"]
    assert len(posts) >= 3
    first_yield = next(i for i, e in enumerate(events) if e[0] == "yield")
    assert [e[0] for e in events[:first_yield]] == ["post", "post", "wait"]   # round 1 posted before round 0 is yielded
    for k in range(len(posts) - 1):
        assert events.index(("post", k + 1)) < events.index(("wait", k))


def test_the_executor_plans_once_per_layout_and_refuses_a_plan_that_fails_validation(monkeypatch):
    """``prepare_reshard`` takes the plan from the process's cache: the second sync of the same
    layout does not plan; a plan that fails validation is a PlanError before any communication."""
    require_installed("torch", "megatron-core")
    import torch

    from ascend_rl_plugins.features.moe_reshard import planner
    from ascend_rl_plugins.features.moe_reshard.executor import prepare_reshard
    from ascend_rl_plugins.features.moe_reshard.layout import MoEShape, RolloutLayout, TrainingLayout, hf_expert_name, \
        hf_to_megatron

    shape = MoEShape(num_layers=2, num_experts=2, hidden=4, ffn_hidden=4, dtype_bytes=4)
    training, rollout = TrainingLayout(tp=1, ep=2, expert_impl="grouped"), RolloutLayout.from_expert_maps(1, 2, [[1], [0]])
    hf = {hf_expert_name(l, e, p): torch.ones(4, 4) for l in range(2) for e in range(2)
          for p in ("gate_proj", "up_proj", "down_proj")}
    local = hf_to_megatron(hf, shape, training.with_world(2), 0)
    cache = planner.PlanCache()
    kwargs = dict(shape=shape, training=training, rollout=rollout, bucket_bytes=1 << 20, rank=0, cache=cache)
    first, second = prepare_reshard(local, **kwargs), prepare_reshard(local, **kwargs)
    assert not first.cached and second.cached and second.plan is first.plan and second.key == first.key
    monkeypatch.setattr(planner.Plan, "validate", lambda self: (_ for _ in ()).throw(planner.PlanError("lost a round")))
    with pytest.raises(planner.PlanError, match="lost a round"):
        prepare_reshard(local, **{**kwargs, "cache": planner.PlanCache()})
