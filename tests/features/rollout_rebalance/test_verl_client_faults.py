"""Three replicas, one slot each, a queue of requests, and replicas dying one after another under
running hops: the migrating verl client with this project's router (verl_client.
MigratingLLMServerClient against router.ExpectedWorkRouter, one event loop, no Ray; the servers
are doubles of verl's server actor that decode a fixed token). Issue 42: the router sent the
queue to a dead replica (it looked idle) and the client moved each request onto the first live
replica unchecked (one survivor held 4 requests against 1 slot). Checked here: no live replica
ever runs more hops at once than its slot, each request answers exactly once with its whole
response, and the books are empty at the end. The real-engine fault run (two vLLM replicas,
one dies mid-migration) is test_router_verl_migration.py."""

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
from tests.features.rollout_rebalance.test_verl_client_books import (  # noqa: E402
    _ActorHandle,
    _Method,
    _Rollout,
)

TOKENS = 4


class _Engine:
    def __init__(self):
        self.errored = False


class _DyingServer:
    """verl's server actor double: ``generate`` decodes ``TOKENS`` tokens one event-loop turn
    each; its engine dies (errors every hop running on it, and every later one) when its
    ``die_after_hops``-th hop is running."""

    def __init__(self, name: str, die_after_hops: int | None):
        self.name, self.die_after_hops = name, die_after_hops
        self.engine = _Engine()
        self.started = 0
        self.running = 0
        self.most_running = 0
        self.completed: list = []   # prompt of each hop that ended with its whole response
        self.generate = _Method(self._generate)
        self.__ray_call__ = _Method(lambda fn, *args: fn(self, *args))

    async def _generate(self, *, request_id, prompt_ids, sampling_params, **kwargs):
        if self.engine.errored:
            raise RuntimeError(f"EngineDeadError (double): {self.name}")
        self.started += 1
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            for _ in range(sampling_params["max_tokens"]):
                await asyncio.sleep(0.001)
                if self.die_after_hops is not None and self.started >= self.die_after_hops:
                    self.engine.errored = True
                if self.engine.errored:
                    raise RuntimeError(f"EngineDeadError (double): {self.name}")
            self.completed.append(tuple(prompt_ids))
            return types.SimpleNamespace(token_ids=[len(prompt_ids)] * sampling_params["max_tokens"],
                                         log_probs=None, stop_reason="completed")
        finally:
            self.running -= 1


@pytest.mark.parametrize("deaths", [("s0",), ("s0", "s1")], ids=["one-dies", "two-die"])
def test_replicas_dying_under_a_queue_keep_every_survivor_within_its_slot(tmp_path, deaths):
    names = ("s0", "s1", "s2")
    shell = router.ExpectedWorkRouter({s: object() for s in names}, {"load": "requests"})
    shell.apply_rollout_config(_Rollout())   # one slot per replica
    shell._configured = True
    servers = {s: _DyingServer(s, die_after_hops=(1 if s == deaths[0] else 3) if s in deaths else None)
               for s in names}
    client = MigratingLLMServerClient(None, _ActorHandle(shell), replicas=servers,
                                      policy=TimedMigration(after_s=100.0), store_dir=str(tmp_path))
    requests = {f"r{i}": [i] * (i + 1) for i in range(7)}   # 7 requests, 3 slots: a queue

    async def scenario():
        calls = {rid: asyncio.ensure_future(client.generate(rid, prompt_ids=prompt,
                                                            sampling_params={"max_tokens": TOKENS}))
                 for rid, prompt in requests.items()}
        done = await asyncio.wait_for(asyncio.gather(*calls.values()), timeout=30.0)
        return dict(zip(calls, done))

    answers = asyncio.run(scenario())
    # each request answered once, whole: TOKENS tokens (a hop cut by a death is re-run from the
    # tokens received, so the response is the prompt's length repeated TOKENS times)
    assert {rid: out.token_ids for rid, out in answers.items()} == \
        {rid: [len(p)] * TOKENS for rid, p in requests.items()}
    assert {s: servers[s].engine.errored for s in names} == {s: s in deaths for s in names}
    survivors = [s for s in names if s not in deaths]
    assert all(servers[s].most_running <= 1 for s in names), \
        {s: servers[s].most_running for s in names}
    assert sum(servers[s].started for s in survivors) >= len(requests) - len(deaths), \
        {s: servers[s].started for s in names}
    completed = [p for s in names for p in servers[s].completed]
    assert sorted(completed) == sorted(tuple(p) for p in requests.values()), completed  # once each
    assert sorted(shell.get_all_servers()) == survivors
    assert shell.get_total_inflight() == 0 and shell.get_status()["queued"] == 0
