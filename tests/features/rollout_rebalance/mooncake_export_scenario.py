"""Scenarios of test_mooncake_export_store.py, each in its own process: a "host" with its own
Mooncake client, named by the ``local_hostname`` the store derives (``process_local_hostname``).

An export of ``TP`` x ``PP`` ranks: every rank's part has two KV layers, filled from the seed and
the rank, so any process rebuilds what each part must hold and checks it bit for bit. Half the
parts are written from contiguous tensors (``write``), half straight from the blocks of a paged
KV tensor (``write_blocks``: :data:`BLOCKS` of a tensor of :data:`NUM_BLOCKS` blocks); both read
back (``read``) as the selected blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tests.support import mooncake as live

TP, PP = 2, 2
NUM_BLOCKS = 12
BLOCKS = [7, 2, 3, 10]          # exported blocks, in the export's order
TOKENS = list(range(100, 100 + 16 * len(BLOCKS) - 5))
LAYERS = {"layer0": ("bfloat16", (NUM_BLOCKS, 2, 16, 2, 8), 0),   # blocks first (vLLM CPU)
          "layer1": ("float16", (2, NUM_BLOCKS, 16, 2, 8), 1)}     # K/V first, then blocks


def _store(extra: dict):
    from ascend_rl_plugins.features.rollout_rebalance.mooncake_export_store import export_store
    return export_store(extra)


def paged(seed: int, tp: int, pp: int) -> dict:
    """Rank (tp, pp)'s paged KV tensors: name -> (tensor, block dimension)."""
    import torch
    out = {}
    for i, (name, (dtype, shape, dim)) in enumerate(sorted(LAYERS.items())):
        g = torch.Generator().manual_seed(seed * 1000 + pp * 100 + tp * 10 + i)
        out[name] = (torch.randn(shape, generator=g).to(getattr(torch, dtype)), dim)
    return out


def expected(seed: int, tp: int, pp: int) -> dict:
    import torch
    return {name: t.index_select(dim, torch.tensor(BLOCKS)) for name, (t, dim) in paged(seed, tp, pp).items()}


def header(tp: int, pp: int, tokens=None):
    from ascend_rl_plugins.features.rollout_rebalance.kv_migration import ExportHeader
    layouts = {name: [dtype, [n for d, n in enumerate(shape) if d != dim]]
               for name, (dtype, shape, dim) in LAYERS.items()}
    return ExportHeader(list(TOKENS if tokens is None else tokens), 16, layouts, TP, PP, tp, pp)


def write_export(folder: str, extra: dict, key: str, seed: int) -> None:
    """Write ``key``'s every part (and an empty export ``<key>-empty``, and a preemption mark
    of ``key``), report, then stay alive until killed."""
    store = _store(extra)
    incomplete_before = []
    for pp in range(PP):
        for tp in range(TP):
            incomplete_before.append(store.exists(key))
            if (tp + pp) % 2:
                store.write_blocks(key, header(tp, pp), paged(seed, tp, pp), BLOCKS)
            else:
                store.write(key, header(tp, pp), expected(seed, tp, pp))
    store.write_empty(key + "-empty", header(0, 0, tokens=[]))
    store.mark_preempted(key)
    names = [n for n in store._listing() if n.startswith(key)]
    live.report(folder, 0, {"hostname": store.settings.local_hostname,
                            "incomplete_before": incomplete_before, "complete": store.exists(key),
                            "placements": sorted({p for n in names for p in
                                                  store.mooncake.placement(store._name(n))})})
    live.wait_until_killed()


@dataclass
class Loaded:
    hostname: str
    complete: bool
    exact: dict = field(default_factory=dict)   # "pp<p>-tp<t>" -> every layer bit-equal
    header_tokens: bool = False
    empty_complete: bool = False
    keys: list = field(default_factory=list)
    preempted: list = field(default_factory=list)


def read_export(extra: dict, key: str, seed: int) -> Loaded:
    import torch
    store = _store(extra)
    head = store.header(key)
    exact = {}
    for pp in range(PP):
        for tp in range(TP):
            found = store.read(key, tp, pp)
            if found is None:
                exact[f"pp{pp}-tp{tp}"] = False
                continue
            got_header, tensors = found
            want = expected(seed, tp, pp)
            exact[f"pp{pp}-tp{tp}"] = got_header == header(tp, pp) and sorted(tensors) == sorted(want) \
                and all(tensors[n].dtype == want[n].dtype and torch.equal(tensors[n], want[n])
                        for n in want)
    empty = store.header(key + "-empty")
    return Loaded(store.settings.local_hostname, store.exists(key), exact,
                  head is not None and head.tokens == TOKENS,
                  empty is not None and empty.tokens == [], store.keys(), sorted(store.preempted_keys()))


@dataclass
class Removed:
    deleted_complete: bool
    deleted_again: bool
    left_of_key: list
    other_kept: bool
    mark_cleared: bool
    swept: int
    after_sweep: list
    young_complete: bool
    swept_all: int
    names_left: list


def delete_and_sweep(extra: dict, key: str, seed: int) -> Removed:
    """Delete ``key``; then the sweep: an old export (with a preemption mark, and a part whose
    header is gone) and an export of one headerless part (dated by its data's stamp alone)
    are removed, a younger one kept."""
    store = _store(extra)
    deleted = store.delete(key)
    again = store.delete(key)
    left = [n for n in store._listing() if n.startswith(key + "@")]
    other_kept = store.exists(key + "-empty")
    cleared = store.clear_preempted(key) and not store.clear_preempted(key)
    store.write("old", header(0, 0), expected(seed, 0, 0))
    store.write("old", header(1, 0), expected(seed, 1, 0))
    store.mooncake.remove(store._name("old@pp0-tp1.json"))   # a writer died between data and header
    store.write("orphan", header(0, 0), expected(seed, 0, 0))   # only data: dated by its stamp
    store.mooncake.remove(store._name("orphan@pp0-tp0.json"))
    store.mark_preempted("old")
    written = time.time()
    while time.time() <= written:   # the clock moves past the old objects' stamps
        pass
    boundary = time.time()
    for pp in range(PP):
        for tp in range(TP):
            store.write("young", header(tp, pp), expected(seed, tp, pp))
    swept = store.sweep(time.time() - boundary)   # cutoff at the boundary
    after = store.keys()
    young = store.exists("young")
    done = time.time()
    while time.time() <= done + 0.001:   # the clock moves past every stamp
        pass
    swept_all = store.sweep(0.0001)
    return Removed(deleted, again, left, other_kept, cleared, swept, after, young, swept_all,
                   store._listing())
