"""Two data-parallel replicas forming their micro-batches with ``microbatch.form`` over a real
gloo group (the DP group is the world here; CP = 2 on each replica, planned as numbers only).

Run by ``test_dp_agreement.py`` through ``tests.support.child.run_group``: each rank returns
what it decided, so a failure shows both replicas' decisions side by side."""

from __future__ import annotations

# per rank: the rows' valid-token counts. In "refuses", replica 1 holds an empty row (all
# padding), which the planner refuses; replica 0's rows plan fine on their own.
BATCHES = {
    "agrees": {0: [700, 30, 25, 40, 900, 12], 1: [50, 800, 20, 33, 61, 700]},
    "refuses": {0: [700, 30, 25, 40, 900, 12], 1: [50, 800, 0, 33, 61, 700]},
}


def run(case: str) -> dict:
    import torch.distributed as dist

    from ascend_rl_plugins.features.hdp import microbatch

    rank = dist.get_rank()
    lengths = BATCHES[case][rank]
    result, why = microbatch.form(lengths, 2, cp_size=2, tp=1, max_token_len=2048, dp_group=None,
                                  same_in_dp=True, divisible_by=None, policy="contiguous",
                                  cost_model_path="")
    return {"rank": rank, "planned": result is not None, "why": why,
            "micro_batches": None if result is None else result.num_micro_batches}
