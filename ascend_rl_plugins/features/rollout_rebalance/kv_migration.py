"""Tail migration between independent vLLM server replicas, through vLLM's KV-connector interface.

verl 0.9 rolls out through independent server replicas (no shared process group), so a running
request moves between them the way prefill/decode disaggregation moves one: through a KV
connector, vLLM's official extension point (``kv_transfer_config`` with
``kv_connector_module_path`` naming this module, ``kv_connector="MigrationKVConnector"``).

A migration of request R from replica A to replica B:

1. R was submitted to A with ``kv_transfer_params[PARAMS_KEY] = {"export_key": K}``.
2. The client aborts R at A. A's scheduler hands R's blocks to :meth:`request_finished`, which
   keeps them (delayed free) and schedules an export; the next step's worker-side connector
   copies those blocks into the :class:`KVExportStore` under K (one file, written under a
   temporary name and renamed: it appears complete or not at all) and reports R as sent, so
   A frees the blocks. The export covers the tokens A had computed KV for and names them.
3. The client submits R' to B: prompt = R's prompt + the tokens the client received,
   ``max_tokens`` reduced, ``{"load_key": K, "export_key": K'}``. B's scheduler asks
   :meth:`get_num_new_matched_tokens`: the longest prefix of R' whose tokens equal the
   export's (never the last prompt token: vLLM computes at least one), minus what B's own
   prefix cache holds; B allocates blocks and the worker-side connector copies the exported
   blocks into them before the forward pass. B decodes on from the same KV.
4. The client deletes K only after B answered (its first output: B holds R' and loaded K).
   Until then the export is the request's state: if B fails, R resumes at A (or any live
   replica) from K, or by re-prefill if K is gone. :mod:`.migration_client` owns that
   bookkeeping.

A missing, foreign or unreadable export costs a re-prefill, never a wrong token: the
scheduler side matches only tokens the export names, and a load that fails in the worker
reports its blocks through ``get_block_ids_with_load_errors`` (vLLM recomputes them under
``kv_load_failure_policy="recompute"``, which :func:`kv_transfer_config` sets).

Transport: on CPU a directory, by default on tmpfs (``/dev/shm``): every replica on one host
reads and writes it (a shared file system would span hosts, slowly). On Atlas A3 the same
protocol would ride vLLM-Ascend's Mooncake or LLMDataDist connectors (device-to-device over
HCCS/RDMA); those run only on NPUs and are not used or emulated here.

Importing this module imports vLLM and torch: vLLM imports it itself, in the engine core
process, when it builds the connector; the plugin's import never does.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus

from .connector_config import (  # noqa: F401 - the connector's config, re-exported here
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    DEFAULT_STORE_DIR,
    STORE_DIR_KEY,
    kv_transfer_config,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("ascend_rl_plugins")

PARAMS_KEY = "ascend_rl_migration"
PREEMPTED_SUFFIX = ".preempted"


# -- what a request carries -------------------------------------------------------------------
@dataclass(frozen=True)
class MigrationParams:
    """The request's ``kv_transfer_params[PARAMS_KEY]``: where its KV goes when it is aborted
    (``export_key``), where its KV comes from on admission (``load_key``), and whether its
    engine marks it in the store when its scheduler preempts it (``mark_preempted``, with an
    ``export_key``: the preemption hand-back, :meth:`KVExportStore.mark_preempted`)."""

    export_key: str | None = None
    load_key: str | None = None
    mark_preempted: bool = False

    def as_kv_transfer_params(self) -> dict:
        return {PARAMS_KEY: {k: v for k, v in (("export_key", self.export_key),
                                               ("load_key", self.load_key),
                                               ("mark_preempted", self.mark_preempted)) if v}}

    @classmethod
    def of(cls, kv_transfer_params: dict | None) -> "MigrationParams | None":
        raw = (kv_transfer_params or {}).get(PARAMS_KEY)
        if raw is None:
            return None
        unknown = set(raw) - {"export_key", "load_key", "mark_preempted"} if isinstance(raw, dict) else ()
        if not isinstance(raw, dict) or unknown:
            raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}] takes the keys export_key and "
                             f"load_key (strings) and mark_preempted (a bool), got {raw!r}")
        if not isinstance(raw.get("mark_preempted", False), bool):
            raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}]['mark_preempted'] must be a bool, "
                             f"got {raw['mark_preempted']!r}")
        for key in ("export_key", "load_key"):
            value = raw.get(key)
            if value is not None and not _valid_key(value):
                raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}][{key!r}] must be a string of "
                                 f"letters, digits, '-', '_' or '.', got {value!r}")
        return cls(raw.get("export_key"), raw.get("load_key"), raw.get("mark_preempted", False))


def new_key() -> str:
    return uuid.uuid4().hex


def _valid_key(key: Any) -> bool:
    return isinstance(key, str) and 0 < len(key) <= 200 and \
        all(c.isalnum() or c in "-_." for c in key) and not key.startswith(".")


# -- the store --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExportHeader:
    """What an export holds: the tokens whose KV it carries (in order, from position 0), the
    block size, and per KV tensor its name, dtype and block shape (to refuse a foreign
    layout before copying)."""

    tokens: list
    block_size: int
    layouts: dict = field(default_factory=dict)  # name -> [dtype, per-block shape]

    @property
    def num_blocks(self) -> int:
        return math.ceil(len(self.tokens) / self.block_size)


class KVExportStore:
    """Exports as files in one directory, two per key: ``<key>.kv`` (each KV tensor's blocks,
    ``torch.save``'d) and ``<key>.json`` (the :class:`ExportHeader`). Each is written under a
    temporary name and renamed, the header last: an export whose header is visible is
    complete, and the scheduler reads only the small header."""

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def _path(self, key: str, suffix: str) -> str:
        if not _valid_key(key):
            raise ValueError(f"bad export key {key!r}")
        return os.path.join(self.directory, f"{key}{suffix}")

    def _write_atomic(self, path: str, write) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".partial-")
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def write(self, key: str, header: ExportHeader, tensors: dict) -> int:
        """Store an export; returns its size in bytes."""
        self._write_atomic(self._path(key, ".kv"), lambda f: torch.save(tensors, f))
        text = json.dumps({"tokens": list(header.tokens), "block_size": header.block_size,
                           "layouts": header.layouts}).encode()
        self._write_atomic(self._path(key, ".json"), lambda f: f.write(text))
        return os.path.getsize(self._path(key, ".kv")) + len(text)

    def header(self, key: str) -> ExportHeader | None:
        """The complete export's header under ``key``, or None if there is none."""
        try:
            with open(self._path(key, ".json"), "rb") as f:
                raw = json.loads(f.read())
        except FileNotFoundError:
            return None
        return ExportHeader(list(raw["tokens"]), int(raw["block_size"]), raw["layouts"])

    def read(self, key: str) -> tuple[ExportHeader, dict] | None:
        header = self.header(key)
        if header is None:
            return None
        try:
            with open(self._path(key, ".kv"), "rb") as f:
                return header, torch.load(f, weights_only=True)
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key, ".json"))

    def delete(self, key: str) -> bool:
        """Drop an export (header first: it stops being visible before its bytes go)."""
        found = False
        for suffix in (".json", ".kv"):
            try:
                os.unlink(self._path(key, suffix))
                found = True
            except FileNotFoundError:
                pass
        return found

    def keys(self) -> list[str]:
        return sorted(n[:-5] for n in os.listdir(self.directory)
                      if n.endswith(".json") and not n.startswith("."))

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


