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
- the export is deleted when the destination's hop has ended in its engine core: when it
  returns finished, or, for a hop aborted there (vLLM's front end returns an aborted hop at
  once, while its engine core may still be about to load the export), once the hop's own
  export is written (``_keep_fuller``); verl's ``generate`` reports no earlier
  acknowledgement. If the destination's engine died first, the request resumes on
  the export's source (or any live replica) from the export; a hop whose replica died with no
  export is re-prefilled on a live replica from the tokens received;
- the caller's request is acquired from verl's router once and released once, on the replica
  the router holds it on; each move is told to the router in between (``move_request``, a
  method of this project's router, where the router has it), so its per-replica load follows
  the move.

Two policies: :class:`TimedMigration` (forced on: a hop still running after a delay moves) and
:class:`.migration_client.PlannedMigration` (the live trigger, what ``ASCEND_RL_ROLLOUT_MIGRATION
=planned`` selects): every interval a planner task reads every replica's vLLM front end
(:func:`progress_on_server`: per request its prompt and the output tokens received *so far*,
exact, one Ray call per replica; verl's non-streaming ``generate`` reports a hop's tokens only
when it ends), runs ``tail_policy.plan_moves`` over all requests on the replicas (other agent-loop
workers' requests count as load but only this client's own move), and aborts the hops it moves.
Every agent-loop worker holds its own copy of the client and plans over the same replica reads
with the same deterministic planner, so their plans agree and each carries out its own share:
each worker builds every request's view from the read alone (:func:`request_view`; a hop's id
says how many tokens the request received before it, so a moved request looks the same, whole,
to every worker), and names it by its hop id (the planner breaks ties by name).

Imports verl and Ray: import it where verl runs (the agent-loop workers unpickle it).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import types
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

from verl.workers.rollout.llm_server import LLMServerClient

from .connector_config import MOONCAKE_KEY, STORE_DIR_KEY, TRANSPORT_KEY, store_choice
from .connector_config import DEFAULT_STORE_DIR
from .exports import KVExportStore, new_key
from .kv_migration import MigrationParams
from .mooncake_export_store import export_store
from .migration_client import (
    InFlight,
    PlannedMigration,
    ReplicaCapacity,
    check_migratable,
    hop_limits,
    replica_capacity,
)

log = logging.getLogger("ascend_rl_plugins")

MOVES_KEPT = 1024   # MigrationStats.moves keeps the latest this many (the client lives across steps)


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


@dataclass(frozen=True)
class ServerRequest:
    """One request a replica's vLLM front end holds now."""

    hop_id: str            # the request id the server gave ``AsyncLLM`` (its external id)
    prompt_tokens: int
    generated: int         # output tokens the front end has received for it so far
    max_tokens: int | None


@dataclass(frozen=True)
class ServerProgress:
    """What :func:`progress_on_server` reads from one replica."""

    capacity: ReplicaCapacity
    requests: tuple


def progress_on_server(server) -> ServerProgress:
    """Runs inside a ``vLLMHttpServer`` actor: every request its ``AsyncLLM`` front end holds,
    with the output tokens received so far (``OutputProcessor.request_states``: each state's
    detokenizer holds every output token the engine core has sent, whatever the output kind),
    and the replica's capacity from its config. No call reaches the engine core: exact as of
    the last output the front end processed, at the cost of one Ray call."""
    engine = server.engine
    states = list(engine.output_processor.request_states.values())
    return ServerProgress(replica_capacity(engine), tuple(
        ServerRequest(state.external_req_id, int(state.prompt_len),
                      int(state.detokenizer.num_output_tokens()), state.max_tokens_param)
        for state in states if state.parent_req is None))


# a hop's id at its server: a fresh uuid and the tokens its request received in earlier hops
_HOP_ID = re.compile(r"([0-9a-f]{32})-before(\d+)")


