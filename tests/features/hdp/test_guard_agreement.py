"""The measured guard on two data-parallel replicas (a real 2-process gloo group): every rank
records the same synchronized step and reaches the same verdict, and a replay where HDP is
10 % faster on every step keeps HDP on, although each replica's own rows model CP
differently (see guard_agreement_scenario.py for the replay)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest

from tests.features.hdp.guard_agreement_scenario import STEPS, RankOutcome
from tests.support.child import run_group

ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "ASCEND_RL_AUTOLOAD": "0", "ASCEND_RL_HDP": "1"}


@pytest.fixture(scope="module")
def ranks() -> list[RankOutcome]:
    try:
        version("torch")
    except PackageNotFoundError:
        pytest.skip("torch is not installed in this interpreter (.ci/stack.sh installs it)")
    return run_group("tests.features.hdp.guard_agreement_scenario", "run", 2, env=ENV, timeout=300,
                     returns=RankOutcome)


def test_every_rank_records_the_same_steps_and_reaches_the_same_verdict(ranks):
    first, second = ranks
    assert first.steps == second.steps, (first.steps, second.steps)
    assert first.fell_back == second.fell_back and first.hdp_enabled == second.hdp_enabled, ranks


def test_hdp_measured_faster_on_every_step_stays_on(ranks):
    for r in ranks:
        assert not r.fell_back and r.hdp_enabled, r
        assert r.timed_steps == STEPS and r.steps[-1].hdp_slower is False, r
        # the CP probe was recorded against the slowest replica's modelled CP time
        probes = [s for s in r.steps if s.probe]
        assert [(s.recorded_modelled_cp_s, s.recorded_regrouped) for s in probes] == [(5.0, False)], r


def test_a_timed_step_pays_one_all_reduce(ranks):
    for r in ranks:
        assert r.all_reduces == r.timed_steps, r
