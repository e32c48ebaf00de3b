"""HDP layout and packing arithmetic (one process, no process group).

The gloo runs in test_runtime_parity.py drive the verl wrappers end to end; these check the
pieces every rank computes alone from a plan: which tokens each rank holds (agreeing with the
planner's ``split_for_group``), that a group's ranks cover each row exactly once, what each
rank's packed length is, and that a layout belongs to its micro-batch's tensors only.
"""

from __future__ import annotations

import itertools

import pytest

from ascend_rl_plugins.features.hdp import layout as hdp_layout
from ascend_rl_plugins.features.hdp.layout import HdpLayout, attach, layout_of, zigzag_ranges

PLANS = [
    (((0, 1, 2, 3),), (0, 0, 0, 0, 0)),
    (((0,), (1,), (2,), (3,)), (0, 1, 2, 3, 0)),
    (((0, 1, 2), (3,)), (0, 1, 0, 1, 0)),
    (((0, 1), (2,), (3,)), (0, 1, 2, 0, 1)),
]
LENGTHS = (37, 12, 20, 9, 1)


def test_rank_ranges_agree_with_the_planner_split():
    planner = pytest.importorskip("ascend_rl_plugins.features.hdp.planner")
    from ascend_rl_plugins.features.hdp.cost_model import pad_multiple
    for length, g, tp in itertools.product((1, 5, 16, 37, 64, 101), (1, 2, 3, 4, 8), (1, 2)):
        padded = hdp_layout.padded(length, g, tp)
        assert padded == -(-length // pad_multiple(g, tp)) * pad_multiple(g, tp)
        for p in range(g):
            mine = [(a, min(b, length)) for a, b in zigzag_ranges(padded, g, p) if min(b, length) > a]
            assert mine == planner.split_for_group(length, g, p, pad_multiple=pad_multiple(g, tp)), (length, g, p)


@pytest.mark.parametrize("groups, group_of", PLANS)
@pytest.mark.parametrize("tp", [1, 2])
def test_a_group_covers_each_of_its_rows_exactly_once(groups, group_of, tp):
    layouts = [HdpLayout(LENGTHS, groups, group_of, r, tp) for r in range(4)]
    for gi, group in enumerate(groups):
        for row in (i for i, g in enumerate(group_of) if g == gi):
            held = sorted(p for r in group for rr, p in zip(*layouts[r].positions()) if rr == row)
            assert held == list(range(layouts[group[0]].padded_length(row))), (row, group)
    for r, lay in enumerate(layouts):
        assert len(lay.positions()[0]) == lay.local_tokens(r) == layouts[0].local_tokens(r)
        assert lay.cu_seqlens_padded()[-1] == lay.local_tokens(r) * lay.group_size
        assert lay.rows == [i for i, g in enumerate(group_of) if r in groups[g]]


def test_the_all_cp_plan_pads_and_splits_as_verl_does():
    lay = HdpLayout(LENGTHS, ((0, 1, 2, 3),), (0,) * 5, cp_rank=1, tp=2)
    assert [lay.padded_length(i) for i in range(5)] == [48, 16, 32, 16, 16]  # multiples of tp * cp * 2
    assert lay.ranges(0) == [(6, 12), (36, 42)]  # chunks 1 and 6 of 8


def test_a_plan_that_is_not_a_partition_is_refused():
    with pytest.raises(ValueError, match="not a partition"):
        HdpLayout((5, 6), ((0, 1), (1, 2)), (0, 1), cp_rank=0)
    with pytest.raises(ValueError, match="2 lengths but 1 group"):
        HdpLayout((5, 6), ((0,), (1,)), (0,), cp_rank=0)


def test_a_layout_belongs_to_its_micro_batch_tensors_only():
    torch = pytest.importorskip("torch")
    first, second = torch.tensor([0, 8], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32)
    a = HdpLayout((8,), ((0, 1),), (0,), cp_rank=0)
    b = HdpLayout((8,), ((0,), (1,)), (1,), cp_rank=1)
    attach([first], a)
    attach([second], b)  # a later micro-batch does not change what the first one's tensors say
    assert layout_of(first) is a and layout_of(second) is b
    assert layout_of(torch.tensor([0, 8])) is None and layout_of(None) is None


def test_from_plan_takes_the_micro_batch_rows_in_plan_order():
    class Plan:
        sequences, groups, group_of = (4, 0, 2), ((1, 0), (2, 3)), (0, 1, 1)
    lay = HdpLayout.from_plan(Plan, [10, 11, 12, 13, 14], cp_rank=0)
    assert lay.lengths == (14, 10, 12) and lay.groups == ((0, 1), (2, 3)) and lay.rows == [0]


@pytest.mark.parametrize("groups, group_of", PLANS)
def test_the_vectorized_token_index_is_the_token_list(groups, group_of):
    pytest.importorskip("torch")
    for r in range(4):
        lay = HdpLayout(LENGTHS, groups, group_of, r, tp=2)
        rows, pos = lay.token_index()
        assert (rows.tolist(), pos.tolist()) == lay.positions()
