"""The router as verl 0.9.1 loads and calls it: ``get_router_handle(servers,
router_config_path=<the shipped YAML>)`` (verl's own loader: YAML, class import, ray.remote,
``cls(servers, yaml_config)``), driven by verl's own ``LLMServerClient.generate`` (required
fields queried once, acquire with ``prompt_ids``, release with ``request_id``), Ray local.

The servers are doubles of verl's ``vLLMHttpServer`` (``ServerDouble``: its
``get_rollout_config`` and ``generate`` signatures, a sleep instead of vLLM) that record what
they serve; the real vLLM server is not started here."""

from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("verl.workers.rollout.router", reason="verl 0.9's router plug-in point")
ray = pytest.importorskip("ray")

from ascend_rl_plugins.features import rollout_rebalance as rr  # noqa: E402


@ray.remote
class ServerDouble:
    """Double of verl 0.9.1's vLLMHttpServer: get_rollout_config and generate (same
    signature), sleeping in proportion to the prompt's last token instead of decoding."""

    def __init__(self, name: str):
        self.name = name
        self.configure(1)

    def configure(self, max_num_seqs: int, full_determinism: bool = False) -> None:
        """Start afresh as a server of ``max_num_seqs`` slots (the module's tests share these
        actors: each one's process imports verl, the costliest part of these tests)."""
        from verl.workers.config.rollout import RolloutConfig
        self.config = RolloutConfig(name="vllm", max_num_seqs=max_num_seqs, response_length=64,
                                    prompt_length=32, full_determinism=full_determinism)
        self.running = 0
        self.most = 0
        self.served: list = []

    def get_rollout_config(self):
        return self.config

    async def generate(self, prompt_ids, sampling_params, request_id, image_data=None,
                       video_data=None, audio_data=None, mm_processor_kwargs=None, priority=0,
                       kv_transfer_params=None):
        from verl.workers.rollout.replica import TokenOutput
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(0.01 * (prompt_ids[-1] % 5 + 1))
        finally:
            self.running -= 1
        self.served.append(list(prompt_ids))
        return TokenOutput(token_ids=[prompt_ids[-1]], log_probs=[0.0], stop_reason="completed",
                           extra_fields={"server": self.name})

    def report(self):
        return {"most": self.most, "served": self.served}


DOUBLES = 3   # the most servers a test of this module asks for


@pytest.fixture(scope="module")
def ray_local():
    """Ray local and the module's server doubles (``{address: handle}``), made once."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    yield {f"127.0.0.{i + 1}:{9000 + i}": ServerDouble.remote(f"s{i}") for i in range(DOUBLES)}
    ray.shutdown()


def _client(full_determinism: bool, handle):
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import LLMServerClient
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "name": "vllm", "full_determinism": full_determinism}}})
    return LLMServerClient(config, load_balancer_handle=handle)


def _servers(doubles: dict, n: int, slots: int, full_determinism: bool = False) -> dict:
    """``n`` of the module's server doubles, each started afresh with ``slots`` slots."""
    chosen = dict(list(doubles.items())[:n])
    ray.get([s.configure.remote(slots, full_determinism) for s in chosen.values()])
    return chosen


def _grpo(client, prompts: int, n: int, ids=None):
    """One GRPO batch as the agent loop sends it: n siblings per prompt, all at once."""
    async def run():
        calls = []
        for p in range(prompts):
            prompt = [100 + p, 7, p]
            for k in range(n):
                rid = ids(p, k) if ids else f"req-{p}-{k}"
                calls.append(client.generate(rid, prompt_ids=prompt, sampling_params={}))
        return await asyncio.gather(*calls)
    return asyncio.run(run())


def test_loaded_through_router_config_path_every_request_answered_once(ray_local):
    from verl.workers.rollout.router import get_router_handle
    servers = _servers(ray_local, 2, slots=3)
    handle = get_router_handle(servers, router_config_path=rr.router_yaml_path())
    assert ray.get(handle.require_acquire_fields.remote()) == ["prompt_ids"]
    client = _client(False, handle)
    outputs = _grpo(client, prompts=6, n=4)  # 24 requests, 6 slots in all: most wait in the router
    assert len(outputs) == 24 and all(o.stop_reason == "completed" for o in outputs)
    reports = [ray.get(s.report.remote()) for s in servers.values()]
    assert sum(len(r["served"]) for r in reports) == 24  # each request served exactly once
    assert all(r["most"] <= 3 for r in reports)  # late binding: never over a server's slots
    assert all(r["served"] for r in reports)  # both replicas worked
    status = ray.get(handle.get_status.remote())
    assert status["total_inflight"] == 0 and status["queued"] == 0 and status["load_source"] == "requests"
    assert ray.get(handle.get_total_inflight.remote()) == 0
    # verl's trainer calls, as verl makes them
    assert ray.get(handle.clear_sticky_cache.remote())["cleared_entries"] == 24
    ray.get(handle.remove_servers.remote([list(servers)[1]]))
    assert ray.get(handle.get_all_servers.remote()) == [list(servers)[0]]
    ray.get(handle.add_servers.remote({list(servers)[1]: servers[list(servers)[1]]}))
    assert len(ray.get(handle.get_all_servers.remote())) == 2


def test_multi_turn_sessions_stay_sticky(ray_local):
    from verl.workers.rollout.router import get_router_handle
    servers = _servers(ray_local, 3, slots=2)
    handle = get_router_handle(servers, router_config_path=rr.router_yaml_path())
    client = _client(False, handle)

    async def conversation(rid):
        seen = []
        prompt = [1, 2, 3]
        for _ in range(3):
            out = await client.generate(rid, prompt_ids=prompt, sampling_params={})
            seen.append(out.extra_fields["server"])
            prompt = prompt + out.token_ids + [9]
        return seen

    async def run():
        return await asyncio.gather(*(conversation(f"conv-{i}") for i in range(6)))
    for turns in asyncio.run(run()):
        assert len(set(turns)) == 1, turns


def test_full_determinism_is_read_from_the_servers_and_keeps_its_meaning(ray_local):
    """verl does not pass rollout.full_determinism to plug-in routers: the router reads it from
    the servers' rollout config; then a request id always lands on the same replica, whatever
    the arrival order and load."""
    from verl.workers.rollout.router import get_router_handle

    def mapping(order):
        servers = _servers(ray_local, 3, slots=1, full_determinism=True)
        handle = get_router_handle(servers, router_config_path=rr.router_yaml_path(),
                                   full_determinism=True)
        client = _client(True, handle)
        ids = [f"det-{i}" for i in order]

        async def run():
            return await asyncio.gather(*(client.generate(rid, prompt_ids=[5, 6, int(rid[4:])],
                                                          sampling_params={}) for rid in ids))
        outs = asyncio.run(run())
        assert ray.get(handle.get_status.remote())["deterministic"] is True
        return {rid: o.extra_fields["server"] for rid, o in zip(ids, outs)}
    first = mapping(range(12))
    assert mapping(reversed(range(12))) == first and len(set(first.values())) > 1


def test_a_bad_yaml_value_fails_when_verl_builds_the_router(ray_local, tmp_path):
    from verl.workers.rollout.router import get_router_handle
    bad = tmp_path / "router.yaml"
    bad.write_text(open(rr.router_yaml_path()).read() + "siblings: sideways\n")
    handle = get_router_handle(_servers(ray_local, 1, slots=1), router_config_path=str(bad))
    with pytest.raises(Exception, match=r"siblings.*accepted: one of 'spread', 'pack'"):
        ray.get(handle.get_status.remote())
