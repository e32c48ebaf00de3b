"""moe_reshard on verl 0.9.1 into real vLLM 0.23 CPU engines: the ``ascend_rl_alltoallv`` backend's
rollout ranks load what they receive through vLLM's own loader, read their expert maps from the
live engines, and re-plan when those maps are not what a stale (configured) map says.

Real: Megatron-Core 0.16.1 trainer ranks (2, SequentialMLP, EP 2), verl 0.9.1's
``CheckpointEngineRegistry`` building the backend on both sides, vLLM 0.23 CPU engines (one per
rollout rank, TP = EP = 1: verl09_engine_scenario.py says why) started on W0 and loaded with W1,
and a reference engine started on W1. What stands in: Megatron-Bridge's dense export (W1's HF
tensors) and Ray (the scenario runs verl's prepare / topology / send + receive / finalize steps).
"""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.support.child import ENGINE_ENV, GREEDY_ENGINE_ENV, free_port, run_group, run_scenario
from tests.support.stacks import require_installed

from .verl09_engine_scenario import CASES, NUM_EXPERTS, ROLLOUTS, TRAINERS, Reference, RolloutOutcome, TrainerRun

SCENARIO = "tests.features.moe_reshard.verl09_engine_scenario"
ENV = dict(ENGINE_ENV, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", ASCEND_RL_AUTOLOAD="0",
           ASCEND_RL_MOE_RESHARD="auto", ASCEND_RL_MOE_RESHARD_BUCKET_MB="1")
# the vLLM engines (reference and rollouts) generate greedily only; the Megatron trainer group
# keeps torch.compile on (Megatron-Core's jit_fuser may be torch.compile)
ENGINE_PROCESS_ENV = dict(ENV, **GREEDY_ENGINE_ENV)


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    version = require_installed("torch", "megatron-core", "vllm", "verl")
    if not version.startswith("0.9."):
        pytest.skip(f"the checkpoint-engine backend is verl 0.9's (this stack has verl {version})")
    out = str(tmp_path_factory.mktemp("moe-reshard-verl09-engine"))
    paths = run_scenario(SCENARIO, "prepare", out, env=ENV, timeout=600)
    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(2 + ROLLOUTS) as pool:
        ref = pool.submit(run_scenario, SCENARIO, "reference", paths, out, env=ENGINE_PROCESS_ENV, timeout=900)
        trainers = pool.submit(run_group, SCENARIO, "trainer", TRAINERS, port, paths, env=ENV, timeout=900,
                               returns=TrainerRun)
        rollouts = [pool.submit(run_scenario, SCENARIO, "rollout", port, r, paths, out, env=ENGINE_PROCESS_ENV,
                                timeout=900)
                    for r in range(ROLLOUTS)]
        return (trainers.result(), [RolloutOutcome.from_json(r.result()) for r in rollouts],
                Reference(**ref.result()))


def test_the_live_engines_host_every_expert_where_the_configured_rule_says_half(synced):
    _, rollouts, _ = synced
    for r in rollouts:
        assert r.live_map == list(range(NUM_EXPERTS))
        half = NUM_EXPERTS // ROLLOUTS
        assert r.cases["stale"].config_map == list(range(r.rank * half, (r.rank + 1) * half))
        assert r.cases["stale"].map_source == "config" and r.cases["stale"].expert_map == r.cases["stale"].config_map
        for case in ("live", "live_again"):
            assert r.cases[case].map_source == "live" and r.cases[case].expert_map == r.live_map


def test_each_rank_receives_exactly_the_experts_its_map_says_once_and_vllm_loads_everything(synced):
    _, rollouts, _ = synced
    for r in rollouts:
        for case in CASES:
            c = r.cases[case]
            assert c.resharded and c.reason == "", (r.rank, case, c.reason)
            assert c.expert_ids == sorted(c.expert_map), (r.rank, case)
            # 2 layers x hosted experts x gate/up/down, each once; every tensor reached the loader
            assert c.expert_tensors == 2 * len(c.expert_map) * 3
            assert c.unique_names == c.received == c.loaded


def test_synced_engines_equal_an_engine_started_on_the_weights(synced):
    """Every parameter bit for bit (after vLLM's post-load processing, e.g. the CPU MoE
    prepack), every received tensor bit for bit with W1's, and the greedy tokens and logprobs.
    The received tensors are compared because vLLM's CPU linear layers keep their weight only
    packed (an empty parameter: ``packed_away``), out of the parameter comparison's sight --
    which is how a wrong ``o_proj`` once passed it (moe_reshard README, TP 2 row-parallel)."""
    _, rollouts, ref = synced
    assert rollouts[0].before != ref.tokens                     # the sync changes what is generated
    for r in rollouts:
        assert r.moe_paths == ref.moe_paths and len(r.moe_paths) == 2
        # none where vLLM takes its plain torch linear (no oneDNN / AMX kernel)
        assert all(n.endswith(("qkv_proj.weight", "o_proj.weight", "gate.weight")) for n in r.packed_away), r.packed_away
        for case in CASES:
            assert r.cases[case].received_different == [], (r.rank, case, r.cases[case].received_different)
        for case in ("live", "live_again"):
            c = r.cases[case]
            assert c.different == [], (r.rank, case, c.different)
            assert c.tokens == ref.tokens and c.logprobs == ref.logprobs, (r.rank, case)


def test_a_sync_keyed_on_the_stale_map_loads_wrong_experts_and_ours_replans(synced):
    """verl #7086's shape on verl 0.9: a sync keyed on a map that is not the live one leaves
    experts the engine serves stale -- generations differ from the reference. Reading the map at
    sync time gives a new plan key (planned afresh, not the stale plan from the cache), then
    the cached plan; generations equal the reference."""
    trainers, rollouts, ref = synced
    for r in rollouts:
        stale, live, again = (r.cases[c] for c in CASES)
        assert stale.different and all(".experts." in n for n in stale.different), stale.different
        assert stale.tokens != ref.tokens
        assert live.plan_key != stale.plan_key and not live.plan_cached
        assert again.plan_key == live.plan_key and again.plan_cached
    for case in CASES:   # every rank of the group agrees on each sync's plan
        keys = {t.cases[case].plan_key for t in trainers} | {r.cases[case].plan_key for r in rollouts}
        assert len(keys) == 1, (case, keys)
