"""Fault injection into the migration protocol (gloo, 2-4 processes, synthetic engines).

Every failure point of a round is hit once (``faults.py``); afterwards every request sits on
exactly one rank, and the round either completed (a failure confined to one request: it
stays at its source) or raised on the ranks it concerns -- never a silent loss or copy.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from .test_protocol import check_exactly_once, placements, run, total  # noqa: E402

COUNTS = [16, 9, 0, 2]  # two loaded ranks, two nearly idle ones: flows 0 -> 2, 1 -> 3, ...


@pytest.mark.parametrize("kv", [True, False], ids=["kv", "recompute"])
def test_extract_raising_at_the_source_keeps_the_request_there(kv):
    results = run(4, COUNTS, kv=kv, rounds=1, fault="extract")
    check_exactly_once(results)
    assert all(r["raised"] == [] for r in results)  # the round completes
    failed = [rid for r in results for rid in r["fault"]["failed_extracts"]]
    assert failed and total(results, "sent") > 0  # some extractions failed, others moved
    for r in results:  # every request whose extraction failed is still at its source
        assert set(r["fault"]["failed_extracts"]) <= set(r["end"]) | set(r["finished"])
    assert total(results, "kept") == len(failed)


def test_undecodable_kv_is_a_refusal_and_the_round_completes():
    # running requests move with KV; a short group timeout makes a rank that raised fail fast
    results = run(4, [6, 5, 0, 1], kv=True, rounds=2, fault="decode", group_timeout_s=20)
    check_exactly_once(results)
    assert all(r["raised"] == [] for r in results)
    assert sum(r["fault"]["fired"] for r in results) >= 1
    assert total(results, "kept") >= 1 and total(results, "sent") == total(results, "received") > 0


@pytest.mark.parametrize("kind", ["meta", "ack"])
def test_an_exchange_raising_everywhere_fails_the_round_on_every_rank_and_loses_nothing(kind):
    """The metadata or the acknowledgement exchange raises on every rank (a broken link):
    every rank raises, destinations drop what they had admitted, sources keep everything;
    the group then goes on rebalancing and nothing was lost or copied."""
    results = run(4, COUNTS, kv=True, rounds=4, fault=kind)
    for r in results:
        assert [x["round"] for x in r["raised"]] == [0], r["raised"]
        assert r["raised"][0]["type"] == "InjectedFault"
        assert r["raised"][0]["held"] == r["start"]  # right after the failure: nothing moved
    if kind == "ack":  # destinations had really admitted requests when it raised
        assert sum(r["fault"]["admitted_at_fire"] for r in results) > 0
    check_exactly_once(results)
    assert total(results, "sent") > 0  # later rounds did move requests


@pytest.mark.parametrize("kind", ["ack", "interrupt"])
def test_a_destination_failing_alone_drops_what_it_half_admitted(kind):
    """Only destination rank 2 fails, after admitting some requests: in its ack exchange, or
    interrupted in the middle of its admissions. It drops what it admitted and raises; its
    peers, left waiting in the exchange, raise when the group times out; no source released
    anything, so every request is still at its source."""
    results = run(4, COUNTS, kv=True, rounds=1, fault=kind, fault_ranks=[2], group_timeout_s=4)
    failing = results[2]
    assert failing["fault"]["fired"] == 1 and failing["fault"]["admitted_at_fire"] >= 1
    want = "InjectedFault" if kind == "ack" else "Interrupted"
    assert [x["type"] for x in failing["raised"]] == [want]
    for rank, r in enumerate(results):
        assert len(r["raised"]) == 1, (rank, r["raised"])  # every rank failed loudly
        assert r["raised"][0]["held"] == r["start"], rank
    check_exactly_once(results)


def test_a_failed_release_releases_the_others_and_names_the_request():
    """A source whose release of one acknowledged request fails still releases the others
    and raises naming the one that may now run on two ranks."""
    results = run(4, COUNTS, kv=True, rounds=1, fault="release", fault_ranks=[0])
    source = results[0]
    name = source["fault"]["failed_release"]
    assert name and [x["type"] for x in source["raised"]] == ["RuntimeError"]
    assert name in source["raised"][0]["message"]
    assert all(r["raised"] == [] for r in results[1:])
    where = placements(results)
    assert where.pop(name) == 2  # said loudly above
    assert all(n == 1 for n in where.values())
    received = sum(s["received"] for r in results for s in r["stats"])
    assert received >= 2  # the others that rank 0 sent were released
