"""The migrating verl client's bookkeeping with the router (verl_client.MigratingLLMServerClient
against router.ExpectedWorkRouter, in one event loop, no Ray): a caller cancelled while its
acquire waits leaves nothing in the router. Issue 42's item 4, client side."""

from __future__ import annotations

import asyncio
import dataclasses
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


# --- issue 42, findings 6 and 7: what each hop asks of its server, and what every worker plans ---

class _Balancer:
    """Double of verl's router: binds each request to the replica ``bind`` names."""

    def __init__(self, bind: dict):
        self.bind = bind

    def require_acquire_fields(self):
        return ["prompt_ids"]

    def require_release_fields(self):
        return ["request_id"]

    def acquire_server(self, request_id, prompt_ids=None, **extra):
        return self.bind[request_id], None

    def release_server(self, *args, **kwargs):
        pass


class _HopState:
    """A request as vLLM's front end holds it (what ``progress_on_server`` reads)."""

    def __init__(self, hop_id, prompt_len, max_tokens, output):
        self.external_req_id, self.prompt_len, self.max_tokens_param = hop_id, prompt_len, max_tokens
        self.parent_req = None
        self.detokenizer = types.SimpleNamespace(num_output_tokens=output)


class _HopEngine:
    """An ``AsyncLLM`` for ``progress_on_server`` and ``_abort_on_server``: an abort is recorded
    and ends the hop at once (``end_on_abort``) or when the test calls ``end_aborted``."""

    def __init__(self, end_on_abort: bool):
        self.errored = False
        self.end_on_abort = end_on_abort
        self.output_processor = types.SimpleNamespace(request_states={})
        self.vllm_config = types.SimpleNamespace(
            cache_config=types.SimpleNamespace(num_gpu_blocks=1000, block_size=16),
            scheduler_config=types.SimpleNamespace(max_num_seqs=16))
        self.ends: dict = {}       # hop id -> its event (set: the hop returns aborted)
        self.aborted: list = []

    async def abort(self, hop_id):
        self.aborted.append(hop_id)
        if self.end_on_abort:
            self.ends[hop_id].set()

    def end_aborted(self):
        for hop_id in self.aborted:
            self.ends[hop_id].set()


class _HopServer:
    """Double of verl's server actor. A hop's request is told by its first prompt token (its
    tag); ``output[tag]``: tokens the hop has produced so far. A hop runs until aborted (then
    returns those tokens, aborted), or, with ``completes``, returns its whole ``max_tokens`` at
    once. ``calls``: each hop's (hop id, prompt, sampling params)."""

    def __init__(self, completes: bool = False, end_on_abort: bool = False):
        self.engine = _HopEngine(end_on_abort)
        self.completes = completes
        self.output: dict = {}
        self.calls: list = []
        self.generate = _Method(self._generate)
        self.__ray_call__ = _Method(lambda fn, *args: fn(self, *args))

    def hops_of(self, tag) -> list:
        return [hop_id for hop_id, prompt, _ in self.calls if prompt[0] == tag]

    def add_plain(self, hop_id, prompt_len, max_tokens):
        """A request this project's client did not submit (verl's own path: unmovable)."""
        self.engine.output_processor.request_states[hop_id] = _HopState(
            hop_id, prompt_len, max_tokens, lambda: 0)

    async def _generate(self, *, request_id, prompt_ids, sampling_params, **kwargs):
        self.calls.append((request_id, list(prompt_ids), dict(sampling_params)))
        if self.completes:
            return types.SimpleNamespace(token_ids=[7] * sampling_params["max_tokens"],
                                         log_probs=None, stop_reason="completed")
        tag = prompt_ids[0]
        states = self.engine.output_processor.request_states
        states[request_id] = _HopState(request_id, len(prompt_ids), sampling_params["max_tokens"],
                                       lambda: self.output.get(tag, 0))
        end = self.engine.ends[request_id] = asyncio.Event()
        try:
            await end.wait()
        finally:
            states.pop(request_id, None)
        return types.SimpleNamespace(token_ids=[7] * self.output.get(tag, 0), log_probs=None,
                                     stop_reason="aborted")


