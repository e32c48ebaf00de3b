"""KV exports in Mooncake Store: the migration's transport between replicas on different hosts.

:class:`MooncakeExportStore` has :class:`.kv_migration.KVExportStore`'s interface and format
(:func:`.kv_migration.part_name`, :func:`.kv_migration.whole_name`,
:func:`.kv_migration.complete_header`, :class:`.kv_migration.ExportHeader`'s JSON), as objects
of a Mooncake Store (:class:`ascend_rl_plugins.transport.mooncake_store.MooncakeStore`) named
``<namespace>/<part name>``:

- a part's data ``<ns>/<key>@pp<p>-tp<t>.kv``: an 8-byte stamp (its ``written_at``, float64)
  then each KV tensor's bytes in the header's order, put from the tensors' memory in place
  (``put_spans``; no ``torch.save``), and read into the destination tensors in place
  (``get_into_spans``); :meth:`MooncakeExportStore.write_blocks` puts a selection of blocks of
  the paged KV tensors themselves (``block_spans``), with no copy at all;
- its header ``<ns>/<key>@pp<p>-tp<t>.json``, put AFTER the data: ``{"export": <ExportHeader>,
  "written_at": <time>, "tensors": [[name, dtype, shape], ...]}``; a visible header means a
  complete part (a rewrite removes the header first);
- the empty export ``<ns>/<key>@all.json``; a preemption mark ``<ns>/<key>.preempted``
  (``{"written_at": ...}``).

Every put goes to the holder's segment when ``holder_segment`` is set (MooncakeStore refuses
a put placed elsewhere): an export must outlive its writer (the source replica may die and the
request resume elsewhere from its export). Listing (:meth:`keys`, :meth:`preempted_keys`,
:meth:`sweep`) reads the master's admin server (``admin_url``, required).

Each process is its own Mooncake client, named by its own ``local_hostname`` (a second client
under a name in use is refused): :func:`process_local_hostname` derives it as this host's
address towards the master (or the configured host) and a port this process holds bound
(see there). One client per process and settings: :func:`export_store` caches it.

Imports torch and vLLM (through :mod:`.kv_migration`); ``mooncake`` on first use.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time

import torch

from ascend_rl_plugins.transport.mooncake_store import (
    MooncakeError,
    MooncakeSettings,
    MooncakeStore,
    block_spans,
    regex_literal,
    tensor_spans,
)

from .connector_config import StoreChoice, store_choice
from .exports import (
    PART_SEPARATOR,
    PREEMPTED_SUFFIX,
    ExportHeader,
    KVExportStore,
    _valid_key,
    complete_header,
    export_name_key,
    part_name,
    whole_name,
)

log = logging.getLogger("ascend_rl_plugins")

STAMP = struct.Struct("<d")   # a data object's first bytes: its written_at
REPLICA_IS_NOT_READY = -703   # Mooncake's answer for an object whose put is under way


class MooncakeExportStore:
    """Exports as Mooncake Store objects under ``namespace`` (module docstring); the interface
    of :class:`.kv_migration.KVExportStore`."""

    def __init__(self, settings: MooncakeSettings, namespace: str, *,
                 sweep_older_than_s: float | None = None):
        if settings.admin_url is None:
            raise ValueError("MooncakeExportStore needs admin_url (the master's admin server): "
                             "exports are listed there")
        self.settings = settings
        self.namespace = namespace
        # connected now, when the engine starts (a replica whose master is unreachable stops
        # there, naming the setting), not at its first export: a client's setup takes seconds,
        # tens under load, which the first move's export would spend waiting
        self.mooncake = MooncakeStore(settings).connect()
        if sweep_older_than_s is not None:
            self.sweep(sweep_older_than_s)

    # -- names ------------------------------------------------------------------------------
    def _name(self, name: str) -> str:
        return f"{self.namespace}/{name}"

    def _check(self, key: str) -> str:
        if not _valid_key(key):
            raise ValueError(f"bad export key {key!r}")
        return key

    def _part(self, key: str, tp_rank: int, pp_rank: int, suffix: str) -> str:
        return self._name(part_name(self._check(key), tp_rank, pp_rank, suffix))

    def _listing(self) -> list[str]:
        """Every object name of this namespace now, without the namespace."""
        prefix = self.namespace + "/"
        return [k[len(prefix):] for k in self.mooncake.keys(prefix)]

    # -- writing ----------------------------------------------------------------------------
    def _put_part(self, key: str, header: ExportHeader, described: list, spans: list) -> int:
        data = self._part(key, header.tp_rank, header.pp_rank, ".kv")
        head = self._part(key, header.tp_rank, header.pp_rank, ".json")
        self.mooncake.remove(head)   # a rewrite: the part stops being visible first
        written_at = time.time()
        stamp = torch.frombuffer(bytearray(STAMP.pack(written_at)), dtype=torch.uint8)
        self.mooncake.put_spans({data: tensor_spans(stamp) + spans}, replace=True)
        text = json.dumps({"export": header.as_dict(), "written_at": written_at,
                           "tensors": described}).encode()
        self.mooncake.put(head, text, replace=True)   # after the data: visible = complete
        return STAMP.size + sum(n for _, n in spans) + len(text)

    def write(self, key: str, header: ExportHeader, tensors: dict) -> int:
        """Store the part of ``header``'s ranks from ``tensors`` (name -> tensor), each put
        from its memory in place (a non-contiguous tensor is made contiguous first); returns
        the bytes stored."""
        tensors = {name: t.contiguous() for name, t in tensors.items()}
        described = [[name, str(t.dtype).replace("torch.", ""), list(t.shape)]
                     for name, t in tensors.items()]
        spans = [s for t in tensors.values() for s in tensor_spans(t)]
        return self._put_part(key, header, described, spans)

    def write_blocks(self, key: str, header: ExportHeader, kv: dict, block_ids: list) -> int:
        """Store the part of ``header``'s ranks straight from the paged KV tensors: ``kv`` is
        name -> (tensor, block dimension), ``block_ids`` the blocks to export in order. The
        object equals what :meth:`write` stores for ``tensor.index_select(dim, block_ids)``
        (and :meth:`read` returns that), with no copy on this side."""
        described, spans = [], []
        for name, (t, dim) in kv.items():
            shape = list(t.shape)
            shape[dim] = len(block_ids)
            described.append([name, str(t.dtype).replace("torch.", ""), shape])
            spans += block_spans(t, dim, block_ids)
        return self._put_part(key, header, described, spans)

    def write_empty(self, key: str, header: ExportHeader) -> None:
        """The export of no tokens for every rank at once (one object)."""
        if header.tokens:
            raise ValueError(f"write_empty: export {key} names {len(header.tokens)} tokens; an "
                             "export with KV is written by each rank (write)")
        text = json.dumps({"export": header.as_dict(), "written_at": time.time(),
                           "tensors": []}).encode()
        self.mooncake.put(self._name(whole_name(self._check(key))), text, replace=True)

    # -- reading ----------------------------------------------------------------------------
    def _get(self, name: str) -> bytes | None:
        """The object's bytes; None where there is none, or its put is still under way
        (Mooncake: ``REPLICA_IS_NOT_READY``, seen by a client polling for an export while
        the writer puts its header)."""
        try:
            return self.mooncake.get(name)
        except MooncakeError as exc:
            if exc.code == REPLICA_IS_NOT_READY:
                return None
            raise

    def _header_object(self, name: str) -> dict | None:
        raw = self._get(name)
        return None if raw is None else json.loads(raw)

    def part_header(self, key: str, tp_rank: int = 0, pp_rank: int = 0) -> ExportHeader | None:
        found = self._header_object(self._part(key, tp_rank, pp_rank, ".json"))
        return None if found is None else ExportHeader.from_dict(found["export"])

    def header(self, key: str) -> ExportHeader | None:
        """The complete export's header (the rule of :func:`.kv_migration.complete_header`)."""
        def whole():
            found = self._header_object(self._name(whole_name(self._check(key))))
            return None if found is None else ExportHeader.from_dict(found["export"])
        return complete_header(lambda tp, pp: self.part_header(key, tp, pp), whole)

    def exists(self, key: str) -> bool:
        return self.header(key) is not None

    def read(self, key: str, tp_rank: int = 0, pp_rank: int = 0) -> tuple[ExportHeader, dict] | None:
        """One rank's part: its header and its tensors (read in place into new tensors), or
        None where it is not there."""
        found = self._header_object(self._part(key, tp_rank, pp_rank, ".json"))
        if found is None:
            return None
        tensors = {name: torch.empty(shape, dtype=getattr(torch, dtype))
                   for name, dtype, shape in found["tensors"]}
        stamp = torch.empty(STAMP.size, dtype=torch.uint8)
        spans = tensor_spans(stamp) + [s for t in tensors.values() for s in tensor_spans(t)]
        data = self._part(key, tp_rank, pp_rank, ".kv")
        try:
            if not self.mooncake.get_into_spans({data: spans})[data]:
                return None
        except MooncakeError as exc:   # being rewritten (a header is put after its data)
            if exc.code == REPLICA_IS_NOT_READY:
                return None
            raise
        return ExportHeader.from_dict(found["export"]), tensors

    # -- removing and listing ---------------------------------------------------------------
    def delete(self, key: str) -> bool:
        """Drop every part of the export (headers first); returns whether it was complete."""
        self._check(key)
        try:
            complete = self.exists(key)
        except (ValueError, KeyError, TypeError):
            complete = False
        client = self.mooncake.client
        base = regex_literal(self._name(key + PART_SEPARATOR))
        client.remove_by_regex("^" + base + r".*\.json$", True)   # stops being visible first
        client.remove_by_regex("^" + base, True)
        return complete

    def keys(self) -> list[str]:
        """The keys of the exports with any object in the store (complete or not; each once)."""
        return sorted({k for k in map(export_name_key, self._listing())
                       if k is not None and not k.startswith(".")})

    def _written_at(self, name: str) -> float | None:
        """When the object ``name`` (without the namespace) was written: a header's or a mark's
        ``written_at``; a data object's stamp (read whole: only a part whose header is gone)."""
        full = self._name(name)
        if name.endswith(".kv"):
            raw = self._get(full)
            return None if raw is None or len(raw) < STAMP.size else STAMP.unpack_from(raw)[0]
        found = self._header_object(full)
        return None if found is None else float(found.get("written_at", 0.0))

    def sweep(self, max_age_s: float) -> int:
        """Remove every export whose newest object is older than ``max_age_s`` (all its parts
        and its preemption mark); returns the number of objects removed. By age only, as the
        directory store."""
        cutoff = time.time() - max_age_s
        names: dict[str, list[str]] = {}
        for name in self._listing():
            key = export_name_key(name)
            if key is None and name.endswith(PREEMPTED_SUFFIX):
                key = name[:-len(PREEMPTED_SUFFIX)]
            if key is not None and _valid_key(key):
                names.setdefault(key, []).append(name)
        removed = 0
        for key, objects in names.items():
            dated = [n for n in objects if not n.endswith(".kv")]
            data = [n for n in objects if n.endswith(".kv")
                    and n[:-3] + ".json" not in objects]   # parts whose header is gone
            stamps = [self._written_at(n) for n in dated + data]
            stamps = [s for s in stamps if s is not None]
            if not stamps or max(stamps) >= cutoff:
                continue   # gone meanwhile, or young
            for name in sorted(objects, key=lambda n: n.endswith(".kv")):
                removed += self.mooncake.remove(self._name(name))
        if removed:
            log.info("ascend-rl kv_migration: swept %d stale object(s) older than %.0f s from "
                     "Mooncake namespace %s", removed, max_age_s, self.namespace)
        return removed

    # -- preemption marks -------------------------------------------------------------------
    def mark_preempted(self, key: str) -> None:
        """As the directory store's; a failed put raises OSError, as a failed file write does
        (the connector's scheduler logs it and goes on: the request just waits there)."""
        try:
            self.mooncake.put(self._name(self._check(key) + PREEMPTED_SUFFIX),
                              json.dumps({"written_at": time.time()}).encode(), replace=True)
        except RuntimeError as exc:   # MooncakeError, MooncakeUnavailable
            raise OSError(f"preemption mark {key} in Mooncake: {exc}") from exc

    def preempted_keys(self) -> set[str]:
        return {n[:-len(PREEMPTED_SUFFIX)] for n in self._listing()
                if n.endswith(PREEMPTED_SUFFIX) and not n.startswith(".")}

    def clear_preempted(self, key: str) -> bool:
        return self.mooncake.remove(self._name(self._check(key) + PREEMPTED_SUFFIX))


