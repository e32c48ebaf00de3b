"""Migration protocol over ``torch.distributed`` on the DP group (gloo, HCCL or NCCL).

One *round* is a fixed sequence of collectives that every DP rank runs at the same point:

1. all-gather of each rank's load (:meth:`~.planner.RankLoad.pack`: request ids and one
   int64 array) and a "still working" flag;
2. every rank computes the same plan locally (:func:`~.planner.plan`);
3. all-to-all-v of request metadata (pickled, sizes first, then one byte buffer);
4. all-to-all-v of KV blocks in bulk: per destination, the blocks of all its requests
   concatenated into one byte buffer (one collective, no per-request messages);
5. destinations re-admit what they received and answer with an all-to-all of acks;
6. sources release (abort) only the acknowledged requests.

Nothing is lost: a request leaves its source only after its destination said it holds it.
A request whose extraction, KV decoding or admission fails stays where it is and keeps
decoding there (the round completes). If anything raises at a destination between its first
admission and the end of the ack exchange (the exchange itself, an interrupt), it drops what
it admitted in this round and re-raises; its sources, without acks, release nothing, so every
request is still at its source. A source whose adapter fails to release an acknowledged
request releases the others and raises, naming it (the one case that can leave a request on
two ranks, said loudly). Tests inject each of these failures
(``tests/features/rollout_rebalance/test_protocol_faults.py``).

The engine side is an :class:`Adapter` (the vLLM one lives in ``engine.py``); tests drive
the protocol with a synthetic adapter over the same interface.
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, Sequence

from .planner import Migration, PlannerConfig, RankLoad, plan

log = logging.getLogger("ascend_rl_plugins")


class Adapter(Protocol):
    """What the protocol needs from one DP rank's engine."""

    def snapshot(self) -> RankLoad:
        """This rank's load, requests in canonical move order."""

    def extract(self, migration: Migration) -> tuple[dict, Any | None]:
        """Metadata (picklable) and the KV tensor (or None) to send; raises to keep it here."""

    def admit(self, meta: dict, kv: Any | None) -> bool:
        """Take a request in (KV placed or recompute queued); False or raise to refuse."""

    def release(self, meta: dict) -> None:
        """Drop a request that its destination acknowledged (no output is emitted here)."""

    def discard(self, meta: dict) -> None:
        """Undo an :meth:`admit` whose round failed later."""


@dataclass
class RoundResult:
    plan_size: int = 0
    sent: int = 0
    received: int = 0
    kept: int = 0  # planned but still at the source (extraction, transfer or admission failed)
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    all_idle: bool = False  # no rank has any request left and no rank is still working
    loads: list = field(default_factory=list)  # the gathered packed loads


def _dist():
    import torch.distributed as dist
    return dist


def all_gather_objects(obj: Any, group) -> list:
    dist = _dist()
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def collective_device(group):
    """The device whose tensors ``group``'s backend exchanges: ``cuda`` (current device) for
    NCCL, ``npu`` (current device, torch_npu) for HCCL, the CPU for gloo and anything else.

    Why: NCCL and HCCL take device tensors only, and KV blocks already live on the device, so
    the buffers of an all-to-all belong there (a host round trip would cross PCIe twice). A
    backend string naming several backends (``"cpu:gloo,cuda:nccl"``) dispatches device
    tensors to its accelerator backend, so the accelerator is chosen."""
    import torch
    backend = str(_dist().get_backend(group)).lower()
    names = {part.rpartition(":")[2].strip() for part in backend.split(",")}
    if "nccl" in names:
        return torch.device("cuda", torch.cuda.current_device())
    if "hccl" in names:
        return torch.device("npu", torch.npu.current_device())   # torch.npu: registered by torch_npu
    return torch.device("cpu")


