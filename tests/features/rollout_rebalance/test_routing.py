"""The verl 0.9 router's decisions (routing.RoutingPolicy) and its settings: pure, no Ray."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from ascend_rl_plugins import flags
from ascend_rl_plugins.features.rollout_rebalance import routing

pytestmark = pytest.mark.stack_independent   # pure Python: nothing a reference stack provides


def _policy(n=2, slots=4, capacity=0, **kw) -> routing.RoutingPolicy:
    policy = routing.RoutingPolicy(routing.RouterSettings(**kw))
    for i in range(n):
        policy.add_replica(f"s{i}", slots)
        if capacity:
            policy.report(f"s{i}", kv_capacity_tokens=capacity, kv_used_tokens=0)
    policy.max_response_tokens = 1000
    return policy


def _ids(dispatches):
    return [d.request_id for d in dispatches]


def test_late_binding_holds_requests_until_a_replica_has_room():
    """KV known: a replica takes requests while their expected final tokens fit the budget;
    the rest wait in the shared queue and go out as releases free room."""
    policy = _policy(n=2, slots=8, capacity=1200, kv_budget=1.0, kv_reserve=0)  # expected 100 + 500 each
    bound = []
    for i in range(6):
        bound += policy.submit(f"r{i}", 100, f"g{i}", now=0.0)
    assert len(bound) == 4 and policy.queued == 2  # two per replica fit
    per = {s: len(r.inflight) for s, r in policy.replicas.items()}
    assert per == {"s0": 2, "s1": 2}
    policy.release(bound[0].server_id, bound[0].request_id, now=1.0)
    more = policy.dispatch(now=1.0)
    assert len(more) == 1 and more[0].server_id == bound[0].server_id and policy.queued == 1


def test_an_idle_replica_always_takes_a_request():
    """Even a request expected beyond the whole budget goes out to an idle replica: the queue
    never stalls."""
    policy = _policy(n=1, slots=4, capacity=100, kv_budget=0.5)
    assert _ids(policy.submit("big", 5000, "g", now=0.0)) == ["big"]
    assert policy.submit("next", 10, "g2", now=0.0) == []
    policy.release("s0", "big", now=2.0)
    assert _ids(policy.dispatch(now=2.0)) == ["next"]


def test_slots_bound_requests_per_replica_without_metrics():
    policy = _policy(n=2, slots=2)
    bound = [d for i in range(7) for d in policy.submit(f"r{i}", 10, f"g{i}", now=0.0)]
    assert len(bound) == 4 and policy.queued == 3


def test_longest_expected_first_learns_from_finished_siblings():
    """Siblings of a prompt whose finished members took long are expected long, and go out of
    the queue before siblings of a prompt whose members were quick."""
    policy = _policy(n=1, slots=1)
    policy.submit("warm", 10, "other", now=0.0)  # occupies the only slot
    for i in range(3):
        policy.submit(f"short{i}", 10, "short", now=0.0)
        policy.submit(f"long{i}", 10, "long", now=0.0)
    # one sibling of each group already finished in an earlier step: short 1 s, long 9 s
    policy.lengths.observe("short", 1.0)
    policy.lengths.observe("long", 9.0)
    assert policy.lengths.relative("long") > 1.0 > policy.lengths.relative("short")
    order = []
    server = "s0"
    current = "warm"
    t = 0.0
    while True:
        t += 1.0
        policy.release(server, current, now=t)
        out = policy.dispatch(now=t)
        if not out:
            break
        current = out[0].request_id
        order.append(current)
    assert order[:3] == ["long0", "long1", "long2"] and sorted(order[3:]) == ["short0", "short1", "short2"]


def test_arrival_order_is_kept_when_asked():
    policy = _policy(n=1, slots=1, order="arrival")
    policy.submit("a", 10, "x", now=0.0)
    for name in ("b", "c", "d"):
        policy.submit(name, 10, name, now=0.0)
    policy.lengths.observe("d", 100.0)
    policy.release("s0", "a", now=1.0)
    assert _ids(policy.dispatch(now=1.0)) == ["b"]


def test_sticky_sessions_go_back_to_their_replica_unqueued():
    policy = _policy(n=2, slots=1)
    first = policy.submit("conv", 10, "turn1", now=0.0)[0].server_id
    policy.submit("other", 10, "o", now=0.0)
    policy.release(first, "conv", now=1.0)
    policy.submit("filler", 10, "f", now=1.0)  # takes the freed slot
    again = policy.submit("conv", 30, "turn2", now=2.0)  # full replica: sticky still wins
    assert [(d.request_id, d.server_id, d.queued) for d in again] == [("conv", first, False)]
    assert policy.clear_sticky() >= 1


def test_pack_prefers_a_siblings_replica_spread_does_not():
    for mode, same in (("pack", True), ("spread", False)):
        policy = _policy(n=2, slots=8, siblings=mode)
        a = policy.submit("a0", 10, "A", now=0.0)[0].server_id
        b = policy.submit("a1", 10, "A", now=0.0)[0].server_id
        assert (a == b) is same, mode


def test_full_determinism_routes_by_request_id_alone():
    """The same ids land on the same replicas whatever the arrival order and load (a stable
    hash over the replicas in registration order; verl's Python hash() is salted per process)."""
    def route(order):
        policy = _policy(n=4, slots=1, deterministic=True)
        return {d.request_id: d.server_id for rid in order
                for d in policy.submit(rid, 10, "g", now=0.0)}
    ids = [f"det-{i}" for i in range(40)]
    first = route(ids)
    shuffled = ids[:]
    random.Random(3).shuffle(shuffled)
    assert route(shuffled) == first and len(first) == 40
    assert set(first.values()) == {"s0", "s1", "s2", "s3"}
    assert first["det-7"] == f"s{routing.stable_index('det-7', 4)}"


def test_no_servers_raises_verls_message():
    policy = routing.RoutingPolicy()
    with pytest.raises(RuntimeError, match=routing.NO_SERVERS):
        policy.submit("r", 1, "g", now=0.0)


def test_a_cancelled_caller_is_never_bound():
    policy = _policy(n=1, slots=1)
    policy.submit("busy", 1, "g", now=0.0)
    policy.submit("gone", 1, "g2", now=0.0)
    policy.cancel("gone")
    policy.release("s0", "busy", now=1.0)
    assert policy.dispatch(now=1.0) == [] and policy.queued == 0


def test_a_cancelled_handed_back_request_leaves_nothing_behind():
    """A handed-back request whose caller gives up while it waits again: never bound, and the
    router keeps no record of its generated tokens (no entry per cancelled hand-back)."""
    policy = _policy(n=1, slots=1)
    policy.submit("back", 10, "g", now=0.0)
    assert policy.requeue("back", "s0", 30)
    policy.submit("busy", 1, "g2", now=0.0)
    assert policy.submit("back", 10, "g", now=0.5) == []
    policy.cancel("back")
    policy.release("s0", "busy", now=1.0)
    assert policy.dispatch(now=1.0) == [] and policy.queued == 0 and policy.requeued == {}


def test_a_handed_back_request_leaves_its_replica_and_its_sticky_entry():
    """The preemption hand-back: off the preempting replica's books and out of its sticky entry
    (resubmitted, it is not routed straight back there); refused where the replica named does
    not hold it."""
    policy = _policy(n=2, slots=1)
    a = policy.submit("a", 10, "ga", now=0.0)[0].server_id
    b = policy.submit("b", 10, "gb", now=0.0)[0].server_id
    assert a != b
    assert not policy.requeue("a", b, 5) and policy.replicas[a].inflight and policy.requeued == {}
    assert policy.requeue("a", a, 40)
    assert "a" not in policy.sticky and not policy.replicas[a].inflight and policy.requeued == {"a": 40}
    assert policy.inflight() == 1


def test_handed_back_requests_go_ahead_of_every_unstarted_one_fewest_generated_first():
    """The preemption hand-back's queue order: every handed-back request before any that never
    started, and among them the fewest generated tokens first (the earliest victim, with the
    most left to the response cap; routing.RoutingPolicy.requeue says why)."""
    policy = _policy(n=1, slots=1)
    for rid, generated in (("x", 3), ("y", 30)):   # each bound once, then preempted and handed back
        policy.submit(rid, 10, f"g{rid}", now=0.0)
        assert policy.requeue(rid, "s0", generated)
    policy.submit("busy", 10, "gb", now=0.0)
    for rid, prompt in (("never", 900), ("x", 13), ("y", 40)):   # the longest expected first...
        assert policy.submit(rid, prompt, f"g{rid}", now=1.0) == []
    order = []
    policy.release("s0", "busy", now=2.0)
    for t in range(3, 6):
        bound = policy.dispatch(now=float(t))
        order += _ids(bound)
        for d in bound:
            policy.release(d.server_id, d.request_id, now=float(t))
    assert order == ["x", "y", "never"], order   # ...but after the handed-back ones
    assert policy.requeued == {} and policy.inflight() == 0 and policy.queued == 0


@hsettings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["submit", "release", "report"]), st.integers(0, 9),
                          st.integers(1, 400)), min_size=1, max_size=80),
       st.sampled_from(["spread", "pack"]), st.integers(1, 3), st.booleans())
