"""verl 0.9's rollout client with tail migration: ``LLMServerManager.get_client(client_cls=
MigratingLLMServerClient, replicas=..., policy=...)`` (verl's own way to customize the client).

Each request runs as *hops* on verl's server actors (``vLLMHttpServer.generate``, which passes
``kv_transfer_params`` to vLLM); between hops the KV moves through the replicas'
``MigrationKVConnector`` (:mod:`.kv_migration`). Same exactly-once rules as
:class:`.migration_client.MigratingClient`, adapted to verl's non-streaming ``generate``:

- a move aborts the hop at the source (``AsyncLLM.abort`` reached through Ray's
  ``__ray_call__``: verl 0.9.1's ``vLLMHttpServer.abort_request`` does not find requests on
  vLLM 0.23, which keys them by internal id), takes the partial tokens and log-probs verl's
  ``generate`` returns for an aborted request, waits for the export, and submits the rest to
  the destination with ``load_key``;
- the export is deleted when the destination's hop returns (verl's ``generate`` reports no
  earlier acknowledgement); if the destination's engine died first, the request resumes on
  the export's source (or any live replica) from the export; a hop whose replica died with no
  export is re-prefilled on a live replica from the tokens received;
- the caller's request is acquired from and released to verl's router once, as by verl's own
  client (the router is not told of moves).

Imports verl and Ray: import it where verl runs (the agent-loop workers unpickle it).
"""

from __future__ import annotations

import asyncio
import logging
import time
import types
from dataclasses import dataclass
from typing import Any, Callable
from uuid import uuid4

from verl.workers.rollout.llm_server import LLMServerClient

from .kv_migration import DEFAULT_STORE_DIR, KVExportStore, MigrationParams, new_key
from .migration_client import check_migratable

log = logging.getLogger("ascend_rl_plugins")


@dataclass
class TimedMigration:
    """Move policy "forced on" for verl's non-streaming hops: a hop still running after
    ``after_s`` seconds is moved to the next live replica, at most ``max_moves`` times per
    request."""

    after_s: float
    max_moves: int = 1

    def __post_init__(self):
        if self.after_s <= 0 or self.max_moves < 0:
            raise ValueError(f"TimedMigration: after_s must be > 0 and max_moves >= 0, got "
                             f"after_s={self.after_s}, max_moves={self.max_moves}")

    def destination(self, source: str, live: list, moves: int) -> str | None:
        if moves >= self.max_moves:
            return None
        others = [r for r in live if r != source]
        return others[0] if others else None


def _abort_on_server(server, request_id: str) -> None:
    """Runs inside the ``vLLMHttpServer`` actor (its event loop): abort by the request id the
    server gave ``AsyncLLM`` (vLLM maps it to its internal ids)."""
    coroutine = server.engine.abort(request_id)
    try:
        asyncio.get_running_loop().create_task(coroutine)
    except RuntimeError:   # called off the actor's loop: hand it to the loop vLLM's outputs use
        asyncio.run_coroutine_threadsafe(coroutine, server.engine.output_handler.get_loop())


def engine_errored(server) -> bool:
    """Runs inside a ``vLLMHttpServer`` actor: has its vLLM engine died?"""
    return bool(server.engine.errored)