def all_to_all_bytes(chunks: Sequence[bytes | memoryview | Any], group) -> list:
    """All-to-all-v of byte buffers: ``chunks[d]`` goes to group rank ``d``; returns what each
    rank sent here as uint8 tensors on the group's :func:`collective_device`. ``chunks`` items
    may be bytes or uint8 tensors (on any device: they are moved to the collective device, a
    no-op for KV already there)."""
    import torch
    dist = _dist()
    world = dist.get_world_size(group)
    device = collective_device(group)
    parts = []
    for c in chunks:
        if isinstance(c, torch.Tensor):
            parts.append(c.reshape(-1).view(torch.uint8).to(device) if c.numel() else
                         torch.empty(0, dtype=torch.uint8, device=device))
        else:
            parts.append(torch.frombuffer(bytearray(c), dtype=torch.uint8).to(device) if len(c) else
                         torch.empty(0, dtype=torch.uint8, device=device))
    assert len(parts) == world, f"need one chunk per rank ({world}), got {len(parts)}"
    send_split = [p.numel() for p in parts]
    send_sizes = torch.tensor(send_split, dtype=torch.int64, device=device)
    recv_sizes = torch.empty_like(send_sizes)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    recv_split = recv_sizes.tolist()          # one device-to-host read: the sizes size the buffers
    sends = torch.cat(parts) if sum(send_split) else torch.empty(0, dtype=torch.uint8, device=device)
    recv = torch.empty(sum(recv_split), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, sends, output_split_sizes=recv_split, input_split_sizes=send_split,
                           group=group)
    return list(torch.split(recv, recv_split))


def all_to_all_objects(per_rank: Sequence[Any], group) -> list:
    """All-to-all-v of picklable objects (metadata, acks); the bytes come back to the host to
    be unpickled (they travel on the collective device like every other buffer)."""
    received = all_to_all_bytes([pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)
                                 for o in per_rank], group)
    return [pickle.loads(t.cpu().numpy().tobytes()) for t in received]


def _as_bytes(kv) -> Any:
    """The KV tensor's bytes, where the KV is: ``all_to_all_bytes`` moves them to the
    collective device (no host round trip when that is the KV's device)."""
    import torch
    return kv.detach().contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(buf, dtype_name: str, shape):
    import torch
    dtype = getattr(torch, dtype_name)
    return buf.view(dtype).reshape(shape) if buf.numel() else torch.empty(shape, dtype=dtype)