# -- each process's name, and the store a config names ------------------------------------------
_held: dict[tuple[int, str], tuple[socket.socket | None, str]] = {}
_stores: dict[tuple[int, StoreChoice], object] = {}
_lock = threading.Lock()


def _address_towards(master_address: str) -> str:
    """This host's address on the route to the master (a UDP socket's connect sends nothing)."""
    host, _, port = master_address.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, int(port)))
        return probe.getsockname()[0]


def process_local_hostname(settings: dict) -> str:
    """This process's Mooncake ``local_hostname``: ``<host>:<port>``, unique among the live
    processes of all hosts. The host: ``settings["local_hostname"]`` (a host, no port) or this
    host's address on the route to the master (what the other hosts reach it by); distinct hosts
    have distinct addresses. The port: one this process binds (port 0: the kernel picks a free
    one) and, over ``tcp``, keeps bound while it lives, so no other live process on this host
    holds the same number (over ``tcp`` Mooncake uses the port as a name only and listens on
    ports of its own). Over ``rdma`` / ``ascend`` the socket is closed at once, leaving the
    port to Mooncake's handshake server (not verified here: no RDMA NIC or NPU). A pid is no
    choice: pids go above 65535. One name per process (cached; a forked child derives its own)."""
    host = settings.get("local_hostname") or _address_towards(settings["master_address"])
    held_key = (os.getpid(), host)
    with _lock:
        if held_key not in _held:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("0.0.0.0", 0))
            port = sock.getsockname()[1]
            if settings.get("protocol", "tcp") != "tcp":
                sock.close()
                sock = None
            _held[held_key] = (sock, f"{host}:{port}")
        return _held[held_key][1]