class MigratingLLMServerClient(LLMServerClient):
    """verl's ``LLMServerClient`` whose requests move between replicas with their KV."""

    def __init__(self, config, load_balancer_handle=None, *, replicas: dict | None = None,
                 policy: TimedMigration | None = None, store_dir: str = DEFAULT_STORE_DIR,
                 export_timeout_s: float = 30.0, **kwargs):
        super().__init__(config=config, load_balancer_handle=load_balancer_handle, **kwargs)
        if policy is not None and not replicas:
            raise ValueError("replicas: a migration policy needs the server handles by server id "
                             "(the addresses verl's router hands out)")
        self.replicas = dict(replicas or {})
        self.policy = policy
        self.store_dir = store_dir
        self.export_timeout_s = export_timeout_s
        self.dead: set[str] = set()

    @property
    def store(self) -> KVExportStore:
        return KVExportStore(self.store_dir)

    def _max_tokens(self, prompt_ids: list, sampling_params: dict) -> int:
        """The request's whole budget, as verl's server would default it for the first hop."""
        for key in ("max_tokens", "max_new_tokens"):
            if sampling_params.get(key) is not None:
                return int(sampling_params[key])
        rollout = self.config.actor_rollout_ref.rollout
        budget = min(rollout.response_length,
                     rollout.prompt_length + rollout.response_length - len(prompt_ids))
        return max(1, min(budget, rollout.max_model_len - len(prompt_ids)))

    async def _alive(self, server_id: str) -> bool:
        if server_id in self.dead:
            return False
        try:
            errored = await self.replicas[server_id].__ray_call__.remote(engine_errored)
        except Exception:  # noqa: BLE001 - the actor itself is gone
            errored = True
        if errored:
            self.dead.add(server_id)
        return not errored

    def _live(self) -> list:
        return [s for s in self.replicas if s not in self.dead]

    def _pick(self, prefer: str | None, exclude: str | None = None) -> str:
        live = self._live()
        if prefer in live:
            return prefer
        candidates = [s for s in live if s != exclude] or live
        if not candidates:
            raise RuntimeError(f"ascend-rl migration: no live replica left (dead: {sorted(self.dead)})")
        return candidates[0]

    async def generate(self, request_id, *, prompt_ids: list, sampling_params: dict, **kwargs):
        movable = self.policy is not None and not any(
            kwargs.get(k) is not None for k in ("image_data", "video_data", "audio_data"))
        if movable:
            try:
                check_migratable(types.SimpleNamespace(**{k: v for k, v in sampling_params.items()
                                                          if k != "logprobs"}))
            except ValueError as exc:
                log.info("ascend-rl migration: %s stays where it starts: %s", request_id, exc)
                movable = False
        if not movable:
            return await super().generate(request_id, prompt_ids=prompt_ids,
                                          sampling_params=sampling_params, **kwargs)
        server_id, _ = await self._acquire_server(request_id, prompt_ids=prompt_ids,
                                                  sampling_params=sampling_params, **kwargs)
        try:
            return await self._hops(server_id, list(prompt_ids), dict(sampling_params), kwargs)
        finally:
            self._release_server(server_id, request_id=request_id)

    async def _hops(self, replica: str, prompt_ids: list, sampling_params: dict, kwargs: dict):
        # what verl's own client forwards to the server (it too drops these two; no media here)
        kwargs = {k: v for k, v in kwargs.items() if v is not None and k not in (
            "mm_processor_output", "image_data", "video_data", "audio_data", "mm_processor_kwargs")}
        if not kwargs.get("priority"):
            kwargs.pop("priority", None)
        budget = self._max_tokens(prompt_ids, sampling_params)
        sampling_params.pop("max_new_tokens", None)
        tokens: list = []
        log_probs: list = []
        load_key: str | None = None
        load_source: str | None = None
        moves = 0
        store = self.store
        while True:
            if replica in self.dead:
                replica = self._pick(prefer=load_source)
            server = self.replicas[replica]
            hop_id = uuid4().hex
            export_key = new_key()
            call = server.generate.remote(
                request_id=hop_id, prompt_ids=prompt_ids + tokens,
                sampling_params=dict(sampling_params, max_tokens=budget - len(tokens)),
                kv_transfer_params=MigrationParams(export_key, load_key).as_kv_transfer_params(),
                **kwargs)
            running = asyncio.ensure_future(_resolve(call))
            destination = self.policy.destination(replica, self._live(), moves)
            if destination is not None:
                done, _ = await asyncio.wait({running}, timeout=self.policy.after_s)
                if not done:
                    await server.__ray_call__.remote(_abort_on_server, hop_id)
                else:
                    destination = None
            try:
                out = await running
            except Exception as exc:  # noqa: BLE001 - replica death or the request's own error
                if await self._alive(replica):
                    if load_key is not None:
                        store.delete(load_key)
                    raise
                log.warning("ascend-rl migration: replica %s died during hop %s (%s); continuing "
                            "from %s", replica, hop_id, type(exc).__name__,
                            f"export {load_key}" if load_key else "a re-prefill")
                replica = self._pick(prefer=load_source) if load_key else self._pick(None, replica)
                store.delete(export_key)
                continue
            if load_key is not None:   # the destination's hop returned: it held the request
                store.delete(load_key)
                load_key = load_source = None
            tokens += list(out.token_ids)
            if out.log_probs is not None:
                log_probs += list(out.log_probs)
            aborted = out.stop_reason in ("aborted", "abort")
            if not (aborted and destination is not None) or len(tokens) >= budget:
                if aborted:   # aborted by verl (or late): its export appears a step later
                    asyncio.ensure_future(_drop_when_written(store, export_key, self.export_timeout_s))
                store.delete(export_key)
                out.token_ids, out.log_probs = tokens, (log_probs if out.log_probs is not None else None)
                if aborted and len(tokens) >= budget:
                    out.stop_reason = "completed"
                return out
            moves += 1
            if await _wait_export(store, export_key, self.export_timeout_s):
                load_key, load_source = export_key, replica
            replica = destination


async def _resolve(ref) -> Any:
    return await ref


async def _drop_when_written(store: KVExportStore, key: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not store.delete(key):
        await asyncio.sleep(0.05)


async def _wait_export(store: KVExportStore, key: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.exists(key):
            return True
        await asyncio.sleep(0.005)
    log.warning("ascend-rl migration: export %s did not appear within %.0f s; the destination "
                "re-prefills", key, timeout_s)
    return False
