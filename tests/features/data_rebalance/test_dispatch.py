"""data_rebalance on verl 0.6.1's real worker-group dispatch.

Real: verl's ``ActorRolloutRefWorker`` (megatron) and the dispatch mode it registers for
``generate_sequences`` (lazy n-d dispatch on the ``rollout`` mesh), ``WorkerGroup.
_bind_worker_method``, ``func_generator`` (patched by the registry), the dispatch/collect
functions, ``parallel_put``, ``DataProto`` (``repeat``, ``chunk``, ``concat``, ``select_idxs``,
``reorder``), the planner. Doubles (tests/features/data_rebalance/local_workers.py): Ray's
``put``/``get`` and the remote execution (a per-rank rollout computed in this process).
Each case is ``@pytest.mark.forked``: the patch and the doubles are process-global.
"""

from __future__ import annotations

import numpy as np
import pytest

from ascend_rl_plugins.features import data_rebalance  # noqa: F401 - declares the patch
from ascend_rl_plugins.patching.core import REGISTRY
from tests.features.data_rebalance import local_workers
from tests.features.data_rebalance.verl_env import import_verl

PATCH = REGISTRY.patches["data_rebalance.generate_dispatch"]
verl, protocol = import_verl("verl", "verl.protocol")
if not verl.__version__.startswith("0.6."):
    pytest.skip("data_rebalance hooks verl 0.6's batch dispatch (verl >= 0.9 balances per request: "
                "the feature declares it does not apply)", allow_module_level=True)
ray_base, megatron_workers = import_verl("verl.single_controller.ray.base", "verl.workers.megatron_workers")

TP, DP, PROMPTS, N = 2, 4, 16, 2


@pytest.fixture
def bind(monkeypatch, flag_env):
    """``bind()``: a local worker group with the real megatron worker's methods bound through
    verl's ``func_generator`` as it is *now* (patched or not)."""
    local_workers.install_ray_doubles(monkeypatch)
    flag_env(ASCEND_RL_DATA_REBALANCE="1", ASCEND_RL_DATA_REBALANCE_MAX_SEQS="2")
    from ascend_rl_plugins.features.data_rebalance import runtime
    runtime.HISTORY.clear()
    cls = local_workers.worker_group_class()

    def make():
        wg = cls(TP, DP)
        wg._bind_worker_method(megatron_workers.ActorRolloutRefWorker, ray_base.func_generator)
        return wg
    return make


def _assert_same(a, b) -> None:
    """Bit-identical DataProtos: every tensor, every non-tensor column, meta_info."""
    import torch
    assert set(a.batch.keys()) == set(b.batch.keys())
    for key in a.batch.keys():
        assert a.batch[key].dtype == b.batch[key].dtype and torch.equal(a.batch[key], b.batch[key]), key
    assert set(a.non_tensor_batch) == set(b.non_tensor_batch)
    for key, value in a.non_tensor_batch.items():
        other = b.non_tensor_batch[key]
        assert value.dtype == other.dtype and len(value) == len(other)
        assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(value, other)), key
    assert a.meta_info == b.meta_info


def _chunks_of(order: np.ndarray) -> list[list[int]]:
    return [list(map(int, c)) for c in np.split(order, DP)]


@pytest.mark.forked
def test_without_the_patch_each_rank_gets_whole_groups(bind):
    """verl's own dispatch: contiguous chunks of the interleaved batch, whole GRPO groups per
    rank (what the feature changes; the test's teeth)."""
    wg = bind()
    wg.generate_sequences(local_workers.interleaved_batch(PROMPTS, N))
    assert wg.received[-1] == _chunks_of(np.arange(PROMPTS * N))


@pytest.mark.forked
def test_every_sample_reaches_one_rank_as_planned_and_comes_back_in_order(bind):
    from ascend_rl_plugins.features.data_rebalance import planner, runtime
    reference_wg = bind()  # bound before the patch: verl's own behaviour
    assert REGISTRY.apply(PATCH), PATCH.outcome
    wg = bind()
    assert isinstance(wg.generate_sequences, runtime.RebalancedGenerate)
    assert not isinstance(wg.compute_log_prob, runtime.RebalancedGenerate)  # other methods untouched

    batch = local_workers.interleaved_batch(PROMPTS, N)
    before = batch.batch["input_ids"].clone()
    for step in range(2):
        expected = reference_wg.generate_sequences(local_workers.interleaved_batch(PROMPTS, N))
        out = wg.generate_sequences(batch)
        plan = runtime.LAST.plan
        received = wg.received[-1]
        # every sample reached exactly one DP rank (TP peers checked in the double) ...
        assert sorted(i for rank in received for i in rank) == list(range(PROMPTS * N))
        # ... exactly the plan's share, in the plan's submission order
        assert received == _chunks_of(plan.order)
        assert np.array_equal(plan.rank_of()[np.concatenate(received)], np.repeat(np.arange(DP), PROMPTS * N // DP))
        # the caller gets every output back in its own order, bit for bit
        _assert_same(out, expected)
        assert np.array_equal(out.non_tensor_batch["sample_id"], np.arange(PROMPTS * N))
        if step == 0:  # nothing seen yet: every estimate equal, the seed's order is what runs
            assert plan.chosen == "seed" and np.array_equal(plan.order, planner.seed_order(PROMPTS * N, N))
        else:  # the first batch's response lengths now inform the plan
            assert plan.chosen == "balanced", plan.modeled
            assert plan.modeled["balanced"] < plan.modeled["seed"]
    assert runtime.LAST.calls == 2 and wg.queries == 1  # the mesh was queried once, as verl does
    assert batch.batch["input_ids"].equal(before) and len(batch) == PROMPTS * N  # caller's batch untouched


@pytest.mark.forked
def test_seed_mode_dispatches_the_recipes_permutation(bind, flag_env):
    """``ASCEND_RL_DATA_REBALANCE_MODE=seed``: rank ``r`` gets the ``r``-th contiguous chunk of
    the transposed batch (``i*n+j -> j*B+i``), as the recipe's patches 0004/0014 did."""
    assert REGISTRY.apply(PATCH), PATCH.outcome
    flag_env(ASCEND_RL_DATA_REBALANCE_MODE="seed")
    wg = bind()
    for _ in range(2):  # with history too
        wg.generate_sequences(local_workers.interleaved_batch(PROMPTS, N))
        transposed = [i * N + j for j in range(N) for i in range(PROMPTS)]
        assert wg.received[-1] == _chunks_of(np.array(transposed))


@pytest.mark.forked
def test_batches_that_do_not_split_evenly_pass_through(bind):
    from ascend_rl_plugins.features.data_rebalance import runtime
    assert REGISTRY.apply(PATCH), PATCH.outcome
    wg = bind()
    batch = local_workers.interleaved_batch(3, 2)  # 6 rows over 4 ranks: verl pads or refuses
    with pytest.raises(AssertionError, match="only support equal chunk"):
        wg.generate_sequences(batch)
    assert runtime.LAST.calls == 0
