"""moe_reshard on verl 0.9.1: the checkpoint-engine backend ``ascend_rl_alltoallv`` and the patch
that hands it the training engine.

Real: verl 0.9.1's ``CheckpointEngineRegistry`` / ``CheckpointEngine`` base and
``import_external_libs`` (what ``custom_backend_module`` triggers), its
``ActorRolloutRefWorker.update_weights`` (called unbound on a minimal worker object), Megatron-Core
0.16.1 models on 4 gloo trainer processes and 2 rollout processes joined by the backend's own
group (verl09_scenario.py says what stands in for Megatron-Bridge's export and for Ray).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from types import SimpleNamespace

import pytest

from ascend_rl_plugins.features import moe_reshard as feature
from tests.features.moe_reshard.verl09_scenario import BAD_TIMEOUTS, GOOD_TIMEOUTS, PublishedPort
from tests.support.child import free_port, rebuild, run_group
from tests.support.stacks import require_installed

ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "ASCEND_RL_AUTOLOAD": "0",
       "ASCEND_RL_MOE_RESHARD": "auto", "ASCEND_RL_MOE_RESHARD_BUCKET_MB": "1"}
SCENARIO = "tests.features.moe_reshard.verl09_scenario"


def _verl09():
    version = require_installed("torch", "megatron-core", "verl")
    if not version.startswith("0.9."):
        pytest.skip(f"the checkpoint-engine backend is verl 0.9's (this stack has verl {version})")


def _run(moe: str, tp: int, ep: int, etp: int, placement: str):
    ports = [free_port() for _ in range(3)]   # the backend's group, again with a fallback, the fallback's
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        trainers = pool.submit(run_group, SCENARIO, "trainer", 4, ports, moe, tp, ep, etp, placement, env=ENV,
                               timeout=900)
        rollouts = pool.submit(run_group, SCENARIO, "rollout", 2, ports, moe, placement, env=ENV, timeout=900)
        return trainers.result(), rollouts.result()


@pytest.fixture(scope="module", params=[
    pytest.param(("sequential", 2, 2, 2, "round_robin"), id="sequential-tp2-ep2-etp2-round_robin"),
    pytest.param(("grouped", 1, 2, 1, "linear"), id="grouped-ep2-etp1-edp2-linear"),
])
def synced(request):
    _verl09()
    return _run(*request.param)


def test_each_rollout_rank_receives_exactly_its_hosted_experts_once_and_every_dense_tensor(synced):
    trainers, rollouts = synced
    for r in rollouts:
        for case in ("reshard", "again", "after"):
            c = r["cases"][case]
            assert c["resharded"] and c["reason"] == "", (case, c)
            want = sorted(f"model.layers.{layer}.mlp.experts.{e}.{p}.weight"
                          for layer in (0, 1) for e in r["hosted"] for p in ("gate_proj", "up_proj", "down_proj"))
            assert c["expert_names"] == want, (case, c["expert_names"])       # each hosted expert, once
            assert c["names"] == c["unique"]
            assert c["dense_names"] == r["stock_dense"]                       # every dense tensor, once
            assert c["from_reshard"] == len(want) and c["from_broadcast"] == len(r["stock_dense"])
            assert c["wrong"] == [], c["wrong"]                               # bit-identical to stock's
    assert sorted(e for r in rollouts for e in r["hosted"]) == [0, 1, 2, 3]
    for t in trainers:
        assert t["cases"]["reshard"]["resharded"] and t["cases"]["reshard"]["log"] == []


def test_the_plan_is_made_once_and_every_rank_agrees_on_its_key(synced):
    trainers, rollouts = synced
    everyone = trainers + rollouts
    keys = {r["cases"][c]["key"] for r in everyone for c in ("reshard", "again", "after")}
    assert len(keys) == 1 and "" not in keys
    assert all(not r["cases"]["reshard"]["cached"] and r["cases"]["again"]["cached"] for r in everyone)


@pytest.mark.parametrize("case,says", [
    ("stock_handoff", "rank 0: verl handed the backend an HF export (experts already gathered), not the training "
                      "engine: the moe_reshard.hand_training_engine patch is not applied"),
    ("trainer_refuses", "rank 2: setup: the training model has no routed experts"),
    ("rollout_refuses", "rank 5: expert map: RuntimeError: expert map unreadable (injected)"),
])
def test_one_rank_refusing_makes_every_rank_take_the_broadcast_fallback_with_one_warning(synced, case, says):
    """One rank of six (4 trainer + 2 rollout) cannot take part: every rank falls back together
    (no partial sync, no rank left waiting), each logs one WARNING naming the rank and reason, and
    every rollout rank receives the whole stock export, bit-identical."""
    trainers, rollouts = synced
    prefix = "ascend-rl moe_reshard: falling back to ascend_rl_alltoallv: the whole export broadcast from " \
             "trainer rank 0: "
    for r in trainers + rollouts:
        c = r["cases"][case]
        assert not c["resharded"] and c["reason"].startswith(says), (case, r["rank"], c["reason"])
        assert len(c["log"]) == 1 and c["log"][0] == prefix + c["reason"], c["log"]
    for r in rollouts:
        c = r["cases"][case]
        assert c["from_reshard"] == 0 and c["names"] == c["unique"] == len(r["stock_dense"]) + r["stock_experts"]
        assert c["wrong"] == []


def test_with_a_fallback_backend_one_rank_refusing_hands_the_whole_sync_to_it_on_every_rank(synced):
    """engine_kwargs name the backend the user would otherwise have (``fallback_backend``; here the
    scenario's ``test_gloo_broadcast``, a registered CheckpointEngine subclass: verl 0.9.1's own
    backends need CUDA, NPU or RDMA libraries). Trainer rank 2 of 6 ranks refuses: every rank
    delegates the whole sync to that backend -- the rollout ranks receive the whole export from it,
    bit-identical, nothing from the reshard nor from this backend's own broadcast -- each with one
    WARNING naming the fallback backend, the rank and the reason. With no refusal the reshard runs
    and the fallback's group stays unused."""
    trainers, rollouts = synced
    prefix = "ascend-rl moe_reshard: falling back to checkpoint-engine backend 'test_gloo_broadcast' " \
             "(fallback_backend): the whole export: "
    for r in trainers + rollouts:
        c = r["cases"]["delegated_refuses"]
        assert not c["resharded"] and c["reason"].startswith("rank 2: setup: the training model has no routed experts")
        assert c["log"] == [prefix + c["reason"]], c["log"]
        ok = r["cases"]["delegated_reshard"]
        assert ok["resharded"] and ok["log"] == [] and ok["fallback_moved"] == 0
    total = len(rollouts[0]["stock_dense"]) + rollouts[0]["stock_experts"]
    assert trainers[0]["cases"]["delegated_refuses"]["returned"] == {"fallback_tensors": total}
    for r in rollouts:
        c = r["cases"]["delegated_refuses"]
        assert c["fallback_moved"] == c["names"] == c["unique"] == total
        assert c["from_reshard"] == 0 and c["from_broadcast"] == 0 and c["wrong"] == []
        ok = r["cases"]["delegated_reshard"]
        assert ok["from_reshard"] == len(ok["expert_names"]) > 0 and ok["wrong"] == []


