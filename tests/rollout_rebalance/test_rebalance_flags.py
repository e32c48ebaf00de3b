"""Flags: seed alias honoured, bad values rejected with the variable's name."""

from __future__ import annotations

import pytest

from ascend_rl_plugins import flags
from ascend_rl_plugins.features import rollout_rebalance as rr


def test_seed_alias_enables():
    assert rr.ENABLE.read({"ROLLOUT_REBALANCE_ENABLE": "1"}) is True
    assert rr.ENABLE.read({}) is False


def test_graph_sizes_parse_to_integers():
    assert rr.GRAPH_SIZES.read({"ASCEND_RL_ROLLOUT_REBALANCE_GRAPH_SIZES": "64, 8,16"}) == (64, 8, 16)
    assert rr.GRAPH_SIZES.read({}) == (4, 8, 16, 32, 64)


@pytest.mark.parametrize("flag, raw", [(rr.GRAPH_SIZES, "8,x"), (rr.GRAPH_SIZES, "0,8"),
                                       (rr.INTERVAL, "0"), (rr.KV, "maybe")])
def test_bad_values_name_the_variable(flag, raw):
    with pytest.raises(flags.FlagError, match=flag.name):
        flag.read({flag.name: raw})
