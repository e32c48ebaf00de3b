"""The verl 0.9 router actor's books (router.ExpectedWorkRouter, called directly, no Ray):
callers that give up leave nothing behind, and a replica that dies leaves the books instead
of looking idle. Issue 42's items 3 and 4, router side."""

from __future__ import annotations

import asyncio

import pytest

from ascend_rl_plugins.features.rollout_rebalance import router

pytestmark = pytest.mark.stack_independent   # asyncio only: nothing a reference stack provides


class _Rollout:  # the fields of verl's RolloutConfig the router reads
    full_determinism = False
    max_num_seqs = 1
    response_length = 100
    disable_log_stats = True


def _router(*servers: str) -> router.ExpectedWorkRouter:
    shell = router.ExpectedWorkRouter({s: object() for s in servers}, {"load": "requests"})
    shell.apply_rollout_config(_Rollout())   # what _configure reads over Ray, once
    shell._configured = True
    return shell


def _no_slot_over(shell) -> None:
    for server_id, replica in shell._policy.replicas.items():
        assert len(replica.inflight) <= replica.slots, (server_id, list(replica.inflight))


def test_a_caller_cancelled_as_the_router_answers_leaves_no_slot():
    """The router binds a waiting request (sets its result) and its caller is cancelled
    before it runs on: the request is off the books, so the total in flight returns to 0."""
    shell = _router("a")

    async def scenario():
        assert (await shell.acquire_server("first", prompt_ids=[1, 2]))[0] == "a"
        waiter = asyncio.ensure_future(shell.acquire_server("second", prompt_ids=[3]))
        await asyncio.sleep(0)
        assert shell.get_status()["queued"] == 1
        shell.release_server("a", "first")   # binds "second": its result is set
        waiter.cancel()                      # ...and its caller gives up before reading it
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(scenario())
    assert shell.get_total_inflight() == 0 and shell.get_status()["queued"] == 0


def test_a_cancel_request_from_the_client_ends_the_waiting_acquire():
    """Cancelling a client's Ray call does not cancel the acquire waiting in the router: the
    client's ``cancel_request`` does, and the request never takes a slot."""
    shell = _router("a")

    async def scenario():
        await shell.acquire_server("busy", prompt_ids=[1])
        waiter = asyncio.ensure_future(shell.acquire_server("gone", prompt_ids=[2]))
        await asyncio.sleep(0)
        shell.cancel_request("gone")
        with pytest.raises(asyncio.CancelledError):
            await waiter
        shell.release_server("a", "busy")

    asyncio.run(scenario())
    assert shell.get_total_inflight() == 0 and shell.get_status()["queued"] == 0


def test_a_dead_replica_is_no_sink_its_requests_wait_for_a_live_slot():
    """3 replicas x 1 slot, three requests queued. Each replica dies in turn while its
    request's caller acquires again: a dead replica takes no work, its request waits at the
    head of the queue for a live slot, and no survivor ever holds more than its slot (the
    issue's replay: one survivor held 4 requests against 1 slot). Added back, a replica
    takes work again."""
    shell = _router("s0", "s1", "s2")
    finished = []

    async def caller(request_id: str, dies: set):
        server_id, _ = await shell.acquire_server(request_id, prompt_ids=[len(request_id)])
        while server_id in dies:   # its hop failed there: the client reports it and asks again
            shell.server_died(server_id)
            server_id, _ = await shell.acquire_server(request_id, prompt_ids=[len(request_id)])
        _no_slot_over(shell)
        await asyncio.sleep(0.01)
        shell.release_server(server_id, request_id)
        finished.append((request_id, server_id))

    async def scenario():
        dies = {"s0", "s1"}
        callers = [asyncio.ensure_future(caller(f"r{i}", dies)) for i in range(6)]
        await asyncio.gather(*callers)

    asyncio.run(scenario())
    assert sorted(r for r, _ in finished) == [f"r{i}" for i in range(6)]
    assert {s for _, s in finished} == {"s2"} and shell.get_all_servers() == ["s2"]
    assert shell.get_total_inflight() == 0 and shell.get_status()["queued"] == 0
    shell.add_servers({"s0": object()})   # verl adds it again

    async def again():
        return (await shell.acquire_server("later", prompt_ids=[9]))[0]
    assert asyncio.run(again()) in ("s0", "s2") and "s0" in shell.get_all_servers()


def test_a_request_displaced_by_verl_removing_its_replica_is_handed_to_its_caller():
    """verl removes a replica while a request runs there: the request is bound again as room
    comes, and its caller's next acquire gets that replica without queueing twice."""
    shell = _router("s0", "s1")

    async def scenario():
        on = {}
        for rid in ("x", "y"):
            on[rid] = (await shell.acquire_server(rid, prompt_ids=[1]))[0]
        shell.remove_servers([on["x"]])
        assert shell.get_status()["queued"] == 1 and shell.get_total_inflight() == 1
        shell.release_server(on["y"], "y")           # room on the survivor: x is bound there
        server_id, _ = await shell.acquire_server("x", prompt_ids=[1])
        assert server_id == on["y"] and shell.get_total_inflight() == 1
        shell.release_server(on["x"], "x")           # released where its caller first acquired it

    asyncio.run(scenario())
    assert shell.get_total_inflight() == 0 and shell.get_status()["queued"] == 0


