"""Flags: seed alias honoured, bad values rejected with the variable's name."""

from __future__ import annotations

import pytest

from ascend_rl_plugins import flags
from ascend_rl_plugins.features import rollout_rebalance as rr
from tests.support import stacks


def test_seed_alias_enables():
    assert rr.ENABLE.read({"ROLLOUT_REBALANCE_ENABLE": "1"}) is True
    assert rr.ENABLE.read({}) is False


def test_graph_sizes_parse_to_integers():
    assert rr.GRAPH_SIZES.read({"ASCEND_RL_ROLLOUT_REBALANCE_GRAPH_SIZES": "64, 8,16"}) == (64, 8, 16)
    assert rr.GRAPH_SIZES.read({}) == (4, 8, 16, 32, 64)


@pytest.mark.parametrize("flag, raw", [(rr.GRAPH_SIZES, "8,x"), (rr.GRAPH_SIZES, "0,8"),
                                       (rr.INTERVAL, "0"), (rr.KV, "maybe"),
                                       (rr.MIGRATION, "on"), (rr.MIGRATION_INTERVAL, "0")])
def test_bad_values_name_the_variable(flag, raw):
    with pytest.raises(flags.FlagError, match=flag.name):
        flag.read({flag.name: raw})


def test_migration_flag_names_its_choices_and_defaults_off():
    with pytest.raises(flags.FlagError, match="off.*planned"):
        rr.MIGRATION.read({rr.MIGRATION.name: "always"})
    assert rr.MIGRATION.read({}) == "off" and rr.MIGRATION_INTERVAL.read({}) == 2.0


def test_async_server_notice_is_logged_once(caplog):
    """verl 0.9's server rollout: with rebalancing requested, the server says why nothing is
    rebalanced (the hook body; its target is checked against the real verl 0.9.1 source by the
    conformance tests and below)."""
    rr._NOTICE_GIVEN.clear()
    with caplog.at_level("WARNING", logger="ascend_rl_plugins"):
        rr._async_server_notice(None, (), {})
        rr._async_server_notice(None, (), {})
    notices = [r for r in caplog.records if "async server" in r.getMessage()]
    assert len(notices) == 1 and "LLM._run_engine" in notices[0].getMessage()


@pytest.mark.parametrize("stack, verdict", [("current", "will apply"),
                                            ("recipe", "not for this version")])
def test_doctor_says_where_rebalancing_does_not_apply(monkeypatch, stack, verdict):
    """doctor on verl 0.9.1 (current) lists the async-server notice as applying (rebalancing
    requested); on verl 0.6.1 (recipe, in-process spmd rollout) it does not apply, and it is
    never reported as a problem."""
    from ascend_rl_plugins.doctor import evaluate
    from ascend_rl_plugins.patching.core import REGISTRY
    roots = stacks.roots(stack)
    monkeypatch.setenv("ASCEND_RL_ROLLOUT_REBALANCE", "1")
    flags.reset_cache()
    try:
        row = evaluate(REGISTRY.patches["rollout_rebalance.verl_async_server_notice"], roots)
    finally:
        monkeypatch.delenv("ASCEND_RL_ROLLOUT_REBALANCE")
        flags.reset_cache()
    assert row.verdict.startswith(verdict) and not row.problem, row
