"""The client half of tail migration between independent vLLM replicas: exactly-once bookkeeping.

One :class:`MigratingClient` owns each request from submission to its final output, and the
request runs on at most one replica at any time. A move (see :mod:`.kv_migration` for the
engine half) is:

1. abort the current hop at the source; its connector exports the KV under the hop's
   ``export_key`` (the source keeps nothing running; the export is the request's state);
2. wait until the export is complete in the store (or a timeout: then the destination
   re-prefills);
3. submit the next hop at the destination: prompt + every token received so far,
   ``max_tokens`` / ``min_tokens`` reduced, ``load_key`` = that export;
4. the destination's first output is its acknowledgement: only then is the export deleted.

If a hop's replica dies (vLLM's ``errored``) the request continues from what the client holds:
before the acknowledgement from the same export, on the export's source if alive ("resumes at
source"), else on any live replica; after it, by re-prefill of prompt + received tokens on a
live replica. Any other error of a hop (the request's own: bad input) is raised as it would be
unmoved, after the hop is aborted. Tokens and log-probs of the hops are concatenated; a token the source computed
but the client never received (cut off by the abort) is computed again at the destination.

What cannot move exactly: ``n > 1`` (one parent, many children), seeded random sampling (the
destination would restart the seed's generator), presence/frequency penalties (they count
output tokens only, which the destination sees as prompt), stop strings and bad words (a
string spanning the boundary), structured outputs (the grammar would restart), prompt
truncation (each hop's prompt is longer). :func:`check_migratable` refuses those by name; such
requests run unmoved. ``max_tokens`` and ``min_tokens`` are reduced per hop (:func:`hop_limits`,
which verl's client shares).

Engines are vLLM ``AsyncLLM``-like objects: ``generate(prompt, sampling_params, request_id)``
(an async iterator of ``RequestOutput``), ``abort(request_id)``, ``errored``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from . import tail_policy
from .exports import KVExportStore, new_key
from .kv_migration import MigrationParams

log = logging.getLogger("ascend_rl_plugins")


class Engine(Protocol):
    def generate(self, prompt: Any, sampling_params: Any, request_id: str): ...
    async def abort(self, request_id: str) -> None: ...
    @property
    def errored(self) -> bool: ...


@dataclass
class Progress:
    """What a migration policy sees after each output of a request."""

    request_id: str
    replica: str
    hop: int
    generated: int        # tokens received in all hops
    remaining: int        # tokens still allowed (max_tokens - generated)
    live_replicas: list


@dataclass
class InFlight:
    """One request the client owns right now, as a planner needs it (kept current per output)."""

    request_id: str
    replica: str          # where its current hop runs
    prompt_tokens: int    # the request's own prompt
    generated: int        # tokens received in all hops
    max_tokens: int
    movable: bool         # this client may move it (False: check_migratable refused it)
    # no client can move it (refused, or a hop no migrating client submitted): every planner
    # sees it as pinned load (a request another client may move is not movable here, not pinned)
    pinned: bool = False


@dataclass
class Hop:
    """One stretch of a request on one replica."""

    replica: str
    request_id: str       # the id this hop had at the replica
    loaded_from: str | None   # export key it was told to load (None: prefill)
    prompt_tokens: int = 0    # the hop's prompt: the request's prompt + tokens received before
    tokens: int = 0       # tokens received from this hop
    cached_tokens: int | None = None   # prompt tokens vLLM did not compute (prefix cache + KV load)
    outcome: str = "running"  # finished | moved | failed
    export_found: bool | None = None   # moved: did the source's export appear in time
    error: str | None = None


@dataclass
class MigratedOutput:
    request_id: str
    prompt_token_ids: list
    token_ids: list
    logprobs: list
    finish_reason: str | None
    hops: list

    @property
    def moves(self) -> int:
        return sum(h.outcome == "moved" for h in self.hops)


@dataclass
class ForcedMigration:
    """A policy that moves every request after ``after_tokens`` tokens of a hop to the next
    live replica (in registration order), at most ``max_moves`` times per request: migration
    "forced on", for tests and for measuring the mechanism."""

    after_tokens: int
    max_moves: int = 1
    _moves: Counter = field(default_factory=Counter)

    def __call__(self, p: Progress) -> str | None:
        if self._moves[p.request_id] >= self.max_moves or p.remaining <= 1:
            return None
        if p.generated < self.after_tokens * (self._moves[p.request_id] + 1):
            return None
        others = [r for r in p.live_replicas if r != p.replica]
        if not others:
            return None
        order = p.live_replicas
        self._moves[p.request_id] += 1
        return others[0] if p.replica not in order else \
            next(r for r in order[order.index(p.replica) + 1:] + order if r != p.replica)


@dataclass(frozen=True)
class ReplicaCapacity:
    """What a replica can hold: sequences in flight and KV tokens."""

    slots: int
    kv_tokens: int


def replica_capacity(engine) -> ReplicaCapacity:
    """An ``AsyncLLM``'s capacity from its own config: ``max_num_seqs``, and its KV cache
    (``num_gpu_blocks`` x ``block_size``; vLLM's core client writes the engine cores' block
    count into the front end's config at start-up)."""
    config = getattr(engine, "vllm_config", None)
    blocks = getattr(getattr(config, "cache_config", None), "num_gpu_blocks", None)
    if config is None or not blocks:
        raise ValueError(f"{type(engine).__name__}: no vllm_config.cache_config.num_gpu_blocks to "
                         f"read its KV capacity from; give PlannedMigration capacities="
                         f"{{replica: ReplicaCapacity(slots, kv_tokens)}}")
    return ReplicaCapacity(int(config.scheduler_config.max_num_seqs),
                           int(blocks) * int(config.cache_config.block_size))


@dataclass
class PlannedMigration:
    """The live trigger: every ``interval_s`` seconds, ``tail_policy.plan_moves`` on what the
    client knows (per replica: its in-flight requests with prompt and generated tokens, its
    slots and KV capacity; per request an expected length, by default its ``max_tokens``), and
    each planned running-request move is made at the request's next output, if it is still on
    the move's source then (a plan is replaced by the next one). A plan runs inside some
    request's output callback: no timer task, nothing runs while nothing is generated.

    What the client cannot do: move a queued request (vLLM does not tell the client which of
    its requests wait; one with no output yet counts as running); 'prefill' moves go the same
    way as 'kv' ones (the source exports its KV; a re-prefill happens only if the export
    does not appear). A planned move of a request ``check_migratable`` refused is skipped.
    ``step`` / ``transfer`` default to the simulator's uncalibrated figures
    (``tail_policy.UNCALIBRATED_STEP`` / ``UNCALIBRATED_TRANSFER``)."""

    interval_s: float
    step: tail_policy.StepCostModel | None = None
    transfer: tail_policy.TransferCostModel | None = None
    settings: tail_policy.TailSettings | None = None
    capacities: dict | None = None        # replica -> ReplicaCapacity; None: read from engines
    expected_tokens: Callable[[InFlight], float] | None = None
    clock: Callable[[], float] = time.monotonic
    rounds: int = 0            # plans made
    planned: int = 0           # running-request moves planned (all rounds)
    started: int = 0           # of those, moves handed to the client
    skipped_unmovable: int = 0
    _client: Any = None
    _pending: dict = field(default_factory=dict)   # request id -> tail_policy.Move
    _last: float | None = None

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"PlannedMigration: interval_s must be > 0, got {self.interval_s!r}")
        self.step = self.step or tail_policy.UNCALIBRATED_STEP
        self.transfer = self.transfer or tail_policy.UNCALIBRATED_TRANSFER

    def attach(self, client: "MigratingClient") -> None:
        self._client = client
        if self.capacities is None:
            self.capacities = {name: replica_capacity(engine)
                               for name, engine in client.replicas.items()}
        missing = sorted(set(client.replicas) - set(self.capacities))
        if missing:
            raise ValueError(f"PlannedMigration: capacities has no entry for replicas {missing}")

    def views(self, live: list, in_flight: dict) -> list:
        """The planner's input from the in-flight requests (live replicas only)."""
        expected = self.expected_tokens or (lambda r: float(r.max_tokens))
        views = {name: tail_policy.ReplicaView(name, self.capacities[name].kv_tokens,
                                               self.capacities[name].slots) for name in live}
        for r in list(in_flight.values()):
            if r.replica in views:
                views[r.replica].running.append(tail_policy.RequestView(
                    r.request_id, r.prompt_tokens, r.generated, expected(r), movable=not r.pinned))
        return list(views.values())

    def plan(self, live: list, in_flight: dict | None = None) -> list:
        """One plan over ``in_flight`` (request id -> :class:`InFlight`; None: the attached
        client's), on the live replicas ``live``; the moves are also kept for ``__call__``.
        A client that reads the replicas itself (verl's: ``verl_client``) passes what it read,
        and ``capacities`` with it, and needs no :meth:`attach`."""
        if in_flight is None:
            if self._client is None:
                raise RuntimeError("PlannedMigration.plan: no in_flight given and no client attached")
            in_flight = self._client.in_flight
        longest = max((r.max_tokens for r in in_flight.values()), default=0)
        moves = [m for m in tail_policy.plan_moves(self.views(live, in_flight), self.step, self.transfer,
                                                   longest, self.settings)
                 if m.method != "queued"]
        self.rounds += 1
        self.planned += len(moves)
        self._pending = {}
        for m in moves:
            if in_flight.get(m.request_id) is not None and not in_flight[m.request_id].movable:
                self.skipped_unmovable += 1
            else:
                self._pending[m.request_id] = m
        if moves:
            log.info("ascend-rl migration: plan %d: %s", self.rounds,
                     ", ".join(f"{m.request_id} {m.source}->{m.destination} ({m.method})"
                               for m in moves))
        return moves

    def __call__(self, p: Progress) -> str | None:
        if self._client is None:
            raise RuntimeError("PlannedMigration: not attached to a MigratingClient")
        now = self.clock()
        if self._last is None or now - self._last >= self.interval_s:
            self._last = now
            self.plan(p.live_replicas)
        move = self._pending.get(p.request_id)
        if move is None or move.source != p.replica or p.remaining <= 1:
            return None
        del self._pending[p.request_id]
        if move.destination not in p.live_replicas:
            return None
        self.started += 1
        return move.destination