# -- connector metadata (scheduler -> worker, once per step) -------------------------------------
@dataclass
class ExportJob:
    request_id: str
    key: str
    block_ids: list
    tokens: list


@dataclass
class LoadJob:
    request_id: str
    key: str
    block_ids: list      # the request's blocks at B, from position 0
    first_block: int     # blocks before this one came from B's own prefix cache
    num_tokens: int      # tokens whose KV is in place after the load


@dataclass
class MigrationConnectorMetadata(KVConnectorMetadata):
    exports: list = field(default_factory=list)
    loads: list = field(default_factory=list)


def _common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class MigrationKVConnector(KVConnectorBase_V1):
    """Exports an aborted request's KV on request and loads an export into a new request.

    Scheduler role: decides (``request_finished``: export; ``get_num_new_matched_tokens`` /
    ``update_state_after_alloc``: load) and sends jobs in the step's metadata. Worker role:
    copies blocks between the paged KV tensors and the store (``start_load_kv``, which runs
    in every step, with or without a forward pass), reports exports done
    (``get_finished``: the scheduler frees the kept blocks) and failed loads."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        unknown = set(extra) - {STORE_DIR_KEY}
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown kv_connector_extra_config key(s) "
                             f"{sorted(unknown)}; accepted: {STORE_DIR_KEY!r} (a directory)")
        self.store = KVExportStore(str(extra.get(STORE_DIR_KEY, DEFAULT_STORE_DIR)))
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else None
        # scheduler side
        self._exports: dict[str, ExportJob] = {}
        self._loads: dict[str, LoadJob] = {}
        self._matched: dict[str, int] = {}   # request id -> tokens its export covers (last query)
        # request id -> export key, of the requests asking for a preemption mark
        self._marked_on_preemption: dict[str, str] = {}
        # worker side
        self._kv: dict[str, tuple[torch.Tensor, int]] = {}   # layer -> (tensor, block dim)
        self._sent: set[str] = set()
        self._load_errors: set[int] = set()
        # request id -> tokens of its KV that are valid after its load failed (the blocks from
        # this engine's own prefix cache); until vLLM finishes the request
        self._failed_loads: dict[str, int] = {}

    # -- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        params = MigrationParams.of(request.kv_transfer_params)
        if params is not None and params.mark_preempted and params.export_key:
            self._marked_on_preemption[request.request_id] = params.export_key
        if params is None or not params.load_key:
            return 0, False
        try:
            header = self.store.header(params.load_key)
        except Exception as exc:  # noqa: BLE001 - an unreadable export costs a re-prefill
            log.warning("ascend-rl kv_migration: export %s unreadable (%s); re-prefilling %s",
                        params.load_key, exc, request.request_id)
            header = None
        if header is None or header.block_size != self.block_size:
            if header is not None:
                log.warning("ascend-rl kv_migration: export %s has block size %d, this engine %d; "
                            "re-prefilling", params.load_key, header.block_size, self.block_size)
            self._matched.pop(request.request_id, None)
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        usable = min(_common_prefix(header.tokens, prompt), len(prompt) - 1)
        self._matched[request.request_id] = usable
        return max(0, usable - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int):
        if num_external_tokens <= 0:
            return
        params = MigrationParams.of(request.kv_transfer_params)
        total = self._matched.pop(request.request_id)
        local = total - num_external_tokens
        assert local % self.block_size == 0, "local prefix-cache hits are whole blocks"
        self._loads[request.request_id] = LoadJob(
            request.request_id, params.load_key, list(blocks.get_block_ids()[0]),
            local // self.block_size, total)

    def build_connector_meta(self, scheduler_output) -> MigrationConnectorMetadata:
        """The step's jobs; and, for each request this step preempted that asked for it, its
        preemption mark in the store (vLLM 0.23's ``SchedulerOutput.preempted_req_ids``: the
        scheduler hands the step's output here once it has decided every preemption)."""
        for request_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            key = self._marked_on_preemption.get(request_id)
            if key is not None:
                try:
                    self.store.mark_preempted(key)
                except OSError as exc:  # the request just waits here, as vLLM has it
                    log.warning("ascend-rl kv_migration: preemption mark %s failed: %s", key, exc)
        meta = MigrationConnectorMetadata(exports=list(self._exports.values()),
                                          loads=list(self._loads.values()))
        self._exports.clear()
        self._loads.clear()
        return meta

    def request_finished(self, request: "Request", block_ids: list) -> tuple[bool, dict | None]:
        """An aborted request that names an ``export_key`` keeps its blocks until the worker
        has copied them out (reported by ``get_finished``)."""
        self._matched.pop(request.request_id, None)
        self._marked_on_preemption.pop(request.request_id, None)
        params = MigrationParams.of(request.kv_transfer_params)
        if params is None or not params.export_key or request.status != RequestStatus.FINISHED_ABORTED:
            return False, None
        covered = min(request.num_computed_tokens, request.num_tokens)
        blocks = math.ceil(covered / self.block_size)
        if covered <= 0 or blocks > len(block_ids):
            # nothing computed yet (still queued): an empty export tells the client at once
            # that the destination prefills (instead of waiting for one that never comes)
            try:
                self.store.write(params.export_key, ExportHeader([], self.block_size, {}), {})
            except Exception as exc:  # noqa: BLE001 - the client times out and re-prefills
                log.warning("ascend-rl kv_migration: empty export %s failed: %s", params.export_key, exc)
            return False, None
        self._exports[request.request_id] = ExportJob(
            request.request_id, params.export_key, list(block_ids[:blocks]),
            list(request.all_token_ids[:covered]))
        return True, None

    # -- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Find each KV tensor's block dimension: the one of size ``num_blocks`` (vLLM 0.23's
        CPU attention: dim 0; other backends differ)."""
        for name, tensor in kv_caches.items():
            dims = [d for d, n in enumerate(tensor.shape) if n == self.num_blocks]
            if len(dims) != 1:
                raise ValueError(f"{type(self).__name__}: cannot tell the block dimension of KV "
                                 f"tensor {name} of shape {tuple(tensor.shape)} "
                                 f"({self.num_blocks} blocks)")
            self._kv[name] = (tensor, dims[0])

    def _layouts(self) -> dict:
        return {name: [str(t.dtype).replace("torch.", ""),
                       [n for d, n in enumerate(t.shape) if d != dim]]
                for name, (t, dim) in self._kv.items()}

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MigrationConnectorMetadata)
        for job in meta.exports:
            self._export(job)
        for job in meta.loads:
            try:
                self._load(job)
            except Exception as exc:  # noqa: BLE001 - vLLM recomputes the blocks
                log.warning("ascend-rl kv_migration: loading %s into %s failed (%s); its blocks "
                            "are recomputed", job.key, job.request_id, exc)
                self._load_errors.update(job.block_ids[job.first_block:
                                                       math.ceil(job.num_tokens / self.block_size)])
                self._failed_loads[job.request_id] = job.first_block * self.block_size

    def _export(self, job: ExportJob) -> None:
        """Copy the job's blocks into the store. A request whose load failed here exports only
        the tokens before the failed blocks: vLLM 0.23 rolls back the computed-token count of
        a request whose load failed only while it runs, and one aborted in that step (a move
        ordered just then) reaches :meth:`request_finished` still counting the tokens it never
        loaded, whose blocks hold whatever was there before."""
        valid = self._failed_loads.pop(job.request_id, None)
        if valid is not None and valid < len(job.tokens):
            log.warning("ascend-rl kv_migration: %s failed to load; its export %s names %d of "
                        "%d tokens", job.request_id, job.key, valid, len(job.tokens))
            job = ExportJob(job.request_id, job.key, job.block_ids[:math.ceil(valid / self.block_size)],
                            job.tokens[:valid])
        try:
            index = torch.tensor(job.block_ids, dtype=torch.long)
            tensors = {name: t.index_select(dim, index).clone() for name, (t, dim) in self._kv.items()}
            self.store.write(job.key, ExportHeader(job.tokens, self.block_size, self._layouts()),
                             tensors)
        except Exception as exc:  # noqa: BLE001 - no export: the destination re-prefills
            log.warning("ascend-rl kv_migration: exporting %s failed (%s); its destination will "
                        "re-prefill", job.request_id, exc)
        self._sent.add(job.request_id)   # the blocks are free either way

    def _load(self, job: LoadJob) -> None:
        found = self.store.read(job.key)
        if found is None:
            raise FileNotFoundError(f"export {job.key} is gone")
        header, tensors = found
        if header.layouts != self._layouts():
            raise ValueError(f"export {job.key} has KV layout {header.layouts}, this engine "
                             f"{self._layouts()}")
        last = math.ceil(job.num_tokens / self.block_size)
        if last > header.num_blocks or last > len(job.block_ids):
            raise ValueError(f"export {job.key} holds {header.num_blocks} blocks, {last} needed")
        src = torch.arange(job.first_block, last, dtype=torch.long)
        dst = torch.tensor(job.block_ids[job.first_block:last], dtype=torch.long)
        for name, (t, dim) in self._kv.items():
            t.index_copy_(dim, dst, tensors[name].index_select(dim, src).to(t.device, t.dtype))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self):
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for request_id in finished_req_ids:   # their exports (if any) ran in this step
            self._failed_loads.pop(request_id, None)
        sent, self._sent = self._sent, set()
        return (sent or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