# -- registration, configuration and the hand-off patch (one child process: importing verl 0.9.1's
# workers imports vLLM, kept out of the pytest process) -------------------------------------------

@pytest.fixture(scope="module")
def checks():
    _verl09()
    from tests.support.child import run_scenario
    return run_scenario(SCENARIO, "registry_and_handoff", env=ENV, timeout=600)


def test_the_backend_registers_through_verls_registry_from_the_module_custom_backend_module_names(checks):
    r = checks["registry"]
    assert r["subclass"] and r["takes_training_engine"]
    assert r["meta_host"] == "127.0.0.1" and r["meta_port"] > 0
    assert r["trainer_ranks"] == [0, 1] and r["rollout_ranks"] == [2, 3, 4] and r["world"] == [5, 5, 5]
    assert r["trainer_world"] == [2, 2] and r["same_master"]
    assert r["replica1_rank1_round_robin"] == [1, 5]
    assert any(feature.BACKEND_MODULE in line for line in feature.verl09_config_lines())


@pytest.mark.parametrize("key,says", [
    ("replica_world_size", "replica_world_size must be an integer >= 1"),
    ("expert_placement", "expert_placement must be one of ('linear', 'round_robin')"),
    ("unknown", "unknown key(s) ['replica_size']"),
    ("fallback_backend", "fallback_backend must be one of ["),
    ("fallback_kwargs", "fallback_kwargs must be a mapping of the fallback_backend's engine_kwargs (and needs "
                        "fallback_backend)"),
    ("expert_maps", "expert_maps must be one of ('auto', 'live', 'config') (where a rollout rank's expert map is "
                    "read), got 'stale'"),
])
def test_bad_engine_kwargs_are_refused_when_verl_builds_the_engine(checks, key, says):
    err = checks["bad_kwargs"][key]
    assert err.startswith("ValueError: checkpoint_engine.engine_kwargs.ascend_rl_alltoallv") and says in err, err
    if key == "fallback_backend":       # names what it got and what is excluded
        assert "got 'ncll'" in err and "'naive'" in err and "'delta_sharded'" in err, err