def step_model_from_text(text: str, name: str = "ASCEND_RL_ROLLOUT_MIGRATION_STEP_MS"
                         ) -> tail_policy.StepCostModel:
    """``"batch:ms,batch:ms,..."`` (a replica's decode step time by batch size, no graph
    padding, no attention term) as a step model; empty: the uncalibrated default. A bad value
    raises ValueError naming ``name`` and the accepted form."""
    if not text.strip():
        return tail_policy.UNCALIBRATED_STEP
    try:
        pairs = tuple((int(b), float(ms)) for b, ms in
                      (item.split(":") for item in text.split(",") if item.strip()))
        return tail_policy.StepCostModel(pairs, attention_ms_per_token=0.0)
    except ValueError as exc:
        raise ValueError(f"{name}={text!r}: accepted comma-separated batch:milliseconds pairs in "
                         f"ascending batch order, e.g. '1:10,8:80' (empty: the uncalibrated "
                         f"default), {exc}") from None


def policy_from_flags(rollout_migration: str | None = None, interval_s: float | None = None):
    """The policy ``ASCEND_RL_ROLLOUT_MIGRATION`` (off | planned) selects, with its interval,
    step model and margin flags."""
    from . import MIGRATION, MIGRATION_INTERVAL, MIGRATION_MARGIN, MIGRATION_STEP_MS
    choice = MIGRATION.value if rollout_migration is None else rollout_migration
    if choice == "off":
        return None
    if choice == "planned":
        return PlannedMigration(MIGRATION_INTERVAL.value if interval_s is None else interval_s,
                                step=step_model_from_text(MIGRATION_STEP_MS.value),
                                settings=tail_policy.TailSettings(margin_s=MIGRATION_MARGIN.value))
    raise ValueError(f"ASCEND_RL_ROLLOUT_MIGRATION={choice!r}: accepted off, planned")


