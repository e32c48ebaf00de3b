"""The migration connector at TP / PP > 1 and its store's housekeeping, without an engine (issue
42, finding 1): every worker rank exports and loads its own part of an export, an export is
complete only with every rank's part, an engine of another TP / PP size refuses it by name, the
scheduler matches token contents (not lengths), and stale exports are swept when a connector
opens the store.

Worker-role connectors are built as ``test_kv_migration_parts`` builds them (a real
``VllmConfig`` / ``KVCacheConfig``), several in one process; each is told its TP / PP rank the
way the connector reads it in a worker, through vLLM's ``parallel_state`` (``get_tp_group`` /
``get_pp_group().rank_in_group``), patched here since no process group runs.
"""

from __future__ import annotations

import logging
import os
import time
import types

import pytest

from tests.features.rollout_rebalance.test_kv_migration_parts import _step  # one engine step
from tests.support.stacks import vllm_version

pytestmark = pytest.mark.skipif(vllm_version() is None or not vllm_version().startswith("0.23"),
                                reason="the KV-connector migration targets vLLM 0.23 (verl 0.9)")

BLOCK = 16
TOKENS = list(range(100, 140))   # 40 tokens: 3 blocks, the last one partly filled


@pytest.fixture(scope="module")
def km():
    from ascend_rl_plugins.features.rollout_rebalance import kv_migration
    return kv_migration


@pytest.fixture
def as_rank(monkeypatch):
    """Make the connectors built next see themselves as worker (tp_rank, pp_rank) of an engine
    whose model-parallel groups are up."""
    from vllm.distributed import parallel_state

    def set_rank(tp_rank: int, pp_rank: int = 0) -> None:
        monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
        monkeypatch.setattr(parallel_state, "get_tp_group",
                            lambda: types.SimpleNamespace(rank_in_group=tp_rank, world_size=None))
        monkeypatch.setattr(parallel_state, "get_pp_group",
                            lambda: types.SimpleNamespace(rank_in_group=pp_rank, world_size=None))
    return set_rank


def _config(km, store_dir: str, tp: int = 1, pp: int = 1, **extra):
    from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, VllmConfig
    kv = km.kv_transfer_config(store_dir)
    kv["kv_connector_extra_config"].update(extra)
    return VllmConfig(cache_config=CacheConfig(block_size=BLOCK),
                      parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                      kv_transfer_config=KVTransferConfig(**kv))


