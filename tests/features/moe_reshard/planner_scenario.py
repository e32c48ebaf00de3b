"""Fresh-interpreter checks of the pure moe_reshard modules (run by ``run_scenario``): the
pytest process's module list and hash seed are not the ones a trainer rank starts with."""

from __future__ import annotations

import sys


def torch_after_importing_layout_and_planner() -> bool:
    """Whether importing the layout algebra and the planner pulled in torch."""
    import ascend_rl_plugins.features.moe_reshard.layout  # noqa: F401
    import ascend_rl_plugins.features.moe_reshard.planner  # noqa: F401
    return "torch" in sys.modules


def digest_of_a_pipelined_round_robin_plan() -> str:
    """The digest of the plan ``test_planner.test_the_same_plan_in_another_interpreter`` also
    computes in the pytest process."""
    from ascend_rl_plugins.features.moe_reshard.layout import MoEShape, RolloutLayout, TrainingLayout
    from ascend_rl_plugins.features.moe_reshard.planner import plan
    shape = MoEShape(num_layers=6, num_experts=8, hidden=8, ffn_hidden=8, moe_layers=(1, 2, 3, 5))
    training = TrainingLayout(tp=2, pp=2, ep=2, etp=2, layer_stages=(0, 0, 0, 1, 1, 1))
    rollout = RolloutLayout.round_robin(1, 8, 8)
    return plan(shape, training, rollout, bucket_bytes=300, ranks_per_node=4).digest()


def key_of_a_pipelined_round_robin_layout() -> str:
    """The plan-cache key (input digest) of the same inputs: what ranks compare before a sync."""
    from ascend_rl_plugins.features.moe_reshard.layout import MoEShape, RolloutLayout, TrainingLayout
    from ascend_rl_plugins.features.moe_reshard.planner import plan_key
    shape = MoEShape(num_layers=6, num_experts=8, hidden=8, ffn_hidden=8, moe_layers=(1, 2, 3, 5))
    training = TrainingLayout(tp=2, pp=2, ep=2, etp=2, layer_stages=(0, 0, 0, 1, 1, 1))
    rollout = RolloutLayout.round_robin(1, 8, 8)
    return plan_key(shape, training, rollout, bucket_bytes=300, ranks_per_node=4)
