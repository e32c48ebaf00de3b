"""Scenarios of tests/transport/test_mooncake_store.py, each run in its own process (a "host":
its own Mooncake client, named by its own ``local_hostname``, with its own segment).

KV-like data: per layer a paged tensor (``NUM_BLOCKS`` blocks of 16 tokens), filled from a seed
so that every process can rebuild the source's blocks and check what it read bit for bit;
two layouts (blocks on dimension 0 and on dimension 1) and three dtypes. A move selects
blocks out of order and not contiguous (:data:`SOURCE_BLOCKS`), reads them in place
(``block_spans``) and writes them into other blocks of the destination's tensors
(:data:`DEST_BLOCKS`), leaving the rest untouched.
"""

from __future__ import annotations

import ctypes
import sys
import time
from dataclasses import dataclass, field

from tests.support import mooncake as live

NUM_BLOCKS = 24
SOURCE_BLOCKS = [7, 2, 3, 11, 0, 19]      # a pair of neighbours (2, 3), the rest scattered
DEST_BLOCKS = [1, 5, 6, 9, 4, 23]
LAYERS = {  # name -> (dtype, shape with NUM_BLOCKS at the block dimension, block dimension)
    "layer0.kv": ("bfloat16", (NUM_BLOCKS, 2, 16, 2, 8), 0),     # vLLM CPU: blocks first
    "layer1.kv": ("float16", (2, NUM_BLOCKS, 16, 2, 8), 1),      # K/V first, then blocks
    "layer2.kv": ("float32", (NUM_BLOCKS, 16, 4, 8), 0),
}
BIG_MIB = 64


def _store(settings: dict):
    from ascend_rl_plugins.transport.mooncake_store import MooncakeSettings, MooncakeStore
    return MooncakeStore(MooncakeSettings(**settings)).connect()


def paged_kv(seed: int | None) -> dict:
    """Each layer's paged tensor: random from ``seed``, or zeros (``seed`` None)."""
    import torch
    out = {}
    for i, (name, (dtype, shape, _dim)) in enumerate(sorted(LAYERS.items())):
        dt = getattr(torch, dtype)
        if seed is None:
            out[name] = torch.zeros(shape, dtype=dt)
        else:
            g = torch.Generator().manual_seed(seed * 100 + i)
            out[name] = torch.randn(shape, generator=g, dtype=torch.float32).to(dt)
    return out


def part_spans(kv: dict, blocks: list[int]) -> list:
    """One object per export part: every layer's selected blocks, layer by layer."""
    from ascend_rl_plugins.transport.mooncake_store import block_spans
    spans = []
    for name in sorted(kv):
        spans += block_spans(kv[name], LAYERS[name][2], blocks)
    return spans


def _bits(t):
    import torch
    return t.contiguous().view(torch.uint8)


# -- the source: puts, reports, stays alive until killed ---------------------------------------
def export_part(folder: str, settings: dict, key: str, seed: int, big: bool, copies: int = 1) -> None:
    """Put the source's selected blocks under ``key`` (and ``copies - 1`` more times under
    ``key.1``, ``key.2``, ...: placements to check; and, with ``big``, a 64 MiB tensor under
    ``key.big``), report where they went and how long the puts took, then stay alive (the
    objects may live in this process's segment) until the test kills it."""
    import torch
    from ascend_rl_plugins.transport.mooncake_store import nbytes, tensor_spans
    store = _store(settings)
    kv = paged_kv(seed)
    spans = part_spans(kv, SOURCE_BLOCKS)
    t0 = time.perf_counter()
    store.put_spans({key: spans})
    result = {"hostname": settings["local_hostname"], "placement": store.placement(key),
              "part_bytes": nbytes(spans), "part_put_s": time.perf_counter() - t0}
    extra = [f"{key}.{i}" for i in range(1, copies)]
    store.put_spans({k: spans for k in extra})
    result["placements"] = [result["placement"]] + [store.placement(k) for k in extra]
    if big:
        g = torch.Generator().manual_seed(seed)
        tensor = torch.randint(0, 256, (BIG_MIB << 20,), dtype=torch.uint8, generator=g)
        t0 = time.perf_counter()
        store.put_spans({key + ".big": tensor_spans(tensor)})
        result["big_put_s"] = time.perf_counter() - t0
    live.report(folder, 0, result)
    live.wait_until_killed()


# -- the destination ---------------------------------------------------------------------------
@dataclass
class Imported:
    found: bool
    error: str = ""
    error_code: int = 0
    exact: dict = field(default_factory=dict)        # layer -> the destination blocks equal the source's
    untouched: bool = False                          # every other destination block still zero
    big_exact: bool | None = None
    big_get_s: float | None = None
    get_s: float = 0.0