def test_every_request_is_bound_exactly_once(events, siblings, replicas, kv_known):
    """Any interleaving of submits, releases and KV reports: each request is bound once, no
    replica goes over its slots, and once every bound request is released the queue empties."""
    policy = _policy(n=replicas, slots=2, capacity=900 if kv_known else 0, siblings=siblings)
    bound: dict[str, str] = {}
    released: set[str] = set()
    t = 0.0
    n = 0

    def take(out):
        for d in out:
            assert d.request_id not in bound, "bound twice"
            bound[d.request_id] = d.server_id

    for kind, group, size in events:
        t += 1.0
        if kind == "submit":
            n += 1
            take(policy.submit(f"r{n}", size, f"g{group}", now=t))
        elif kind == "release":
            live = sorted(set(bound) - released)
            if live:
                rid = live[size % len(live)]
                released.add(rid)
                policy.release(bound[rid], rid, now=t)
                take(policy.dispatch(now=t))
        else:
            sid = f"s{group % replicas}"
            policy.report(sid, kv_used_tokens=size * 3)
            take(policy.dispatch(now=t))
        for r in policy.replicas.values():
            assert len(r.inflight) <= r.slots
    while len(released) < n:
        live = sorted(set(bound) - released)
        assert live, "queued requests but nothing in flight: the queue stalled"
        released.add(live[0])
        t += 1.0
        policy.release(bound[live[0]], live[0], now=t)
        take(policy.dispatch(now=t))
    assert len(bound) == n and policy.queued == 0 and policy.inflight() == 0


