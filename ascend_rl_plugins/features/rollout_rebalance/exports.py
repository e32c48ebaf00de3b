"""The export format of tail migration and the single-host store: what a KV export is (per TP
rank of each PP stage, a part: its blocks and a header; complete when every rank's part is
there and all agree), and :class:`KVExportStore`, exports as files in one directory.

Kept apart from :mod:`.kv_migration` (the vLLM connector, which imports vLLM) so that every
store and client shares one definition of the format without importing the connector:
:mod:`.mooncake_export_store` (between hosts), :mod:`.verl_client`, :mod:`.migration_client`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from .connector_config import valid_name

log = logging.getLogger("ascend_rl_plugins")

PREEMPTED_SUFFIX = ".preempted"


def new_key() -> str:
    return uuid.uuid4().hex


def _valid_key(key: Any) -> bool:
    return valid_name(key)


# -- the store --------------------------------------------------------------------------------
# a part's file name: <key>@pp<pp rank>-tp<tp rank>.<kv|json>, or <key>@all.json for an export
# with no KV at all; '@' is no character of a key, so no key's files share another key's prefix
PART_SEPARATOR = "@"
WHOLE_PART = "all"
PARTIAL_PREFIX = ".partial-"
_EXPORT_FILE = re.compile(r"^(?P<key>[^@/]+)@(?:pp(?P<pp>\d+)-tp(?P<tp>\d+)\.(?:kv|json)|all\.json)$")


# -- the export format, shared by every store (this module's directory, and the Mooncake store
# of :mod:`.mooncake_export_store`): the names of a part's data and header, the name of the
# empty export, and the completeness rule (:func:`complete_header`)
def part_name(key: str, tp_rank: int, pp_rank: int, suffix: str) -> str:
    """The name of one rank's part: ``<key>@pp<p>-tp<t>`` + ``.kv`` (its KV) or ``.json`` (its
    header)."""
    return f"{key}{PART_SEPARATOR}pp{int(pp_rank)}-tp{int(tp_rank)}{suffix}"


def whole_name(key: str) -> str:
    """The name of an export with no KV, for every rank at once: ``<key>@all.json``."""
    return f"{key}{PART_SEPARATOR}{WHOLE_PART}.json"


def export_name_key(name: str) -> str | None:
    """The export key a part's (or the empty export's) name belongs to; None for other names."""
    m = _EXPORT_FILE.match(name)
    return m["key"] if m is not None else None


def complete_header(part_header, whole_header) -> "ExportHeader | None":
    """The completeness rule: an export is complete when the part of rank (tp 0, pp 0) is there
    and every other rank's part (of the TP/PP sizes it names) is, all agreeing on the tokens,
    the block size and the TP/PP sizes; or, with no part of rank (0, 0), when the empty export
    is there. ``part_header(tp_rank, pp_rank)`` / ``whole_header()`` read one header (None
    where absent). Returns the first part's header (or the empty export's), or None."""
    first = part_header(0, 0)
    if first is None:
        return whole_header()
    for pp_rank in range(first.pp_size):
        for tp_rank in range(first.tp_size):
            if tp_rank == 0 and pp_rank == 0:
                continue
            part = part_header(tp_rank, pp_rank)
            if part is None or part.tokens != first.tokens or \
                    part.block_size != first.block_size or part.tp_size != first.tp_size or \
                    part.pp_size != first.pp_size:
                return None
    return first


@dataclass(frozen=True)
class ExportHeader:
    """What one part of an export holds: the tokens whose KV it carries (in order, from position
    0), the block size, and per KV tensor of its rank its name, dtype and block shape (to refuse
    a foreign layout before copying); the engine's TP and PP sizes and the part's ranks in them
    (every worker rank exports and loads its own part: its own KV heads, its own layers)."""

    tokens: list
    block_size: int
    layouts: dict = field(default_factory=dict)  # name -> [dtype, per-block shape]
    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0

    def __post_init__(self):
        for kind, size, rank in (("tp", self.tp_size, self.tp_rank), ("pp", self.pp_size, self.pp_rank)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"ExportHeader: {kind}_size must be an int >= 1, got {size!r}")
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
                raise ValueError(f"ExportHeader: {kind}_rank must be an int from 0 to "
                                 f"{kind}_size - 1 = {size - 1}, got {rank!r}")

    @property
    def num_blocks(self) -> int:
        return math.ceil(len(self.tokens) / self.block_size)

    def as_dict(self) -> dict:
        return {"tokens": list(self.tokens), "block_size": self.block_size,
                "layouts": self.layouts, "tp_size": self.tp_size, "pp_size": self.pp_size,
                "tp_rank": self.tp_rank, "pp_rank": self.pp_rank}

    def as_json(self) -> bytes:
        return json.dumps(self.as_dict()).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "ExportHeader":
        return cls.from_dict(json.loads(raw))

    @classmethod
    def from_dict(cls, d: dict) -> "ExportHeader":
        return cls(list(d["tokens"]), int(d["block_size"]), d["layouts"], int(d["tp_size"]),
                   int(d["pp_size"]), int(d["tp_rank"]), int(d["pp_rank"]))


class KVExportStore:
    """Exports as files in one directory, in parts: each worker rank of the exporting engine
    (its TP rank within its PP stage) writes its own part, ``<key>@pp<p>-tp<t>.kv`` (its KV
    tensors' blocks, ``torch.save``'d) and ``<key>@pp<p>-tp<t>.json`` (its
    :class:`ExportHeader`), and loads only the part of its own ranks at the destination. Each
    file is written under a temporary name and renamed, the header last: a part whose header is
    visible is complete. An export is complete (:meth:`header`, :meth:`exists`) when every
    rank's part is, and all of them agree on the tokens, the block size and the TP/PP sizes.
    An export with no KV at all (its request computed nothing) is one file for every rank,
    ``<key>@all.json`` (:meth:`write_empty`): complete the moment it appears.

    ``sweep_older_than_s`` (the connector gives it): at opening, remove every export, stray
    temporary file and preemption mark older than that (:meth:`sweep`)."""

    def __init__(self, directory: str, *, sweep_older_than_s: float | None = None):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        if sweep_older_than_s is not None:
            self.sweep(sweep_older_than_s)

    def _path(self, key: str, suffix: str) -> str:
        if not _valid_key(key):
            raise ValueError(f"bad export key {key!r}")
        return os.path.join(self.directory, f"{key}{suffix}")

    def _part_path(self, key: str, tp_rank: int, pp_rank: int, suffix: str) -> str:
        self._path(key, "")   # validates the key
        return os.path.join(self.directory, part_name(key, tp_rank, pp_rank, suffix))

    def _whole_path(self, key: str) -> str:
        self._path(key, "")
        return os.path.join(self.directory, whole_name(key))

    def _write_atomic(self, path: str, write) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=PARTIAL_PREFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def write(self, key: str, header: ExportHeader, tensors: dict) -> int:
        """Store the part of ``header``'s ranks (``header.tp_rank``, ``header.pp_rank``: the
        whole export where TP and PP are 1); returns its size in bytes."""
        data = self._part_path(key, header.tp_rank, header.pp_rank, ".kv")
        self._write_atomic(data, lambda f: torch.save(tensors, f))
        text = header.as_json()
        self._write_atomic(self._part_path(key, header.tp_rank, header.pp_rank, ".json"),
                           lambda f: f.write(text))
        return os.path.getsize(data) + len(text)

    def write_empty(self, key: str, header: ExportHeader) -> None:
        """Store an export of no tokens for every rank at once (one file, complete when it
        appears): what the scheduler writes for a request that computed nothing."""
        if header.tokens:
            raise ValueError(f"write_empty: export {key} names {len(header.tokens)} tokens; an "
                             "export with KV is written by each rank (write)")
        text = header.as_json()
        self._write_atomic(self._whole_path(key), lambda f: f.write(text))

    def _read_header(self, path: str) -> ExportHeader | None:
        try:
            with open(path, "rb") as f:
                return ExportHeader.from_json(f.read())
        except FileNotFoundError:
            return None

    def part_header(self, key: str, tp_rank: int = 0, pp_rank: int = 0) -> ExportHeader | None:
        """One rank's part's header, or None where that part is not (yet) there."""
        return self._read_header(self._part_path(key, tp_rank, pp_rank, ".json"))

    def header(self, key: str) -> ExportHeader | None:
        """The complete export's header under ``key`` (its first part's: the tokens, block size
        and TP/PP sizes every part agrees on), or None where there is none: no part yet, a part
        missing, or parts that disagree."""
        return complete_header(lambda tp, pp: self.part_header(key, tp, pp),
                               lambda: self._read_header(self._whole_path(key)))

    def read(self, key: str, tp_rank: int = 0, pp_rank: int = 0) -> tuple[ExportHeader, dict] | None:
        """One rank's part (its header and KV blocks), or None where it is not there."""
        header = self.part_header(key, tp_rank, pp_rank)
        if header is None:
            return None
        try:
            with open(self._part_path(key, tp_rank, pp_rank, ".kv"), "rb") as f:
                return header, torch.load(f, weights_only=True)
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        """Whether the export is complete (every rank's part there): what a client waits for."""
        return self.header(key) is not None

    def _files_of(self, key: str) -> list[str]:
        """The file names of ``key``'s parts present now, headers first."""
        self._path(key, "")   # validates the key
        names = [n for n in os.listdir(self.directory)
                 if n.startswith(key + PART_SEPARATOR) and _EXPORT_FILE.match(n)]
        return sorted(names, key=lambda n: (not n.endswith(".json"), n))

    def delete(self, key: str) -> bool:
        """Drop every part of an export (each part's header before its bytes: it stops being
        visible first). Returns whether the export was complete (:meth:`exists`) when called:
        a caller waiting for an export to be written and then dropping it (verl's client) stops
        on True, and dropping an incomplete one still removes the parts there."""
        try:
            complete = self.exists(key)
        except (ValueError, KeyError, TypeError):   # a part's header unreadable: drop it too
            complete = False
        for name in self._files_of(key):
            try:
                os.unlink(os.path.join(self.directory, name))
            except FileNotFoundError:
                pass
        return complete

    def keys(self) -> list[str]:
        """The keys of the exports with any file in the store (complete or not; each once)."""
        return sorted({m["key"] for m in map(_EXPORT_FILE.match, os.listdir(self.directory))
                       if m is not None and not m["key"].startswith(".")})

    # -- the stale-export sweep -----------------------------------------------------------------
    def sweep(self, max_age_s: float) -> int:
        """Remove every export whose newest file is older than ``max_age_s`` (all its parts and
        its preemption mark), and every temporary file (``.partial-*``) that old; returns the
        number of files removed. By file age only: several replicas share the directory, and
        none knows which of the others' exports are still wanted. Files of other names are left
        alone."""
        cutoff = time.time() - max_age_s
        newest: dict[str, float] = {}
        files: dict[str, list[str]] = {}
        stray: list[str] = []
        for name in os.listdir(self.directory):
            try:
                mtime = os.stat(os.path.join(self.directory, name)).st_mtime
            except FileNotFoundError:
                continue
            if name.startswith(PARTIAL_PREFIX):
                if mtime < cutoff:
                    stray.append(name)
                continue
            m = _EXPORT_FILE.match(name)
            key = m["key"] if m is not None else \
                name[:-len(PREEMPTED_SUFFIX)] if name.endswith(PREEMPTED_SUFFIX) else None
            if key is None or not _valid_key(key):
                continue
            newest[key] = max(newest.get(key, mtime), mtime)
            files.setdefault(key, []).append(name)
        doomed = stray + [n for key, names in files.items() if newest[key] < cutoff
                          for n in sorted(names, key=lambda n: not n.endswith(".json"))]
        removed = 0
        for name in doomed:
            try:
                os.unlink(os.path.join(self.directory, name))
                removed += 1
            except FileNotFoundError:   # another replica swept it first
                pass
            except OSError as exc:
                log.warning("ascend-rl kv_migration: sweeping %s: %s", name, exc)
        if removed:
            log.info("ascend-rl kv_migration: swept %d stale file(s) (exports, temporary files "
                     "and preemption marks older than %.0f s) from %s", removed, max_age_s,
                     self.directory)
        return removed

    # -- preemption marks: the engine says a hop was preempted; its client hands it back ------
    def mark_preempted(self, key: str) -> None:
        """The hop exporting to ``key`` was preempted by its engine's scheduler (an empty
        ``<key>.preempted``; its client reads it with :meth:`preempted_keys` and clears it)."""
        with open(self._path(key, PREEMPTED_SUFFIX), "wb"):
            pass

    def preempted_keys(self) -> set[str]:
        """Every export key marked preempted now: one directory listing, whatever the number
        of hops a client watches."""
        return {n[:-len(PREEMPTED_SUFFIX)] for n in os.listdir(self.directory)
                if n.endswith(PREEMPTED_SUFFIX) and not n.startswith(".")}

    def clear_preempted(self, key: str) -> bool:
        try:
            os.unlink(self._path(key, PREEMPTED_SUFFIX))
            return True
        except FileNotFoundError:
            return False