def _import(store, key: str, seed: int, big: bool) -> Imported:
    import torch
    from ascend_rl_plugins.transport.mooncake_store import MooncakeError, tensor_spans
    dest = paged_kv(None)
    t0 = time.perf_counter()
    try:
        found = store.get_into_spans({key: part_spans(dest, DEST_BLOCKS)})[key]
    except MooncakeError as exc:
        return Imported(False, str(exc), exc.code)
    out = Imported(found, get_s=time.perf_counter() - t0)
    if not found:
        return out
    source = paged_kv(seed)
    src_ids, dst_ids = torch.tensor(SOURCE_BLOCKS), torch.tensor(DEST_BLOCKS)
    others = torch.tensor([b for b in range(NUM_BLOCKS) if b not in DEST_BLOCKS])
    out.untouched = True
    for name, t in dest.items():
        dim = LAYERS[name][2]
        out.exact[name] = torch.equal(_bits(t.index_select(dim, dst_ids)),
                                      _bits(source[name].index_select(dim, src_ids)))
        out.untouched &= bool((_bits(t.index_select(dim, others)) == 0).all())
    if big:
        g = torch.Generator().manual_seed(seed)
        want = torch.randint(0, 256, (BIG_MIB << 20,), dtype=torch.uint8, generator=g)
        got = torch.empty_like(want)
        t0 = time.perf_counter()
        store.get_into_spans({key + ".big": tensor_spans(got)})
        out.big_get_s = time.perf_counter() - t0
        out.big_exact = torch.equal(got, want)
    return out


def import_part(settings: dict, key: str, seed: int, big: bool) -> Imported:
    """Read ``key`` into the destination's blocks (another process, another segment)."""
    return _import(_store(settings), key, seed, big)


def import_part_when_told(folder: str, settings: dict, seed: int) -> None:
    """A destination that connects first (step 0: its segment is mounted), then, on the
    test's command ``{"key": ...}``, reads that part (step 1)."""
    import dataclasses
    store = _store(settings)
    live.report(folder, 0, {"hostname": settings["local_hostname"]})
    command = live.next_command()
    if command is None:
        return
    live.report(folder, 1, dataclasses.asdict(_import(store, command["key"], seed, False)))
    live.wait_until_killed()


# -- Mooncake's rules, and this client's answers to them ---------------------------------------
@dataclass
class Rules:
    raw_reput_value: str = ""          # Mooncake's get after put(k, 'old'), put(k, 'new')
    raw_reput_rc: int = 1              # ... and that second put's return code
    refused_reput: str = ""            # MooncakeStore.put on the existing key: the error
    replaced_value: str = ""           # after MooncakeStore.put(..., replace=True)
    refused_span_reput: str = ""       # MooncakeStore.put_spans on an existing key: the error
    replaced_span_value: str = ""      # after put_spans(..., replace=True)
    raw_remove_leased_rc: int = 0      # Mooncake's remove after a get (leased)
    raw_exists_after: bool = False     # ... and whether the object is still there
    removed_leased: bool = False       # MooncakeStore.remove of a leased object
    remove_leased_error: str = ""
    exists_after_remove: bool = True
    raw_get_missing: str = "x"         # Mooncake's get of a missing key
    get_missing_is_none: bool = False  # MooncakeStore.get of a missing key
    big_bytes_exact: bool = False      # a 20 MiB bytes object (> local_buffer_size 16 MiB)
    empty_refused: str = ""
    keys_with_prefix: list = field(default_factory=list)
    removed_by_prefix: int = 0
    keys_after_prefix_removal: list = field(default_factory=list)
    foreign_key_kept: bool = False
    holder_absent_error: str = ""      # put with holder_segment naming no mounted segment
    holder_absent_left_object: bool = True
    unreachable_master: str = ""
    unreachable_metadata: str = ""
    size_mismatch: str = ""            # reading an object into spans of another size


