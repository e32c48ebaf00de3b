"""The KV-migration parts that need no engine: request parameters, the export store, the forced
policy and the refusals (the engines run in ``test_kv_migration_e2e.py``)."""

from __future__ import annotations

import tempfile

import types

import pytest

from tests.support.stacks import vllm_version

pytestmark = pytest.mark.skipif(vllm_version() is None or not vllm_version().startswith("0.23"),
                                reason="the KV-connector migration targets vLLM 0.23 (verl 0.9)")


@pytest.fixture(scope="module")
def km():
    from ascend_rl_plugins.features.rollout_rebalance import kv_migration
    return kv_migration


def test_params_round_trip_and_bad_values_name_the_key(km):
    p = km.MigrationParams(export_key="abc", load_key="d-e_f.1")
    assert km.MigrationParams.of(p.as_kv_transfer_params()) == p
    assert km.MigrationParams.of(None) is None and km.MigrationParams.of({"other": 1}) is None
    with pytest.raises(ValueError, match="export_key and load_key"):
        km.MigrationParams.of({km.PARAMS_KEY: {"export": "x"}})
    with pytest.raises(ValueError, match="'load_key'"):
        km.MigrationParams.of({km.PARAMS_KEY: {"load_key": "../etc/passwd"}})
    marked = km.MigrationParams(export_key="abc", mark_preempted=True)
    assert km.MigrationParams.of(marked.as_kv_transfer_params()) == marked
    assert "mark_preempted" not in p.as_kv_transfer_params()[km.PARAMS_KEY]   # off: not sent
    with pytest.raises(ValueError, match="'mark_preempted'.*bool"):
        km.MigrationParams.of({km.PARAMS_KEY: {"export_key": "abc", "mark_preempted": "yes"}})


def test_preemption_marks_are_listed_in_one_read_and_cleared(km, tmp_path):
    store = km.KVExportStore(str(tmp_path))
    assert store.preempted_keys() == set() and not store.clear_preempted("k1")
    store.mark_preempted("k1")
    store.mark_preempted("k2")
    store.mark_preempted("k1")   # preempted again before its client read it: one mark
    assert store.preempted_keys() == {"k1", "k2"} and store.keys() == []   # not exports
    assert store.clear_preempted("k1") and store.preempted_keys() == {"k2"}
    with pytest.raises(ValueError, match="bad export key"):
        store.mark_preempted("../x")


def test_store_is_atomic_and_releases(km, tmp_path):
    import torch
    store = km.KVExportStore(str(tmp_path))
    header = km.ExportHeader(list(range(20)), 16, {"layer0": ["float32", [2, 16, 4]]})
    blocks = {"layer0": torch.arange(2 * 2 * 16 * 4, dtype=torch.float32).reshape(2, 2, 16, 4)}
    assert store.header("k1") is None and store.read("k1") is None
    size = store.write("k1", header, blocks)
    assert size > blocks["layer0"].numel() * 4
    assert store.keys() == ["k1"] and store.exists("k1")
    got_header, got = store.read("k1")
    assert got_header == header and torch.equal(got["layer0"], blocks["layer0"])
    assert header.num_blocks == 2
    assert store.delete("k1") and not store.delete("k1")
    assert store.keys() == [] and not any(p.name.startswith(".partial") for p in tmp_path.iterdir())


def test_connector_config_names_the_shipped_class(km):
    cfg = km.kv_transfer_config("/tmp/x")
    assert cfg["kv_connector"] == "MigrationKVConnector" and cfg["kv_role"] == "kv_both"
    assert cfg["kv_connector_module_path"] == "ascend_rl_plugins.features.rollout_rebalance.kv_migration"
    assert cfg["kv_load_failure_policy"] == "recompute"   # a failed load is recomputed, never used
    assert cfg["kv_connector_extra_config"] == {"store_dir": "/tmp/x"}


