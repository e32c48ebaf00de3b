"""Rollout rebalance inside an in-process vLLM ``LLM`` (verl 0.6.x spmd rollout).

Each DP rank owns one engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: ``LLMEngine`` ->
``InprocClient`` -> ``EngineCore`` -> scheduler and model runner in this process). The
``LLM._run_engine`` wrapper opens a :class:`Rollout` for the duration of one ``generate``;
the ``LLMEngine.step`` after-hook runs a protocol round every N steps. A rank whose own work
is done keeps joining rounds (it is the best receiver) until no rank has anything left; then
finished outputs of migrated requests travel back to the rank that owns them, and every rank
returns its caller's outputs, each exactly once, in the caller's order.

Re-admission at the destination uses vLLM's own request path, so the scheduler, the block
table and the model runner's persistent input batch are filled by vLLM itself:

* the request is added again with prompt = original prompt + tokens generated so far, and
  ``max_tokens``/``min_tokens`` reduced by what was generated;
* KV migration: before it is scheduled, the transferred full KV blocks are written into
  fresh blocks that are registered in the prefix cache under the request's own block hashes
  (``BlockPool.cache_full_blocks``) and released to the evictable pool, so the scheduler's
  prefix-cache lookup hands exactly those blocks to the request; only the tokens of the last,
  partial block (< block_size) are recomputed. Without prefix caching, or without the KV,
  the whole prefix is recomputed (migration by recompute).

Sampling state moves with the request:

* ``max_tokens``/``min_tokens`` are reduced by what was generated; stop token ids, EOS and
  length limits then behave as if the request had never moved;
* a seeded request's generator state (``SamplingParams.seed``: the model runner's
  per-request ``torch.Generator``) is read at the source and restored at the destination
  right after the runner creates the request's generator, before its first sample (the
  ``GPUModelRunner._update_states`` after-hook), so the random stream continues;
* text and stop strings: the destination keeps a *shadow* of the origin's detokenizer (vLLM's
  own ``IncrementalDetokenizer``, primed with the original prompt and fed every token
  generated so far), so the text is decoded exactly as at the origin (a character split
  across the boundary, the decoder's prompt context) and stop strings are checked after
  every step exactly as the origin would (one may span the boundary; ``min_tokens`` and
  ``include_stop_str_in_output`` included): the destination's engine gets no stop strings
  of its own, and the request finishes when the shadow finds one;
* logprobs and the cumulative logprob generated so far are prepended at the end;
* ``n > 1``: each child request moves on its own; at the end the origin completes the
  parent's output (the children it kept plus the returned ones, by index) itself;
* requests whose sampling depends on state we do not move stay where they are: prompt
  logprobs, frequency/presence penalties (vLLM counts them over output tokens only, and the
  moved prefix becomes prompt at the destination), bad words, structured outputs.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import threading
from dataclasses import dataclass, replace
from typing import Any

from . import planner as _planner
from . import protocol as _protocol

log = logging.getLogger("ascend_rl_plugins")

MIGRATED_PREFIX = "ascend-rl-rebalance:"
_current = threading.local()
_groups: dict[tuple, Any] = {}
_explicit_group: list = []


def set_dp_group(group) -> None:
    """Use ``group`` (a torch.distributed group of this rank's DP peers) for rebalancing."""
    _explicit_group[:] = [group]


@dataclass
class Origin:
    """Where a migrated-in request came from and what it had generated before arriving."""

    rank: int
    request_id: str  # external id at the origin rank (what the caller sees)
    prompt: Any
    prompt_token_ids: list
    prefix: list  # tokens generated before arriving here
    prefix_text: str = ""
    prefix_logprobs: Any = None
    prefix_cumulative_logprob: float | None = None
    params: Any = None  # the caller's sampling params (max_tokens etc. before any migration)
    parent: str | None = None  # n > 1: the parent's external id at the origin
    index: int = 0  # n > 1: this child's index among the parent's completions


@dataclass
class Settings:
    interval: int = 64
    graph_sizes: tuple = (4, 8, 16, 32, 64)
    kv: str = "auto"  # auto | on | off
    log_moves: bool = False
    link_bytes_per_s: float = 20e9
    prefill_tokens_per_s: float = 20000.0


_overrides: dict = {}


def settings_from_flags() -> Settings:
    from . import GRAPH_SIZES, INTERVAL, KV, LOG
    base = Settings(interval=INTERVAL.value, graph_sizes=tuple(int(x) for x in GRAPH_SIZES.value),
                    kv=KV.value, log_moves=LOG.value)
    return replace(base, **{k: v for k, v in _overrides.items() if k != "paused"})


@contextlib.contextmanager
def overridden(**changes):
    """Change settings for the ``generate`` calls inside (``paused=True``: no rebalance;
    every DP rank must use the same settings). E.g. ``with overridden(kv="off"): ...``."""
    unknown = set(changes) - set(Settings.__dataclass_fields__) - {"paused"}
    if unknown:
        raise TypeError(f"overridden(): unknown setting(s) {sorted(unknown)}; accepted: "
                        f"paused, {', '.join(Settings.__dataclass_fields__)}")
    saved = dict(_overrides)
    _overrides.update(changes)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


# -- reading and changing one engine ---------------------------------------------------------

class VllmAdapter:
    """The protocol's :class:`~.protocol.Adapter` over a real in-process vLLM V1 engine."""

    _ids = itertools.count()

    def __init__(self, llm_engine, rank: int):
        self.engine = llm_engine
        client = llm_engine.engine_core
        core = getattr(client, "engine_core", None)
        if core is None or not hasattr(core, "scheduler"):
            raise RuntimeError("rollout rebalance needs the in-process engine core "
                               "(VLLM_ENABLE_V1_MULTIPROCESSING=0, as verl's spmd rollout sets)")
        self.rank = rank
        self.core = core
        self.scheduler = core.scheduler
        self.kv_manager = self.scheduler.kv_cache_manager
        self.block_pool = self.kv_manager.block_pool
        self.block_size = self.scheduler.cache_config.block_size
        self.origins: dict[str, Origin] = {}  # internal id -> origin (migrated-in requests)
        # (origin rank, parent external id or None, child index, merged final output)
        self.stash: list[tuple] = []
        # requests sent from here: (origin rank, caller id, child index, tokens generated)
        self.moves: list[tuple] = []
        self.admitted: dict[str, tuple] = {}  # protocol id -> (our external id, internal id)
        self.by_external: dict[str, str] = {}  # our new external id -> internal id
        self.runner = None
        self.kv_caches, _ = self._find_kv_caches()
        self.parents: dict[str, Any] = {}  # parent external id -> its ParentRequest (origin)
        self.migrated_children: dict[str, set] = {}  # parent external id -> indices moved
        self._leaving: dict[str, Any] = {}  # protocol id -> ParentRequest, until released
        self.shadows: dict[str, _Shadow] = {}  # internal id -> origin-exact detokenizer
        self.tokenizer = getattr(llm_engine.output_processor, "tokenizer", None)
        try:
            import inspect
            self._abort_internal = "internal" in inspect.signature(
                llm_engine.abort_request).parameters
        except (TypeError, ValueError):
            self._abort_internal = False
        groups = self.scheduler.kv_cache_config.kv_cache_groups
        self.kv_capable = bool(self.kv_manager.enable_caching and len(groups) == 1
                               and self.kv_caches is not None)
        self.kv_bytes_per_token = self._kv_bytes_per_token()

    # -- state reads -----------------------------------------------------------------
    def _find_kv_caches(self):
        """[(tensor, block dim)] of every KV tensor of the model runner, or (None, None).

        vLLM keeps one tensor per layer; vLLM-Ascend a (K, V) tuple per layer; the block
        dimension differs between backends (0.13 CPU: dim 1 of (2, blocks, ...), 0.23 CPU:
        dim 0), so it is found as the one dimension of size ``num_blocks``."""
        try:
            runner = self.core.model_executor.driver_worker.worker.model_runner
            self.runner = runner
            layers = list(runner.kv_caches)
        except AttributeError:
            return None, None
        tensors = []
        for layer in layers:
            tensors.extend(layer if isinstance(layer, (tuple, list)) else [layer])
        num_blocks = self.scheduler.kv_cache_config.num_blocks
        found = []
        for t in tensors:
            dims = [d for d, n in enumerate(getattr(t, "shape", ())) if n == num_blocks]
            if len(dims) != 1 or t.dtype != tensors[0].dtype:
                return None, None
            found.append((t, dims[0]))
        return (found, True) if found else (None, None)

    def _kv_bytes_per_token(self) -> float:
        if self.kv_caches is None:
            return 1.0
        per_block = sum(t.numel() // t.shape[d] * t.element_size() for t, d in self.kv_caches)
        return per_block / self.block_size

    def _states(self):
        return self.engine.output_processor.request_states

    def _external(self, internal_id: str) -> str:
        state = self._states()[internal_id]
        return getattr(state, "external_req_id", None) or internal_id

    def caller_id(self, internal_id: str) -> str:
        """The request id of the output the caller gets (the parent's, for n > 1 children)."""
        state = self._states()[internal_id]
        parent = getattr(state, "parent_req", None)
        if parent is not None:
            return _parent_external(parent)
        return getattr(state, "external_req_id", None) or internal_id

    def _abort(self, internal_id: str) -> None:
        """Drop one request (by internal id: on vLLM 0.23 children share their parent's
        external id, and aborting that would take the siblings too)."""
        if self._abort_internal:
            self.engine.abort_request([internal_id], internal=True)
        else:
            self.engine.abort_request([internal_id])

    def snapshot(self) -> _planner.RankLoad:
        from vllm.v1.request import RequestStatus
        requests = {}
        for iid, sreq in self.scheduler.requests.items():
            if sreq.is_finished():
                continue
            waiting = sreq.status != RequestStatus.RUNNING
            requests[iid] = (sreq.num_tokens, waiting)
        total = self.block_pool.num_gpu_blocks
        used = total - self.block_pool.get_num_free_blocks()
        return _planner.RankLoad.from_requests(
            self.rank, requests, kv_blocks_used=used, kv_blocks_total=total,
            block_size=self.block_size, max_num_seqs=self.scheduler.max_num_running_reqs)

    # -- source side -----------------------------------------------------------------------
    def extract(self, m: _planner.Migration) -> tuple[dict, Any]:
        from vllm.v1.request import RequestStatus
        iid = m.request_id
        state = self._states()[iid]
        sreq = self.scheduler.requests[iid]
        origin = self.origins.get(iid)
        params = origin.params if origin is not None else sreq.sampling_params
        unmovable(params)
        running = sreq.status == RequestStatus.RUNNING
        if running and sreq.num_computed_tokens < sreq.num_prompt_tokens:
            raise ValueError("still in prefill")
        generator = self._generator_state(iid, params, sreq)
        local = list(sreq.output_token_ids)
        detok = getattr(state, "detokenizer", None)
        lp = getattr(state, "logprobs_processor", None)
        shadow = self.shadows.get(iid)
        if shadow is not None:  # migrated in: the shadow holds the origin-exact text
            shadow.feed(local[shadow.fed:])
            text = shadow.text()
        else:
            text = (origin.prefix_text if origin is not None else "") + \
                (getattr(detok, "output_text", "") or "")
        logprobs = getattr(lp, "logprobs", None)
        cumulative = getattr(lp, "cumulative_logprob", None)
        if origin is None:
            parent = getattr(state, "parent_req", None)
            origin = Origin(self.rank, self._external(iid), state.prompt,
                            list(state.prompt_token_ids or sreq.prompt_token_ids), [],
                            params=params)
            if parent is not None:
                origin.parent = _parent_external(parent)
                origin.index = int(state.request_index)
                self._leaving[iid] = parent
        meta = {
            "origin": replace(origin, prefix=origin.prefix + local, prefix_text=text,
                              prefix_logprobs=_concat(origin.prefix_logprobs, logprobs),
                              prefix_cumulative_logprob=_add(origin.prefix_cumulative_logprob,
                                                             cumulative)),
            "generated_here": len(local),
            "external_id": self._external(iid),
            "generator": generator,
        }
        kv = None
        if m.with_kv and self.kv_capable and running:
            import torch
            n_full = min(sreq.num_computed_tokens, sreq.num_tokens - 1) // self.block_size
            if n_full:
                block_ids = self.kv_manager.get_block_ids(iid)[0][:n_full]
                index = torch.tensor(block_ids, dtype=torch.long)
                # one flat buffer: every KV tensor's blocks of this request, in engine order
                kv = torch.cat([t.index_select(d, index).reshape(-1) for t, d in self.kv_caches])
                meta["kv_blocks"] = n_full
        return meta, kv

    def release(self, meta: dict) -> None:
        """The destination holds the request now: drop it here without emitting an output."""
        iid = meta["_id"]
        parent = self._leaving.pop(iid, None)
        self._abort(iid)
        self.origins.pop(iid, None)
        self.shadows.pop(iid, None)
        origin = meta["origin"]
        self.moves.append((origin.rank, origin.parent or origin.request_id, origin.index,
                           len(origin.prefix)))
        if parent is not None:  # a child leaves its origin: complete the parent at the end
            key = meta["origin"].parent
            self.parents.setdefault(key, parent)
            self.migrated_children.setdefault(key, set()).add(meta["origin"].index)

    def _generator_state(self, iid: str, params, sreq):
        """A seeded request's generator state (CPU bytes), or None if it has none yet."""
        from vllm.sampling_params import SamplingType
        if params.sampling_type != SamplingType.RANDOM_SEED:
            return None
        cached = getattr(self.runner, "requests", {}).get(iid) if self.runner else None
        generator = getattr(cached, "generator", None)
        if generator is None:
            if sreq.num_output_tokens:
                raise ValueError("seeded request whose generator state cannot be read stays")
            return None  # never sampled: the destination seeds it afresh
        return bytes(generator.get_state().numpy().tobytes())

    # -- destination side ------------------------------------------------------------------------
    def admit(self, meta: dict, kv) -> bool:
        origin: Origin = meta["origin"]
        params = origin.params.clone()
        done = len(origin.prefix)
        if params.max_tokens is not None:
            params.max_tokens = params.max_tokens - done
            if params.max_tokens <= 0:
                raise ValueError("nothing left to generate")
        if getattr(params, "min_tokens", 0):
            params.min_tokens = max(0, params.min_tokens - done)
        if getattr(params, "truncate_prompt_tokens", None) is not None:
            params.truncate_prompt_tokens = None  # the origin truncated the real prompt already
        params.n = 1
        shadow = None
        if self.tokenizer is not None and getattr(params, "detokenize", True):
            shadow = _Shadow(self.tokenizer, origin)
            if shadow.stops:
                params.stop = None  # the shadow checks them, as the origin would
        generator = meta.get("generator")
        if generator is not None and not _can_restore_generators(self.runner):
            raise ValueError("this engine's model runner cannot take a generator state")
        new_id = f"{MIGRATED_PREFIX}{origin.rank}:{origin.request_id}:{origin.index}:" \
                 f"{next(self._ids)}"
        tokens = list(origin.prompt_token_ids) + list(origin.prefix)
        iid = self.engine.add_request(new_id, {"prompt_token_ids": tokens}, params) or new_id
        try:
            if kv is not None:
                self._inject(iid, kv, meta["kv_blocks"])
                # the planner made room for it: ASCEND_RL_KV_ADMISSION_RESERVE must not hold it
                # back (its cached blocks would be evicted while it waits)
                from ...request_marks import admit_without_reserve
                admit_without_reserve(self.scheduler.requests[iid])
            if generator is not None:
                import torch
                _pending_generators()[iid] = torch.frombuffer(bytearray(generator),
                                                              dtype=torch.uint8)
        except Exception:
            _pending_generators().pop(iid, None)
            self._abort(iid)
            raise
        self.origins[iid] = origin
        self.admitted[meta["_id"]] = (new_id, iid)
        self.by_external[new_id] = iid
        if shadow is not None:
            self.shadows[iid] = shadow
        return True

    def _inject(self, iid: str, kv, n_full: int) -> None:
        """Place transferred full blocks in the prefix cache under this request's hashes."""
        import torch
        if not self.kv_capable:
            raise RuntimeError("this engine has no prefix cache: cannot take KV")
        sreq = self.scheduler.requests[iid]
        if len(sreq.block_hashes) < n_full:
            raise RuntimeError(f"request has {len(sreq.block_hashes)} block hashes, KV has {n_full}")
        sizes = [t.numel() // t.shape[d] * n_full for t, d in self.kv_caches]
        if kv.numel() != sum(sizes):
            raise RuntimeError(f"KV of {kv.numel()} elements, this engine's layout needs {sum(sizes)}")
        blocks = self.block_pool.get_new_blocks(n_full)
        try:
            index = torch.tensor([b.block_id for b in blocks], dtype=torch.long)
            for (cache, d), part in zip(self.kv_caches, torch.split(kv, sizes)):
                shape = list(cache.shape)
                shape[d] = n_full
                cache.index_copy_(d, index, part.reshape(shape).to(cache.device, cache.dtype))
            self.block_pool.cache_full_blocks(sreq, blocks, 0, n_full, self.block_size, 0)
        finally:
            # evictable but cached: the scheduler's prefix lookup hands them to the request
            self.block_pool.free_blocks(list(reversed(blocks)))

    def discard(self, meta: dict) -> None:
        ids = self.admitted.pop(meta["_id"], None)
        if ids is not None:
            new_id, iid = ids
            _pending_generators().pop(iid, None)
            self.shadows.pop(iid, None)
            self.by_external.pop(new_id, None)
            self.origins.pop(iid, None)
            self._abort(iid)

    # -- outputs ----------------------------------------------------------------------------------
    def take_migrated_outputs(self, outputs: list) -> list:
        """Remove migrated-in requests' outputs from a step's outputs; stash finished ones
        (text and stop strings decided by the request's shadow detokenizer)."""
        keep = []
        for out in outputs:
            rid = getattr(out, "request_id", "")
            if not (isinstance(rid, str) and rid.startswith(MIGRATED_PREFIX)):
                keep.append(out)
                continue
            if not out.finished:
                continue
            iid = self.by_external.pop(rid, None)
            origin = self.origins.pop(iid, None) or _parse_origin(rid)
            shadow = self.shadows.pop(iid, None)
            text = None
            if shadow is not None and out.outputs:
                c = out.outputs[0]
                stop = shadow.feed(list(c.token_ids)[shadow.fed:],
                                   stop_terminated=c.finish_reason == "stop")
                text = shadow.text()
                if stop is not None:  # the origin would have stopped on this string
                    c = copy.copy(c)
                    c.finish_reason, c.stop_reason = "stop", stop
                    out = copy.copy(out)
                    out.outputs = [c] + list(out.outputs[1:])
            self._stash(origin, merge_output(out, origin, text))
        if any(shadow.stops for shadow in self.shadows.values()):
            self._check_stop_strings()
        return keep

    def _stash(self, origin: Origin, merged) -> None:
        self.stash.append((origin.rank, origin.parent, origin.index, merged))

    def _check_stop_strings(self) -> None:
        """After a step: feed the shadows of unfinished migrated-in requests that have stop
        strings; one that finds a stop string finishes its request as the origin would."""
        requests = self.scheduler.requests
        for iid, shadow in list(self.shadows.items()):
            sreq = requests.get(iid)
            if not shadow.stops or sreq is None:
                continue
            stop = shadow.feed(list(sreq.output_token_ids)[shadow.fed:])
            if stop is None:
                continue
            from vllm.v1.engine import FinishReason
            state = self._states()[iid]
            out = state.make_request_output(new_token_ids=[], pooling_output=None,
                                            finish_reason=FinishReason.STOP, stop_reason=stop)
            self._abort(iid)
            del self.shadows[iid]
            origin = self.origins.pop(iid)
            external = next((k for k, v in self.by_external.items() if v == iid), None)
            self.by_external.pop(external, None)
            self._stash(origin, merge_output(out, origin, shadow.text()))


class _Shadow:
    """The origin's detokenizer, rebuilt at the destination: vLLM's own incremental
    detokenizer primed with the original prompt and fed every generated token, so the text
    and the stop-string decisions are those the origin would have made."""

    def __init__(self, tokenizer, origin: Origin):
        from types import SimpleNamespace

        from vllm.v1.engine.detokenizer import IncrementalDetokenizer
        request = SimpleNamespace(request_id=f"{MIGRATED_PREFIX}shadow", prompt_embeds=None,
                                  prompt_token_ids=list(origin.prompt_token_ids),
                                  sampling_params=origin.params)
        self.detok = IncrementalDetokenizer.from_new_request(tokenizer, request)
        self.stops = _stop_strings(origin.params)
        self.fed = 0  # tokens generated here that the shadow has seen
        # the prefix completed no stop string at the origin (else it would have stopped
        # there): decode it without looking for one
        saved = getattr(self.detok, "stop", None)
        if saved is not None:
            self.detok.stop = []
        self.detok.update(list(origin.prefix), False)
        if saved is not None:
            self.detok.stop = saved

    def feed(self, tokens: list, stop_terminated: bool = False):
        """Tokens generated here since the last call; returns a stop string they completed."""
        if not tokens:
            return None
        self.fed += len(tokens)
        return self.detok.update(list(tokens), stop_terminated)

    def text(self) -> str:
        return self.detok.get_next_output_text(True, False)


def _parse_origin(rid: str) -> Origin:
    rank, rest = rid[len(MIGRATED_PREFIX):].split(":", 1)
    request_id, index, _ = rest.rsplit(":", 2)
    return Origin(int(rank), request_id, None, [], [], index=int(index))


def _parent_external(parent) -> str:
    return getattr(parent, "external_req_id", None) or parent.request_id


def _stop_strings(params) -> list:
    stop = getattr(params, "stop", None)
    if not stop:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def unmovable(params) -> None:
    """Raise (the request stays at its source) when its sampling depends on state that does
    not move with it."""
    if params is None:
        raise ValueError("pooling requests stay where they are")
    if params.prompt_logprobs is not None:
        raise ValueError("prompt-logprob requests stay where they are")
    if getattr(params, "frequency_penalty", 0.0) or getattr(params, "presence_penalty", 0.0):
        raise ValueError("frequency/presence penalties count output tokens only: the request "
                         "stays where they are counted")
    if getattr(params, "bad_words", None):
        raise ValueError("bad-words requests stay where they are")
    if getattr(params, "structured_outputs", None) is not None or \
            getattr(params, "guided_decoding", None) is not None:
        raise ValueError("structured-output requests stay where they are")
    if getattr(params, "logits_processors", None):
        raise ValueError("requests with logits processors stay where they are")


def _pending_generators() -> dict:
    from . import PENDING_GENERATORS
    return PENDING_GENERATORS


def _can_restore_generators(runner) -> bool:
    """The runner hook that restores generator states is active for this runner."""
    if runner is None or not hasattr(runner, "requests"):
        return False
    from . import _restore_generators
    patch = getattr(_restore_generators, "__ascend_rl_patch__", None)
    return patch is not None and patch.outcome.state == "applied" and \
        isinstance(runner, _patched_runner_class())


def _patched_runner_class():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    return GPUModelRunner


def restore_generators(runner, scheduler_output) -> None:
    """Runner after-hook body: give newly added migrated requests their generator state
    (the runner just created their generators from the seed; nothing has sampled yet)."""
    pending = _pending_generators()
    requests = getattr(runner, "requests", {})
    for new in getattr(scheduler_output, "scheduled_new_reqs", ()):
        state = pending.pop(new.req_id, None)
        if state is None:
            continue
        cached = requests.get(new.req_id)
        generator = getattr(cached, "generator", None)
        if generator is None:
            log.warning("ascend-rl rollout_rebalance: %s has no generator to restore",
                        new.req_id)
            continue
        generator.set_state(state)


def _concat(a, b):
    if a is None:
        return None if b is None else list(b)
    if b is None:
        return list(a)
    return list(a) + list(b)


def _add(a, b):
    if a is None and b is None:
        return None
    return (a or 0.0) + (b or 0.0)


def merge_output(out, origin: Origin, text: str | None = None):
    """The caller's view of a migrated request: original id, prompt and all its tokens
    (``text``: the whole output text, when a shadow detokenizer decoded it)."""
    merged = copy.copy(out)
    merged.request_id = origin.request_id
    if origin.prompt_token_ids:
        merged.prompt = origin.prompt
        merged.prompt_token_ids = list(origin.prompt_token_ids)
    completions = []
    for c in out.outputs:
        c = copy.copy(c)
        c.index = origin.index
        c.token_ids = list(origin.prefix) + list(c.token_ids)
        c.text = text if text is not None else origin.prefix_text + (c.text or "")
        if origin.prefix_logprobs is not None and c.logprobs is not None:
            c.logprobs = _concat(origin.prefix_logprobs, c.logprobs)
        if origin.prefix_cumulative_logprob is not None and c.cumulative_logprob is not None:
            c.cumulative_logprob = origin.prefix_cumulative_logprob + c.cumulative_logprob
        completions.append(c)
    merged.outputs = completions
    return merged


# -- one generate() call across the DP group ---------------------------------------------------------

def _dp_group(llm_engine):
    """This rank's DP peers: an explicit group, else the ranks sharing this TP/PP position."""
    if _explicit_group:
        return _explicit_group[0]
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        return None
    if getattr(llm_engine, "dp_group", None) is not None:
        log.warning("ascend-rl rollout_rebalance: vLLM's own data parallelism is active; "
                    "rebalance is off (it rebalances external DP ranks, verl's spmd layout)")
        return None
    world = dist.get_world_size()
    pc = llm_engine.vllm_config.parallel_config
    model_parallel = pc.tensor_parallel_size * pc.pipeline_parallel_size
    if world % model_parallel or world // model_parallel < 2:
        return None
    key = (world, model_parallel)
    if key not in _groups:
        mine = None
        for position in range(model_parallel):  # collective: every rank builds every group
            ranks = list(range(position, world, model_parallel))
            g = dist.new_group(ranks, backend="gloo")
            if dist.get_rank() in ranks:
                mine = g
        _groups[key] = mine
    return _groups[key]


class Rollout:
    """State of one ``LLM._run_engine`` call on one DP rank."""

    def __init__(self, llm, group, settings: Settings):
        import torch.distributed as dist
        self.llm = llm
        self.engine = llm.llm_engine
        self.group = group
        self.settings = settings
        self.rank = dist.get_rank(group)
        self.adapter = VllmAdapter(self.engine, self.rank)
        self.config = _planner.PlannerConfig(
            graph_sizes=settings.graph_sizes, kv_migration=settings.kv != "off",
            kv_always=settings.kv == "on", kv_bytes_per_token=self.adapter.kv_bytes_per_token,
            link_bytes_per_s=settings.link_bytes_per_s,
            prefill_tokens_per_s=settings.prefill_tokens_per_s,
            lookahead_steps=settings.interval)  # project KV growth up to the next check
        self.steps = 0
        self.rounds = 0
        self.moved_out = 0
        self.moved_in = 0
        self.kv_bytes_in = 0
        states = self.adapter._states()
        self.caller_order = {}
        for i in states:  # children share their parent's position
            self.caller_order.setdefault(self.adapter.caller_id(i), len(self.caller_order))

    def round(self, working: bool) -> _protocol.RoundResult:
        self.rounds += 1
        result = _protocol.rebalance_round(self.adapter, self.group, self.config,
                                           working=working, log_moves=self.settings.log_moves,
                                           kv_capable=self.adapter.kv_capable)
        self.moved_out += result.sent
        self.moved_in += result.received
        self.kv_bytes_in += result.bytes_received
        return result

    def after_step(self, outputs):
        outputs = self.adapter.take_migrated_outputs(list(outputs))
        self.steps += 1
        if self.steps % self.settings.interval == 0:
            self.round(working=True)
        return outputs

    def run(self, wrapped, args, kwargs):
        outputs = list(wrapped(*args, **kwargs))
        while True:  # our work is done: keep joining rounds, run what we receive
            if self.round(working=False).all_idle:
                break
            if self.engine.has_unfinished_requests():
                outputs.extend(wrapped(*args, **kwargs))
        world = len(self.group_ranks())
        back: list[list] = [[] for _ in range(world)]
        for origin_rank, parent, index, out in self.adapter.stash:
            back[origin_rank].append((parent, index, out))
        self.adapter.stash.clear()
        returned = [o for per in _protocol.all_to_all_objects(back, self.group) for o in per]
        plain = [out for parent, _, out in returned if parent is None]
        parents = self._complete_parents([x for x in returned if x[0] is not None])
        seen = set()
        result = []
        for out in outputs + plain + parents:
            if out.request_id in seen:  # a request that ran twice after a failed round
                continue
            seen.add(out.request_id)
            result.append(out)
        last = len(self.caller_order)
        result.sort(key=lambda o: self.caller_order.get(o.request_id, last))
        if self.settings.log_moves:
            log.warning("ascend-rl rollout_rebalance: rank %d: %d rounds, %d requests out, %d in",
                        self.rank, self.rounds, self.moved_out, self.moved_in)
        _current.last_stats = {"rounds": self.rounds, "moved_out": self.moved_out,
                               "moved_in": self.moved_in, "kv_bytes_in": self.kv_bytes_in,
                               "steps": self.steps, "moves": list(self.adapter.moves)}
        return result

    def _complete_parents(self, children: list) -> list:
        """n > 1 parents some of whose children finished elsewhere: their completions (by
        index) join those the origin's output processor aggregated; one output per parent."""
        by_parent: dict[str, list] = {}
        for key, index, out in children:
            by_parent.setdefault(key, []).append((index, out))
        done = []
        processor = self.engine.output_processor
        for key, got in by_parent.items():
            parent = self.adapter.parents.pop(key, None)
            n = max(index for index, _ in got) + 1
            completions = list(getattr(parent, "output_aggregator", None) or [])
            if parent is not None:
                n = max(n, int(parent.sampling_params.n))
                getattr(processor, "parent_requests", {}).pop(parent.request_id, None)
            completions += [None] * (n - len(completions))
            for index, out in got:
                completions[index] = out.outputs[0]
            missing = [i for i, c in enumerate(completions) if c is None]
            if missing:
                log.warning("ascend-rl rollout_rebalance: request %s lost completion(s) %s",
                            key, missing)
            merged = copy.copy(got[0][1])
            merged.request_id = key
            merged.outputs = [c for c in completions if c is not None]
            merged.finished = True
            done.append(merged)
            self.adapter.migrated_children.pop(key, None)
        return done

    def group_ranks(self):
        import torch.distributed as dist
        return range(dist.get_world_size(self.group))


def current() -> Rollout | None:
    return getattr(_current, "rollout", None)


def last_stats() -> dict | None:
    """Counters of this thread's last rebalanced ``generate`` (for tests and logs)."""
    return getattr(_current, "last_stats", None)


def run_engine(wrapped, llm, args, kwargs):
    """``LLM._run_engine`` wrapper body."""
    if current() is not None or _overrides.get("paused"):
        return wrapped(*args, **kwargs)  # nested (the drain loop calls the original), or paused
    group = _dp_group(llm.llm_engine)
    if group is None:
        return wrapped(*args, **kwargs)
    rollout = Rollout(llm, group, settings_from_flags())
    _current.rollout = rollout
    try:
        return rollout.run(wrapped, args, kwargs)
    finally:
        _current.rollout = None


def after_step(outputs, engine):
    """``LLMEngine.step`` after-hook body."""
    rollout = current()
    if rollout is None or rollout.engine is not engine:
        return outputs
    return rollout.after_step(outputs)