@pytest.mark.parametrize("value", BAD_TIMEOUTS, ids=repr)
def test_a_timeout_that_is_not_a_positive_finite_number_of_seconds_is_refused_when_verl_builds_the_engine(
        checks, value):
    """0 or less would time every wait of the group out at once, NaN, infinity or more than a year
    fail only at the first sync (torch's timedelta / deadline), text, None or a bool are no number
    of seconds: each is refused up front, naming the key and what it accepts."""
    err = checks["bad_kwargs"][f"timeout_s={value!r}"]
    assert err == ("ValueError: checkpoint_engine.engine_kwargs.ascend_rl_alltoallv.timeout_s must be a finite "
                   f"number of seconds > 0 and <= 31536000 (a year; the group's timeout), got {value!r}"), err


def test_positive_finite_timeouts_up_to_a_year_are_taken_as_given(checks):
    assert checks["good_timeouts"] == {repr(value): value for value in GOOD_TIMEOUTS}


def test_the_port_trainer_rank_0_publishes_is_held_by_its_store_until_the_group_forms(checks):
    """verl's manager gathers every rank's prepare metadata before any rank calls
    init_process_group; meanwhile another bind on the node may take a port that was merely found
    free (the store then fails with EADDRINUSE on every rank). Here another socket tries to take
    the published port before each of two syncs: it cannot, and the group forms at that port."""
    r = rebuild(PublishedPort, checks["published_port"])
    assert r.errors == ["", ""], r.errors
    assert r.taken_by_other == [False, False] and all(p > 0 for p in r.ports), r
    assert r.gathered == [[0, 1], [0, 1]]


def test_the_patch_hands_the_training_engine_to_a_backend_that_takes_it_and_nothing_else_changes(checks):
    """verl's real ActorRolloutRefWorker.update_weights, called unbound on a minimal worker: stock
    hands every non-naive backend but delta_sharded the HF export; with the patch applied a backend
    whose class sets takes_training_engine receives the training engine (as delta_sharded does),
    any other backend still the export, and 'naive' (colocated) still runs verl's own path."""
    h = checks["handoff"]
    assert h["stock"] == "export" and h["state"] == "applied"
    assert h["taker"] == "engine" and h["taker_returns"] == {"sent": 1}
    assert h["other"] == "export" and h["naive_untouched"]
    assert h["reverted"] == "export"


def test_in_verls_naive_sync_the_patch_marks_the_engines_export_as_colocated_feeding_its_vllm_worker(checks):
    """verl's real ActorRolloutRefWorker.update_weights(mode='naive') on a minimal colocated worker
    (rollout rank 1 of a TP 2 / EP 2 round-robin replica): stock calls the engine's export with no
    colocated scope; with the patch the export runs inside one naming that vLLM worker (which
    moe_reshard.colocated_export reads), verl's own naive code unchanged around it (same export
    arguments, the export loaded into the rollout), and no scope outlives the call."""
    n = checks["naive"]
    assert n["stock"]["scope"] is None
    assert n["patched"]["scope"] == dict(rollout_rank=1, tp=2, dp=1, expert_parallel=True, placement="round_robin",
                                         reason="")
    assert n["stock"]["kwargs"] == n["patched"]["kwargs"] == [["base_sync_done", True], ["layered_summon", False]]
    assert n["stock"]["loaded"] == n["patched"]["loaded"] == ["model.embed_tokens.weight"]
    assert n["after"] is None


def test_a_rollout_rank_votes_the_live_engines_map_when_a_reader_is_attached(checks):
    """Without a reader the configured rule (round-robin, replicas of 4: rank 1 hosts 1 and 5);
    with one, what the engine says, in its slot order; a map that is not distinct ids in range
    is a refusal with the reason (every rank then falls back together)."""
    m = checks["live_map"]
    assert m["none"] == {"map": [1, 5], "why": "", "source": "config", "config": [1, 5]}
    assert m["live"] == {"map": [3, 0, 5], "why": "", "source": "live", "config": [1, 5]}
    for case, got in (("repeats", "[1, 1]"), ("out_of_range", "[0, 8]")):
        assert m[case]["map"] is None and m[case]["why"] == (
            f"expert map: the live engine's expert map {got} is not a set of distinct expert ids in [0, 8)")
    # engine_kwargs expert_maps: "config" keeps the rule even with a reader; "live" refuses where no
    # live engine is reachable (here: no reader, not a Ray actor; a verl deployment: test_verl09_deploy.py)
    assert m["mode_config"] == {"map": [1, 5], "why": "", "source": "config"}
    assert m["mode_live"]["map"] is None and m["mode_live"]["why"] == (
        "expert map: engine_kwargs.ascend_rl_alltoallv.expert_maps=live but no live engine is reachable (no reader "
        "attached, not inside verl's CheckpointEngineWorker)")