def rebalance_round(adapter: Adapter, group, config: PlannerConfig, *, working: bool,
                    log_moves: bool = False, kv_capable: bool = True) -> RoundResult:
    """Run one round on this rank (every rank of ``group`` must call it).

    ``working``: this rank is still inside its own generation loop. ``kv_capable``: this rank
    can take KV; KV moves are planned only when every rank can (the plan must be the same on
    every rank, so everything it depends on is gathered)."""
    dist = _dist()
    t0 = time.perf_counter()
    me = dist.get_rank(group)
    world = dist.get_world_size(group)
    load = adapter.snapshot()
    load.rank = me  # group ranks are the identities the plan talks about
    request_ids, values = load.pack()
    # compact: one int64 array per rank (pickled as raw bytes) plus its request ids
    gathered = all_gather_objects(((request_ids, values), bool(working), bool(kv_capable)),
                                  group)
    loads = [g[0] for g in gathered]
    if config.kv_migration and not all(g[2] for g in gathered):
        config = replace(config, kv_migration=False)
    result = RoundResult(loads=loads)
    if not any(g[1] for g in gathered) and not any(ids for ids, _ in loads):
        result.all_idle = True
        return result
    planned = plan(loads, config, for_rank=me)
    migrations = planned.migrations
    result.plan_size = planned.total
    if not planned.total:  # decided from the whole plan: every rank takes the same branch
        result.seconds = time.perf_counter() - t0
        return result

    # -- source: extract (a failure keeps the request here) --------------------------------
    metas: list[list[dict]] = [[] for _ in range(world)]
    kv_parts: list[list] = [[] for _ in range(world)]
    for m in migrations:
        if m.src != me:
            continue
        try:
            meta, kv = adapter.extract(m)
        except Exception as exc:  # noqa: BLE001 - any failure: the request stays
            log.warning("ascend-rl rollout_rebalance: keeping %s on rank %d: %s", m.request_id,
                        me, exc)
            result.kept += 1
            continue
        meta = dict(meta, _src=me, _dst=m.dst, _id=m.request_id)
        if kv is not None:
            buf = _as_bytes(kv)
            meta["_kv"] = (str(kv.dtype).replace("torch.", ""), tuple(kv.shape), buf.numel())
            kv_parts[m.dst].append(buf)
            result.bytes_sent += buf.numel()
        metas[m.dst].append(meta)

    import torch
    received_meta = all_to_all_objects(metas, group)
    kv_chunks = [torch.cat(p) if p else torch.empty(0, dtype=torch.uint8) for p in kv_parts]
    received_kv = all_to_all_bytes(kv_chunks, group)

    # -- destination: admit, then acknowledge -------------------------------------------------
    # Whatever escapes from here on before the acks are in (an interrupt in the admission
    # loop, the ack exchange raising) leaves every planned request at its source, which
    # releases nothing without an ack: the copies admitted here are dropped again.
    acks: list[list[str]] = [[] for _ in range(world)]
    admitted: list[dict] = []
    try:
        for src in range(world):
            offset = 0
            buf = received_kv[src]
            for meta in received_meta[src]:
                if _admit_one(adapter, meta, buf, offset, me, src, result):
                    acks[src].append(meta["_id"])
                    admitted.append(meta)
                offset += meta["_kv"][2] if "_kv" in meta else 0
        received_acks = all_to_all_objects(acks, group)
    except BaseException:
        _discard_all(adapter, admitted, me)
        raise
    result.received = len(admitted)

    # -- source: release what the destination holds now ---------------------------------------
    acked = {rid for per_dst in received_acks for rid in per_dst}
    failed = []
    for per_dst in metas:
        for meta in per_dst:
            if meta["_id"] not in acked:
                result.kept += 1
                continue
            try:
                adapter.release(meta)
            except Exception as exc:  # noqa: BLE001 - release the others, then fail loudly
                failed.append(f"{meta['_id']} ({type(exc).__name__}: {exc})")
            result.sent += 1
    if failed:
        raise RuntimeError(f"ascend-rl rollout_rebalance: rank {me} could not release "
                           f"{len(failed)} request(s) its destination acknowledged, which may now "
                           f"run on two ranks: {'; '.join(failed)}")
    result.seconds = time.perf_counter() - t0
    if log_moves and (result.sent or result.received):
        log.warning("ascend-rl rollout_rebalance: rank %d sent %d, received %d, kept %d, "
                    "bytes out %d in %d, %.1f ms", me, result.sent, result.received, result.kept,
                    result.bytes_sent, result.bytes_received, result.seconds * 1e3)
    return result


def _admit_one(adapter: Adapter, meta: dict, buf, offset: int, me: int, src: int,
               result: RoundResult) -> bool:
    """Decode one received request's KV and admit it; any failure refuses it (it stays at
    its source, which gets no ack for it)."""
    try:
        kv = None
        if "_kv" in meta:
            dtype_name, shape, nbytes = meta["_kv"]
            kv = _from_bytes(buf[offset:offset + nbytes], dtype_name, shape)
            result.bytes_received += nbytes
        return bool(adapter.admit(meta, kv))
    except Exception as exc:  # noqa: BLE001 - any failure: the request stays at its source
        log.warning("ascend-rl rollout_rebalance: rank %d refused %s from rank %d: %s", me,
                    meta.get("_id"), src, exc)
        return False


def _discard_all(adapter: Adapter, admitted: list, me: int) -> None:
    """Undo every admission of a round that failed before its acks were exchanged."""
    for meta in admitted:
        try:
            adapter.discard(meta)
        except Exception as exc:  # noqa: BLE001 - keep discarding; the round raises anyway
            log.error("ascend-rl rollout_rebalance: rank %d could not discard %s after a failed "
                      "round (it may now run on two ranks): %s", me, meta["_id"], exc)