def hop_id_for(tokens_before: int) -> str:
    """A new hop's request id at its server, saying how many tokens the request received in
    earlier hops (:func:`tokens_before_hop` reads it back, in whichever worker reads the server)."""
    return f"{uuid4().hex}-before{int(tokens_before)}"


def tokens_before_hop(hop_id: str) -> int:
    """The tokens received before the hop ``hop_id`` (0: a first hop, or a request this project's
    client did not submit)."""
    match = _HOP_ID.fullmatch(hop_id)
    return int(match.group(2)) if match else 0


def replica_host(server_id: str) -> str | None:
    """The host of a verl server id (``host:port``, ``[v6 address]:port``); None for an id of
    another form (it names no host)."""
    host, sep, port = str(server_id).rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]")


def request_view(server_id: str, q: ServerRequest, movable: bool = False) -> InFlight:
    """One request a replica read shows, as the planner sees it: named by its hop id, with the
    request's own prompt, every token it generated (earlier hops too) and its whole budget.
    Every worker builds it from the read alone, so every worker sees the same request whatever
    its owner: the KV it holds (prompt + generated: the hop's prompt + this hop's output) and
    its remaining budget (the hop's ``max_tokens`` - this hop's output) are the server's, and
    its age (generated) counts the earlier hops, for the planner's survival rule. ``movable``
    is the reader's (its own request, in flight); it does not enter the plan. A request whose
    id is not a hop id (verl's own client, or a request the migrating client refused to move:
    both run through verl's ``generate`` under verl's id) is pinned for every worker: no
    worker can move it, so no plan spends a move on it."""
    ours = _HOP_ID.fullmatch(q.hop_id) is not None
    before = tokens_before_hop(q.hop_id)
    if before > q.prompt_tokens:   # no hop of this project's: a foreign id of that form
        before, ours = 0, False
    generated = before + q.generated
    max_tokens = before + q.max_tokens if q.max_tokens is not None else generated + 1
    return InFlight(q.hop_id, server_id, q.prompt_tokens - before, generated, max_tokens, movable,
                    pinned=not ours)


@dataclass(frozen=True)
class CurrentHop:
    """The hop a request of this client runs now."""

    hop_id: str            # its id at the server (what progress_on_server reports; hop_id_for)
    tokens_before: int     # tokens the request received in earlier hops
    replica: str = ""      # the server it runs on
    export_key: str = ""   # where its KV goes if aborted (and its preemption mark's name)


@dataclass
class MoveRecord:
    """One planned move this client carried out (what a test checks the planner saw)."""

    request_id: str
    source: str
    destination: str
    tokens_before_hop: int      # received in earlier hops
    generated_at_plan: int      # what the planner saw (earlier hops + the server's live count)
    generated_at_abort: int = -1   # what the client held once the aborted hop returned
    export_found: bool | None = None


@dataclass
class MigrationStats:
    """Per client (one per agent-loop worker): plans made, moves carried out, KV loads asked."""

    rounds: int = 0
    planned: int = 0              # running-request moves planned, all rounds, all clients' requests
    ordered: int = 0              # of those, this client's own, ordered (hop aborted)
    moved: int = 0                # moves carried out: the next hop started on another replica
    moves_undone: int = 0         # moves whose destination had died before the next hop
                                  # started, which then went on where the request already ran
    loads: int = 0                # hops started with an export to load
    finished: int = 0             # requests this client returned
    router_told: int = 0          # moves the router accepted (move_request returned True)
    requeued: int = 0             # hops preempted by their engine and handed back to the router
    # the latest MOVES_KEPT planned moves carried out (the counters above cover the whole run)
    moves: deque[MoveRecord] = field(default_factory=lambda: deque(maxlen=MOVES_KEPT))


