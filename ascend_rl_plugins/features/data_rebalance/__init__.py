"""Data rebalance: balance generation work across DP ranks, outputs in the caller's order.

verl 0.6 cuts the generation batch into one contiguous chunk per rollout DP rank. The GRPO
batch is interleaved (a prompt's ``n`` samples side by side), so a rank gets whole groups, and
response lengths are correlated within a group: one rank draws the hard prompts and the
whole step waits for it. The recipe's verl patches 0004 (PPO trainer) and 0014 (DAPO trainer)
dispatched the batch in a fixed transposed order instead. This feature decides the order per
batch (:mod:`.planner`: LPT with group spreading, swap refinement and longest-first within a
rank on a cost model fed by past response lengths; never modeled worse than the seed's
order, which it keeps when it cannot do better) and hooks it where verl builds a worker
group's ``generate_sequences`` (:mod:`.runtime`), so every trainer's call (PPO, DAPO, REMAX
baseline, validation) is rebalanced and restored to its order with ``DataProto.reorder``.
README.md beside this file: why, how, flags, measured figures, verified where.

Remove when: verl dispatches generation per request to the least-loaded server (verl >= 0.9
does, with its global request load balancer) or balances the synchronous dispatch itself.
"""

from __future__ import annotations

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_DATA_REBALANCE", "bool", False,
    "Dispatch verl 0.6's generation batch to the rollout DP ranks in a balanced order "
    "(outputs are returned in the caller's order).", feature="data_rebalance")
MODE = flags.define(
    "ASCEND_RL_DATA_REBALANCE_MODE", "enum", "balanced",
    "With ASCEND_RL_DATA_REBALANCE: 'balanced' plans each batch from past response lengths (and "
    "keeps the seed's order when its plan does not model faster); 'seed' always uses the recipe's "
    "fixed permutation.", choices=("balanced", "seed"), feature="data_rebalance")
MAX_SEQS = flags.define(
    "ASCEND_RL_DATA_REBALANCE_MAX_SEQS", "int", 0,
    "Sequences one rollout DP rank decodes at once (vLLM's running requests, bounded by "
    "max_num_seqs and the KV cache); 0: unknown, the plan assumes all at once.", minimum=0,
    feature="data_rebalance")
STEP_OVERHEAD = flags.define(
    "ASCEND_RL_DATA_REBALANCE_STEP_OVERHEAD", "float", 64.0,
    "Fixed cost of one decode step in units of one running sequence's share of a step "
    "(weights read once per step vs. per-sequence KV reads); the balanced plan's cost model.",
    minimum=0.0, feature="data_rebalance")

FEATURE = Feature(
    "data_rebalance", "Balanced generation dispatch over rollout DP ranks (verl 0.6), outputs restored.",
    flag=ENABLE,
    replaces="the recipe's verl patches 0004-verl-feature-data_rebalance and "
             "0014-verl-feature-dapo_data_rebalance",
    verified=Verified(
        cpu_runtime="planner and simulator; verl 0.6.1's real worker-group binding (_bind_worker_method, "
                    "func_generator), lazy n-d dispatch/collect, DataProto chunk/concat/select_idxs/reorder "
                    "on the real megatron ActorRolloutRefWorker's registered generate_sequences",
        doubles="Ray's object store and remote execution (ray.put/ray.get, the per-rank generate)",
        static="hook point in verl 0.6.1; verl 0.9.1 routes requests through its global load balancer"),
    stacks="recipe")

FEATURE.does_not_apply(
    dist="verl", versions=">=0.9",
    why="the rollout runs as servers fed request by request through verl's least-in-flight "
        "GlobalRequestLoadBalancer (verl/workers/rollout/router.py): there is no batch split "
        "over DP ranks to rebalance")

BIND_PARAMS = ("self", "method_name", "dispatch_fn", "collect_fn", "execute_fn", "blocking")


def mode_from_flags() -> str:
    return MODE.value


def model_from_flags(max_len: int = 0):
    """The planner's cost model from the flags (``max_len``: the response limit seen so far)."""
    from .planner import CostModel
    return CostModel(step_overhead=STEP_OVERHEAD.value, max_seqs=MAX_SEQS.value, max_len=float(max_len))


def _bind(self, method_name, dispatch_fn, collect_fn, execute_fn, blocking):
    return self, method_name, dispatch_fn, collect_fn, execute_fn, blocking


@FEATURE.after("verl.single_controller.ray.base:func_generator", dist="verl", versions=">=0.6,<0.7",
               params=BIND_PARAMS, name="data_rebalance.generate_dispatch",
               reason="verl 0.6 splits the interleaved generation batch into contiguous per-rank "
                      "chunks, so a rank gets whole GRPO groups and the step waits for the rank "
                      "that drew the long ones",
               replaces="recipe verl patches 0004 (RayPPOTrainer.fit) and 0014 (RayDAPOTrainer.fit)",
               upstream="https://github.com/verl-project/verl/issues/658",
               remove_when="verl balances generation over DP ranks itself (verl >= 0.9 routes each "
                           "request through its global load balancer)")
def _rebalanced_generate(functor, instance, args, kwargs):
    from .runtime import wrap_generate
    return wrap_generate(functor, *_bind(*args, **kwargs))
