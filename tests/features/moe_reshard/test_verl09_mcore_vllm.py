"""moe_reshard on verl 0.9.1 end to end with verl's real ``MegatronEngine`` on the trainer side
(4 gloo ranks, Megatron-Bridge 0.3.1; SequentialMLP at TP 2 / EP 2 / ETP 1, then legacy
GroupedMLP at TP 1 / EP 2 / ETP 2) and real vLLM 0.23 CPU engines on the rollout side: after
each engine's sync through ``ascend_rl_alltoallv`` (experts by the reshard, with the maps read
from the live engines; dense tensors from the bridge's export), into rollout engines holding
the noisy ``Wn``, every received tensor equals the checkpoint's, every parameter vLLM keeps
equals that of an engine started on the checkpoint, and so do the greedy tokens and their
logprobs.

Real: verl's engine and registry, Megatron-Bridge / Megatron-Core, vLLM's engines and loader.
What stands in: the TransformerEngine double, verl's CPU device platform and the harness's CPU
shims (verl09_mcore_engine_scenario.py, tests/support/verl_megatron_engine.py), Ray (the
scenario runs verl's prepare / topology / send + receive / finalize steps).
"""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.support.child import ENGINE_ENV, GREEDY_ENGINE_ENV, free_port, run_group, run_scenario
from tests.support.stacks import require_installed

from .verl09_engine_scenario import Reference, TrainerRun
from .verl09_mcore_engine_scenario import NUM_EXPERTS
from .verl09_mcore_vllm_scenario import ROLLOUTS, SYNCS, TRAINERS, SyncedRollout

SCENARIO = "tests.features.moe_reshard.verl09_mcore_vllm_scenario"
REFERENCE = "tests.features.moe_reshard.verl09_engine_scenario"
ENV = dict(ENGINE_ENV, **GREEDY_ENGINE_ENV, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", ASCEND_RL_AUTOLOAD="0",
           ASCEND_RL_MOE_RESHARD="auto", ASCEND_RL_MOE_RESHARD_BUCKET_MB="1")


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    version = require_installed("torch", "megatron-core", "vllm", "verl")
    if not version.startswith("0.9."):
        pytest.skip(f"the checkpoint-engine backend and MegatronEngine are verl 0.9's (this stack has verl {version})")
    require_installed("megatron-bridge")
    out = str(tmp_path_factory.mktemp("moe-reshard-verl09-mcore-vllm"))
    paths = run_scenario(SCENARIO, "prepare", out, env=ENV, timeout=600)
    ports = [free_port() for _ in SYNCS]
    with concurrent.futures.ThreadPoolExecutor(2 + ROLLOUTS) as pool:
        ref = pool.submit(run_scenario, REFERENCE, "reference", paths, out, env=ENV, timeout=900, returns=Reference)
        trainers = pool.submit(run_group, SCENARIO, "trainer", TRAINERS, ports, paths["w"], env=ENV, timeout=900,
                               returns=TrainerRun)
        rollouts = [pool.submit(run_scenario, SCENARIO, "rollout", ports, r, paths, out, env=ENV, timeout=900,
                                returns=SyncedRollout) for r in range(ROLLOUTS)]
        return trainers.result(), [r.result() for r in rollouts], ref.result()


@pytest.mark.parametrize("sync", list(SYNCS))
def test_each_engine_receives_every_expert_it_hosts_once_and_vllm_loads_everything(synced, sync):
    trainers, rollouts, _ = synced
    assert all(t.cases[sync].resharded for t in trainers)
    half = NUM_EXPERTS // ROLLOUTS
    for rollout in rollouts:
        r = rollout.syncs[sync]
        assert r.resharded and r.reason == "" and r.map_source == "live", r
        assert r.config_map == list(range(rollout.rank * half, (rollout.rank + 1) * half))
        assert r.expert_map == r.experts == list(range(NUM_EXPERTS))   # the live engine hosts all 4
        assert r.received == r.unique == r.loaded, r
        assert len({t.cases[sync].plan_key for t in trainers} | {r.plan_key}) == 1


@pytest.mark.parametrize("sync", list(SYNCS))
def test_engines_equal_an_engine_started_on_the_checkpoint(synced, sync):
    """Received tensors, kept parameters (vLLM's CPU linears keep only a packed weight: those are
    covered by the received tensors and the tokens), greedy tokens and logprobs; before each
    sync the engine generated ``Wn``'s tokens (the second sync starts from ``Wn`` reloaded)."""
    _, rollouts, ref = synced
    first = list(SYNCS)[0]
    for rollout in rollouts:
        r = rollout.syncs[sync]
        assert r.before == rollout.syncs[first].before != ref.tokens   # the sync changes what is generated
        assert r.received_different == [], r.received_different
        assert r.different == [], r.different
        assert all(n.endswith(("qkv_proj.weight", "o_proj.weight", "gate.weight")) for n in r.packed_away), r.packed_away
        assert r.tokens == ref.tokens and r.logprobs == ref.logprobs, rollout.rank
