"""The Mooncake client's settings and spans, without a Mooncake Store: bad settings are refused
naming the setting and what it accepts; importing the module imports neither mooncake nor
torch; ``block_spans`` names exactly the bytes of a block selection."""

from __future__ import annotations

import pytest

from ascend_rl_plugins.transport.mooncake_store import MooncakeSettings
from tests.support.child import run_scenario

SCENARIO = "tests.transport.mooncake_scenario"
GOOD = {"master_address": "10.0.0.1:50051", "metadata_server": "http://10.0.0.1:8080/metadata",
        "local_hostname": "10.0.0.2:17001"}


@pytest.mark.stack_independent
@pytest.mark.parametrize("override, named", [
    ({"protocol": "udp"}, "protocol='udp': accepted 'tcp', 'rdma', 'ascend'"),
    ({"master_address": "10.0.0.1"}, "master_address='10.0.0.1'"),
    ({"master_address": "10.0.0.1:0"}, "port in 1..65535"),
    ({"metadata_server": "10.0.0.1:8080"}, "metadata_server='10.0.0.1:8080': accepted an http://"),
    ({"local_hostname": ""}, "local_hostname=''"),
    ({"segment_size": -1}, "segment_size=-1"),
    ({"local_buffer_size": 0}, "local_buffer_size=0"),
    ({"replica_num": 0}, "replica_num=0: accepted an integer in 1..8"),
    ({"holder_segment": "10.0.0.3"},
     "holder_segment='10.0.0.3': accepted 'host:port' (the port is missing)"),
    ({"admin_url": "ftp://x"}, "admin_url='ftp://x'"),
])
def test_bad_settings_are_refused_by_name(override, named):
    with pytest.raises(ValueError) as info:
        MooncakeSettings(**{**GOOD, **override})
    assert named in str(info.value)


@pytest.mark.stack_independent
def test_settings_from_a_mapping_refuse_unknown_keys():
    assert MooncakeSettings.from_dict({**GOOD, "replica_num": 2}).replica_num == 2
    unknown = r"unknown Mooncake setting\(s\) \['segment'\]; accepted: master_address"
    with pytest.raises(ValueError, match=unknown):
        MooncakeSettings.from_dict({**GOOD, "segment": 1})


def test_importing_the_module_imports_neither_mooncake_nor_torch():
    loaded = run_scenario(SCENARIO, "imports_of_the_module")
    assert loaded == {"mooncake": False, "mooncake.store": False, "torch": False}


@pytest.mark.parametrize("layer, blocks, spans", [
    ("layer0.kv", [7, 2, 3, 11, 0, 19], 5),     # blocks first: one span per run of neighbours
    ("layer1.kv", [7, 2, 3, 11, 0, 19], 10),    # blocks second: per K/V half
    ("layer2.kv", [4, 5, 6], 1),
])
def test_block_spans_are_the_bytes_of_the_selection(layer, blocks, spans):
    pytest.importorskip("torch")
    from tests.transport.mooncake_scenario import spans_bytes
    got = spans_bytes(layer, blocks)
    assert got["equal"], got
    assert got["spans"] == spans