def test_forced_policy_moves_each_request_at_most_max_moves_times():
    from ascend_rl_plugins.features.rollout_rebalance.migration_client import (
        ForcedMigration,
        Progress,
    )
    policy = ForcedMigration(after_tokens=4, max_moves=2)
    live = ["A", "B", "C"]
    assert policy(Progress("r", "A", 0, 3, 10, live)) is None
    assert policy(Progress("r", "A", 0, 4, 10, live)) == "B"
    assert policy(Progress("r", "B", 1, 5, 9, live)) is None          # next move after 8
    assert policy(Progress("r", "B", 1, 8, 6, live)) == "C"
    assert policy(Progress("r", "C", 2, 12, 2, live)) is None         # two moves done
    assert policy(Progress("s", "A", 0, 4, 1, live)) is None          # nothing left to move
    assert policy(Progress("t", "A", 0, 4, 10, ["A"])) is None        # nowhere to go


@pytest.mark.parametrize("field,value", [("n", 2), ("seed", 3), ("presence_penalty", 0.5),
                                         ("frequency_penalty", 0.1), ("stop", ["x"])])
def test_refusals_name_the_sampling_parameter(field, value):
    from ascend_rl_plugins.features.rollout_rebalance.migration_client import check_migratable
    params = types.SimpleNamespace(n=1, seed=None, temperature=1.0, presence_penalty=0.0,
                                   frequency_penalty=0.0, stop=None)
    check_migratable(params)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=field):
        check_migratable(params)
    if field == "seed":   # a seed with greedy decoding moves
        params.temperature = 0.0
        check_migratable(params)


def _planned_client(**policy_args):
    """A MigratingClient with a PlannedMigration, given capacities (no engine is started: the
    policy reads only the client's bookkeeping; the engines run in test_kv_migration_planned)."""
    from ascend_rl_plugins.features.rollout_rebalance import kv_migration, tail_policy
    from ascend_rl_plugins.features.rollout_rebalance.migration_client import (
        InFlight,
        MigratingClient,
        PlannedMigration,
        ReplicaCapacity,
    )
    clock = [0.0]
    policy = PlannedMigration(
        interval_s=1.0, clock=lambda: clock[0],
        step=tail_policy.StepCostModel(((1, 10.0), (8, 80.0)), attention_ms_per_token=0.0),
        settings=tail_policy.TailSettings(margin_s=0.0, growth_reserve_tokens=16),
        capacities={"A": ReplicaCapacity(8, 4096), "B": ReplicaCapacity(8, 4096)}, **policy_args)
    # the store makes its directory: a private temporary one (never '/nonexistent', which other
    # tests rely on not existing)
    store = kv_migration.KVExportStore(tempfile.mkdtemp(prefix="arp-unused-kv-store-"))
    client = MigratingClient({"A": object(), "B": object()}, store, policy=policy)
    for i in range(6):
        client.in_flight[f"r{i}"] = InFlight(f"r{i}", "A", 20, 4 + i, 64, movable=i != 5)
    return client, policy, clock


def _progress(client, request_id, replica="A"):
    from ascend_rl_plugins.features.rollout_rebalance.migration_client import Progress
    r = client.in_flight[request_id]
    return Progress(request_id, replica, 0, r.generated, r.max_tokens - r.generated, ["A", "B"])


def test_planned_policy_moves_the_planned_requests_once_each():
    client, policy, clock = _planned_client()
    # every expectation is the max_tokens (no estimate): the planner ranks by what ran (the
    # survival rule), so the longest-running r5 and r4 are planned to B; r5 is refused (counts
    # as load, skipped), r4 moves
    answers = {rid: policy(_progress(client, rid)) for rid in client.in_flight}
    assert policy.rounds == 1 and policy.planned == 2 and policy.skipped_unmovable == 1, answers
    assert answers == {"r0": None, "r1": None, "r2": None, "r3": None, "r4": "B", "r5": None}
    assert policy.started == 1
    assert policy(_progress(client, "r4")) is None   # a move is made once
    client.in_flight["r4"].replica = "B"
    clock[0] = 0.5
    assert policy(_progress(client, "r0")) is None and policy.rounds == 1   # within the interval
    clock[0] = 1.0
    policy(_progress(client, "r0"))
    assert policy.rounds == 2   # re-planned from the bookkeeping as it is now