def _worker(km, store_dir: str, tp: int = 1, pp: int = 1, pp_rank: int = 0, fill: float = 0.0,
            blocks: int = 8, **extra):
    """A worker-role connector over one KV tensor per layer of its PP stage (block dimension
    first, as vLLM 0.23's CPU attention lays it out), filled with values no other rank holds
    (``fill`` + position); returns it and its KV tensors."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig
    connector = km.MigrationKVConnector(_config(km, store_dir, tp, pp, **extra), KVConnectorRole.WORKER,
                                        KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[],
                                                      kv_cache_groups=[]))
    kv = {f"layer{2 * pp_rank + i}": fill + torch.arange(blocks * 2 * BLOCK * 4, dtype=torch.float32)
          .reshape(blocks, 2, BLOCK, 4) for i in range(2)}
    connector.register_kv_caches(kv)
    return connector, kv


def _scheduler(km, store_dir: str, tp: int = 1, pp: int = 1):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    return km.MigrationKVConnector(_config(km, store_dir, tp, pp), KVConnectorRole.SCHEDULER)


def _export(km, as_rank, store_dir: str, key: str, tp: int, pp: int = 1, ranks=None, tokens=TOKENS):
    """Every worker of an engine at (tp, pp), or only ``ranks``, exports blocks 1-3 of one
    request under ``key``; returns {(tp_rank, pp_rank): that worker's KV tensors}."""
    held = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            if ranks is not None and (tp_rank, pp_rank) not in ranks:
                continue
            as_rank(tp_rank, pp_rank)
            source, kv = _worker(km, store_dir, tp, pp, pp_rank, fill=1000.0 * (1 + tp_rank + tp * pp_rank))
            (sent, _), _ = _step(source, km.MigrationConnectorMetadata(
                exports=[km.ExportJob("hop-a", key, [1, 2, 3], list(tokens))]), finished={"hop-a"})
            assert sent == {"hop-a"}
            held[tp_rank, pp_rank] = kv
    return held


def _request(km, load_key: str | None, prompt: list, request_id: str = "hop-b", **more):
    """What the connector's scheduler side reads of a vLLM request."""
    params = km.MigrationParams(load_key=load_key, export_key=more.pop("export_key", None))
    return types.SimpleNamespace(request_id=request_id, prompt_token_ids=list(prompt),
                                 kv_transfer_params=params.as_kv_transfer_params(), **more)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_each_rank_loads_exactly_its_own_source_ranks_kv(km, tmp_path, as_rank, tp, pp):
    """The corruption of issue 42: at TP 2 both workers wrote one file and both destination
    workers loaded it, so one of them decoded on from the other's KV heads (same shapes: no
    layout check could see it). Each destination rank must end with its own source rank's
    blocks, and every source rank's blocks differ."""
    import torch
    held = _export(km, as_rank, str(tmp_path), "k", tp, pp)
    assert km.KVExportStore(str(tmp_path)).keys() == ["k"]   # one export, however many parts
    for (tp_rank, pp_rank), source_kv in held.items():
        as_rank(tp_rank, pp_rank)
        dest, kv = _worker(km, str(tmp_path), tp, pp, pp_rank, fill=-1.0e6)
        _, errors = _step(dest, km.MigrationConnectorMetadata(
            loads=[km.LoadJob("hop-b", "k", [5, 6, 7], 0, len(TOKENS))]))
        assert not errors, (tp_rank, pp_rank, errors)
        for name, tensor in kv.items():
            assert torch.equal(tensor[5:8], source_kv[name][1:4]), (tp_rank, pp_rank, name)
            for other, other_kv in held.items():
                if other != (tp_rank, pp_rank) and name in other_kv:
                    assert not torch.equal(tensor[5:8], other_kv[name][1:4]), (tp_rank, other)


def test_an_export_of_another_tp_size_is_refused_by_name(km, tmp_path, as_rank, caplog):
    _export(km, as_rank, str(tmp_path), "k2", tp=2)
    prompt = TOKENS + [7]
    for tp in (1, 4):
        with caplog.at_level(logging.WARNING, logger="ascend_rl_plugins"):
            caplog.clear()
            got = _scheduler(km, str(tmp_path), tp=tp).get_num_new_matched_tokens(
                _request(km, "k2", prompt), 0)
        assert got == (0, False), tp   # B re-prefills
        assert "export k2" in caplog.text and "tensor_parallel_size=2" in caplog.text and \
            f"tensor_parallel_size={tp}" in caplog.text, caplog.text
    # the same export at the engine size it was written at: all its tokens match
    assert _scheduler(km, str(tmp_path), tp=2).get_num_new_matched_tokens(
        _request(km, "k2", prompt), 0) == (len(TOKENS), False)


def test_an_export_is_complete_only_with_every_ranks_part(km, tmp_path, as_rank):
    store = km.KVExportStore(str(tmp_path))
    _export(km, as_rank, str(tmp_path), "k", tp=2, ranks={(0, 0)})   # rank 1 not written yet
    assert store.header("k") is None and not store.exists("k")
    assert store.part_header("k", 0, 0).tp_size == 2 and store.keys() == ["k"]
    # the destination's scheduler does not match an incomplete export
    assert _scheduler(km, str(tmp_path), tp=2).get_num_new_matched_tokens(
        _request(km, "k", TOKENS + [7]), 0) == (0, False)
    _export(km, as_rank, str(tmp_path), "k", tp=2, ranks={(1, 0)})
    assert store.exists("k") and store.header("k").tokens == TOKENS
    # parts that disagree on the tokens (one rank's load failed before the abort): incomplete
    _export(km, as_rank, str(tmp_path), "d", tp=2, ranks={(0, 0)})
    _export(km, as_rank, str(tmp_path), "d", tp=2, ranks={(1, 0)}, tokens=TOKENS[:16])
    assert not store.exists("d")
    # delete drops every part and says whether the export was complete; keys are not parts
    assert store.keys() == ["d", "k"]
    assert store.delete("k") and not store.delete("d") and store.keys() == []
    assert os.listdir(tmp_path) == []


def _empty_export(km, store_dir: str, key: str, tp: int = 2) -> None:
    """What the scheduler does for a hop aborted before it computed anything."""
    from vllm.v1.request import RequestStatus
    request = _request(km, None, TOKENS, export_key=key, status=RequestStatus.FINISHED_ABORTED,
                       num_computed_tokens=0, num_tokens=len(TOKENS), all_token_ids=TOKENS)
    assert _scheduler(km, store_dir, tp=tp).request_finished(request, []) == (False, None)


def test_a_request_that_computed_nothing_leaves_one_complete_empty_export(km, tmp_path):
    """The scheduler's empty export (the hop still waited in the queue) is complete at once for
    every rank: the client learns at once that the destination prefills."""
    _empty_export(km, str(tmp_path), "e")
    store = km.KVExportStore(str(tmp_path))
    header = store.header("e")
    assert store.exists("e") and header.tokens == [] and header.tp_size == 2, header
    assert store.keys() == ["e"] and store.delete("e") and os.listdir(tmp_path) == []


def test_matching_compares_token_contents_not_just_lengths(km, tmp_path):
    """An export whose tokens are as many as the prompt's prefix but differ after the 20th
    matches only those 20 (a length comparison would load KV of other tokens)."""
    store = km.KVExportStore(str(tmp_path))
    store.write("k", km.ExportHeader(list(TOKENS), BLOCK, {}), {})
    scheduler = _scheduler(km, str(tmp_path))
    prompt = TOKENS[:20] + [t + 1 for t in TOKENS[20:]] + [7]   # same length as the export + 1
    assert scheduler.get_num_new_matched_tokens(_request(km, "k", prompt), 0) == (20, False)
    assert scheduler.get_num_new_matched_tokens(_request(km, "k", prompt), 16) == (4, False)
    assert scheduler.get_num_new_matched_tokens(_request(km, "k", TOKENS + [7]), 0) == (40, False)


def _age(path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_stale_exports_are_swept_when_a_connector_opens_the_store(km, tmp_path, as_rank):
    store = km.KVExportStore(str(tmp_path))
    _export(km, as_rank, str(tmp_path), "old", tp=2)
    _export(km, as_rank, str(tmp_path), "fresh", tp=2)
    _empty_export(km, str(tmp_path), "old-empty")
    store.mark_preempted("old")
    store.mark_preempted("fresh-mark")
    for name in (".partial-old", ".partial-fresh", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    day = 24 * 3600
    for name in os.listdir(tmp_path):
        if name.startswith(("old", ".partial-old", "notes")):
            _age(tmp_path / name, day)
    # one old file of a fresh export: the export's newest file decides, and it is kept whole
    fresh_header = min(n for n in os.listdir(tmp_path) if n.startswith("fresh") and n.endswith(".json"))
    _age(tmp_path / fresh_header, day)
    as_rank(0)
    _worker(km, str(tmp_path))                   # the default max age (6 hours)
    assert store.keys() == ["fresh"] and store.exists("fresh")
    assert store.preempted_keys() == {"fresh-mark"}
    assert not (tmp_path / ".partial-old").exists() and (tmp_path / ".partial-fresh").exists()
    assert (tmp_path / "notes.txt").exists()     # not a file of the store's: left alone
    # a shorter max age, from kv_connector_extra_config
    for name in os.listdir(tmp_path):
        _age(tmp_path / name, 120)
    _worker(km, str(tmp_path), stale_export_max_age_s=60)
    assert store.keys() == [] and store.preempted_keys() == set()
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


@pytest.mark.parametrize("value", [0, 59, 31 * 24 * 3600, "600", True, None])
def test_a_bad_sweep_max_age_is_refused_naming_the_key_and_range(km, tmp_path, value):
    with pytest.raises(ValueError, match=r"\['stale_export_max_age_s'\] must be a number of "
                                         r"seconds from 60 to 2592000"):
        _worker(km, str(tmp_path), stale_export_max_age_s=value)
    with pytest.raises(ValueError, match="stale_export_max_age_s"):
        km.kv_transfer_config(str(tmp_path), stale_export_max_age_s=59)
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config key.*'store_dir'.*"
                                         "'stale_export_max_age_s'"):
        _worker(km, str(tmp_path), max_age=600)


def test_export_headers_refuse_ranks_outside_their_sizes(km):
    with pytest.raises(ValueError, match="tp_rank must be an int from 0 to tp_size - 1 = 1"):
        km.ExportHeader([], BLOCK, {}, tp_size=2, tp_rank=2)
    with pytest.raises(ValueError, match="pp_size must be an int >= 1"):
        km.ExportHeader([], BLOCK, {}, pp_size=0)
    with pytest.raises(ValueError, match="write_empty"):
        km.KVExportStore.write_empty(None, "k", km.ExportHeader([1], BLOCK, {}))
