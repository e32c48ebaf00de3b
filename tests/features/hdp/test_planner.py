"""HDP planner properties: every token computed once, one group per rank, the cap, K >= K_min,
identical plans everywhere, never worse than fixed CP, never below the lower bound."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from ascend_rl_plugins.features.hdp.cost_model import CostModel, pad_multiple, padded_length
from ascend_rl_plugins.features.hdp.planner import (
    GROUP_POLICIES, HdpPlan, MicroBatchPlan, plan, planning_work, split_for_group)

# A GQA-like and an MLA-like model (small models are enough: the properties hold for any
# non-negative cost model) plus the shipped default.
GQA = CostModel(linear_per_token=4e-5, attention_per_token_pair=4.5e-9,
                kv_bytes_per_token=36096.0, link_bytes_per_s=50e9, ring_step_latency=2.35e-4,
                per_micro_batch_overhead=0.02)
MLA = CostModel(linear_per_token=3.5e-5, attention_per_token_pair=3.6e-9,
                kv_bytes_per_token=468480.0, link_bytes_per_s=50e9, ring_step_latency=7.6e-5,
                per_micro_batch_overhead=0.02)
NO_OVERHEAD = CostModel(linear_per_token=1e-6, attention_per_token_pair=1e-10,
                        kv_bytes_per_token=1e5, link_bytes_per_s=1e9, ring_step_latency=1e-3)
# a calibrated model's measured error: regroup only for a larger modelled gain
MLA_WITH_ERROR = CostModel(**{**MLA.to_dict(), "relative_error": 0.1})
MODELS = [None, GQA, MLA, NO_OVERHEAD, MLA_WITH_ERROR]


@st.composite
def cases(draw):
    cp_size = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    tp = draw(st.sampled_from([1, 2, 4]))
    short = st.integers(1, 600)
    long = st.integers(600, 9000)
    lengths = draw(st.lists(st.one_of(short, short, long), min_size=1, max_size=48))
    # a cap at which the longest sequence just fits under CP, times a slack factor
    need = max(int(padded_length(x, cp_size, tp)) // cp_size for x in lengths)
    cap = max(need, int(need * draw(st.sampled_from([1.0, 1.05, 1.5, 2.0, 4.0]))))
    k_min = draw(st.integers(1, min(len(lengths), 6)))
    policy = draw(st.sampled_from(GROUP_POLICIES))
    model = draw(st.sampled_from(MODELS))
    return dict(lengths=lengths, cp_size=cp_size, max_tokens_per_rank=cap,
                min_micro_batches=k_min, group_policy=policy, cost_model=model, tp=tp)


def rank_tokens(mb: MicroBatchPlan, rank: int, lengths, tp: int) -> int:
    """Tokens a rank computes in a micro-batch, its share of the padding included."""
    return sum(int(padded_length(lengths[seq], len(group), tp)) // len(group)
               for seq, group, _ in mb.rank_work(rank))


def check_plan(result: HdpPlan, case: dict) -> None:
    lengths, cp_size, tp = case["lengths"], case["cp_size"], case["tp"]
    cap = case["max_tokens_per_rank"]
    model = case["cost_model"] or CostModel.load(None)
    # K >= K_min, every sequence in exactly one micro-batch
    assert len(result.micro_batches) >= case["min_micro_batches"]
    placed = [s for mb in result.micro_batches for s in mb.sequences]
    assert sorted(placed) == list(range(len(lengths)))
    for mb in result.micro_batches:
        # the groups partition the CP ranks into contiguous runs; one group per rank
        flat = [r for g in mb.groups for r in g]
        assert sorted(flat) == list(range(cp_size)) and len(flat) == cp_size
        for g in mb.groups:
            assert list(g) == list(range(g[0], g[0] + len(g)))
            if case["group_policy"] == "pow2" and not mb.fixed_cp:
                assert len(g) & (len(g) - 1) == 0
                assert g[0] % len(g) == 0  # aligned, as NCCL/TE groups need
        assert mb.fixed_cp == (mb.groups == (tuple(range(cp_size)),))
        assert len(mb.group_of) == len(mb.sequences)
        assert set(mb.group_of) == set(range(len(mb.groups)))  # no idle group
        # every token of every sequence computed by exactly one rank
        covered = {seq: [] for seq in mb.sequences}
        for rank in range(cp_size):
            for seq, group, position in mb.rank_work(rank):
                assert group[position] == rank
                covered[seq] += split_for_group(lengths[seq], len(group), position,
                                                pad_multiple=pad_multiple(len(group), tp))
        for seq, ranges in covered.items():
            ranges.sort()
            assert all(a < b for a, b in ranges)
            assert ranges[0][0] == 0 and ranges[-1][1] == lengths[seq]
            assert all(prev[1] == nxt[0] for prev, nxt in zip(ranges, ranges[1:]))
        # the cap, padding share included, on every rank
        for rank in range(cp_size):
            assert rank_tokens(mb, rank, lengths, tp) <= cap
        # the micro-batch's cost is what the cost model says, and never above CP's
        by_group = [[lengths[s] for s, g in zip(mb.sequences, mb.group_of) if g == gi]
                    for gi in range(len(mb.groups))]
        modelled = max(model.group_time(ls, len(mb.groups[gi]), tp=tp)
                       for gi, ls in enumerate(by_group)) + model.per_micro_batch_overhead
        assert math.isclose(mb.cost, modelled, rel_tol=1e-9)
        cp = model.group_time([lengths[s] for s in mb.sequences], cp_size, tp=tp)
        assert math.isclose(mb.fixed_cp_cost, cp + model.per_micro_batch_overhead,
                            rel_tol=1e-9)
        assert mb.cost <= mb.fixed_cp_cost
        if not mb.fixed_cp:  # a regrouping gains more than the model's measured error
            overhead = model.per_micro_batch_overhead
            assert mb.cost - overhead < (mb.fixed_cp_cost - overhead) * (1 - model.relative_error)
    # never worse than fixed CP, never below the lower bound
    assert result.cost <= result.fixed_cp_cost
    assert result.cost >= result.lower_bound * (1 - 1e-9)
    assert math.isclose(result.cost, math.fsum(mb.cost for mb in result.micro_batches),
                        rel_tol=1e-9)


@settings(max_examples=200, deadline=None)
@given(cases())
def test_plan_invariants(case):
    result = plan(**case)
    check_plan(result, case)
    # fixed CP as stock verl would run it: the same cost the plan compares itself with
    cp_only = plan(**case, allow_hdp=False)
    check_plan(cp_only, case)
    assert all(mb.fixed_cp for mb in cp_only.micro_batches)
    assert cp_only.cost == cp_only.fixed_cp_cost == result.fixed_cp_cost
    assert result.cost <= cp_only.cost
    # identical plans from identical inputs, and the JSON round trip is exact
    again = plan(**case)
    assert again.digest() == result.digest()
    assert HdpPlan.from_json(result.to_json()) == result


@settings(max_examples=100, deadline=None)
@given(cases(), st.integers(0, 3))
def test_dp_ranks_can_agree_on_one_micro_batch_count(case, extra):
    # the count another DP rank needs: at least ours; re-planning with min = max = it
    # gives exactly that many micro-batches, still a valid plan no worse than fixed CP
    natural = len(plan(**case).micro_batches)
    target = min(len(case["lengths"]), natural + extra)
    forced = {**case, "min_micro_batches": target}
    result = plan(**forced, max_micro_batches=target)
    assert len(result.micro_batches) == target
    check_plan(result, forced)
    with pytest.raises(ValueError, match="max_micro_batches=0"):
        plan(**{**case, "min_micro_batches": 1}, max_micro_batches=0)


def test_cp_micro_batch_count_is_verls_when_the_cap_allows():
    # 16 sequences of 1000 tokens, CP4, 1000 tokens per rank: verl's K = ceil(16000/4000)
    lengths = [1000] * 16
    result = plan(lengths, cp_size=4, max_tokens_per_rank=1000, cost_model=GQA,
                  allow_hdp=False)
    assert len(result.micro_batches) == 4
    assert len(plan(lengths, cp_size=4, max_tokens_per_rank=1000, cost_model=GQA,
                    min_micro_batches=7, allow_hdp=False).micro_batches) == 7


def test_cap_raises_k_for_fixed_cp_too():
    # two 3000-token sequences cannot share a micro-batch at 1000 tokens per rank on CP4,
    # and neither can take the 1500-token one: verl's formula gives K = ceil(7500 / 4000) = 2
    lengths = [3000, 3000, 1500]
    result = plan(lengths, cp_size=4, max_tokens_per_rank=1000, cost_model=GQA)
    assert len(result.micro_batches) == 3
    check_plan(result, dict(lengths=lengths, cp_size=4, max_tokens_per_rank=1000,
                            min_micro_batches=1, group_policy="contiguous", cost_model=GQA,
                            tp=1))


def test_mla_mix_runs_short_sequences_on_single_ranks():
    # one long and many short sequences at CP8 with MLA-sized K/V: ring steps of the short
    # ones are exposed, so HDP must beat CP, with the short ones alone on ranks
    lengths = [20000] + [900] * 21
    result = plan(lengths, cp_size=8, max_tokens_per_rank=8192, tp=4, cost_model=MLA)
    assert result.cost < result.fixed_cp_cost
    hdp = [mb for mb in result.micro_batches if not mb.fixed_cp]
    assert hdp
    singles = [seq for mb in hdp for seq, g in zip(mb.sequences, mb.group_of)
               if len(mb.groups[g]) == 1]
    assert singles and all(lengths[s] == 900 for s in singles)


def test_gqa_long_sequences_stay_on_cp():
    # GQA, long sequences only: ring communication is hidden, CP is balanced: nothing to gain
    result = plan([16000, 15000, 16000, 14000], cp_size=4, max_tokens_per_rank=16384, tp=4,
                  cost_model=GQA)
    assert all(mb.fixed_cp for mb in result.micro_batches)
    assert result.cost == result.fixed_cp_cost


def test_allow_hdp_false_and_cp_size_one_are_plain():
    for kwargs in (dict(cp_size=4, allow_hdp=False), dict(cp_size=1)):
        result = plan([100, 2000, 50, 700], max_tokens_per_rank=4000, cost_model=MLA, **kwargs)
        assert all(mb.fixed_cp for mb in result.micro_batches)
        assert result.cost == result.fixed_cp_cost


def test_rank_work_lists_the_ranks_group():
    mb = MicroBatchPlan(sequences=(3, 5, 9), groups=((0, 1), (2,), (3,)), group_of=(0, 1, 0),
                        fixed_cp=False, cost=1.0, fixed_cp_cost=2.0)
    assert mb.rank_work(1) == [(3, (0, 1), 1), (9, (0, 1), 1)]
    assert mb.rank_work(2) == [(5, (2,), 0)]
    assert mb.rank_work(3) == []
    with pytest.raises(ValueError, match="rank=4"):
        mb.rank_work(4)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 8), st.sampled_from([1, 2, 4]))
def test_split_for_group_is_megatrons_balanced_split(length, group_size, tp):
    m = pad_multiple(group_size, tp)
    parts = [split_for_group(length, group_size, p, pad_multiple=m) for p in range(group_size)]
    flat = sorted(r for ranges in parts for r in ranges)
    assert flat[0][0] == 0 and flat[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(flat, flat[1:]))
    if group_size > 1:
        padded = int(padded_length(length, group_size, tp))
        chunk = padded // (2 * group_size)
        for p, ranges in enumerate(parts):
            # chunks p and 2g-1-p, padding cut off
            expected = [(c * chunk, min((c + 1) * chunk, length))
                        for c in (p, 2 * group_size - 1 - p)]
            assert ranges == [r for r in expected if r[1] > r[0]]
    else:
        assert parts == [[(0, length)]]


def test_split_for_group_examples():
    assert split_for_group(10, 2, 0, pad_multiple=4) == [(0, 3), (9, 10)]
    assert split_for_group(10, 2, 1, pad_multiple=4) == [(3, 6), (6, 9)]
    assert split_for_group(7, 1, 0, pad_multiple=4) == [(0, 7)]
    with pytest.raises(ValueError, match="pad_multiple"):
        split_for_group(10, 2, 0, pad_multiple=6)
    with pytest.raises(ValueError, match="position"):
        split_for_group(10, 2, 2, pad_multiple=4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(cp_size=0), "cp_size=0"),
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank=0"),
    (dict(group_policy="ring"), "group_policy='ring'.*'contiguous', 'pow2'"),
    (dict(min_micro_batches=9), "min_micro_batches=9"),
    (dict(tp=0), "tp=0"),
    (dict(lengths=[100, 5000]), r"lengths\[1\]=5000: longer than cp_size\*max_tokens_per_rank"),
    (dict(lengths=[100, 0]), "at least 1 token"),
    (dict(lengths=[]), "non-empty"),
])
def test_invalid_input_names_the_argument(kwargs, match):
    args = dict(lengths=[100, 200, 300], cp_size=4, max_tokens_per_rank=1000)
    args.update(kwargs)
    lengths = args.pop("lengths")
    with pytest.raises(ValueError, match=match):
        plan(lengths, **args)


def child_plan_json(request: dict) -> str:
    """Child-process scenario: the plan of ``request`` as JSON (run with and without numba)."""
    model = request.pop("model")
    return plan(request.pop("lengths"), cost_model=MLA if model == "mla" else GQA,
                **request).to_json()


def test_identical_plan_in_other_processes_compiled_or_not():
    from tests.support.child import run_scenario
    lengths = [(i * 7919) % 9000 + 1 for i in range(64)]
    request = dict(lengths=lengths, cp_size=8, max_tokens_per_rank=4096, tp=2,
                   min_micro_batches=3, model="mla")
    here = child_plan_json(dict(request))
    jit = run_scenario("tests.features.hdp.test_planner", "child_plan_json", dict(request),
                       env={"PYTHONHASHSEED": "7"}, timeout=600)
    plain = run_scenario("tests.features.hdp.test_planner", "child_plan_json", dict(request),
                         env={"PYTHONHASHSEED": "11", "NUMBA_DISABLE_JIT": "1"}, timeout=600)
    assert jit == here
    assert plain == here


def child_kk_parity(cases: int) -> int | None:
    """Child-process scenario: how many of ``cases`` random inputs verl's own Karmarkar-Karp
    partitions differently from the planner's (None: verl is not installed here)."""
    import random

    import numpy as np
    try:
        from verl.utils.seqlen_balancing import karmarkar_karp
    except ImportError:
        return None
    from ascend_rl_plugins.features.hdp.planner import _kk_partition
    mismatches = 0
    for case in range(cases):
        rng = random.Random(case)
        n = rng.randint(1, 120)
        k = rng.randint(1, min(n, 24))
        top = rng.choice([5, 50, 10 ** 6])  # small ranges force ties in the ordering
        values = [rng.randint(1, top) for _ in range(n)]
        theirs = sorted(tuple(sorted(p)) for p in karmarkar_karp(values, k, equal_size=False))
        part = _kk_partition(np.array(values, dtype=np.int64), k)
        ours = sorted(tuple(np.flatnonzero(part == j).tolist()) for j in range(k))
        mismatches += theirs != ours
    return mismatches


