"""The data-parallel replicas decide together whether the planner's micro-batches are used:
one replica whose planner refuses its rows makes every replica keep verl's micro-batches
(replicas with different micro-batch formations would run different collective schedules)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest

from tests.support.child import run_group

ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "ASCEND_RL_AUTOLOAD": "0"}


@pytest.fixture(scope="module", autouse=True)
def needs_torch():
    try:
        version("torch")
    except PackageNotFoundError:
        pytest.skip("torch is not installed in this interpreter (.ci/stack.sh installs it)")


def test_a_replica_whose_planner_refuses_keeps_every_replica_on_verls_micro_batches():
    ranks = run_group("tests.features.hdp.dp_agreement_scenario", "run", 2, "refuses", env=ENV,
                      timeout=300)
    assert [r["planned"] for r in ranks] == [False, False], ranks
    assert "the planner refused this batch" in ranks[1]["why"], ranks
    assert "could not agree" in ranks[0]["why"], ranks


def test_replicas_whose_planners_accept_use_the_plans_with_one_count():
    ranks = run_group("tests.features.hdp.dp_agreement_scenario", "run", 2, "agrees", env=ENV,
                      timeout=300)
    assert [r["planned"] for r in ranks] == [True, True], ranks
    assert ranks[0]["micro_batches"] == ranks[1]["micro_batches"] >= 2, ranks
