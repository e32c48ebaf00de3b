"""The KV-migration parts that need no engine: request parameters, the export store, the forced
policy and the refusals (the engines run in ``test_kv_migration_e2e.py``)."""

from __future__ import annotations

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
