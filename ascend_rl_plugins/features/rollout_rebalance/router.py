"""verl 0.9 router plug-in: expected-work, KV-aware, late-binding routing of rollout requests.

Loaded by verl itself, no patch: ``actor_rollout_ref.rollout.router_config_path`` names a YAML
whose ``router_class`` verl imports (``verl.workers.rollout.router._create_plugin_extension``)
and starts as a Ray actor with ``(servers, yaml_config)``; verl's ``LLMServerClient`` then calls
``require_acquire_fields`` / ``require_release_fields`` once, ``acquire_server(request_id=...,
prompt_ids=...)`` before and ``release_server(server_id=..., request_id=...)`` after each
generate; trainers call ``add_servers`` / ``remove_servers`` / ``clear_sticky_cache`` /
``get_total_inflight``. ``router.yaml`` next to this module is that YAML (``ascend-rl router``
prints the line to add). The decisions are :mod:`.routing`'s; this module is the verl-facing
shell: Ray actor, server reads, waiting callers.

``acquire_server`` may wait: a request is bound to a replica only when one has room
(:mod:`.routing`, late binding), so the class is exposed as a Ray actor class with a high
``max_concurrency`` (:data:`ExpectedWorkRouterActor`): an async actor runs at most that many
calls at once, and the waiting acquires must never keep a ``release_server`` out.

What it reads from the servers, and why there:
* ``get_rollout_config()`` of the first server actor (verl's getter "for external routers"):
  ``full_determinism`` (verl does not forward it to plug-in routers, and under it the server
  seeds each request by replica, so routing must not depend on timing), ``max_num_seqs``
  (slots), ``response_length`` (the longest response), ``disable_log_stats``;
* vLLM's Prometheus ``/metrics`` on the server address verl uses as the server id (the
  official interface for engine state; there is no RPC for it on verl's server actor):
  ``vllm:cache_config_info`` (``num_gpu_blocks`` x ``block_size`` per engine: KV capacity),
  ``vllm:kv_cache_usage_perc`` (per engine: KV in use) and ``vllm:request_generation_tokens``
  (sum / count: mean generated tokens per request). vLLM updates them only with stats
  logging on, i.e. ``actor_rollout_ref.rollout.disable_log_stats=False`` (verl's default is
  True); without them (``ASCEND_RL_ROUTER_LOAD=requests``, or ``auto`` with stats off, said
  once in the log) a replica's room is its slots only.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from . import routing

log = logging.getLogger("ascend_rl_plugins")

# YAML key -> flag name: each key may be set in the YAML verl loads, else the flag's value
# (environment, validated when the plugin loads), else the flag's default
SETTING_FLAGS = {
    "siblings": "ASCEND_RL_ROUTER_SIBLINGS",
    "order": "ASCEND_RL_ROUTER_ORDER",
    "kv_budget": "ASCEND_RL_ROUTER_KV_BUDGET",
    "kv_reserve": "ASCEND_RL_ROUTER_KV_RESERVE",
    "slots": "ASCEND_RL_ROUTER_SLOTS",
    "load": "ASCEND_RL_ROUTER_LOAD",
    "metrics_interval_s": "ASCEND_RL_ROUTER_METRICS_INTERVAL",
}
MAX_CONCURRENCY = 1_000_000  # waiting acquires + releases + status calls the actor runs at once
# a cancel that found nothing of its request is kept this long, and at most this many such
EARLY_CANCEL_KEEP_S = 600.0
EARLY_CANCEL_KEPT = 65536


class AcquireCancelled(RuntimeError):
    """The acquire's request was cancelled by its client before the acquire reached the router
    (its caller is gone: nobody reads this but Ray's log)."""


@dataclass(frozen=True)
class ShellSettings:
    """The router's settings: the routing decisions' and where load comes from."""

    routing: routing.RouterSettings
    load: str  # auto | metrics | requests
    metrics_interval_s: float


def settings_from(config: dict | None, *, deterministic: bool = False) -> ShellSettings:
    """Settings from the YAML dict verl hands the constructor, then the flags. A key that is
    not a setting, or a bad value, raises naming the key and what is accepted."""
    from ... import flags
    from . import ROUTER_FLAGS  # noqa: F401  (the flags are declared with the feature)
    config = dict(config or {})
    config.pop("router_class", None)
    unknown = sorted(set(config) - set(SETTING_FLAGS))
    if unknown:
        raise ValueError(f"router YAML key(s) {', '.join(map(repr, unknown))} unknown to "
                         f"{__name__}.ExpectedWorkRouter; accepted keys: router_class, "
                         f"{', '.join(SETTING_FLAGS)}")
    values = {}
    for key, name in SETTING_FLAGS.items():
        flag = flags.get(name)
        if key in config:
            values[key] = flag.parse(str(config[key]), source=f"router YAML key {key!r} ({name})")
        else:
            values[key] = flag.value
    return ShellSettings(
        routing.RouterSettings(siblings=values["siblings"], order=values["order"],
                               kv_budget=float(values["kv_budget"]),
                               kv_reserve=int(values["kv_reserve"]), slots=int(values["slots"]),
                               deterministic=deterministic),
        values["load"], float(values["metrics_interval_s"]))


def prompt_key(prompt_ids) -> str:
    """The GRPO group of a request: siblings (and the same prompt in later steps) share it."""
    if prompt_ids is None:
        return ""
    data = array("q", map(int, prompt_ids)).tobytes()
    return hashlib.blake2b(data, digest_size=12).hexdigest()


# -- vLLM's /metrics ------------------------------------------------------------------------

@dataclass(frozen=True)
class ServerMetrics:
    """One server's KV cache and generated-length statistics, summed over its engines."""

    kv_capacity_tokens: int
    kv_used_tokens: int
    generation_tokens_sum: float
    generation_requests: float


def parse_metrics(text: str) -> ServerMetrics | None:
    """Read vLLM's Prometheus exposition; None if it has no KV cache information (stats off)."""
    from prometheus_client.parser import text_string_to_metric_families
    blocks: dict[str, float] = {}
    usage: dict[str, float] = {}
    gen_sum = gen_count = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            engine = sample.labels.get("engine", "")
            if sample.name == "vllm:cache_config_info":
                try:
                    blocks[engine] = (float(sample.labels["num_gpu_blocks"])
                                      * float(sample.labels["block_size"]))
                except (KeyError, ValueError):
                    continue
            elif sample.name == "vllm:kv_cache_usage_perc":
                usage[engine] = float(sample.value)
            elif sample.name == "vllm:request_generation_tokens_sum":
                gen_sum += float(sample.value)
            elif sample.name == "vllm:request_generation_tokens_count":
                gen_count += float(sample.value)
    if not blocks:
        return None
    capacity = sum(blocks.values())
    used = sum(blocks.get(e, 0.0) * u for e, u in usage.items())
    return ServerMetrics(int(capacity), int(used), gen_sum, gen_count)


def _fetch(url: str, timeout: float) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (the server's own address)
        return response.read().decode()


# -- the router ------------------------------------------------------------------------------

class ExpectedWorkRouter:
    """verl's ``RequestLoadBalancer`` protocol over :class:`routing.RoutingPolicy`.

    verl constructs it as ``ray.remote(cls).remote(servers, yaml_config)``; use
    :data:`ExpectedWorkRouterActor` in the YAML (this class with a high ``max_concurrency``)."""

    def __init__(self, servers: dict[str, Any], config: dict | None = None):
        self._config = dict(config or {})
        self._shell = settings_from(self._config)  # validates now, when verl builds the router
        self._handles: dict[str, Any] = {}
        self._policy = routing.RoutingPolicy(self._shell.routing)
        self._waiting: dict[str, asyncio.Future] = {}
        # requests a replica's death put back in the queue, whose callers have not asked again
        # yet: request id -> the replica they were bound to since (None: still queued)
        self._displaced: dict[str, str | None] = {}
        # cancels that found nothing of their request (its acquire had not reached the router:
        # Ray does not order an async actor's calls, and the first acquire waits on
        # ``_configure``): request id -> when; the acquire that arrives later ends at once
        self._cancelled_early: OrderedDict[str, float] = OrderedDict()
        self._configured = False
        self._configuring: asyncio.Lock | None = None
        self._poller: asyncio.Task | None = None
        self._use_metrics = False
        self._slots = 0
        self._generation: dict[str, tuple[float, float]] = {}  # server -> (tokens, requests)
        self.add_servers(servers)

    # -- verl's protocol -------------------------------------------------------------------
    def require_acquire_fields(self) -> list[str]:
        return ["prompt_ids"]

    def require_release_fields(self) -> list[str]:
        return ["request_id"]

    async def acquire_server(self, request_id: str, prompt_ids=None, **extra) -> tuple[str, Any]:
        await self._configure()
        if self._cancelled_early.pop(request_id, None) is not None:
            raise AcquireCancelled(f"request {request_id!r} was cancelled by its client before its "
                                   "acquire reached the router; it takes no slot")
        rebound = self._displaced.pop(request_id, None)
        if rebound is not None:  # its replica died; the router re-bound it before it asked again
            return rebound, self._handles[rebound]
        now = time.monotonic()
        bound = self._policy.submit(request_id, len(prompt_ids) if prompt_ids is not None else 0,
                                    prompt_key(prompt_ids), now)
        mine = self._hand_out(bound, request_id)
        if mine is not None:
            return mine, self._handles[mine]
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        try:
            server_id = await future
        except asyncio.CancelledError:
            # the caller gave up while waiting, or as the router answered: nothing of the
            # request may stay (no queue entry, no slot nobody would release)
            self._waiting.pop(request_id, None)
            self._drop_request(request_id)
            raise
        return server_id, self._handles[server_id]

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        now = time.monotonic()
        self._displaced.pop(request_id, None)
        waiting = self._waiting.pop(request_id, None)
        if waiting is not None and not waiting.done():   # its caller gave up while it waited
            waiting.cancel()                               # again (a hand-back, a death)
        self._policy.release(server_id, request_id, now)
        self._hand_out(self._policy.dispatch(now))

    def cancel_request(self, request_id: str) -> None:
        """Not verl's protocol (``MigratingLLMServerClient`` calls it): the caller's
        ``generate`` was cancelled before it held a replica. Cancelling the caller's Ray call
        does not cancel the acquire waiting here, so the client says so: the acquire ends and
        the request leaves the queue, or, bound already, its slot; a cancel that comes before
        its acquire is kept, and that acquire ends at once (:class:`AcquireCancelled`)."""
        future = self._waiting.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()
        if not self._drop_request(request_id) and future is None:
            self._remember_early_cancel(request_id)   # its acquire has not come yet

    def add_servers(self, servers: dict[str, Any]) -> None:
        for server_id, handle in servers.items():
            self._handles[server_id] = handle
            self._policy.add_replica(server_id, self._slots or 1)
        if servers and self._configured:
            self._hand_out(self._policy.dispatch(time.monotonic()))

    def remove_servers(self, server_ids: list[str]) -> None:
        """The replicas leave (verl removed them, or ``server_died``): they take no new work,
        and their bound requests go back to the head of the queue, bound again as room comes
        (a caller whose hop there failed acquires again and gets its new replica); verl's
        ``add_servers`` brings a replica back."""
        for server_id in server_ids:
            self._handles.pop(server_id, None)
            for request_id in self._policy.remove_replica(server_id):
                if request_id not in self._waiting:
                    self._displaced[request_id] = None
        if self._configured and self._policy.replicas:
            self._hand_out(self._policy.dispatch(time.monotonic()))

    def server_died(self, server_id: str) -> None:
        """Not verl's protocol (``MigratingLLMServerClient`` calls it when a replica's engine
        has died): it leaves the router's books as ``remove_servers`` says, instead of looking
        idle and taking every queued request."""
        self.remove_servers([server_id])

    # -- tail migration (not verl's protocol: MigratingLLMServerClient calls these) ----------
    def get_server_handles(self) -> dict[str, Any]:
        """Server id -> server actor handle: the replicas a migrating client may move to."""
        return dict(self._handles)

    def move_request(self, request_id: str, source: str, destination: str) -> bool:
        """A migrating client moved ``request_id``: its load follows it (the source gets room,
        the queue is dispatched); the client releases it on ``destination``."""
        moved = self._policy.move(request_id, source, destination)
        if not moved and request_id in self._displaced:
            # ``source`` died and the router put the request back in its queue (or bound it
            # again, for its caller to collect), but its client has moved it to
            # ``destination`` meanwhile: counted there from now on
            rebound = self._displaced[request_id]
            moved = (self._policy.place(request_id, destination, time.monotonic()) if rebound is None
                     else rebound == destination
                     or self._policy.move(request_id, rebound, destination))
            if moved:
                del self._displaced[request_id]
        if moved:
            self._hand_out(self._policy.dispatch(time.monotonic()))
        return moved

    def requeue_request(self, request_id: str, server_id: str, generated_tokens: int) -> bool:
        """A migrating client hands back a request ``server_id`` preempted (the preemption
        hand-back, ``routing.RoutingPolicy.requeue``): it leaves that replica's load, and the
        client's next ``acquire_server`` for it queues it ahead of every request not yet
        started. False where ``server_id`` does not hold it (the client then keeps it there)."""
        requeued = self._policy.requeue(request_id, server_id, generated_tokens)
        if requeued:
            self._hand_out(self._policy.dispatch(time.monotonic()))
        return requeued

    def get_all_servers(self) -> list[str]:
        return list(self._policy.replicas)

    def get_inflight_count(self, server_id: str) -> int:
        replica = self._policy.replicas.get(server_id)
        return len(replica.inflight) if replica else 0

    def get_total_inflight(self) -> int:
        return self._policy.inflight()

    def clear_sticky_cache(self) -> dict:
        return {"cleared_entries": self._policy.clear_sticky(),
                "server_loads": {s: len(r.inflight) for s, r in self._policy.replicas.items()}}

    def get_status(self) -> dict:
        replicas = self._policy.replicas
        return {"servers": {s: len(r.inflight) for s, r in replicas.items()},
                "total_inflight": self._policy.inflight(),
                "active_servers": len(replicas),
                "registered_handles": list(self._handles),
                "queued": self._policy.queued,
                "deterministic": self._policy.settings.deterministic,
                "load_source": "metrics" if self._use_metrics else "requests",
                "kv": {s: {"capacity_tokens": r.kv_capacity_tokens, "used_tokens": r.kv_used_tokens,
                           "expected_tokens": r.expected_tokens} for s, r in replicas.items()}}

    # -- internals -------------------------------------------------------------------------
    def _hand_out(self, bound: list, own: str | None = None) -> str | None:
        """Wake the callers of requests just bound; return ``own``'s server if it is one."""
        mine = None
        for d in bound:
            if d.request_id == own:
                mine = d.server_id
                continue
            future = self._waiting.pop(d.request_id, None)
            if future is not None and not future.done():
                future.set_result(d.server_id)
            elif d.request_id in self._displaced:  # its caller asks again later: kept for it
                self._displaced[d.request_id] = d.server_id
            elif future is None:  # bound, but nobody waits (cannot happen; keep counts right)
                self._policy.release(d.server_id, d.request_id, time.monotonic())
        return mine

    def _drop_request(self, request_id: str) -> bool:
        """Nothing of a request whose caller gave up stays; a slot it held goes to the queue.
        True where the router held anything of it."""
        displaced = request_id in self._displaced
        self._displaced.pop(request_id, None)
        dropped = self._policy.cancel(request_id)
        if dropped and self._policy.replicas:
            self._hand_out(self._policy.dispatch(time.monotonic()))
        return dropped or displaced

    def _remember_early_cancel(self, request_id: str) -> None:
        """Keep a cancel that came before its acquire, for :data:`EARLY_CANCEL_KEEP_S` and at
        most :data:`EARLY_CANCEL_KEPT` of them (an acquire that Ray dropped with its cancelled
        call never comes): the router lives across steps, so this stays bounded."""
        now = time.monotonic()
        self._cancelled_early[request_id] = now
        self._cancelled_early.move_to_end(request_id)
        while self._cancelled_early and (
                len(self._cancelled_early) > EARLY_CANCEL_KEPT
                or now - next(iter(self._cancelled_early.values())) > EARLY_CANCEL_KEEP_S):
            self._cancelled_early.popitem(last=False)

    async def _configure(self) -> None:
        """Once, before the first request: read the servers' rollout config (an RPC, so not
        in ``__init__``) and start the metrics poller."""
        if self._configured:
            return
        if self._configuring is None:
            self._configuring = asyncio.Lock()
        async with self._configuring:
            if self._configured:
                return
            if not self._handles:
                raise RuntimeError(routing.NO_SERVERS)
            handle = next(iter(self._handles.values()))
            rollout = await handle.get_rollout_config.remote()
            self.apply_rollout_config(rollout)
            if self._use_metrics:
                self._poller = asyncio.get_running_loop().create_task(self._poll_metrics())
            self._configured = True

    def apply_rollout_config(self, rollout: Any) -> None:
        """What the router takes from verl's rollout config (see the module docstring)."""
        deterministic = bool(getattr(rollout, "full_determinism", False))
        settings = self._shell.routing
        if deterministic != settings.deterministic:
            from dataclasses import replace
            settings = replace(settings, deterministic=deterministic)
            self._policy.settings = settings
        self._slots = int(getattr(rollout, "max_num_seqs", 0) or 0)
        for replica in self._policy.replicas.values():
            replica.slots = settings.slots or max(self._slots, 1)
        self._policy.max_response_tokens = int(getattr(rollout, "response_length", 0) or 0)
        stats_off = bool(getattr(rollout, "disable_log_stats", True))
        load = self._shell.load
        if load == "metrics" and stats_off:
            raise ValueError(
                "ASCEND_RL_ROUTER_LOAD='metrics' (router YAML key 'load') needs the servers' "
                "vLLM metrics, but actor_rollout_ref.rollout.disable_log_stats is True: set it "
                "to False, or set load to 'auto' or 'requests' (accepted: 'auto', 'metrics', "
                "'requests')")
        self._use_metrics = load == "metrics" or (load == "auto" and not stats_off)
        if load == "auto" and stats_off and not deterministic:
            log.warning("ascend-rl router: the servers publish no vLLM metrics "
                        "(actor_rollout_ref.rollout.disable_log_stats=True), so a replica's room is "
                        "its %d slots only, not its KV cache; set disable_log_stats=False for "
                        "KV-aware routing", self._slots)

    def apply_metrics(self, server_id: str, metrics: ServerMetrics | None) -> None:
        """One server's /metrics, parsed: KV capacity and use, mean generated length."""
        if metrics is None:
            return
        self._policy.report(server_id, kv_capacity_tokens=metrics.kv_capacity_tokens,
                            kv_used_tokens=metrics.kv_used_tokens)
        self._generation[server_id] = (metrics.generation_tokens_sum, metrics.generation_requests)
        total = sum(s for s, _ in self._generation.values())
        count = sum(c for _, c in self._generation.values())
        if count > 0:
            self._policy.mean_response_tokens = total / count

    async def _poll_metrics(self) -> None:
        interval = self._shell.metrics_interval_s
        while True:
            for server_id in list(self._policy.replicas):
                try:
                    text = await asyncio.to_thread(_fetch, f"http://{server_id}/metrics", 5.0)
                    self.apply_metrics(server_id, parse_metrics(text))
                except Exception as exc:  # a server restarting: keep its last report
                    log.debug("ascend-rl router: /metrics of %s: %s", server_id, exc)
            self._hand_out(self._policy.dispatch(time.monotonic()))
            await asyncio.sleep(interval)


def __getattr__(name: str):
    """``ExpectedWorkRouterActor``: the Ray actor class verl starts (built on first access, so
    importing this module does not import ray)."""
    if name == "ExpectedWorkRouterActor":
        import ray
        actor = ray.remote(max_concurrency=MAX_CONCURRENCY)(ExpectedWorkRouter)
        globals()[name] = actor
        return actor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