def test_karmarkar_karp_is_verls_partition():
    from tests.support.child import run_scenario
    mismatches = run_scenario("tests.features.hdp.test_planner", "child_kk_parity", 400,
                              timeout=600)
    if mismatches is None:
        pytest.skip("verl is not installed in this interpreter")
    assert mismatches == 0


def child_heavy_modules() -> list:
    """Child-process scenario: plan something, report which heavy modules got imported."""
    import sys
    plan([5000, 300, 200], cp_size=4, max_tokens_per_rank=2048, cost_model=MLA)
    return sorted(m for m in ("torch", "verl", "megatron", "mindspeed") if m in sys.modules)


def test_planner_imports_no_torch():
    from tests.support.child import run_scenario
    assert run_scenario("tests.features.hdp.test_planner", "child_heavy_modules",
                        timeout=600) == []


@pytest.mark.parametrize("cp_size, tp, cap, model", [(4, 4, 16384, GQA), (8, 4, 8192, MLA)])
def test_planning_work_grows_no_faster_than_n_log_n(cp_size, tp, cap, model):
    # counted work (inner-loop steps), not a timing: per n*log2(n), 8192 sequences cost no
    # more than 1024 do (the old shelf packing visited every shelf per item: quadratic)
    import numpy as np
    rng = np.random.default_rng(0)
    pool = (rng.integers(256, 2049, 8192)
            + np.clip(rng.lognormal(np.log(3000), 1.0, 8192), 16, 32768)).astype(np.int64)
    per = {}
    for n in (1024, 8192):
        work = planning_work(pool[:n], cp_size=cp_size, max_tokens_per_rank=cap,
                             min_micro_batches=cp_size, cost_model=model, tp=tp)
        per[n] = work / (n * math.log2(n))
    assert per[8192] <= 1.1 * per[1024], per


def test_regrouping_needs_a_gain_above_the_models_measured_error():
    lengths = [9000, 300, 200, 250, 180, 220, 310, 260]
    kw = dict(cp_size=4, max_tokens_per_rank=4096, tp=1)
    free = plan(lengths, **kw, cost_model=MLA)
    assert not free.micro_batches[0].fixed_cp
    mb = free.micro_batches[0]
    gain = 1 - (mb.cost - MLA.per_micro_batch_overhead) / (
        mb.fixed_cp_cost - MLA.per_micro_batch_overhead)
    above = plan(lengths, **kw, cost_model=CostModel(**{**MLA.to_dict(),
                                                        "relative_error": gain * 1.01}))
    assert all(m.fixed_cp for m in above.micro_batches)
    assert above.cost == above.fixed_cp_cost
    below = plan(lengths, **kw, cost_model=CostModel(**{**MLA.to_dict(),
                                                        "relative_error": gain * 0.99}))
    assert below.digest() != above.digest() and not below.micro_batches[0].fixed_cp
