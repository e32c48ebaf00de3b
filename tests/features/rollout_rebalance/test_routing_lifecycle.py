"""Property test of the routing policy (routing.RoutingPolicy) with the client's bookkeeping
modelled around it: any sequence of submit / release / move / hand-back (requeue) and
re-submit / cancel / a router answer its caller never read / replica death / a displaced
request failed over by its client / replica return / KV report. After every step no replica
is over its slots and the router's books are the model's; at the end every request finished
exactly once (or was cancelled) and the books are empty. Pure, no Ray."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from ascend_rl_plugins.features.rollout_rebalance import routing

pytestmark = pytest.mark.stack_independent   # pure Python: nothing a reference stack provides

OPS = ("submit", "submit", "release", "move", "requeue", "resubmit", "cancel", "lost",
       "die", "return", "report", "failover")
SERVERS = ("s0", "s1", "s2")


@dataclass
class ClientModel:
    """What the callers know: each request's state and, running, its replica."""

    policy: routing.RoutingPolicy
    slots: int
    state: dict = field(default_factory=dict)     # id -> queued|running|handed_back|displaced|done|cancelled
    where: dict = field(default_factory=dict)     # running id -> replica its caller holds
    claims: dict = field(default_factory=dict)    # displaced id bound again, caller not asked yet
    prompts: dict = field(default_factory=dict)
    released: Counter = field(default_factory=Counter)
    now: float = 0.0

    def take(self, dispatches) -> None:
        for d in dispatches:
            rid = d.request_id
            assert d.server_id in self.policy.replicas, f"{rid} bound to removed {d.server_id}"
            if self.state.get(rid) == "queued":
                self.state[rid], self.where[rid] = "running", d.server_id
            else:
                assert self.state.get(rid) == "displaced" and rid not in self.claims, \
                    f"{rid} bound while {self.state.get(rid)}"
                self.claims[rid] = d.server_id

    def ask(self, rid: str) -> None:
        """The caller acquires (again): a displaced request bound already gets its claim."""
        if rid in self.claims:
            self.state[rid], self.where[rid] = "running", self.claims.pop(rid)
            return
        self.state[rid] = "queued"
        self.take(self.policy.submit(rid, self.prompts[rid], f"g{self.prompts[rid] % 3}", self.now))

    def pick(self, states, index: int):
        ids = sorted(r for r, s in self.state.items() if s in states)
        return ids[index % len(ids)] if ids else None

    def release(self, rid: str) -> None:
        self.policy.release(self.where.pop(rid), rid, self.now)
        self.state[rid] = "done"
        self.released[rid] += 1
        self.take(self.policy.dispatch(self.now))

    def check(self) -> None:
        books = {}
        for server_id, replica in self.policy.replicas.items():
            assert len(replica.inflight) <= replica.slots, (server_id, list(replica.inflight))
            books.update(dict.fromkeys(replica.inflight, server_id))
        expected = {**self.where, **self.claims}
        assert books == expected
        waiting = sum(1 for r, s in self.state.items() if s == "queued"
                      or (s == "displaced" and r not in self.claims))
        assert self.policy.queued == waiting


def _step(model: ClientModel, op: str, index: int, size: int, dead: list) -> None:
    policy = model.policy
    if op == "submit":
        rid = f"r{len(model.state)}"
        model.prompts[rid] = size
        model.ask(rid)
    elif op == "release" and (rid := model.pick({"running"}, index)):
        model.release(rid)
    elif op == "move" and (rid := model.pick({"running"}, index)):
        room = [s for s, r in policy.replicas.items()
                if s != model.where[rid] and len(r.inflight) < r.slots]
        if room:   # the tail planner moves only where a slot is free
            destination = room[size % len(room)]
            assert policy.move(rid, model.where[rid], destination)
            model.where[rid] = destination
            model.take(policy.dispatch(model.now))
    elif op == "requeue" and (rid := model.pick({"running"}, index)):
        assert policy.requeue(rid, model.where.pop(rid), size)
        model.state[rid] = "handed_back"
        model.take(policy.dispatch(model.now))
    elif op == "resubmit" and (rid := model.pick({"handed_back", "displaced"}, index)):
        model.ask(rid)
    elif op == "cancel" and (rid := model.pick({"queued", "handed_back", "displaced"}, index)):
        policy.cancel(rid)
        model.state[rid] = "cancelled"
        model.claims.pop(rid, None)
        model.take(policy.dispatch(model.now))
    elif op == "lost" and (rid := model.pick({"running"}, index)):
        # the router answered as the caller was cancelled: the caller never runs it
        assert policy.cancel(rid)
        model.where.pop(rid)
        model.state[rid] = "cancelled"
        model.take(policy.dispatch(model.now))
    elif op == "die" and len(policy.replicas) > 1:
        server_id = sorted(policy.replicas)[index % len(policy.replicas)]
        displaced = policy.remove_replica(server_id)
        on_it = {r for r, s in {**model.where, **model.claims}.items() if s == server_id}
        assert set(displaced) == on_it
        for rid in displaced:
            model.where.pop(rid, None)
            model.claims.pop(rid, None)
            model.state[rid] = "displaced"
        dead.append(server_id)
        model.take(policy.dispatch(model.now))
    elif op == "failover" and (rid := model.pick({"displaced"}, index)):
        # its client moved it to a live replica with a free slot before asking again
        room = [s for s, r in policy.replicas.items() if len(r.inflight) < r.slots]
        if room:
            destination = room[size % len(room)]
            claim = model.claims.pop(rid, None)
            if claim is None:
                assert policy.place(rid, destination, model.now)
            elif claim != destination:
                assert policy.move(rid, claim, destination)
            model.state[rid], model.where[rid] = "running", destination
            model.take(policy.dispatch(model.now))
    elif op == "return" and dead:
        policy.add_replica(dead.pop(index % len(dead)), model.slots)
        model.take(policy.dispatch(model.now))
    elif op == "report" and policy.replicas:
        server_id = sorted(policy.replicas)[index % len(policy.replicas)]
        policy.report(server_id, kv_capacity_tokens=2000, kv_used_tokens=size * 4)
        model.take(policy.dispatch(model.now))


@hsettings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 50), st.integers(1, 400)),
                min_size=1, max_size=60),
       st.integers(1, 2), st.sampled_from(["spread", "pack"]), st.integers(0, 512))
def test_every_request_finishes_once_no_slot_overfills_and_the_books_end_empty(
        events, slots, siblings, kv_reserve):
    policy = routing.RoutingPolicy(routing.RouterSettings(siblings=siblings, kv_reserve=kv_reserve))
    for server_id in SERVERS:
        policy.add_replica(server_id, slots)
    policy.max_response_tokens = 1000
    model = ClientModel(policy, slots)
    dead: list = []
    for op, index, size in events:
        model.now += 1.0
        _step(model, op, index, size, dead)
        model.check()
    # the rest of the rollout: callers ask again, running requests finish
    while True:
        model.now += 1.0
        if rid := model.pick({"handed_back", "displaced"}, 0):
            model.ask(rid)
        elif rid := model.pick({"running"}, 0):
            model.release(rid)
        else:
            assert model.pick({"queued"}, 0) is None, "queued requests but nothing in flight: stalled"
            break
        model.check()
    assert all(model.released[r] == 1 for r, s in model.state.items() if s == "done")
    assert set(model.state.values()) <= {"done", "cancelled"}
    assert not any(model.released[r] for r, s in model.state.items() if s == "cancelled")
    assert policy.inflight() == 0 and policy.queued == 0
    assert policy.requeued == {} and policy._started == {} and policy._bound == {}