async def _until(condition, what: str, timeout_s: float = 10.0):
    """Poll ``condition`` (each loop turn) until it holds; fail saying ``what`` after the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("min_tokens,received,expected", [(10, 4, 6), (4, 4, 0), (3, 4, 0),
                                                           (None, 4, None)])
def test_each_hop_asks_min_tokens_less_what_the_request_received(tmp_path, min_tokens, received,
                                                                 expected):
    """Issue 42's finding 6: a request moved after ``received`` tokens asks its destination for
    ``min_tokens - received`` more (never below 0), as it asks ``max_tokens - received``: the
    whole min_tokens again at every hop suppressed EOS anew after each move, and vLLM refused
    a hop whose budget had fallen below it."""
    servers = {"a": _HopServer(end_on_abort=True), "b": _HopServer(completes=True)}
    servers["a"].output[1] = received
    client = MigratingLLMServerClient(None, _ActorHandle(_Balancer({"r": "a"})), replicas=servers,
                                      policy=TimedMigration(after_s=0.01), store_dir=str(tmp_path),
                                      export_timeout_s=0.05)
    params = {"max_tokens": 20, "temperature": 0.0}
    if min_tokens is not None:
        params["min_tokens"] = min_tokens

    out = asyncio.run(client.generate("r", prompt_ids=[1, 2, 3], sampling_params=dict(params)))
    assert len(out.token_ids) == 20
    (_, first_prompt, first), (_, prompt, hop) = servers["a"].calls + servers["b"].calls
    assert first.get("min_tokens") == min_tokens and first["max_tokens"] == 20
    assert prompt == first_prompt + [7] * received
    assert hop["max_tokens"] == 20 - received
    assert hop.get("min_tokens") == expected, hop
    assert ("min_tokens" in hop) == (min_tokens is not None)


def _planned(interval_s: float = 1000.0):
    """Each worker's own policy, alike (a plan only when the test asks: ``plan_round``)."""
    from ascend_rl_plugins.features.rollout_rebalance import tail_policy
    from ascend_rl_plugins.features.rollout_rebalance.migration_client import PlannedMigration
    return PlannedMigration(
        interval_s=interval_s,
        step=tail_policy.StepCostModel(((1, 10.0), (8, 80.0)), attention_ms_per_token=0.0),
        settings=tail_policy.TailSettings(margin_s=1.0, growth_reserve_tokens=16, moves_per_replica=1))


def _spy_plans(client) -> list:
    """Every plan ``client``'s policy makes, as (hop id, source, destination) moves."""
    plans: list = []
    plan = client.policy.plan

    def spied(live, in_flight=None):
        moves = plan(live, in_flight)
        # the planner's names back to the hops they are (before issue 42's fix the client named
        # its own requests by its request id, every other one by its hop id)
        hop_of = {rid: hop.hop_id for rid, hop in client._hop.items()}
        plans.append(sorted((hop_of.get(m.request_id, m.request_id), m.source, m.destination)
                            for m in moves))
        return moves

    client.policy.plan = spied
    return plans


def test_every_worker_plans_the_same_moves_from_the_same_reads_after_a_move(tmp_path):
    """Issue 42's finding 7: two agent-loop workers (two clients) over the same replica reads.
    Worker A's request X has moved once (300 tokens before its hop on r2); worker B's Y runs on
    r2 too. Before the fix A viewed X whole (all 310 tokens generated, its 1000-token budget)
    and B saw only X's hop (10 generated, 700 budget, so the longest budget B knew was 700 and
    X looked nearly done): A planned X r2->r3, B planned Y r2->r3, and each carried out its own,
    two moves out of r2 and into r3 with moves_per_replica=1. Every worker now builds each
    request from the read alone (a hop's id carries the tokens before it): one plan, carried
    out once."""
    servers = {name: _HopServer() for name in ("r1", "r2", "r3")}
    balancer = _ActorHandle(_Balancer({"X": "r1", "Y": "r2"}))
    worker_a = MigratingLLMServerClient(None, balancer, replicas=servers, policy=_planned(),
                                        store_dir=str(tmp_path), export_timeout_s=0.05)
    worker_b = MigratingLLMServerClient(None, balancer, replicas=servers, policy=_planned(),
                                        store_dir=str(tmp_path), export_timeout_s=0.05)
    plans_a, plans_b = _spy_plans(worker_a), _spy_plans(worker_b)
    for i in range(4):   # plain requests of verl's own path, short: load, never the tail
        servers["r1"].add_plain(f"plain1{i}", 10, 8)

    async def scenario():
        x = asyncio.ensure_future(worker_a.generate(
            "X", prompt_ids=[1] * 50, sampling_params={"max_tokens": 1000, "temperature": 0.0}))
        await _until(lambda: servers["r1"].hops_of(1), "X's first hop at r1")
        servers["r1"].output[1] = 300
        # X alone in the tail, on the loaded r1: A moves it to r2 (its first move)
        moved = await worker_a.plan_round()
        assert [(m.source, m.destination) for m in moved] == [("r1", "r2")], plans_a
        await _until(lambda: servers["r1"].engine.aborted, "the abort of X's first hop at r1")
        servers["r1"].engine.end_aborted()
        await _until(lambda: servers["r2"].hops_of(1), "X's second hop at r2")
        servers["r2"].output[1] = 10
        for i in range(4):
            servers["r2"].add_plain(f"plain2{i}", 10, 8)
        y = asyncio.ensure_future(worker_b.generate(
            "Y", prompt_ids=[2] * 60, sampling_params={"max_tokens": 600, "temperature": 0.0}))
        await _until(lambda: servers["r2"].hops_of(2), "Y's hop at r2")
        servers["r2"].output[2] = 200
        # the aborts are recorded, not carried out, until both have planned: the same reads
        ordered = (await worker_a.plan_round()) + (await worker_b.plan_round())
        seen, orders = (worker_a.in_flight, worker_b.in_flight), dict(worker_a._orders)
        for caller in (x, y):
            caller.cancel()
        await asyncio.gather(x, y, return_exceptions=True)
        return ordered, seen, orders

    ordered, (views_a, views_b), orders_a = asyncio.run(scenario())
    # what both carried out: within moves_per_replica (1) at every replica, sent or received
    executed = [(m.source, m.destination) for m in ordered]
    for replica in servers:
        assert sum(replica in move for move in executed) <= 1, (replica, executed)
    # the one plan, each of its moves carried out by its owner
    assert plans_a[-1] == plans_b[-1], (plans_a[-1], plans_b[-1])
    assert plans_a[-1], "the planner found no move to make"
    assert sorted((m.request_id, m.source, m.destination) for m in ordered) == plans_a[-1]
    # every request as both see it, only which is whose differs; X (moved before): its whole
    # prompt, generated tokens and budget
    def unowned(views):
        return {hop_id: dataclasses.replace(v, movable=False) for hop_id, v in views.items()}
    assert unowned(views_a) == unowned(views_b) and len(views_a) == 10
    assert [v.movable for v in views_a.values()].count(True) == 1
    (x_view,) = [v for v in views_a.values() if v.replica == "r2" and v.prompt_tokens == 50]
    assert (x_view.generated, x_view.max_tokens) == (310, 1000), x_view
    # a move record says what the planner saw: earlier hops + the server's live count
    (first,) = worker_a.stats.moves   # r1 -> r2, carried out
    assert (first.tokens_before_hop, first.generated_at_plan) == (0, 300), first
    second = orders_a["X"]            # r2 -> r3, ordered
    assert (second.source, second.tokens_before_hop, second.generated_at_plan) == ("r2", 300, 310)