def export_store(extra: dict | None, *, sweep_older_than_s: float | None = None):
    """The export store a ``kv_connector_extra_config`` names (validated: ValueError naming the
    key): a :class:`.kv_migration.KVExportStore` on ``store_dir`` for ``transport="directory"``
    (the default), a :class:`MooncakeExportStore` for ``transport="mooncake"``: one per process
    and config (its Mooncake client named by :func:`process_local_hostname`), swept when first
    built."""
    choice = store_choice(extra)
    if choice.transport == "directory":
        return KVExportStore(choice.store_dir, sweep_older_than_s=sweep_older_than_s)
    cache_key = (os.getpid(), choice)
    with _lock:
        found = _stores.get(cache_key)
    if found is not None:
        return found
    raw = choice.mooncake_settings
    settings = MooncakeSettings.from_dict({**raw, "local_hostname": process_local_hostname(raw)})
    store = MooncakeExportStore(settings, choice.namespace, sweep_older_than_s=sweep_older_than_s)
    with _lock:
        return _stores.setdefault(cache_key, store)


def reset_process_state() -> None:
    """Forget this process's Mooncake export stores (each client leaves Mooncake) and release
    the ports its names hold: the one place this module's per-process state ends (a test, or a
    process that switches its transport). The next :func:`export_store` starts afresh."""
    with _lock:
        stores, held = list(_stores.values()), list(_held.values())
        _stores.clear()
        _held.clear()
    for store in stores:
        try:
            store.mooncake.close()
        except Exception as exc:  # noqa: BLE001 - leaving is best effort; the master times it out
            log.warning("ascend-rl kv_migration: closing a Mooncake client failed: %s", exc)
    for sock, _ in held:
        if sock is not None:
            sock.close()