class MigratingLLMServerClient(LLMServerClient):
    """verl's ``LLMServerClient`` whose requests move between replicas with their KV.

    ``replicas``: server id -> server actor handle; empty: read from the router
    (``get_server_handles``, this project's router) when first needed. ``policy``:
    :class:`TimedMigration`, a :class:`.migration_client.PlannedMigration`, or None (no moves)."""

    def __init__(self, config, load_balancer_handle=None, *, replicas: dict | None = None,
                 policy: TimedMigration | PlannedMigration | None = None,
                 store_dir: str = DEFAULT_STORE_DIR, export_timeout_s: float = 30.0,
                 requeue_preempted: bool = False, preempt_poll_s: float = 0.1,
                 store_config: dict | None = None, **kwargs):
        super().__init__(config=config, load_balancer_handle=load_balancer_handle, **kwargs)
        # the replicas' kv_connector_extra_config (transport and its settings; store_dir alone
        # where not given): the client builds the same store as their connectors
        self.store_config = dict(store_config) if store_config is not None else \
            {STORE_DIR_KEY: store_dir}
        self._store_choice = store_choice(self.store_config)   # ValueError naming a bad key
        if requeue_preempted and (policy is None
                                  or not hasattr(self._load_balancer, "requeue_request")):
            raise ValueError("requeue_preempted: the preemption hand-back needs a migration policy "
                             "(hops with exports) and this project's router (requeue_request); "
                             "set ASCEND_RL_ROLLOUT_MIGRATION=planned and the router line "
                             "`ascend-rl router --migration` prints, or turn "
                             "ASCEND_RL_ROLLOUT_REQUEUE_PREEMPTED off")
        if preempt_poll_s <= 0:
            raise ValueError(f"preempt_poll_s: accepted a number of seconds > 0, got {preempt_poll_s!r}")
        if policy is not None and not isinstance(policy, (TimedMigration, PlannedMigration)):
            raise ValueError(f"policy: accepted TimedMigration, PlannedMigration or None, got "
                             f"{type(policy).__name__}")
        if isinstance(policy, TimedMigration) and not replicas:
            raise ValueError("replicas: a timed migration policy needs the server handles by server "
                             "id (the addresses verl's router hands out)")
        self.replicas = dict(replicas or {})
        self._check_hosts(self.replicas)
        self.policy = policy
        self.store_dir = store_dir
        self.export_timeout_s = export_timeout_s
        self.dead: set[str] = set()
        self.stats = MigrationStats()
        self._own: set[str] = set()                # this client's planned requests in flight
        self._hop: dict[str, CurrentHop] = {}      # request id -> the hop it runs now
        self._seen: dict[str, InFlight] = {}       # hop id -> every request of the last read
                                                   # (replaced each round, emptied when idle)
        self._orders: dict[str, MoveRecord] = {}   # request id -> the move its aborted hop makes
        self._planner: asyncio.Task | None = None
        self.requeue_preempted = requeue_preempted
        self.preempt_poll_s = preempt_poll_s
        self._requeue: dict[str, str] = {}         # request id -> its preempted hop, aborted
        self._watcher: asyncio.Task | None = None
        self._cleanups: set = set()   # export deletions still waiting (held until done)

    def __getstate__(self):   # pickled to every agent-loop worker before any request: no task
        state = dict(self.__dict__)
        state["_planner"] = None
        state["_watcher"] = None
        state["_cleanups"] = set()
        return state

    @property
    def store(self) -> KVExportStore:
        """The export store of ``store_config`` (a directory, or this process's Mooncake
        client: built once per process)."""
        return export_store(self.store_config)

    def _check_hosts(self, server_ids) -> None:
        """The directory transport reaches one host's replicas only: refuse replicas (server
        ids are verl's ``host:port`` addresses) on several hosts."""
        if self._store_choice.transport != "directory":
            return
        hosts = sorted({replica_host(s) for s in server_ids} - {None})
        if len(hosts) > 1:
            raise ValueError(
                f"ascend-rl migration: the replicas run on {len(hosts)} hosts ({', '.join(hosts)}) "
                f"and the migration KV connector's transport is 'directory' (store_dir="
                f"{self._store_choice.store_dir!r}), which no other host reads: set "
                f"kv_connector_extra_config {{'{TRANSPORT_KEY}': 'mooncake', '{MOONCAKE_KEY}': "
                "{'master_address': '<master ip>:<rpc port>', 'metadata_server': "
                "'http://<master ip>:<port>/metadata', 'admin_url': 'http://<master ip>:<metrics "
                "port>', 'segment_size': <bytes>, 'holder_segment': '<holder host:port>'}} on "
                "every replica and give the client the same config")

    @property
    def in_flight(self) -> dict:
        """What the planner saw in the last round (``PlannedMigration.views``): every request
        the replicas held at the last read, by hop id (:func:`request_view`), this client's own
        hops movable, every other one unmovable load."""
        return dict(self._seen)

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
        """False where the replica's engine has died or its actor is gone for good; any other
        error of the check (a Ray hiccup, an actor restarting) is no death: a replica marked
        dead here stays out until the router lists it again (``_refresh_replicas``)."""
        if server_id in self.dead:
            return False
        from ray.exceptions import ActorDiedError
        try:
            errored = await self.replicas[server_id].__ray_call__.remote(engine_errored)
        except ActorDiedError:
            errored = True
        except Exception as exc:  # noqa: BLE001 - transient: the replica keeps its place
            log.warning("ascend-rl migration: checking replica %s: %s: %s (not taken as its death)",
                        server_id, type(exc).__name__, exc)
            errored = False
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

    async def _refresh_replicas(self) -> None:
        """The router's replicas (elastic add/remove included), where it can say."""
        if hasattr(self._load_balancer, "get_server_handles"):
            handles = await self._load_balancer.get_server_handles.remote()
            if handles:
                self._check_hosts(handles)
                self.replicas = dict(handles)
                if hasattr(self._load_balancer, "server_died"):
                    # this project's router drops a replica reported dead; listed again, verl
                    # has added it back
                    self.dead -= set(handles)

    def _cancel_at_router(self, request_id: str) -> None:
        """The caller was cancelled before it held a replica: cancelling its Ray call does not
        end the acquire waiting in the router, so the router is told (fire-and-forget, like
        verl's release), where it can be."""
        if hasattr(self._load_balancer, "cancel_request"):
            self._load_balancer.cancel_request.remote(request_id)

    async def _after_death(self, request_id: str, held: list, prompt_ids: list, dead: str,
                           load_source: str | None) -> str:
        """``dead``'s engine died under the request's hop: where the next hop runs. With this
        project's router, the replica leaves the router's books (``server_died``: it no longer
        looks idle and takes every queued request) and the request is acquired again, so it
        waits for a live slot; else the first live replica (the export's source first)."""
        if not hasattr(self._load_balancer, "server_died"):
            return self._pick(prefer=load_source) if load_source else self._pick(None, dead)
        await self._load_balancer.server_died.remote(dead)
        server_id, _ = await self._acquire_server(request_id, prompt_ids=prompt_ids)
        held[0] = server_id
        if server_id not in self.replicas:
            await self._refresh_replicas()
        return server_id

    def check_migratable(self, sampling_params: dict) -> None:
        """Raise ValueError naming what a move of a request with ``sampling_params`` would
        change: :func:`.migration_client.check_migratable` on the parameters given (left out:
        vLLM's defaults), and what verl's server adds to them: under ``full_determinism`` it
        seeds every request with its replica's seed, so a random request's generator would
        restart at the destination, with another seed."""
        given = {k: v for k, v in sampling_params.items() if k != "logprobs"}
        check_migratable(types.SimpleNamespace(**given))
        try:
            seeded = bool(self.config.actor_rollout_ref.rollout.full_determinism)
        except AttributeError:   # no such config (a test's client, another verl)
            seeded = False
        if seeded and given.get("seed") is None and (given.get("temperature", 1.0) or 0.0) > 0:
            raise ValueError("full_determinism: verl's server seeds each request with its "
                             "replica's seed, which a move would change; use temperature=0 or "
                             "turn actor_rollout_ref.rollout.full_determinism off")

    async def generate(self, request_id, *, prompt_ids: list, sampling_params: dict, **kwargs):
        movable = self.policy is not None and not any(
            kwargs.get(k) is not None for k in ("image_data", "video_data", "audio_data"))
        if movable:
            try:
                self.check_migratable(sampling_params)
            except ValueError as exc:
                log.info("ascend-rl migration: %s stays where it starts: %s", request_id, exc)
                movable = False
        if not movable:
            return await super().generate(request_id, prompt_ids=prompt_ids,
                                          sampling_params=sampling_params, **kwargs)
        held: list = [None]   # the replica the router counts the request on (None: none yet)
        try:
            server_id, _ = await self._acquire_server(request_id, prompt_ids=prompt_ids,
                                                      sampling_params=sampling_params, **kwargs)
            held[0] = server_id
            if not self.replicas:
                await self._refresh_replicas()
            return await self._hops(request_id, server_id, list(prompt_ids), dict(sampling_params),
                                    kwargs, held)
        finally:
            self._own.discard(request_id)
            self._hop.pop(request_id, None)
            self._orders.pop(request_id, None)
            self._requeue.pop(request_id, None)   # a cancelled hop's mark: nothing else drops it
            if held[0] is None:   # cancelled (or failed) while acquiring: no slot, no queue entry
                self._cancel_at_router(request_id)
            else:
                self._release_server(held[0], request_id=request_id)

    async def _tell_router(self, request_id: str, held: list, replica: str) -> None:
        """The request now runs on ``replica``: move its load there in the router (planned and
        forced moves alike)."""
        if replica == held[0] or not hasattr(self._load_balancer, "move_request"):
            return
        if await self._load_balancer.move_request.remote(request_id, held[0], replica):
            self.stats.router_told += 1
            held[0] = replica

    def _start_planner(self) -> None:
        if isinstance(self.policy, PlannedMigration) and (self._planner is None or self._planner.done()):
            self._planner = asyncio.get_running_loop().create_task(self._plan_while_busy())

    async def _plan_while_busy(self) -> None:
        """The live trigger: a plan every ``interval_s`` while this client has requests in flight."""
        try:
            while self._own:
                await asyncio.sleep(self.policy.interval_s)
                if not self._own:
                    return
                try:
                    await self.plan_round()
                except Exception as exc:  # noqa: BLE001 - a plan never fails a request; logged
                    log.warning("ascend-rl migration: plan round failed: %s: %s",
                                type(exc).__name__, exc)
        finally:
            self._seen = {}   # idle: no read is kept across steps

    async def plan_round(self) -> list:
        """Read every live replica, plan, and order this client's planned moves (abort their
        hops at the source). Returns the moves ordered (named by hop id, as planned).

        The plan's input is the read alone, the same in every agent-loop worker: each request
        as :func:`request_view` builds it, named by its hop id, in the read's order; only
        which ones are movable (this client's own hops) differs, and that does not enter the
        plan. A request of this client the read does not show (between hops, or its hop not
        yet at the server) is not planned here, as it is not in any other worker."""
        policy: PlannedMigration = self.policy
        await self._refresh_replicas()
        live = self._live()
        reads = await asyncio.gather(*(self.replicas[s].__ray_call__.remote(progress_on_server)
                                       for s in live), return_exceptions=True)
        progress = {s: r for s, r in zip(live, reads) if isinstance(r, ServerProgress)}
        mine = {hop.hop_id: request_id for request_id, hop in self._hop.items()}
        seen = {}
        for server_id, read in progress.items():
            for q in read.requests:
                seen[q.hop_id] = request_view(server_id, q, movable=q.hop_id in mine)
        self._seen = seen
        policy.capacities = {s: r.capacity for s, r in progress.items()}
        moves = policy.plan(list(progress), seen)
        self.stats.rounds = policy.rounds
        self.stats.planned = policy.planned
        ordered = []
        for m in moves:
            request_id = mine.get(m.request_id)
            view = seen.get(m.request_id)
            hop = self._hop.get(request_id) if request_id is not None else None
            if (hop is None or hop.hop_id != m.request_id or view.replica != m.source
                    or request_id in self._orders or request_id in self._requeue
                    or view.max_tokens - view.generated <= 1):
                continue
            self._orders[request_id] = MoveRecord(request_id, m.source, m.destination,
                                                  hop.tokens_before, view.generated)
            policy.started += 1
            self.stats.ordered += 1
            ordered.append(m)
            try:
                await self.replicas[m.source].__ray_call__.remote(_abort_on_server, hop.hop_id)
            except Exception as exc:  # noqa: BLE001 - the source died: its hop fails over by itself
                log.warning("ascend-rl migration: abort of %s at %s: %s", request_id, m.source, exc)
        return ordered

    def _start_watcher(self) -> None:
        if self.requeue_preempted and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.get_running_loop().create_task(self._watch_preemptions())

    async def _watch_preemptions(self) -> None:
        """The preemption hand-back's trigger: every ``preempt_poll_s`` while this client has
        hops in flight, one listing of the store's preemption marks (the replicas'
        ``MigrationKVConnector`` writes one for each hop its scheduler preempts); each of this
        client's hops marked is aborted at its replica, and ``_hops`` hands the request back
        to the router instead of leaving it in that replica's own queue."""
        while self._hop:
            await asyncio.sleep(self.preempt_poll_s)
            try:
                marked = self.store.preempted_keys()
            except OSError as exc:
                log.warning("ascend-rl migration: reading preemption marks: %s", exc)
                continue
            for request_id, hop in list(self._hop.items()):
                if (hop.export_key not in marked or request_id in self._requeue
                        or request_id in self._orders):
                    continue
                self._requeue[request_id] = hop.hop_id
                try:
                    await self.replicas[hop.replica].__ray_call__.remote(_abort_on_server, hop.hop_id)
                except Exception as exc:  # noqa: BLE001 - the replica died: the hop fails over
                    log.warning("ascend-rl migration: abort of preempted %s at %s: %s",
                                request_id, hop.replica, exc)

    async def _next_load(self, store: KVExportStore, export_key: str, replica: str,
                         load_key: str | None, load_source: str | None) -> tuple:
        """After a hop at ``replica`` ended aborted (a move or a hand-back): wait for its export
        and keep the fuller of it and ``load_key``. Returns the next hop's (load key, its
        source, whether the export appeared)."""
        found = await _wait_export(store, export_key, self.export_timeout_s,
                                   source_alive=lambda: self._alive(replica))
        load_key, load_source = _keep_fuller(store, load_key, load_source,
                                             export_key if found else None, replica)
        return load_key, load_source, found

    async def _requeue_at_router(self, request_id: str, held: list, prompt_ids: list,
                                 tokens: list) -> str | None:
        """Hand a preempted request back to the router and acquire it again: the replica the
        router binds it to (the next hop re-prefills there, or loads an export it holds), or
        None where the router does not hold it where ``held`` says (it stays there)."""
        if not await self._load_balancer.requeue_request.remote(request_id, held[0], len(tokens)):
            return None
        # the original prompt, as on the first acquire: the router keys the GRPO group by it
        # and already holds the generated tokens from requeue_request (it counts both against
        # the replica it binds to; prompt + tokens here would count the tokens twice and put
        # the request in a group of its own)
        server_id, _ = await self._acquire_server(request_id, prompt_ids=prompt_ids)
        held[0] = server_id
        if server_id not in self.replicas:
            await self._refresh_replicas()
        return server_id

    async def _hops(self, request_id: str, replica: str, prompt_ids: list, sampling_params: dict,
                    kwargs: dict, held: list):
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
        move_pending = False   # the last hop ended aborted for a move
        ran_on: str | None = None   # the replica the last hop ran on
        store = self.store
        planned = isinstance(self.policy, PlannedMigration)
        if planned:
            self._own.add(request_id)
            self._start_planner()
        while True:
            if replica in self.dead or replica not in self.replicas:
                replica = self._pick(prefer=load_source)
            if move_pending:
                # counted where the request really changes replica: with the destination dead
                # already, _pick may send it back where it ran, which is no move (and nothing
                # to tell the router)
                if replica != ran_on:
                    self.stats.moved += 1
                else:
                    self.stats.moves_undone += 1
            move_pending, ran_on = False, replica
            await self._tell_router(request_id, held, replica)
            server = self.replicas[replica]
            hop_id = hop_id_for(len(tokens))
            export_key = new_key()
            self._hop[request_id] = CurrentHop(hop_id, len(tokens), replica, export_key)
            self._start_watcher()
            if load_key is not None:
                self.stats.loads += 1
            hop_params = dict(sampling_params)
            hop_params["max_tokens"], min_tokens = hop_limits(
                budget, sampling_params.get("min_tokens"), len(tokens))
            if sampling_params.get("min_tokens") is not None:
                hop_params["min_tokens"] = min_tokens
            call = server.generate.remote(
                request_id=hop_id, prompt_ids=prompt_ids + tokens, sampling_params=hop_params,
                kv_transfer_params=MigrationParams(
                    export_key, load_key, mark_preempted=self.requeue_preempted).as_kv_transfer_params(),
                **kwargs)
            running = asyncio.ensure_future(_resolve(call))
            order: MoveRecord | None = None
            if planned:
                destination = None
            else:
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
                self._orders.pop(request_id, None)
                self._requeue.pop(request_id, None)
                if self.requeue_preempted:
                    store.clear_preempted(export_key)
                if await self._alive(replica):
                    if load_key is not None:
                        store.delete(load_key)
                    raise
                log.warning("ascend-rl migration: replica %s died during hop %s (%s); continuing "
                            "from %s", replica, hop_id, type(exc).__name__,
                            f"export {load_key}" if load_key else "a re-prefill")
                store.delete(export_key)
                replica = await self._after_death(request_id, held, prompt_ids, replica,
                                                  load_source if load_key else None)
                continue
            if planned:   # between hops nothing of the request runs: no plan may order it
                self._hop.pop(request_id, None)
                order = self._orders.pop(request_id, None)
                destination = order.destination if order is not None else None
            # the watcher aborted this very hop (not an earlier one that had ended meanwhile)
            handed_back = self._requeue.get(request_id) == hop_id
            if self.requeue_preempted:
                self._hop.pop(request_id, None)
                self._requeue.pop(request_id, None)
                store.clear_preempted(export_key)
            tokens += list(out.token_ids)
            if out.log_probs is not None:
                log_probs += list(out.log_probs)
            aborted = out.stop_reason in ("aborted", "abort")
            if aborted and handed_back and destination is None and len(tokens) < budget:
                # preempted at ``replica``: back to the router's queue, on where it binds it,
                # from the export the abort wrote (empty where it still waited: a re-prefill)
                self.stats.requeued += 1
                load_key, load_source, _ = await self._next_load(store, export_key, replica,
                                                                 load_key, load_source)
                bound = await self._requeue_at_router(request_id, held, prompt_ids, tokens)
                replica = bound if bound is not None else replica   # a hand-back, not a move
                continue
            if not (aborted and destination is not None) or len(tokens) >= budget:
                if aborted:   # aborted by verl (or late): the engine core may still hold it
                    cleanup = asyncio.ensure_future(_drop_when_written(
                        store, export_key, self.export_timeout_s, then=load_key))
                    self._cleanups.add(cleanup)   # held until done: no task lost, none kept
                    cleanup.add_done_callback(self._cleanups.discard)
                elif load_key is not None:   # it ran to the end at the destination: loaded
                    store.delete(load_key)
                store.delete(export_key)
                out.token_ids, out.log_probs = tokens, (log_probs if out.log_probs is not None else None)
                if aborted and len(tokens) >= budget:
                    out.stop_reason = "completed"
                self.stats.finished += 1
                return out
            moves += 1
            move_pending = True
            load_key, load_source, found = await self._next_load(store, export_key, replica,
                                                                 load_key, load_source)
            if order is not None:
                order.generated_at_abort, order.export_found = len(tokens), found
                self.stats.moves.append(order)
            replica = destination


