"""Mooncake Store across "hosts": each client a process of its own with its own
``local_hostname`` and segment, one ``mooncake_master`` on loopback (tests/transport/conftest.py).

- KV blocks move exactly: a non-contiguous, unordered selection of blocks of paged tensors
  (three layers, two layouts, three dtypes) read in place at the source and written in place
  into other blocks at the destination; the 64 MiB move's timings are printed, not asserted.
- An object lives in the segment of the client the master put it in: with the source's
  process killed after its put, the object is lost when it lived there, and still read
  exactly when a holder process held it (``holder_segment``), or, with ``replica_num=2``,
  by a reader that holds the second replica itself.
- Mooncake's rules and this client's answers (:func:`mooncake_scenario.rules`): a put on an
  existing key (Mooncake keeps the old value), removal of a leased key, a missing key, bytes
  over the local buffer, listing and sweeping by prefix, a holder that is not there, spans of
  the wrong size, a master or metadata server that does not answer.
"""

from __future__ import annotations

import pytest

from tests.support import mooncake
from tests.support.child import run_scenario
from tests.support.ports import lease
from tests.transport.mooncake_scenario import Imported, Rules

SCENARIO = "tests.transport.mooncake_scenario"
MiB = 1 << 20
SEED = 42
ALL_EXACT = {"layer0.kv": True, "layer1.kv": True, "layer2.kv": True}


def test_two_hosts_move_kv_blocks_exactly(private_mooncake_master):
    source = private_mooncake_master.settings(segment_size=256 * MiB)
    dest = private_mooncake_master.settings(segment_size=0)   # lends nothing: the object stays at the source
    with mooncake.LiveScenario(SCENARIO, "export_part", source, "req1@tp0", SEED, True) as exporter:
        put = exporter.result()
        assert put["placement"] == [source["local_hostname"]]
        got = run_scenario(SCENARIO, "import_part", dest, "req1@tp0", SEED, True, returns=Imported)
    assert got.found, got.error
    assert got.exact == ALL_EXACT
    assert got.untouched, "blocks outside the destination selection changed"
    assert got.big_exact
    print(f"\nmooncake tcp loopback, two processes: KV part of {put['part_bytes']} bytes put "
          f"{put['part_put_s'] * 1e3:.1f} ms, got {got.get_s * 1e3:.1f} ms; {64} MiB put "
          f"{put['big_put_s'] * 1e3:.0f} ms ({64 / put['big_put_s']:.0f} MiB/s), got "
          f"{got.big_get_s * 1e3:.0f} ms ({64 / got.big_get_s:.0f} MiB/s)")


def test_an_object_in_the_killed_sources_segment_is_lost(private_mooncake_master):
    """Why the holder: the object lives in the source's memory, and goes with it."""
    source = private_mooncake_master.settings(segment_size=64 * MiB)
    dest = private_mooncake_master.settings(segment_size=0)
    with mooncake.LiveScenario(SCENARIO, "export_part", source, "req2@tp0", SEED, False) as exporter:
        assert exporter.result()["placement"] == [source["local_hostname"]]
        exporter.kill()
        got = run_scenario(SCENARIO, "import_part", dest, "req2@tp0", SEED, False, returns=Imported)
    # a failed transfer (the master still lists the object) or no object (it dropped it)
    assert not got.found and not got.exact, got
    assert got.error_code == -800 or got.error == "", got


def test_a_holder_keeps_the_object_when_the_source_is_killed(private_mooncake_master):
    with mooncake.running_holder(private_mooncake_master, 128 * MiB) as holder:
        source = private_mooncake_master.settings(segment_size=64 * MiB, holder_segment=holder)
        dest = private_mooncake_master.settings(segment_size=0)
        with mooncake.LiveScenario(SCENARIO, "export_part", source, "req3@tp0", SEED, False, 8) as exporter:
            # the source lends memory too: without holder_segment the master picks either
            # segment for each of the 8 objects
            assert exporter.result()["placements"] == [[holder]] * 8
            exporter.kill()
            got = run_scenario(SCENARIO, "import_part", dest, "req3@tp0", SEED, False, returns=Imported)
    assert got.found, got.error
    assert got.exact == ALL_EXACT and got.untouched


def test_replica_num_2_serves_a_reader_holding_the_second_replica(private_mooncake_master):
    """Two replicas, on the source and the destination (the only segments): the destination
    reads its own after the source is killed. (A third reader would read the first replica
    the master lists, the dead one, until the master drops it after --client_ttl: use a
    holder for "any replica resumes".)"""
    dest = private_mooncake_master.settings(segment_size=64 * MiB)
    source = private_mooncake_master.settings(segment_size=64 * MiB, replica_num=2)
    with mooncake.LiveScenario(SCENARIO, "import_part_when_told", dest, SEED) as importer:
        importer.result(0)   # its segment is mounted
        with mooncake.LiveScenario(SCENARIO, "export_part", source, "req4@tp0", SEED, False) as exporter:
            put = exporter.result()
            assert sorted(put["placement"]) == sorted([source["local_hostname"], dest["local_hostname"]])
            exporter.kill()
            importer.send({"key": "req4@tp0"})
            got = Imported(**importer.result(1))
    assert got.found, got.error
    assert got.exact == ALL_EXACT and got.untouched


@pytest.fixture(scope="module")
def rules(mooncake_master) -> Rules:
    dead_port = lease(1)   # leased and never bound: nothing answers there
    return run_scenario(SCENARIO, "rules", mooncake_master.settings(), dead_port,
                        f"127.0.0.1:{lease(1)}", returns=Rules)


def test_a_put_on_an_existing_key_is_refused_or_replaces(rules):
    # Mooncake: the second put says 0 and the OLD value stays
    assert (rules.raw_reput_rc, rules.raw_reput_value) == (0, "old")
    assert "a put on an existing key keeps the old value" in rules.refused_reput
    assert rules.replaced_value == "newer"
    assert "'rules.spans'" in rules.refused_span_reput
    assert rules.replaced_span_value == "02" * 32


def test_a_leased_key_is_removed_by_force(rules):
    # Mooncake: a get leases the object for 10 s and a plain remove fails (OBJECT_HAS_LEASE)
    assert rules.raw_remove_leased_rc == -706 and rules.raw_exists_after
    assert rules.removed_leased, rules.remove_leased_error
    assert not rules.exists_after_remove


def test_missing_and_large_objects(rules):
    assert rules.raw_get_missing == "" and rules.get_missing_is_none
    assert rules.big_bytes_exact        # 20 MiB through a 16 MiB local buffer
    assert "no empty objects" in rules.empty_refused


def test_keys_are_listed_and_swept_by_prefix(rules):
    assert rules.keys_with_prefix == ["sweep.a@tp0", "sweep.a@tp1"]
    assert rules.removed_by_prefix == 2
    assert rules.keys_after_prefix_removal == ["sweepXa@tp0"] and rules.foreign_key_kept


def test_a_holder_that_is_not_there_is_an_error(rules):
    assert "not on the holder holder_segment=" in rules.holder_absent_error
    assert not rules.holder_absent_left_object


def test_spans_of_another_size_are_an_error(rules):
    assert "the object holds 100 bytes, the spans 60" in rules.size_mismatch


def test_an_unreachable_server_is_named(rules):
    assert "master_address='127.0.0.1:" in rules.unreachable_master
    assert "does not answer" in rules.unreachable_master
    assert "metadata_server='http://127.0.0.1:" in rules.unreachable_metadata