def test_planned_policy_skips_a_move_whose_request_left_its_source():
    client, policy, _ = _planned_client()
    policy(_progress(client, "r0"))
    assert set(policy._pending) == {"r4"}
    assert policy(_progress(client, "r4", replica="B")) is None and policy.started == 0


def test_planned_policy_plans_over_requests_a_client_read_itself():
    """verl's client reads the replicas itself and hands the policy what it read: the same
    plan as from an attached client's bookkeeping, and no attach needed."""
    import dataclasses
    client, attached, _ = _planned_client()
    expected = attached.plan(["A", "B"])
    fresh = dataclasses.replace(attached, rounds=0, planned=0, _client=None, _pending={})
    assert fresh.plan(["A", "B"], client.in_flight) == expected and fresh.rounds == 1
    with pytest.raises(RuntimeError, match="no in_flight given and no client attached"):
        fresh.plan(["A", "B"])


def test_planned_policy_and_flags_reject_bad_input():
    from ascend_rl_plugins.features.rollout_rebalance.migration_client import (
        MigratingClient,
        PlannedMigration,
        policy_from_flags,
        replica_capacity,
    )
    with pytest.raises(ValueError, match="interval_s"):
        PlannedMigration(interval_s=0)
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        replica_capacity(object())
    with pytest.raises(ValueError, match="capacities has no entry for replicas \\['B'\\]"):
        from ascend_rl_plugins.features.rollout_rebalance.migration_client import ReplicaCapacity
        MigratingClient({"A": object(), "B": object()}, None,
                        policy=PlannedMigration(1.0, capacities={"A": ReplicaCapacity(1, 16)}))
    with pytest.raises(ValueError, match="ASCEND_RL_ROLLOUT_MIGRATION='on': accepted off, planned"):
        policy_from_flags("on")
    assert policy_from_flags("off") is None
    assert policy_from_flags("planned", 0.5).interval_s == 0.5


def test_client_policy_defaults_to_the_flag(monkeypatch):
    from ascend_rl_plugins import flags
    from ascend_rl_plugins.features.rollout_rebalance.migration_client import MigratingClient
    monkeypatch.setenv("ASCEND_RL_ROLLOUT_MIGRATION", "off")
    flags.reset_cache()
    try:
        assert MigratingClient({"A": object()}, None).policy is None
    finally:
        monkeypatch.undo()
        flags.reset_cache()


def test_a_request_id_already_in_flight_is_refused():
    import asyncio

    from ascend_rl_plugins.features.rollout_rebalance.migration_client import InFlight, MigratingClient
    client = MigratingClient({"A": object()}, None, policy=None)
    client.in_flight["r0"] = InFlight("r0", "A", 3, 0, 8, movable=True)
    with pytest.raises(ValueError, match="request_id 'r0' is already in flight"):
        asyncio.run(client.generate("r0", [1, 2, 3], None, "A"))
    assert "r0" in client.in_flight   # the running one's record is kept


def _worker_connector(km, store_dir: str, blocks: int = 8, block_size: int = 16):
    """The shipped connector in vLLM's worker role, built from a real ``VllmConfig`` and
    ``KVCacheConfig``, over one KV tensor (block dimension first, as vLLM 0.23's CPU
    attention lays it out)."""
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig
    config = VllmConfig(cache_config=CacheConfig(block_size=block_size),
                        kv_transfer_config=KVTransferConfig(**km.kv_transfer_config(store_dir)))
    connector = km.MigrationKVConnector(config, KVConnectorRole.WORKER,
                                        KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[],
                                                      kv_cache_groups=[]))
    kv = torch.arange(blocks * 2 * block_size * 4, dtype=torch.float32).reshape(blocks, 2, block_size, 4)
    connector.register_kv_caches({"layer0": kv})
    return connector


def _step(connector, meta, finished=()):
    """One engine step of the worker-side connector: load/export, then what vLLM collects."""
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)
    done = connector.get_finished(set(finished))
    errors = connector.get_block_ids_with_load_errors()
    connector.clear_connector_metadata()
    return done, errors