def test_a_seed_the_server_adds_under_full_determinism_keeps_a_random_request_in_place():
    """verl's server seeds each request with its replica's seed under ``full_determinism``: the
    client's check names it for a random request (its generator would restart with another
    seed at the destination), not for a greedy one, nor with full_determinism off."""
    def client(full_determinism):
        config = types.SimpleNamespace(actor_rollout_ref=types.SimpleNamespace(
            rollout=types.SimpleNamespace(full_determinism=full_determinism)))
        return MigratingLLMServerClient(config, None, replicas={"a": object()},
                                        policy=TimedMigration(after_s=1.0))

    with pytest.raises(ValueError, match="full_determinism"):
        client(True).check_migratable({"temperature": 1.0, "min_tokens": 4, "logprobs": True})
    with pytest.raises(ValueError, match="full_determinism"):
        client(True).check_migratable({})                   # vLLM's default temperature, 1.0
    client(True).check_migratable({"temperature": 0.0})
    client(False).check_migratable({"temperature": 1.0, "min_tokens": 4})
    with pytest.raises(ValueError, match="bad_words"):
        client(False).check_migratable({"temperature": 0.0, "bad_words": ["x y"]})


def test_a_request_under_verls_own_id_is_pinned_for_every_worker():
    """Requests the migrating client did not submit as hops (verl's own client, or one it
    refused to move, both under verl's id) are pinned in every worker's view, so the planner
    spends no move on them; a hop id of this client is movable by its owner only."""
    from ascend_rl_plugins.features.rollout_rebalance.migration_client import (
        PlannedMigration,
        ReplicaCapacity,
    )
    from ascend_rl_plugins.features.rollout_rebalance.verl_client import (
        ServerRequest,
        hop_id_for,
        request_view,
    )
    verl_id = ServerRequest("0f3c9a7e5b2d4c1e8f6a0b9c7d5e3f1a", 100, 50, 1000)
    hop = ServerRequest(hop_id_for(20), 120, 30, 980)
    assert request_view("r", verl_id).pinned and request_view("r", verl_id, movable=True).pinned
    seen = request_view("r", hop)
    assert not seen.pinned and (seen.prompt_tokens, seen.generated, seen.max_tokens) == (100, 50, 1000)
    policy = PlannedMigration(interval_s=1.0, capacities={
        k: ReplicaCapacity(slots=8, kv_tokens=10_000) for k in ("r", "s")})
    views = policy.views(["r", "s"], {"a": request_view("r", verl_id), "b": request_view("r", hop)})
    assert [(v.request_id, v.movable) for v in views[0].running] == [(verl_id.hop_id, False),
                                                                    (hop.hop_id, True)]
