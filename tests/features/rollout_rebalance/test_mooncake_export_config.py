"""Choosing the exports' transport (``kv_connector_extra_config``: "directory" or "mooncake"),
with no Mooncake running: bad values refused naming the key at the connector's construction,
each process's Mooncake name its own, and the verl client refusing the directory transport for
replicas on several hosts."""

from __future__ import annotations

import socket

import pytest

from ascend_rl_plugins.features.rollout_rebalance.connector_config import (
    kv_transfer_config,
    store_choice,
)

MOONCAKE = {"master_address": "10.0.0.9:50051", "metadata_server": "http://10.0.0.9:8080/metadata",
            "admin_url": "http://10.0.0.9:9003", "segment_size": 0, "holder_segment": "10.0.0.9:17777"}


def test_the_default_is_the_directory_and_mooncake_is_chosen_by_name():
    assert store_choice({"store_dir": "/tmp/x"}).transport == "directory"
    assert store_choice({}).transport == "directory"
    extra = kv_transfer_config("/tmp/x", mooncake=MOONCAKE)["kv_connector_extra_config"]
    choice = store_choice(extra)
    assert extra["transport"] == "mooncake" and choice.transport == "mooncake"
    assert choice.mooncake_settings == MOONCAKE and choice.namespace == "ascend-rl-kv-migration"


@pytest.mark.parametrize("extra, named", [
    ({"transport": "nfs"}, r"\['transport'\]='nfs': accepted 'directory' or 'mooncake'"),
    ({"transprot": "mooncake"}, r"unknown kv_connector_extra_config key\(s\) \['transprot'\]"),
    ({"transport": "mooncake"}, r"\['mooncake'\]=None: accepted a mapping of Mooncake settings"),
    ({"mooncake": MOONCAKE}, r"\['mooncake'\]=.*nothing with transport='directory'"),
    ({"transport": "mooncake", "mooncake": {**MOONCAKE, "local_hostname": "10.0.0.1:5000"}},
     r"\['mooncake.local_hostname'\]='10.0.0.1:5000': accepted a host .*no port"),
    ({"transport": "mooncake", "mooncake": {k: v for k, v in MOONCAKE.items() if k != "admin_url"}},
     r"\['mooncake.admin_url'\]=None"),
    ({"transport": "mooncake", "mooncake": {**MOONCAKE, "protocol": "udp"}},
     r"\['mooncake'\]: protocol='udp': accepted 'tcp', 'rdma', 'ascend'"),
    ({"transport": "mooncake", "mooncake": {**MOONCAKE, "segmentsize": 1}},
     r"unknown Mooncake setting\(s\) \['segmentsize'\]"),
    ({"transport": "mooncake", "mooncake": MOONCAKE, "mooncake_namespace": "a/b"},
     r"\['mooncake_namespace'\]='a/b'"),
])
def test_bad_choices_name_the_key_and_the_accepted_values(extra, named):
    with pytest.raises(ValueError, match=named):
        store_choice(extra)


def test_the_connector_refuses_a_bad_transport_at_construction(tmp_path):
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from ascend_rl_plugins.features.rollout_rebalance import kv_migration
    kv = kv_transfer_config(str(tmp_path))
    kv["kv_connector_extra_config"]["transport"] = "moon"
    config = VllmConfig(kv_transfer_config=KVTransferConfig(**kv))
    with pytest.raises(ValueError, match=r"\['transport'\]='moon': accepted 'directory' or 'mooncake'"):
        kv_migration.MigrationKVConnector(config, KVConnectorRole.SCHEDULER)


def test_each_process_derives_its_own_mooncake_name():
    pytest.importorskip("torch")
    from ascend_rl_plugins.features.rollout_rebalance.mooncake_export_store import (
        process_local_hostname,
        reset_process_state,
    )
    from tests.support.child import run_scenario
    settings = {"master_address": "127.0.0.1:50051"}
    mine = process_local_hostname(settings)
    assert mine == process_local_hostname(settings)   # one name per process
    host, _, port = mine.rpartition(":")
    assert host == "127.0.0.1"                        # the address towards the master
    with socket.socket() as other, pytest.raises(OSError):   # the port stays held: no other
        other.bind(("0.0.0.0", int(port)))                  # process of this host gets it
    theirs = run_scenario("ascend_rl_plugins.features.rollout_rebalance.mooncake_export_store",
                          "process_local_hostname", settings)
    assert theirs != mine and theirs.startswith("127.0.0.1:")
    assert process_local_hostname({**settings, "local_hostname": "10.1.2.3"}).startswith("10.1.2.3:")
    reset_process_state()                             # the names' ports are released
    with socket.socket() as other:
        other.bind(("0.0.0.0", int(port)))


def test_the_verl_client_refuses_the_directory_for_replicas_on_several_hosts(tmp_path):
    pytest.importorskip("verl.workers.rollout.llm_server",
                        reason="verl < 0.9 has no LLMServerClient (the client this test builds)")
    from ascend_rl_plugins.features.rollout_rebalance.verl_client import (
        MigratingLLMServerClient,
        TimedMigration,
    )

    def client(replicas, **kwargs):
        return MigratingLLMServerClient(None, None, replicas=replicas,
                                        policy=TimedMigration(after_s=100.0), **kwargs)

    two_hosts = {"10.0.0.1:8000": object(), "10.0.0.2:8000": object(), "10.0.0.1:8001": object()}
    with pytest.raises(ValueError, match=r"2 hosts \(10\.0\.0\.1, 10\.0\.0\.2\).*'directory'.*"
                                         r"'transport': 'mooncake', 'mooncake': \{'master_address'"):
        client(two_hosts, store_dir=str(tmp_path))
    client({"10.0.0.1:8000": object(), "10.0.0.1:8001": object()}, store_dir=str(tmp_path))   # one host
    chosen = client(two_hosts, store_config=kv_transfer_config(
        str(tmp_path), mooncake=MOONCAKE)["kv_connector_extra_config"])
    assert chosen.store_config["transport"] == "mooncake"   # built on first use, not here
    with pytest.raises(ValueError, match=r"\['transport'\]='ftp'"):
        client({}, store_config={"transport": "ftp"})
