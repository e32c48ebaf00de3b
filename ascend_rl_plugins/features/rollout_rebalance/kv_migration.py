"""Tail migration between independent vLLM server replicas, through vLLM's KV-connector interface.

verl 0.9 rolls out through independent server replicas (no shared process group), so a running
request moves between them the way prefill/decode disaggregation moves one: through a KV
connector, vLLM's official extension point (``kv_transfer_config`` with
``kv_connector_module_path`` naming this module, ``kv_connector="MigrationKVConnector"``).

A migration of request R from replica A to replica B:

1. R was submitted to A with ``kv_transfer_params[PARAMS_KEY] = {"export_key": K}``.
2. The client aborts R at A. A's scheduler hands R's blocks to :meth:`request_finished`, which
   keeps them (delayed free) and schedules an export; in the next step every worker-side
   connector (one per TP rank of each PP stage, each holding its own KV heads of its own
   layers) copies those blocks of its KV tensors into the :class:`KVExportStore` under K as
   its own part (files named by K and its ranks, each written under a temporary name and
   renamed: a part appears complete or not at all) and reports R as sent; A frees the blocks
   once every worker did. The export covers the tokens A had computed KV for and names them;
   it is complete when every rank's part is there and all agree on the tokens (a request that
   computed nothing gets one empty export for all ranks at once, written by the scheduler).
3. The client, once the export is complete (:meth:`KVExportStore.exists`), submits R' to B:
   prompt = R's prompt + the tokens the client received, ``max_tokens`` reduced,
   ``{"load_key": K, "export_key": K'}``. B's scheduler asks
   :meth:`get_num_new_matched_tokens`: the longest prefix of R' whose tokens equal the
   export's (never the last prompt token: vLLM computes at least one), minus what B's own
   prefix cache holds; B allocates blocks and each worker-side connector copies its own
   rank's part into them before the forward pass. B decodes on from the same KV. An export
   written at another TP or PP size than B's is refused by name (a warning naming the key and
   both engines' sizes) and B re-prefills: B's ranks would find no part, or another split of
   the heads, under their own ranks.
4. The client deletes K only after B answered (its first output: B holds R' and loaded K).
   Until then the export is the request's state: if B fails, R resumes at A (or any live
   replica) from K, or by re-prefill if K is gone. :mod:`.migration_client` owns that
   bookkeeping.

A missing, foreign or unreadable export costs a re-prefill, never a wrong token: the
scheduler side matches only tokens the export names, and a load that fails in the worker
reports its blocks through ``get_block_ids_with_load_errors`` (vLLM recomputes them under
``kv_load_failure_policy="recompute"``, which :func:`kv_transfer_config` sets).

Stale exports are swept when the store starts: each connector, when it opens the store,
removes every export (all its parts and its preemption mark) and every temporary file older
than ``kv_connector_extra_config["stale_export_max_age_s"]`` (default 6 hours: an export lives
from its hop's abort until the destination's hop ends, minutes; the replicas sharing the
directory cannot know which of the others' exports are still wanted, so age is the rule).
What it finds are the leftovers of killed runs, which would otherwise hold ``/dev/shm``.

Transport (``kv_connector_extra_config["transport"]``): ``directory`` (the default), a
directory on tmpfs (``/dev/shm``) that every replica on one host reads and writes; or
``mooncake``, Mooncake Store between hosts (:mod:`.mooncake_export_store`, the engine
vLLM-Ascend's disaggregated serving uses; its ``ascend`` protocol on Atlas A3, TCP here). Both
keep the same parts and completeness rule (:func:`part_name`, :func:`complete_header`).

Importing this module imports vLLM and torch: vLLM imports it itself, in the engine core
process, when it builds the connector; the plugin's import never does.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus

from .exports import (  # noqa: F401 - the export format and the directory store, re-exported here
    PREEMPTED_SUFFIX,
    ExportHeader,
    KVExportStore,
    PARTIAL_PREFIX,
    PART_SEPARATOR,
    WHOLE_PART,
    _valid_key,
    complete_header,
    export_name_key,
    new_key,
    part_name,
    whole_name,
)
from .connector_config import (  # noqa: F401 - the connector's config, re-exported here
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    DEFAULT_STALE_MAX_AGE_S,
    DEFAULT_STORE_DIR,
    EXTRA_CONFIG_KEYS,
    STALE_MAX_AGE_KEY,
    STORE_DIR_KEY,
    kv_transfer_config,
    stale_max_age_s,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("ascend_rl_plugins")

PARAMS_KEY = "ascend_rl_migration"


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


def _worker_ranks(tp_size: int, pp_size: int) -> tuple[int, int]:
    """This worker's (TP rank, PP rank), from vLLM's parallel state (its TP group is the ranks
    of its PP stage; both vLLM 0.13 and 0.23 keep ``rank_in_group`` on the group coordinators
    that ``get_tp_group`` / ``get_pp_group`` return). A worker of an engine at TP = PP = 1 in a
    process with no model-parallel groups (the parts' tests) is rank (0, 0)."""
    from vllm.distributed import parallel_state
    if not parallel_state.model_parallel_is_initialized():
        if tp_size * pp_size == 1:
            return 0, 0
        raise RuntimeError(f"MigrationKVConnector: a worker of an engine at tensor_parallel_size="
                           f"{tp_size}, pipeline_parallel_size={pp_size} built before vLLM's "
                           "model-parallel groups: its rank (its part of each export) is unknown")
    tp_rank = parallel_state.get_tp_group().rank_in_group
    pp_rank = parallel_state.get_pp_group().rank_in_group
    if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size):
        raise RuntimeError(f"MigrationKVConnector: worker ranks tp {tp_rank}, pp {pp_rank} outside "
                           f"tensor_parallel_size={tp_size}, pipeline_parallel_size={pp_size}")
    return tp_rank, pp_rank


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
        unknown = set(extra) - set(EXTRA_CONFIG_KEYS)
        if unknown:
            accepted = ", ".join(f"{k!r} ({what})" for k, what in EXTRA_CONFIG_KEYS.items())
            raise ValueError(f"{type(self).__name__}: unknown kv_connector_extra_config key(s) "
                             f"{sorted(unknown)}; accepted: {accepted}")
        max_age_s = stale_max_age_s(extra)
        parallel = vllm_config.parallel_config
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if getattr(parallel, name, 1) != 1:
                raise ValueError(f"{type(self).__name__}: {name}={getattr(parallel, name)} is not "
                                 "supported (accepted: 1): its ranks split a block's tokens, which "
                                 "the exports' block layout does not describe")
        self.tp_size = int(parallel.tensor_parallel_size)
        self.pp_size = int(parallel.pipeline_parallel_size)
        # this worker's part of every export: its TP rank (its KV heads) in its PP stage (its
        # layers); the scheduler (one per engine) holds no KV
        self.tp_rank, self.pp_rank = _worker_ranks(self.tp_size, self.pp_size) \
            if role == KVConnectorRole.WORKER else (0, 0)
        # the transport (kv_connector_extra_config["transport"]): this module's directory
        # store, or Mooncake Store (.mooncake_export_store), validated here
        from .mooncake_export_store import export_store
        self.store = export_store(extra, sweep_older_than_s=max_age_s)
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
        if header is not None and (header.tp_size, header.pp_size) != (self.tp_size, self.pp_size):
            # each worker rank loads its own rank's part: another split of the KV heads or of
            # the layers has no part for some rank, or a part holding other heads
            log.warning("ascend-rl kv_migration: export %s was written by an engine at "
                        "tensor_parallel_size=%d, pipeline_parallel_size=%d; this engine runs "
                        "tensor_parallel_size=%d, pipeline_parallel_size=%d; re-prefilling %s",
                        params.load_key, header.tp_size, header.pp_size, self.tp_size,
                        self.pp_size, request.request_id)
            header = None
        elif header is not None and header.block_size != self.block_size:
            log.warning("ascend-rl kv_migration: export %s has block size %d, this engine %d; "
                        "re-prefilling", params.load_key, header.block_size, self.block_size)
            header = None
        if header is None:
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
                self.store.write_empty(params.export_key, ExportHeader(
                    [], self.block_size, {}, self.tp_size, self.pp_size))
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
            self.store.write(job.key, ExportHeader(job.tokens, self.block_size, self._layouts(),
                                                   self.tp_size, self.pp_size, self.tp_rank,
                                                   self.pp_rank), tensors)
        except Exception as exc:  # noqa: BLE001 - no export: the destination re-prefills
            log.warning("ascend-rl kv_migration: exporting %s failed (%s); its destination will "
                        "re-prefill", job.request_id, exc)
        self._sent.add(job.request_id)   # the blocks are free either way

    def _load(self, job: LoadJob) -> None:
        found = self.store.read(job.key, self.tp_rank, self.pp_rank)
        if found is None:
            raise FileNotFoundError(f"export {job.key}: the part of tp rank {self.tp_rank}, pp "
                                    f"rank {self.pp_rank} is gone")
        header, tensors = found
        if (header.tp_size, header.pp_size, header.tp_rank, header.pp_rank) != \
                (self.tp_size, self.pp_size, self.tp_rank, self.pp_rank):
            raise ValueError(f"export {job.key}: part of tp {header.tp_rank}/{header.tp_size}, pp "
                             f"{header.pp_rank}/{header.pp_size}; this worker is tp "
                             f"{self.tp_rank}/{self.tp_size}, pp {self.pp_rank}/{self.pp_size}")
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