FROM_FLAGS = "flags"


def hop_limits(max_tokens: int, min_tokens: int | None, received: int) -> tuple[int, int]:
    """The next hop's ``(max_tokens, min_tokens)`` once the request has received ``received``
    tokens in earlier hops: both limits count the request's output, and the next hop's output
    starts after those tokens (its prompt holds them). ``min_tokens`` never goes below 0: with
    it unreduced, every hop suppressed EOS (and the stop tokens) anew, and a hop whose
    remaining budget fell below it was refused by vLLM (min_tokens > max_tokens)."""
    return max_tokens - received, max(0, (min_tokens or 0) - received)


# vLLM's SamplingParams defaults, for parameters given as a dict that leaves them out (verl's)
_VLLM_DEFAULTS = {"n": 1, "temperature": 1.0}


def check_migratable(params) -> None:
    """Raise ValueError naming the sampling parameter that a move would change (``params``:
    vLLM's ``SamplingParams``, or any object with its attribute names; one left out has
    vLLM's default). ``max_tokens`` and ``min_tokens`` move: each hop gets them reduced
    (:func:`hop_limits`); so do the per-step ones (temperature, top-p/k, min-p, repetition
    penalty, which counts prompt and output alike, logit bias, allowed and stop token ids)."""
    def given(name):
        return getattr(params, name, _VLLM_DEFAULTS.get(name))

    if given("n") != 1:
        raise ValueError(f"n={given('n')}: only n=1 requests move (verl submits n=1 per sample)")
    if given("seed") is not None and (given("temperature") or 0.0) > 0:
        raise ValueError("seed: a seeded random request would restart its generator at the "
                         "destination; use seed=None or temperature=0")
    for name in ("presence_penalty", "frequency_penalty"):
        if given(name):
            raise ValueError(f"{name}: it counts output tokens only, which the destination sees "
                             f"as prompt; use 0")
    if given("stop"):
        raise ValueError("stop: a stop string may span the move; stop on token ids "
                         "(stop_token_ids) instead")
    if given("bad_words"):
        raise ValueError("bad_words: vLLM matches them against output tokens only, so a word of "
                         "several tokens may span the move unblocked; leave bad_words unset")
    for name in ("structured_outputs", "guided_decoding"):
        if given(name) is not None:
            raise ValueError(f"{name}: the grammar's state covers the output so far, which the "
                             f"destination would restart from its start; leave {name} unset")
    if given("truncate_prompt_tokens") is not None:
        raise ValueError("truncate_prompt_tokens: each hop's prompt holds the tokens received "
                         "before it, so it would be truncated differently; leave it unset")