def test_a_handed_back_caller_that_gives_up_releases_its_waiting_acquire():
    """A handed-back request's caller acquires again and gives up while it waits: its client
    releases it on the replica it held (verl's ``finally``); the waiting acquire ends and the
    request leaves the queue, with no hand-back record left."""
    shell = _router("a")

    async def scenario():
        await shell.acquire_server("back", prompt_ids=[1])
        assert shell.requeue_request("back", "a", 7)
        await shell.acquire_server("busy", prompt_ids=[2])
        waiter = asyncio.ensure_future(shell.acquire_server("back", prompt_ids=[1]))
        await asyncio.sleep(0)
        shell.release_server("a", "back")
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiter, timeout=5.0)   # a TimeoutError: it kept waiting
        shell.release_server("a", "busy")

    asyncio.run(scenario())
    assert shell.get_total_inflight() == 0 and shell.get_status()["queued"] == 0
    assert shell._policy.requeued == {}


def test_a_request_its_client_moved_off_a_dead_replica_is_counted_where_it_runs():
    """Its replica died and the router queued it for its caller, but its client had already
    moved it to the survivor (a move ordered before the death): ``move_request`` from the dead
    replica is accepted and the router counts it on the survivor, once."""
    shell = _router("s0", "s1")

    async def scenario():
        on = (await shell.acquire_server("m", prompt_ids=[1]))[0]
        other = next(s for s in ("s0", "s1") if s != on)
        shell.server_died(on)
        assert shell.get_status()["queued"] == 0 and shell.get_inflight_count(other) == 1
        return on, other

    on, other = asyncio.run(scenario())
    # bound again on the survivor for its caller; the client's move there is then no change
    assert shell.move_request("m", on, other) is True
    shell.release_server(on, "m")
    assert shell.get_total_inflight() == 0 and shell.get_status()["queued"] == 0

    shell = _router("s0", "s1")

    async def queued_then_moved():
        on = (await shell.acquire_server("m", prompt_ids=[1]))[0]
        other = next(s for s in ("s0", "s1") if s != on)
        await shell.acquire_server("busy", prompt_ids=[2])   # the survivor's slot is taken
        shell.server_died(on)
        assert shell.get_status()["queued"] == 1
        return on, other

    on, other = asyncio.run(queued_then_moved())
    assert shell.move_request("m", on, other) is True
    assert shell.get_status()["queued"] == 0 and shell.get_inflight_count(other) == 2
    shell.release_server(on, "m")
    shell.release_server(other, "busy")
    assert shell.get_total_inflight() == 0 and shell.get_status()["queued"] == 0


class _SlowConfigServer:
    """A server actor handle whose ``get_rollout_config`` answers only when the test says so:
    the router's first acquire waits there (``_configure``), the window in which a client's
    cancel can reach the router before its acquire."""

    def __init__(self):
        self.answer = asyncio.Event()
        self.get_rollout_config = self

    def remote(self):
        async def config():
            await self.answer.wait()
            return _Rollout()
        return config()


def test_a_cancel_that_reaches_the_router_before_its_acquire_is_not_lost():
    """Ray does not order an async actor's calls: the client's ``cancel_request`` may run while
    the acquire it cancels still waits before the queue. That acquire ends at once
    (``AcquireCancelled``) and the request takes no slot and no queue entry (before the fix the
    cancel found nothing, the acquire queued and was bound later, and nobody released it)."""
    server = _SlowConfigServer()
    shell = router.ExpectedWorkRouter({"a": server}, {"load": "requests"})

    async def scenario():
        acquire = asyncio.ensure_future(shell.acquire_server("early", prompt_ids=[1, 2]))
        await asyncio.sleep(0)            # the acquire now waits in _configure
        shell.cancel_request("early")     # ... and its cancel arrives first
        server.answer.set()
        with pytest.raises(router.AcquireCancelled, match="early"):
            await acquire
        # the next request is served normally, and the kept cancel is spent
        assert (await shell.acquire_server("next", prompt_ids=[3]))[0] == "a"
        shell.release_server("a", "next")

    asyncio.run(scenario())
    assert shell.get_total_inflight() == 0 and shell.get_status()["queued"] == 0
    assert not shell._cancelled_early


def test_kept_cancels_are_bounded_in_number_and_age(monkeypatch):
    """A cancel whose acquire never comes (Ray dropped the cancelled call) is kept only so
    long and only so many: the router actor lives for the whole run."""
    shell = _router("a")
    monkeypatch.setattr(router, "EARLY_CANCEL_KEPT", 3)
    for rid in ("c1", "c2", "c3", "c4"):
        shell.cancel_request(rid)
    assert list(shell._cancelled_early) == ["c2", "c3", "c4"]
    clock = [1000.0]
    monkeypatch.setattr(router.time, "monotonic", lambda: clock[0])
    shell._cancelled_early.clear()
    shell.cancel_request("old")
    clock[0] += router.EARLY_CANCEL_KEEP_S + 1
    shell.cancel_request("new")
    assert list(shell._cancelled_early) == ["new"]


def test_a_cancel_of_a_request_the_router_holds_keeps_nothing():
    """A cancel that finds its request (queued or bound) drops it and keeps no record."""
    shell = _router("a")

    async def scenario():
        await shell.acquire_server("held", prompt_ids=[1])
    asyncio.run(scenario())
    shell.cancel_request("held")
    assert shell.get_total_inflight() == 0 and not shell._cancelled_early
