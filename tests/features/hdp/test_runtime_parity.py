"""HDP runtime parity on 4 gloo processes, float64, on the running stack.

One group run (parity_scenario.run) checks: the verl pre/post wrappers with an all-CP plan
are bit-identical to upstream verl (values and gradient); patched RoPE with the all-CP plan
is bit-identical to stock Megatron-Core RoPE; for all-CP, pure-DP, odd-group and mixed plans,
loss and every gradient (input, q/k/v/o weights; summed over ranks) equal a single-process
no-CP reference within 1e-12; without the RoPE patch a mixed plan is wrong; without any
patch the stock functions cannot run a plan; the planner forms micro-batches that carry their
plan. The same run drives MindSpeed's ring-attention entry and RingP2P as mirrored by the
double (mindspeed_scenario.py). See parity_scenario.py for what is real.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest

from ascend_rl_plugins.features import hdp as feature
from tests.doubles import mindspeed_double_check as ms
from tests.support.child import run_group

ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "ASCEND_RL_AUTOLOAD": "0", "ASCEND_RL_HDP": "1",
       "VERL_USE_EXTERNAL_PLUGINS": "none"}
TOLERANCE = 1e-12


@pytest.fixture(scope="module")
def ranks():
    try:
        version("torch"), version("megatron-core"), version("verl")
    except PackageNotFoundError:
        pytest.skip("torch, megatron-core and verl are not installed in this interpreter (.ci/stack.sh installs them)")
    return run_group("tests.features.hdp.parity_scenario", "run", 4, ms.DOUBLE_ROOT, env=ENV, timeout=600)


def test_patches_apply_on_this_stack(ranks):
    megatron = version("megatron-core")
    rope = ("hdp.rope_thd", "hdp.rope_unfused") if megatron.startswith("0.12") else ("hdp.rope_cp_group",)
    for r in ranks:
        states = r["patch_states"]
        assert set(states) == {p.name for p in feature.FEATURE.patches}
        for name in (*rope, "hdp.verl_preprocess", "hdp.verl_postprocess", "hdp.model_support"):
            assert states[name] == "applied", states


def test_the_schedule_verl_gets_is_timed_by_the_guard(ranks):
    for r in ranks:
        # applied once the schedules module is imported (lazily on Megatron-Core 0.12)
        assert r["schedule"] == {"state": "applied", "wrapped": True, "inner": "forward_backward_no_pipelining",
                                 "module_global": True}, r["schedule"]


def test_verl_wrappers_are_bit_identical_to_upstream_for_the_all_cp_plan(ranks):
    for r in ranks:
        assert r["verl_all_cp_equal"] == {"packed": True, "cu_seqlens": True, "max_seqlen": True,
                                          "output": True, "output_grad": True}, r["verl_all_cp_equal"]


def test_rope_is_bit_identical_to_stock_for_the_all_cp_plan(ranks):
    assert all(r["rope_all_cp_equal"] for r in ranks)


def test_fused_rope_requested_under_a_split_plan_runs_unfused_on_megatron_0_12(ranks):
    if not version("megatron-core").startswith("0.12"):
        pytest.skip("Megatron-Core 0.16 passes the group's process group to the fused kernel (hdp.rope_cp_group)")
    assert [r.get("fused_request_runs_unfused") for r in ranks] == [True, True, None, None]


@pytest.mark.parametrize("plan", ["all_cp", "pure_dp", "odd_and_single", "pair_and_singles"])
def test_loss_and_gradients_equal_the_no_cp_reference(ranks, plan):
    for r in ranks:
        diffs = r["plans"][plan]
        assert max(diffs.values()) <= TOLERANCE, (plan, diffs)
        assert set(diffs) == {"loss", "x", "wq", "wk", "wv", "wo"}


def test_the_reference_is_not_trivial(ranks):
    assert abs(ranks[0]["reference_loss"]) > 1e-3


def test_without_the_patches_a_plan_is_wrong(ranks):
    for r in ranks:
        assert "applied" not in r["stock_states"] and "pending" not in r["stock_states"], r["stock_states"]
        broken = r["without_rope_patch"]
        assert isinstance(broken, str) or broken > 1e-6, broken
        stock = r["unpatched_mixed"]
        assert isinstance(stock, str) or stock > 1e-6, stock


def test_micro_batches_are_formed_by_the_planner_and_carry_their_plan(ranks):
    for r in ranks:
        mb = r["micro_batches"]
        assert mb["k_hdp"] >= mb["k_verl"] >= 1, mb
        assert mb["rows"] == list(range(10)), mb  # every row once
        for groups in mb["plans"]:
            assert groups is not None and sorted(x for g in groups for x in g) == [0, 1, 2, 3], mb
        assert any(len(groups) > 1 for groups in mb["plans"]), mb  # HDP actually regrouped
        assert all(mb["same_groups_after_copy"]) and all(mb["cap_ok"]), mb
    assert len({str(r["micro_batches"]) for r in ranks}) == 1  # every CP rank formed the same


def test_activation_recompute_uses_its_own_micro_batch_plan(ranks):
    assert all(r["recompute_equal"] for r in ranks)


def test_the_planned_micro_batch_count_is_agreed_over_the_data_parallel_group(ranks):
    got = [r["dp_synced"] for r in ranks]
    assert [g["dp_rank"] for g in got] == [0, 0, 1, 1]  # CP = 2 groups: (0, 1), (2, 3)
    assert {(g["k_verl"], g["k"]) for g in got} == {(1, 2)}, got  # one count for both DP replicas
    for g in got:
        assert g["rows"] == list(range(len(g["rows"]))) and len(g["rows"]) == (3 if g["dp_rank"] == 0 else 6), g
        assert all(p is not None and sorted(x for grp in p for x in grp) == [0, 1] for p in g["plans"]), g


def test_without_a_plan_the_wrappers_plan_from_the_lengths_and_round_trip_exactly(ranks):
    for r in ranks:
        path = r["planner_path"]
        assert path["exact"], path
        assert len(path["groups"]) > 1, path  # one long row, five short ones: not plain CP
    assert len({str(r["planner_path"]["groups"]) for r in ranks}) == 1


# -- MindSpeed, against the double (mindspeed_scenario.py) --------------------------------------

def _unmatched(ranks, direction):
    """(sender, receiver) pairs whose send and receive are posted on different communicators."""
    sides = {r: ranks[r][direction] for r in range(3)}
    return [(a, s["next"]) for a, s in sides.items() if sides[s["next"]]["recv_on"] != s["send_on"]
            or sides[s["next"]]["prev"] != a]


def test_mindspeed_double_stock_ring_p2p_mismatches_communicators_on_a_ring_of_three(ranks):
    stock = [r["mindspeed"]["stock"] for r in ranks]
    assert _unmatched(stock, "forward") == [(2, 0)] and _unmatched(stock, "backward") == [(0, 2)]


def test_mindspeed_double_with_the_odd_ring_fix_every_send_meets_its_receive(ranks):
    states = ranks[0]["mindspeed"]["patch_states"]
    assert states == {"hdp.mindspeed_ring_cp_para": "applied", "hdp.mindspeed_odd_ring": "applied"}, states
    patched = [r["mindspeed"]["patched"] for r in ranks]
    assert _unmatched(patched, "forward") == [] and _unmatched(patched, "backward") == []


def test_mindspeed_double_ring_attention_over_the_sub_rings_equals_whole_row_attention(ranks):
    ranks = [r["mindspeed"] for r in ranks]
    for r in ranks:
        assert r["tokens"] > 0 and r["max_error"] <= 1e-12, r
        assert r["cp_para_unchanged"], r
    assert [r["ring_used"] for r in ranks] == [
        {"ring_rank": 0, "next": 1, "prev": 2}, {"ring_rank": 1, "next": 2, "prev": 0},
        {"ring_rank": 2, "next": 0, "prev": 1}, {"ring_rank": 0, "next": 3, "prev": 3}]


def test_building_a_model_with_the_sequence_aux_loss_falls_back_to_cp(ranks):
    for r in ranks:
        got = r["model_support"]
        assert got["dense_keeps_hdp"] and not got["seq_aux_loss_keeps_hdp"], got
        assert "sequence-level MoE auxiliary loss" in got["reason"], got
