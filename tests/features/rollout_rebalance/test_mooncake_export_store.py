"""The KV exports over Mooncake Store (mooncake_export_store.MooncakeExportStore), across "hosts":
each process its own Mooncake client under the ``local_hostname`` it derives, one
``mooncake_master`` on loopback, a holder process holding every object.

- a TP=2 x PP=2 export written by one process (half its parts straight from paged KV blocks)
  is complete for, and read bit for bit by, another; and still after its writer is killed;
- deletion removes every part; the stale-export sweep removes what is older than its max age
  (a part whose header is gone included), and keeps the rest.

The choice of the transport (``kv_connector_extra_config``) is validated without Mooncake:
test_mooncake_export_config.py."""

from __future__ import annotations

import pytest

from tests.support import mooncake
from tests.support.child import run_scenario
from tests.support.stacks import vllm_version

pytestmark = pytest.mark.skipif(vllm_version() is None or not vllm_version().startswith("0.23"),
                                reason="the KV-connector migration targets vLLM 0.23 (verl 0.9)")

SCENARIO = "tests.features.rollout_rebalance.mooncake_export_scenario"
MiB = 1 << 20
SEED = 7


@pytest.fixture
def master_and_holder():
    reason = mooncake.missing()
    if reason is not None:
        pytest.skip(f"Mooncake Store needs {reason}")
    with mooncake.running_master() as master, mooncake.running_holder(master, 64 * MiB) as holder:
        yield master, holder


def _extra(master, holder: str) -> dict:
    """A replica's kv_connector_extra_config: the Mooncake transport, no local_hostname (each
    process derives its own), every object on the holder. Each process lends memory too, so
    an object placed anywhere but on the holder could land in its writer's segment (and die
    with it)."""
    return {"transport": "mooncake", "mooncake_namespace": "test-exports",
            "mooncake": {"master_address": master.master_address,
                         "metadata_server": master.metadata_server, "admin_url": master.admin_url,
                         "segment_size": 32 * MiB, "holder_segment": holder}}


def test_an_export_crosses_hosts_outlives_its_writer_and_is_removed(master_and_holder):
    from tests.features.rollout_rebalance.mooncake_export_scenario import Loaded, Removed
    master, holder = master_and_holder
    extra = _extra(master, holder)
    all_exact = {f"pp{p}-tp{t}": True for p in range(2) for t in range(2)}
    with mooncake.LiveScenario(SCENARIO, "write_export", extra, "k1", SEED) as writer:
        written = writer.result()
        # a part's header after its data: incomplete until the last part is in
        assert written["incomplete_before"] == [False] * 4 and written["complete"]
        assert written["placements"] == [holder]
        loaded = run_scenario(SCENARIO, "read_export", extra, "k1", SEED, returns=Loaded)
        assert loaded.hostname != written["hostname"]   # two clients, two names
        assert loaded.hostname.startswith("127.0.0.1:")  # the address towards the master
        assert loaded.complete and loaded.header_tokens and loaded.exact == all_exact
        assert loaded.empty_complete and loaded.keys == ["k1", "k1-empty"]
        assert loaded.preempted == ["k1"]
        writer.kill()
        after = run_scenario(SCENARIO, "read_export", extra, "k1", SEED, returns=Loaded)
    assert after.complete and after.exact == all_exact, after

    removed = run_scenario(SCENARIO, "delete_and_sweep", extra, "k1", SEED, returns=Removed)
    assert removed.deleted_complete and not removed.deleted_again
    assert removed.left_of_key == [] and removed.other_kept and removed.mark_cleared
    # old: 2 data, 1 header, 1 mark; orphan: 1 data; k1-empty: 1 object; young kept
    assert removed.swept == 6 and removed.after_sweep == ["young"] and removed.young_complete
    assert removed.swept_all == 8 and removed.names_left == []
