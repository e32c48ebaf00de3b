"""The migration protocol on real gloo process groups, over a synthetic engine state
(``protocol_scenario.py``): after any number of rounds every request exists on exactly one
rank, with its tokens and KV intact, including when destinations refuse some requests."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from tests.support.child import run_group  # noqa: E402

SCENARIO = "tests.features.rollout_rebalance.protocol_scenario"
ENV = {"ASCEND_RL_AUTOLOAD": "0", "OMP_NUM_THREADS": "1"}


def run(world, counts, *, kv=True, refuse=None, rounds=3, finish=1, fault=None, fault_ranks=None,
        group_timeout_s=None):
    return run_group(SCENARIO, "run", world, counts, kv, refuse, rounds, finish, fault, fault_ranks,
                     group_timeout_s, env=ENV, timeout=300)


def placements(results) -> dict:
    """request id -> how many ranks hold it now (finished requests count where they ended)."""
    where: dict = {}
    for r in results:
        for rid in r["end"] + r["finished"]:
            where[rid] = where.get(rid, 0) + 1
    return where


def check_exactly_once(results):
    start = [rid for r in results for rid in r["start"]]
    assert len(start) == len(set(start))
    where = placements(results)
    assert sorted(where) == sorted(start), "a request was lost"
    assert [rid for rid, n in where.items() if n != 1] == [], "a request is on two ranks"
    assert not any(r["errors"] for r in results), [r["errors"] for r in results]


def total(results, key):
    return sum(s[key] for r in results for s in r["stats"])


@pytest.mark.parametrize("kv", [True, False], ids=["kv", "recompute"])
def test_every_request_exactly_once_two_ranks(kv):
    results = run(2, [6, 0], kv=kv)
    check_exactly_once(results)
    assert total(results, "sent") > 0
    if kv:
        assert total(results, "bytes_sent") > 0  # KV bytes really travelled
    else:
        assert total(results, "bytes_sent") == 0


def test_four_ranks_with_refusals_keep_requests_at_source():
    results = run(4, [16, 9, 0, 2], refuse="3", rounds=4)
    check_exactly_once(results)
    kept, sent, received = (total(results, k) for k in ("kept", "sent", "received"))
    assert kept > 0 and sent > 0 and sent == received
    for rank, r in enumerate(results):  # refused requests never left their origin
        for rid in r["end"]:
            if rid.endswith("3"):
                assert rid.startswith(f"r{rank}-")