def test_an_export_after_a_failed_load_names_only_the_kv_it_holds(km, tmp_path):
    """A request whose load failed (its export gone) and that is aborted before vLLM recomputes
    it reaches request_finished still counting the tokens it never loaded: its export must not
    name them (the next destination would decode on from whatever those blocks held)."""
    store = km.KVExportStore(str(tmp_path))
    connector = _worker_connector(km, str(tmp_path))
    tokens = list(range(40))
    # step 1: a load of a gone export into blocks 5 and 6 (block 4 from the prefix cache)
    meta = km.MigrationConnectorMetadata(loads=[km.LoadJob("hop-1", "gone", [4, 5, 6], 1, 39)])
    _, errors = _step(connector, meta)
    assert errors == {5, 6}          # vLLM is told (recompute policy)
    # step 2: the hop is aborted: its export names only the 16 tokens of the prefix-cache block
    meta = km.MigrationConnectorMetadata(exports=[km.ExportJob("hop-1", "k1", [4, 5, 6], tokens)])
    (sent, _), _ = _step(connector, meta, finished={"hop-1"})
    assert sent == {"hop-1"}
    header, blocks = store.read("k1")
    assert header.tokens == tokens[:16] and blocks["layer0"].shape[0] == 1
    # a request whose load succeeded exports everything it computed
    source = _worker_connector(km, str(tmp_path))
    _step(source, km.MigrationConnectorMetadata(exports=[km.ExportJob("a", "k2", [1, 2, 3], tokens)]),
          finished={"a"})
    _, errors = _step(connector, km.MigrationConnectorMetadata(
        loads=[km.LoadJob("hop-2", "k2", [0, 6, 7], 0, 39)]))
    assert errors is None or errors == set()
    _step(connector, km.MigrationConnectorMetadata(exports=[km.ExportJob("hop-2", "k3", [0, 6, 7], tokens)]),
          finished={"hop-2"})
    assert store.header("k3").tokens == tokens
    assert connector._failed_loads == {}     # nothing kept past the request's end


def test_a_moved_hop_keeps_the_fuller_export_and_drops_the_other(km, tmp_path):
    """verl's client after an aborted hop: the new export replaces the one the hop loaded
    unless the hop never ran (an empty export); neither is deleted before the new one is
    written (the engine core may still be about to load the old one)."""
    pytest.importorskip("verl.workers.rollout.llm_server", reason="verl 0.9's client")
    from ascend_rl_plugins.features.rollout_rebalance.verl_client import _keep_fuller
    store = km.KVExportStore(str(tmp_path))

    def export(key, n):
        store.write(key, km.ExportHeader(list(range(n)), 16, {}), {})

    export("old", 30)
    export("empty", 0)
    assert _keep_fuller(store, "old", "A", "empty", "B") == ("old", "A")
    assert store.keys() == ["old"]
    export("new", 31)
    assert _keep_fuller(store, "old", "A", "new", "B") == ("new", "B")
    assert store.keys() == ["new"]
    assert _keep_fuller(store, "new", "B", None, "A") == ("new", "B")   # no export appeared
    assert _keep_fuller(store, None, None, "new", "A") == ("new", "A")


@pytest.mark.engine
def test_the_connector_marks_exactly_the_preempted_requests_that_ask(tmp_path):
    """A real vLLM 0.23 engine on a KV cache too small for its requests: the connector marks
    each preempted request that asked (``mark_preempted``), from the scheduler's own list of
    the step's preemptions, and no other; outputs unchanged."""
    from tests.features.rollout_rebalance.preemption_scenario import LENGTHS, PreemptionMarks
    from tests.support.child import ENGINE_ENV, GREEDY_ENGINE_ENV, run_scenario
    got = run_scenario("tests.features.rollout_rebalance.preemption_scenario", "connector_marks",
                       str(tmp_path), env=dict(ENGINE_ENV, **GREEDY_ENGINE_ENV), timeout=600,
                       returns=PreemptionMarks)
    asked, preempted = set(got.asked), set(got.preempted)
    assert preempted & asked and preempted - asked, got   # or the scenario has no teeth
    assert got.marked == sorted(preempted & asked), got
    assert got.exports == [] and got.lengths == LENGTHS and got.tokens_match_unmarked_run, got