# -- settings: YAML keys and flags ------------------------------------------------------------

def test_yaml_settings_are_validated_naming_the_key_and_accepted_values():
    from ascend_rl_plugins.features.rollout_rebalance import router
    with pytest.raises(flags.FlagError, match=r"siblings.*ASCEND_RL_ROUTER_SIBLINGS.*'spread', 'pack'"):
        router.settings_from({"siblings": "sideways"})
    with pytest.raises(flags.FlagError, match=r"kv_budget.*\[0.05, 16\]"):
        router.settings_from({"kv_budget": 100})
    with pytest.raises(ValueError, match=r"'kv_bugdet'.*accepted keys: router_class, siblings"):
        router.settings_from({"kv_bugdet": 1})
    shell = router.settings_from({"router_class": "x.Y", "siblings": "pack", "kv_budget": 2})
    assert shell.routing.siblings == "pack" and shell.routing.kv_budget == 2.0
    assert shell.routing.order == "longest_first" and shell.load == "auto"


@pytest.mark.parametrize("name, raw", [("ASCEND_RL_ROUTER_ORDER", "random"),
                                       ("ASCEND_RL_ROUTER_LOAD", "kv"),
                                       ("ASCEND_RL_ROUTER_SLOTS", "-1"),
                                       ("ASCEND_RL_ROUTER_METRICS_INTERVAL", "0")])
def test_bad_router_flags_name_the_variable(name, raw):
    import ascend_rl_plugins.features.rollout_rebalance  # noqa: F401  (declares the flags)
    with pytest.raises(flags.FlagError, match=name):
        flags.get(name).read({name: raw})


