"""The verl 0.9 tail-migration planner (tail_policy.plan_moves): which running or queued
requests move between replicas, how (KV or re-prefill) and only when the gain exceeds the
cost. Pure, no Ray, no clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from ascend_rl_plugins.features.rollout_rebalance import tail_policy as tp

pytestmark = pytest.mark.stack_independent   # pure Python: nothing a reference stack provides

STEP = tp.StepCostModel(((4, 50.0), (64, 80.0), (256, 124.0)), attention_ms_per_token=75.0 / 850_000,
                        graph_sizes=(4, 8, 16, 32, 64))
FAST_LINK = tp.TransferCostModel(kv_bytes_per_token=48128, link_bytes_per_s=20e9, prefill_tokens_per_s=8000)
SLOW_LINK = tp.TransferCostModel(kv_bytes_per_token=48128, link_bytes_per_s=1e6, prefill_tokens_per_s=8000)


def _req(rid, generated=1000, expected=2000, prompt=500):
    return tp.RequestView(rid, prompt, generated, expected)


def _replica(sid, running=(), queued=(), kv=850_000, slots=256):
    return tp.ReplicaView(sid, kv, slots, running=list(running), queued=list(queued))


def _loaded_and_idle():
    heavy = [_req("long", generated=8000, expected=30000)] + [_req(f"s{i}", 100, 400) for i in range(120)]
    return [_replica("a", heavy), _replica("b")]


def test_the_longest_request_of_a_loaded_replica_moves_to_an_idle_one_with_its_kv():
    moves = tp.plan_moves(_loaded_and_idle(), STEP, FAST_LINK, max_response_tokens=32768)
    assert moves and moves[0].request_id == "long" and (moves[0].source, moves[0].destination) == ("a", "b")
    assert moves[0].method == "kv" and moves[0].gain_s > moves[0].cost_s


def test_a_slow_link_makes_the_move_a_re_prefill_and_no_gain_means_no_move():
    moves = tp.plan_moves(_loaded_and_idle(), STEP, SLOW_LINK, max_response_tokens=32768)
    assert moves and moves[0].method == "prefill"
    nearly_done = [_req("long", generated=8000, expected=8010)] + [_req(f"s{i}", 100, 120) for i in range(120)]
    lazy = tp.TailSettings(survival=0.0)  # trust the expectation: 10 tokens left
    assert tp.plan_moves([_replica("a", nearly_done), _replica("b")], STEP, FAST_LINK, 32768, lazy) == []


def test_a_request_no_client_can_move_is_never_planned_and_spends_no_move():
    """A replica whose longest request is pinned (its client refused to move it, or no
    migrating client submitted it): no plan names it (a planned move nobody carries out would
    spend the round's ``moves_per_replica``); another replica's movable long request still
    moves. Before ``RequestView.movable`` the planner named the pinned one."""
    pinned = [tp.RequestView("pinned", 500, 8000, 30000, movable=False)] + \
        [_req(f"s{i}", 100, 400) for i in range(120)]
    assert tp.plan_moves([_replica("a", pinned), _replica("b")], STEP, FAST_LINK, 32768) == []
    movable = [_req("long", generated=8000, expected=30000)] + [_req(f"t{i}", 100, 400) for i in range(120)]
    one = tp.TailSettings(moves_per_replica=1)
    moves = tp.plan_moves([_replica("a", pinned), _replica("c", movable), _replica("b")],
                          STEP, FAST_LINK, 32768, one)
    assert [(m.request_id, m.source) for m in moves] == [("long", "c")], moves


def test_a_move_never_overfills_the_destination():
    full = _replica("b", [_req(f"f{i}", 4000, 5000) for i in range(150)], kv=700_000)
    moves = tp.plan_moves([_loaded_and_idle()[0], full], STEP, FAST_LINK, 32768)
    assert all(m.destination != "b" for m in moves)


def test_reserving_expected_growth_keeps_a_move_out_of_a_replica_whose_requests_will_fill_it():
    """A moved request starts at its destination as the newest, vLLM's first preemption victim:
    with ``reserve_expected_growth`` the planner moves it only where the KV also holds what every
    request there is expected to grow by. Here the destination has room for the 2048-token
    reserve per request (8 x 20500 tokens held, 2048 each to grow, the moved request's 8500: 191K
    of 250K) but its 8 requests are expected to run to the 32768 cap (12768 more each, survival
    2) and the moved one 22000 more: 296K."""
    growing = _replica("b", [_req(f"g{i}", 20000, 32768) for i in range(8)], kv=250_000)
    source = _loaded_and_idle()[0]
    by_reserve = tp.plan_moves([source, growing], STEP, FAST_LINK, 32768)
    assert [(m.request_id, m.destination) for m in by_reserve] == [("long", "b")]
    careful = tp.TailSettings(reserve_expected_growth=True)
    assert tp.plan_moves([source, growing], STEP, FAST_LINK, 32768, careful) == []
    idle = tp.plan_moves([source, growing, _replica("c")], STEP, FAST_LINK, 32768, careful)
    assert [(m.request_id, m.destination) for m in idle] == [("long", "c")]


def test_queued_requests_go_to_a_replica_with_room():
    waiting = _replica("a", [_req("r", 100, 200)], queued=[_req("q0", 300, 900), _req("q1", 0, 900)])
    moves = tp.plan_moves([waiting, _replica("b")], STEP, FAST_LINK, 32768)
    queued = [m for m in moves if m.method == "queued"]
    assert [(m.request_id, m.destination) for m in queued] == [("q0", "b"), ("q1", "b")]


def test_expected_remaining_is_floored_by_what_ran_and_capped_by_the_maximum():
    assert tp.expected_remaining(_req("r", 3000, 2000), 32768, survival=1.0) == 3000
    assert tp.expected_remaining(_req("r", 1000, 9000), 32768, survival=1.0) == 8000


def test_an_expectation_at_the_cap_is_no_estimate_and_the_long_running_request_moves():
    """What the live client passes without the router's estimate (each request's max_tokens)
    carries no information: the survival rule ranks requests by what they ran, so the request
    that has run longest is the one that moves, not the youngest."""
    assert tp.expected_remaining(_req("r", 1000, 32768), 32768, survival=1.0) == 1000
    assert tp.expected_remaining(_req("r", 0, 32768), 32768, survival=1.0) == 1
    assert tp.expected_remaining(_req("r", 20000, 40000), 32768, survival=1.0) == 12768
    heavy = [_req("old", generated=12000, expected=32768)] + [
        _req(f"young{i}", 50, 32768) for i in range(120)]
    moves = tp.plan_moves([_replica("a", heavy), _replica("b")], STEP, FAST_LINK, max_response_tokens=32768)
    assert moves and moves[0].request_id == "old" and moves[0].method == "kv"
    assert tp.expected_remaining(_req("r", 30000, 9000), 32768, survival=1.0) == 2768


def test_by_default_a_request_is_expected_to_run_twice_what_it_ran_up_to_the_maximum():
    """The default survival multiple (2, chosen on the long-tail simulator's 235B workload,
    tail_policy's docstring): a request with no estimate that has run 1000 tokens is expected
    to run 2000 more, one near the cap only what the cap leaves; and the default planner, given
    a lighter replica, moves the request ranked longest by that rule."""
    survival = tp.TailSettings().survival
    assert survival == 2.0
    assert tp.expected_remaining(_req("r", 1000, 32768), 32768, survival) == 2000
    assert tp.expected_remaining(_req("r", 20000, 32768), 32768, survival) == 12768
    busy = [_req("mid", 9000, 32768), _req("older", 20000, 32768)] + [
        _req(f"young{i}", 50, 32768) for i in range(120)]
    moves = tp.plan_moves([_replica("a", busy), _replica("b")], STEP, FAST_LINK, max_response_tokens=32768)
    # survival 1 ranks 'older' (12768 left) above 'mid' (9000); survival 2 ranks 'mid' (18000)
    assert moves and moves[0].request_id == "mid"


def test_bad_model_and_settings_name_the_argument():
    with pytest.raises(ValueError, match="link_bytes_per_s=0.*> 0"):
        tp.TransferCostModel(48128, 0, 8000)
    with pytest.raises(ValueError, match="base_ms.*ascending"):
        tp.StepCostModel(((64, 80.0), (4, 50.0)), 0.0)
    with pytest.raises(ValueError, match="margin_s=-1.*>= 0"):
        tp.TailSettings(margin_s=-1)
    with pytest.raises(ValueError, match="moves_per_replica=1.5.*integer"):
        tp.TailSettings(moves_per_replica=1.5)
    with pytest.raises(ValueError, match="reserve_expected_growth='yes'.*True or False"):
        tp.TailSettings(reserve_expected_growth="yes")


@st.composite
def _cluster(draw):
    replicas = []
    rid = 0
    for i in range(draw(st.integers(2, 6))):
        running, queued = [], []
        slots = draw(st.sampled_from([8, 64, 256]))
        for _ in range(draw(st.integers(0, min(40, slots)))):
            running.append(_req(f"r{rid}", draw(st.integers(0, 30000)), draw(st.integers(16, 32768)),
                                draw(st.integers(16, 4000))))
            rid += 1
        for _ in range(draw(st.integers(0, 3))):
            queued.append(_req(f"r{rid}", draw(st.integers(0, 3000)), draw(st.integers(16, 32768)), 500))
            rid += 1
        replicas.append(_replica(f"s{i}", running, queued, kv=draw(st.sampled_from([200_000, 850_000])),
                                 slots=slots))
    return replicas


@hsettings(max_examples=80, deadline=None)
@given(_cluster(), st.sampled_from([FAST_LINK, SLOW_LINK]),
       st.builds(tp.TailSettings, margin_s=st.sampled_from([0.0, 1.0, 30.0]),
                 moves_per_replica=st.integers(1, 4), max_moves=st.integers(1, 16),
                 reserve_expected_growth=st.booleans()))
def test_every_move_is_worth_its_cost_and_moves_each_request_once(replicas, link, settings):
    """Whatever the cluster: a running request moves only if its expected gain exceeds its
    cost plus the margin, from the replica that holds it to another one with a free slot and
    room for its KV, at most once per round, within the per-replica and per-round limits."""
    where = {r.request_id: v.server_id for v in replicas for r in v.running + v.queued}
    tokens = {r.request_id: r.tokens for v in replicas for r in v.running + v.queued}
    moves = tp.plan_moves(replicas, STEP, link, 32768, settings)
    assert len(moves) <= settings.max_moves
    assert len({m.request_id for m in moves}) == len(moves)
    touched = {}
    for m in moves:
        assert where[m.request_id] == m.source != m.destination
        assert m.method in tp.METHODS
        if m.method != "queued":
            assert m.gain_s > m.cost_s + settings.margin_s
            expected = min(link.kv_seconds(tokens[m.request_id]), link.prefill_seconds(tokens[m.request_id]))
            assert m.cost_s == pytest.approx(expected)
        touched[m.destination] = touched.get(m.destination, 0) + 1
    assert all(n <= settings.moves_per_replica for n in touched.values())
    # destinations end within slots and KV (each running request keeps its growth reserve)
    final = {v.server_id: list(v.running) for v in replicas}
    by_id = {r.request_id: r for v in replicas for r in v.running + v.queued}
    for m in moves:
        if m.method != "queued":
            final[m.source].remove(by_id[m.request_id])
        final[m.destination].append(by_id[m.request_id])
    for v in replicas:
        if any(m.destination == v.server_id for m in moves):
            assert len(final[v.server_id]) <= v.slots
            assert (sum(r.tokens for r in final[v.server_id]) + len(final[v.server_id]) * settings.growth_reserve_tokens
                    <= v.kv_capacity_tokens)
            if settings.reserve_expected_growth:  # and room for every request's expected growth
                growth = sum(tp.expected_remaining(r, 32768, settings.survival) for r in final[v.server_id])
                assert sum(r.tokens for r in final[v.server_id]) + growth <= v.kv_capacity_tokens


def test_a_destination_needs_room_for_the_moved_requests_own_tokens_and_every_reserve():
    """The room check counts what the moved request brings (its 8500 prompt + generated
    tokens, held in KV at the destination) on top of the growth reserve of every request
    there: an idle replica of 8500 + 2048 tokens takes it, one token less does not."""
    source = _loaded_and_idle()[0]
    exact = tp.plan_moves([source, _replica("b", kv=8500 + 2048)], STEP, FAST_LINK, 32768)
    assert [(m.request_id, m.destination) for m in exact] == [("long", "b")]
    assert tp.plan_moves([source, _replica("b", kv=8500 + 2047)], STEP, FAST_LINK, 32768) == []