async def _resolve(ref) -> Any:
    return await ref


async def _drop_when_written(store: KVExportStore, key: str, timeout_s: float,
                             then: str | None = None) -> None:
    """Delete the export ``key`` of an aborted hop once it is written, and then ``then``
    (the export that hop loaded): the engine core has finished the hop by the time it writes
    ``key``, so nothing loads ``then`` any more."""
    deadline = time.monotonic() + timeout_s
    # complete first (every TP/PP rank's part: deleting as soon as any part shows would
    # race the ranks still writing), then gone; at the deadline whatever parts came
    while time.monotonic() < deadline and not store.exists(key):
        await asyncio.sleep(0.05)
    store.delete(key)
    if then is not None:
        store.delete(then)


def _keep_fuller(store: KVExportStore, old: str | None, old_source: str | None,
                 new: str | None, new_source: str) -> tuple:
    """After a moved hop's export ``new`` appeared (None: it did not), the export the next hop
    loads: the one covering more tokens, the other deleted.

    A hop is aborted in vLLM's front end, which returns it at once; its engine core may still
    be about to load ``old`` (scheduled in a step that has not run yet). ``old`` is dropped only
    after ``new`` appeared: the engine core writes ``new`` after that step, so no load of
    ``old`` is pending then. (Dropped on the hop's return instead, such a load found no
    export, and vLLM 0.23 kept the aborted request's computed-token count: the next export
    named tokens whose KV was never loaded, and the request went on from garbage KV.) ``new``
    covers fewer tokens where the hop never ran (an empty export: it waited in the queue)."""
    if new is None:
        return old, old_source
    if old is None:
        return new, new_source
    new_header, old_header = store.header(new), store.header(old)
    if old_header is not None and (new_header is None or len(old_header.tokens) > len(new_header.tokens)):
        store.delete(new)
        return old, old_source
    store.delete(old)
    return new, new_source


# while an export is awaited, how often the source's engine is asked whether it died (an
# export appears within milliseconds on a live one: a dead one would hold the request for the
# whole timeout)
SOURCE_CHECK_S = 0.5


async def _wait_export(store: KVExportStore, key: str, timeout_s: float,
                       source_alive: Callable[[], Awaitable[bool]] | None = None) -> bool:
    """Wait for the aborted hop's export; False on timeout or as soon as ``source_alive`` says
    its engine died (the destination re-prefills, or resumes from the export loaded before)."""
    deadline = time.monotonic() + timeout_s
    next_check = time.monotonic() + SOURCE_CHECK_S
    while time.monotonic() < deadline:
        if store.exists(key):
            return True
        if source_alive is not None and time.monotonic() >= next_check:
            if not await source_alive():
                log.warning("ascend-rl migration: export %s: its engine died before writing it",
                            key)
                return False
            next_check = time.monotonic() + SOURCE_CHECK_S
        await asyncio.sleep(0.005)
    log.warning("ascend-rl migration: export %s did not appear within %.0f s; the destination "
                "re-prefills", key, timeout_s)
    return False