def test_router_settings_reject_bad_values_directly():
    with pytest.raises(ValueError, match="siblings='x': accepted 'spread', 'pack'"):
        routing.RouterSettings(siblings="x")
    with pytest.raises(ValueError, match="slots=-1"):
        routing.RouterSettings(slots=-1)


def test_kv_reserve_keeps_room_for_the_running_requests_to_grow():
    """With the KV in use reported, a replica takes another request only while every request
    on it keeps ``kv_reserve`` tokens to grow (prompts sent since the report count too)."""
    policy = _policy(n=1, slots=16, capacity=10_000, kv_budget=16, kv_reserve=1000)
    policy.report("s0", kv_used_tokens=5_000)
    bound = [d for i in range(6) for d in policy.submit(f"r{i}", 100, f"g{i}", now=0.0)]
    # 5000 used + 100 per prompt sent + 1000 per request must stay within 10000
    assert len(bound) == 4 and policy.queued == 2
    policy.report("s0", kv_used_tokens=2_000)  # requests finished elsewhere freed KV
    assert len(policy.dispatch(now=1.0)) == 2


def test_a_handed_back_requests_generated_tokens_count_against_its_replicas_room():
    """A handed-back request brings back what it had generated: its new replica re-prefills
    prompt and generated tokens, so until the next KV report both count against the room
    ``kv_reserve`` keeps (a prompt alone would let the replica take more than it holds, and
    vLLM preempt the newest, the resumed request, again)."""
    policy = _policy(n=1, slots=16, capacity=10_000, kv_budget=16, kv_reserve=1000)
    policy.submit("resumed", 100, "g", now=0.0)
    assert policy.requeue("resumed", "s0", 4_000)
    policy.report("s0", kv_used_tokens=2_000)
    assert _ids(policy.submit("resumed", 100, "g", now=1.0)) == ["resumed"]
    assert policy.replicas["s0"].tokens_bound_since_report == 4_100
    # 2000 used + 4100 re-prefilled + 1000 per request: a second fits, a third does not
    bound = [d for i in range(3) for d in policy.submit(f"r{i}", 100, f"g{i}", now=1.0)]
    assert _ids(bound) == ["r0", "r1"] and policy.queued == 1


def test_spread_places_a_groups_siblings_on_replicas_without_one_first():
    """spread: a sibling goes to a replica holding none of its group even when a replica with
    one is less loaded (a group's correlated long tail shared out); pack does the opposite."""
    policy = _policy(n=2, slots=8)
    policy.submit("x0", 10, "X", now=0.0)  # s0
    policy.submit("y0", 10, "Y", now=0.0)  # s1
    policy.submit("y1", 10, "Y", now=0.0)  # s0 (no Y there yet)
    policy.submit("y2", 10, "Y", now=0.0)  # s1 (less loaded, both hold one Y)
    first_x = next(s for s, r in policy.replicas.items() if "x0" in r.inflight)
    # s0 now holds x0,y1; s1 holds y0,y2: equal counts; X's sibling avoids the replica with x0
    placed = policy.submit("x1", 10, "X", now=0.0)[0].server_id
    assert placed != first_x



# -- replica death, cancelled callers, hand-back durations, bounded state (issue 42) ------------

def test_a_dead_replicas_requests_go_back_to_the_head_and_it_takes_no_new_work():
    """3 replicas x 1 slot, all busy, three requests waiting; s0 dies: its request goes back
    to the head of the queue (not lost from the books, not bound to the dead replica), and
    as the survivors free their slots it goes out first, one per slot. s0 returns when added
    again and takes work like any replica."""
    policy = _policy(n=3, slots=1)
    first = {d.server_id: d.request_id
             for i in range(3) for d in policy.submit(f"r{i}", 10, f"g{i}", now=0.0)}
    for i in range(3, 6):
        assert policy.submit(f"w{i}", 10, f"g{i}", now=0.0) == []
    assert policy.remove_replica("s0") == [first["s0"]]
    assert "s0" not in policy.replicas and policy.queued == 4 and policy.inflight() == 2
    policy.release("s1", first["s1"], now=1.0)
    again = policy.dispatch(now=1.0)
    assert [(d.request_id, d.server_id) for d in again] == [(first["s0"], "s1")]
    assert all(len(r.inflight) <= r.slots for r in policy.replicas.values())
    policy.add_replica("s0", 1)   # verl adds it back
    assert [d.server_id for d in policy.dispatch(now=2.0)] == ["s0"] and policy.queued == 2