class NoLiveReplica(RuntimeError):
    pass


class MigratingClient:
    """Runs requests on a set of replicas, moving them when ``policy`` says so.

    ``finished_on`` counts final outputs per replica (what exactly-once is checked on);
    ``in_flight`` holds every request between its submission and its end (what a planning
    policy reads). ``policy``: a callable, None (no moves), or ``FROM_FLAGS`` (the default:
    :func:`policy_from_flags`). A policy with an ``attach`` method is given the client."""

    def __init__(self, replicas: dict, store: KVExportStore, *,
                 policy: Callable[[Progress], str | None] | None | str = FROM_FLAGS,
                 export_timeout_s: float = 30.0):
        if not replicas:
            raise ValueError("replicas: need at least one")
        if export_timeout_s <= 0:
            raise ValueError(f"export_timeout_s must be > 0, got {export_timeout_s}")
        self.replicas = dict(replicas)
        self.store = store
        if policy == FROM_FLAGS:
            policy = policy_from_flags()
        self.policy = policy
        self.export_timeout_s = export_timeout_s
        self.dead: set[str] = set()
        self.finished_on: Counter = Counter()
        self.in_flight: dict[str, InFlight] = {}
        if hasattr(policy, "attach"):
            policy.attach(self)

    def live(self) -> list:
        return [name for name, engine in self.replicas.items()
                if name not in self.dead and not getattr(engine, "errored", False)]

    async def generate(self, request_id: str, prompt_token_ids: list, params, replica: str
                       ) -> MigratedOutput:
        if request_id in self.in_flight:
            raise ValueError(f"request_id {request_id!r} is already in flight on this client")
        try:
            return await self._generate(request_id, prompt_token_ids, params, replica)
        finally:
            self.in_flight.pop(request_id, None)

    async def _generate(self, request_id: str, prompt_token_ids: list, params, replica: str
                        ) -> MigratedOutput:
        from vllm.sampling_params import RequestOutputKind
        movable = True
        if self.policy is not None:
            try:
                check_migratable(params)
            except ValueError as exc:
                log.info("ascend-rl migration: %s stays where it starts: %s", request_id, exc)
                movable = False
        tokens: list = []
        logprobs: list = []
        hops: list[Hop] = []
        load_key: str | None = None      # the export the next hop loads (None: prefill)
        load_source: str | None = None   # the replica that wrote it
        max_tokens = params.max_tokens
        record = self.in_flight[request_id] = InFlight(request_id, replica, len(prompt_token_ids),
                                                       0, max_tokens, movable, pinned=not movable)
        while True:
            if replica not in self.live():
                replica = self._pick(prefer=load_source)
            record.replica = replica
            hop = Hop(replica, f"{request_id}.{len(hops)}", load_key,
                      prompt_tokens=len(prompt_token_ids) + len(tokens))
            hops.append(hop)
            export_key = new_key() if movable and self.policy is not None else None
            hop_params = params.clone()
            hop_params.max_tokens, hop_params.min_tokens = hop_limits(max_tokens, params.min_tokens,
                                                                      len(tokens))
            hop_params.output_kind = RequestOutputKind.DELTA
            hop_params.extra_args = dict(params.extra_args or {}, kv_transfer_params=MigrationParams(
                export_key=export_key, load_key=load_key).as_kv_transfer_params())
            engine = self.replicas[replica]
            destination = None
            stream = engine.generate({"prompt_token_ids": list(prompt_token_ids) + tokens},
                                     hop_params, hop.request_id)
            try:
                async for out in stream:
                    completion = out.outputs[0]
                    if hop.cached_tokens is None:
                        hop.cached_tokens = getattr(out, "num_cached_tokens", None)
                    new = list(completion.token_ids)
                    tokens += new
                    hop.tokens += len(new)
                    record.generated = len(tokens)
                    if completion.logprobs is not None:
                        logprobs += [lp[t].logprob for t, lp in zip(new, completion.logprobs)]
                    if load_key is not None:   # the destination answered: it holds the request
                        self.store.delete(load_key)
                        load_key = load_source = None
                    if out.finished:
                        hop.outcome = "finished"
                        self.finished_on[replica] += 1
                        return MigratedOutput(request_id, list(prompt_token_ids), tokens, logprobs,
                                              completion.finish_reason, hops)
                    if export_key is not None:
                        destination = self.policy(Progress(
                            request_id, replica, len(hops) - 1, len(tokens),
                            max_tokens - len(tokens), self.live()))
                        if destination is not None:
                            break
                else:
                    raise RuntimeError(f"{replica} closed the stream of {hop.request_id} unfinished")
            except Exception as exc:  # noqa: BLE001 - decided below: replica death or not
                hop.outcome, hop.error = "failed", f"{type(exc).__name__}: {exc}"
                await self._stop(engine, hop.request_id, stream)
                if not getattr(engine, "errored", False):
                    # the request itself failed (bad input, ...): as it would unmoved; nothing
                    # of it runs anywhere now, and its export is not needed any more
                    if load_key is not None:
                        self.store.delete(load_key)
                    raise
                self.dead.add(replica)
                log.warning("ascend-rl migration: replica %s died during hop %s; continuing %s "
                            "from %s", replica, hop.request_id, request_id,
                            f"export {load_key}" if load_key else "a re-prefill")
                replica = self._pick(prefer=load_source) if load_key else self._pick(exclude=replica)
                continue
            # move: stop here with the KV exported, then go on at the destination
            await self._stop(engine, hop.request_id, stream)
            hop.outcome = "moved"
            hop.export_found = await self._wait_export(export_key, engine)
            if hop.export_found:
                load_key, load_source = export_key, replica
            replica = destination

    def _pick(self, prefer: str | None = None, exclude: str | None = None) -> str:
        live = self.live()
        if prefer in live:
            return prefer
        candidates = [r for r in live if r != exclude] or live
        if not candidates:
            raise NoLiveReplica("ascend-rl migration: no live replica left "
                                f"(dead: {sorted(self.dead)})")
        return candidates[0]

    @staticmethod
    async def _stop(engine, hop_id: str, stream) -> None:
        """End a hop at its replica: close our stream (vLLM aborts the request when its
        stream closes) and abort it by id as well (a no-op where it already finished or is
        gone); a dead engine's calls may raise, and nothing runs there any more."""
        for step in (stream.aclose, lambda: engine.abort(hop_id)):
            try:
                await step()
            except Exception:  # noqa: BLE001
                pass

    async def _wait_export(self, key: str, engine) -> bool:
        """Wait until the source's export of an aborted hop is complete (False: it did not
        appear in time, or the source died first)."""
        deadline = time.monotonic() + self.export_timeout_s
        while time.monotonic() < deadline:
            if self.store.exists(key):
                return True
            if getattr(engine, "errored", False):
                return False
            await asyncio.sleep(0.005)
        log.warning("ascend-rl migration: export %s did not appear within %.0f s; the destination "
                    "re-prefills", key, self.export_timeout_s)
        return False