def rules(settings: dict, dead_port: int, other_hostname: str) -> Rules:
    import os
    import torch
    from ascend_rl_plugins.transport.mooncake_store import (
        KeyExistsError,
        MooncakeError,
        MooncakeSettings,
        MooncakeStore,
        MooncakeUnavailable,
        tensor_spans,
    )
    store = _store(dict(settings, segment_size=64 << 20))
    raw = store.client
    out = Rules()
    # a put on an existing key keeps the old value (and says 0)
    raw.put("rules.reput", b"old")
    out.raw_reput_rc = raw.put("rules.reput", b"new")
    out.raw_reput_value = raw.get("rules.reput").decode()
    store.put("rules.mine", b"old")
    try:
        store.put("rules.mine", b"new")
    except KeyExistsError as exc:
        out.refused_reput = str(exc)
    store.put("rules.mine", b"newer", replace=True)
    out.replaced_value = store.get("rules.mine").decode()
    a, b = torch.full((64,), 1, dtype=torch.uint8), torch.full((32,), 2, dtype=torch.uint8)
    store.put_spans({"rules.spans": tensor_spans(a)})
    try:
        store.put_spans({"rules.spans": tensor_spans(b)})
    except KeyExistsError as exc:
        out.refused_span_reput = str(exc)
    store.put_spans({"rules.spans": tensor_spans(b)}, replace=True)
    out.replaced_span_value = (store.get("rules.spans") or b"").hex()
    # a read grants a lease: Mooncake's plain remove fails, this client's forces
    raw.put("rules.leased", b"x")
    raw.get("rules.leased")
    out.raw_remove_leased_rc = raw.remove("rules.leased")
    out.raw_exists_after = raw.is_exist("rules.leased") == 1
    store.put("rules.leased2", b"x")
    store.get("rules.leased2")
    try:
        out.removed_leased = store.remove("rules.leased2")
    except MooncakeError as exc:
        out.remove_leased_error = str(exc)
    out.exists_after_remove = store.exists("rules.leased2")
    # a missing object: b'' from Mooncake (as for a failed read), None here
    out.raw_get_missing = raw.get("rules.none").hex()
    out.get_missing_is_none = store.get("rules.none") is None
    big = os.urandom(20 << 20)
    store.put("rules.big", big)
    out.big_bytes_exact = store.get("rules.big") == big
    try:
        store.put("rules.empty", b"")
    except ValueError as exc:
        out.empty_refused = str(exc)
    # listing and sweeping by prefix ('.' in the prefix is no wildcard)
    for k in ("sweep.a@tp0", "sweep.a@tp1", "sweepXa@tp0"):
        store.put(k, b"1")
    out.keys_with_prefix = store.keys("sweep.a@")
    out.removed_by_prefix = store.remove_prefix("sweep.a@")
    out.keys_after_prefix_removal = store.keys("sweep")
    out.foreign_key_kept = store.exists("sweepXa@tp0")
    # a holder that is not there: Mooncake would place the object elsewhere, silently
    absent = MooncakeStore(MooncakeSettings(**dict(settings, local_hostname=other_hostname,
                                                    holder_segment=f"127.0.0.1:{dead_port}")))
    try:
        absent.put("rules.held", b"x")
    except MooncakeError as exc:
        out.holder_absent_error = str(exc)
    absent.close()
    out.holder_absent_left_object = store.exists("rules.held")
    # reading into spans of another size
    store.put("rules.sized", b"y" * 100)
    buf = torch.zeros(60, dtype=torch.uint8)
    try:
        store.get_into_spans({"rules.sized": tensor_spans(buf)})
    except MooncakeError as exc:
        out.size_mismatch = str(exc)
    # nothing answers: the error names the setting
    for attr, override in (("unreachable_master", {"master_address": f"127.0.0.1:{dead_port}"}),
                           ("unreachable_metadata",
                            {"metadata_server": f"http://127.0.0.1:{dead_port}/metadata"})):
        try:
            MooncakeStore(MooncakeSettings(**dict(settings, connect_timeout_s=2, **override))).connect()
        except MooncakeUnavailable as exc:
            setattr(out, attr, str(exc))
    store.remove_prefix("rules.")
    store.close()
    return out


def imports_of_the_module() -> dict:
    """Which heavy modules importing the transport module (and building settings) loads."""
    from ascend_rl_plugins.transport import mooncake_store
    mooncake_store.MooncakeSettings("127.0.0.1:1", "http://127.0.0.1:2/metadata", "127.0.0.1:3")
    return {name: name in sys.modules for name in ("mooncake", "mooncake.store", "torch")}


def spans_bytes(layer: str, blocks: list[int]) -> dict:
    """``block_spans`` of a layer's selection, read back from memory, against the selection's
    own bytes; and the number of spans (neighbours merged)."""
    import torch
    from ascend_rl_plugins.transport.mooncake_store import block_spans
    t = paged_kv(5)[layer]
    dim = LAYERS[layer][2]
    spans = block_spans(t, dim, blocks)
    got = b"".join(ctypes.string_at(a, n) for a, n in spans)
    want = _bits(t.index_select(dim, torch.tensor(blocks))).numpy().tobytes()
    return {"equal": got == want, "spans": len(spans), "bytes": len(got)}