def test_a_caller_cancelled_after_the_router_bound_it_leaves_no_slot():
    """The router answered as the caller was cancelled: nobody will release that request, so
    the cancel takes it off its replica's books (and the queued request gets the slot)."""
    policy = _policy(n=1, slots=1)
    policy.submit("answered", 10, "g", now=0.0)
    policy.submit("next", 10, "g2", now=0.0)
    assert policy.cancel("answered") is True
    assert policy.inflight() == 0 and policy.lengths.observed == 0
    assert _ids(policy.dispatch(now=1.0)) == ["next"]
    assert policy.cancel("never-seen") is False and policy.queued == 0


def test_a_handed_back_requests_duration_runs_from_its_first_bind():
    """Acquired at 0 s, handed back, bound again at 150 s, released at 200 s: the router
    learns 200 s for its group, not the last hop's 50 s (preempted requests are the long
    ones: timed from the re-bind, their groups would be ranked short)."""
    policy = _policy(n=1, slots=1)
    policy.submit("long", 10, "g", now=0.0)
    assert policy.requeue("long", "s0", 500)
    policy.submit("other", 10, "o", now=100.0)
    assert policy.submit("long", 10, "g", now=120.0) == []
    policy.release("s0", "other", now=150.0)
    assert _ids(policy.dispatch(now=150.0)) == ["long"]
    policy.release("s0", "long", now=200.0)
    assert policy.lengths.by_group["g"][0] == 200.0


def test_a_displaced_request_is_released_where_it_was_bound_again():
    """A request displaced by its replica's death and bound elsewhere is released by its
    caller on the replica it first acquired (a plain verl client): the router drops it where
    it runs now; released while still queued, it leaves the queue."""
    policy = _policy(n=2, slots=1)
    a = policy.submit("a", 10, "ga", now=0.0)[0].server_id
    policy.submit("b", 10, "gb", now=0.0)
    policy.submit("c", 10, "gc", now=0.0)
    policy.remove_replica(a)
    assert policy.queued == 2
    policy.release(a, "a", now=1.0)        # its caller gives up on the dead replica
    assert policy.queued == 1 and policy.requeued == {}
    survivor = next(iter(policy.replicas))
    policy.release(survivor, "b", now=2.0)
    assert _ids(policy.dispatch(now=2.0)) == ["c"] and policy.inflight() == 1


def test_a_sticky_session_whose_replica_was_removed_is_routed_to_a_live_one():
    policy = _policy(n=2, slots=4)
    home = policy.submit("conv", 10, "t1", now=0.0)[0].server_id
    policy.release(home, "conv", now=1.0)
    assert policy.sticky["conv"] == home
    policy.remove_replica(home)
    again = policy.submit("conv", 10, "t2", now=2.0)
    assert [d.server_id for d in again] == [next(iter(policy.replicas))] and home not in policy.replicas


def test_the_sticky_memory_forgets_the_least_recently_used_session():
    policy = _policy(n=2, slots=8, sticky_entries=2)
    for rid in ("old", "mid"):
        policy.submit(rid, 10, rid, now=0.0)
    policy.submit("old", 10, "old", now=1.0)    # used again: now the most recent
    policy.submit("new", 10, "new", now=2.0)
    assert list(policy.sticky) == ["old", "new"]


def test_yaml_kv_reserve_reaches_the_policy():
    """``kv_reserve`` from the YAML (the flag's default equals the dataclass default, so only
    a value set here shows whether it is passed on)."""
    from ascend_rl_plugins.features.rollout_rebalance import router
    assert router.settings_from({"kv_reserve": 512}).routing.kv_reserve == 512
    assert router.settings_from({"kv_reserve": 0}).routing.kv_reserve == 0
