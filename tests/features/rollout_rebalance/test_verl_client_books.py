"""The migrating verl client's bookkeeping with the router (verl_client.MigratingLLMServerClient
against router.ExpectedWorkRouter, in one event loop, no Ray): a caller cancelled while its
acquire waits leaves nothing in the router. Issue 42's item 4, client side."""

from __future__ import annotations

import asyncio
import types

import pytest

pytest.importorskip("verl.workers.rollout.llm_server",
                    reason="verl < 0.9 has no LLMServerClient (the client this module's subject extends)")

from ascend_rl_plugins.features.rollout_rebalance import router  # noqa: E402
from ascend_rl_plugins.features.rollout_rebalance.verl_client import (  # noqa: E402
    MigratingLLMServerClient,
    TimedMigration,
)


class _Rollout:  # the fields of verl's RolloutConfig the router reads
    full_determinism = False
    max_num_seqs = 1
    response_length = 100
    disable_log_stats = True


class _Method:
    def __init__(self, bound):
        self._bound = bound

    def remote(self, *args, **kwargs):
        """As a Ray actor call: the call runs on its own, and cancelling whoever awaits its
        result does not cancel it."""
        result = self._bound(*args, **kwargs)
        if asyncio.iscoroutine(result):
            return asyncio.shield(asyncio.ensure_future(result))
        future = asyncio.get_running_loop().create_future()
        future.set_result(result)
        return future


class _ActorHandle:
    """The router as an actor handle: each public method has ``.remote``."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        return _Method(getattr(self._target, name))


def test_a_generate_cancelled_while_its_acquire_waits_leaves_no_slot_and_no_queue_entry():
    shell = router.ExpectedWorkRouter({"a": object()}, {"load": "requests"})
    shell.apply_rollout_config(_Rollout())
    shell._configured = True
    client = MigratingLLMServerClient(None, _ActorHandle(shell), replicas={"a": object()},
                                      policy=TimedMigration(after_s=100.0))

    async def scenario():
        await shell.acquire_server("busy", prompt_ids=[1])   # the only slot
        caller = asyncio.ensure_future(client.generate("r", prompt_ids=[1, 2], sampling_params={}))
        for _ in range(20):
            await asyncio.sleep(0.01)
            if shell.get_status()["queued"]:
                break
        assert shell.get_status()["queued"] == 1
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0.05)                              # the client's cancel arrives
        shell.release_server("a", "busy")
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert shell.get_total_inflight() == 0 and shell.get_status()["queued"] == 0


class _Engine:
    def __init__(self, errored: bool):
        self.errored = errored


class _Server:
    """Double of verl's server actor: ``generate`` (fails on a dead one) and ``__ray_call__``;
    records how many requests the router held on it as each hop started."""

    def __init__(self, name: str, shell, dead: bool = False):
        self.name, self.shell, self.engine = name, shell, _Engine(dead)
        self.router_load_at_hop: list = []
        self.generate = _Method(self._generate)
        self.__ray_call__ = _Method(lambda fn, *args: fn(self, *args))

    async def _generate(self, *, request_id, prompt_ids, sampling_params, **kwargs):
        self.router_load_at_hop.append(self.shell.get_inflight_count(self.name))
        if self.engine.errored:
            raise RuntimeError("EngineDeadError (double)")
        await asyncio.sleep(0)
        return types.SimpleNamespace(token_ids=[7] * sampling_params["max_tokens"], log_probs=None,
                                     stop_reason="completed")


def test_a_hop_on_a_dead_replica_waits_for_a_live_slot_instead_of_overfilling_one(tmp_path):
    """The replica a request was bound to dies under its hop: the client reports it to the
    router and acquires again, so the request waits for the survivor's only slot (before, it
    was moved onto the survivor while the survivor's slot was taken)."""
    shell = router.ExpectedWorkRouter({"live": object(), "dead": object()}, {"load": "requests"})
    shell.apply_rollout_config(_Rollout())
    shell._configured = True
    servers = {"dead": _Server("dead", shell, dead=True), "live": _Server("live", shell)}
    client = MigratingLLMServerClient(None, _ActorHandle(shell), replicas=servers,
                                      policy=TimedMigration(after_s=100.0), store_dir=str(tmp_path))

    async def scenario():
        assert (await shell.acquire_server("other", prompt_ids=[5, 5, 5]))[0] == "live"
        caller = asyncio.ensure_future(client.generate(
            "r", prompt_ids=[1, 2], sampling_params={"max_tokens": 3}))
        for _ in range(50):
            await asyncio.sleep(0.01)
            if shell.get_status()["queued"] or caller.done():
                break
        shell.release_server("live", "other")
        return await asyncio.wait_for(caller, timeout=10.0)

    out = asyncio.run(scenario())
    assert out.token_ids == [7, 7, 7]
    assert servers["live"].router_load_at_hop == [1], servers["live"].router_load_at_hop
    assert shell.get_all_servers() == ["live"]
    assert shell.get_total_inflight() == 0 and shell.get_status()["queued"] == 0


class _Flaky:
    """A server actor whose ``__ray_call__`` raises ``error``."""

    def __init__(self, error: Exception):
        def fail(*args):
            raise error
        self.__ray_call__ = _Method(fail)


def test_a_transient_check_error_is_no_death_and_a_replica_listed_again_returns(tmp_path):
    """Issue 42's item 8: only a dead actor or an errored engine marks a replica dead (one Ray
    hiccup used to exclude it for the whole run), and a replica the router lists again (verl
    added it back) is live again for the client."""
    from ray.exceptions import ActorDiedError
    shell = router.ExpectedWorkRouter({"a": object(), "b": object()}, {"load": "requests"})
    client = MigratingLLMServerClient(None, _ActorHandle(shell), replicas={
        "a": _Flaky(TimeoutError("slow reply")), "b": _Flaky(ActorDiedError())},
        policy=TimedMigration(after_s=100.0), store_dir=str(tmp_path))

    async def scenario():
        assert await client._alive("a") and client.dead == set()
        assert not await client._alive("b") and client.dead == {"b"}
        shell.server_died("b")
        await client._refresh_replicas()
        assert client.dead == {"b"}                    # the router no longer lists it
        shell.add_servers({"b": object()})
        await client._refresh_replicas()
        assert client.dead == set() and client._live() == ["a", "b"]

    asyncio.run(scenario())


def test_the_move_records_are_bounded_across_steps():
    from ascend_rl_plugins.features.rollout_rebalance import verl_client
    stats = verl_client.MigrationStats()
    for i in range(verl_client.MOVES_KEPT + 5):
        stats.moves.append(verl_client.MoveRecord(f"r{i}", "a", "b", 0, 0))
    assert len(stats.moves) == verl_client.MOVES_KEPT and stats.moves[-1].request_id == f"r{i}"
