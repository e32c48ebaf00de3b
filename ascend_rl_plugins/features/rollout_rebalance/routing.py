"""Expected-work routing of rollout requests over independent server replicas (verl 0.9).

Pure and deterministic (no ray, verl, numpy or clock inside): the verl router actor
(``router.py``) and the long-tail simulator (``benchmarks/bench_rollout_router.py``) drive the
same :class:`RoutingPolicy` with the same kinds of observations, so what the simulator
measures is this code's decisions.

Why it beats verl's least-in-flight router (which counts requests and binds each one to a
replica the moment it arrives):

* **Late binding.** A request is bound to a replica only when some replica has room for it:
  a free slot and, where the replica's KV cache is known, room for the request's *expected
  final* size (prompt + expected response) next to the expected final sizes of what it already
  runs (``kv_budget`` times its KV tokens), with the KV in use leaving every request there
  ``kv_reserve`` tokens to grow. Until then it waits here, in one queue shared by
  every replica: a replica that drains early pulls the next request instead of idling while
  another replica's own queue holds work (verl #658's shared queue), and no replica admits
  more than its cache holds, so fewer requests are preempted and re-prefilled.
* **Longest expected first.** The shared queue is ordered by expected size (``order``),
  the classic longest-processing-time rule for makespan: a long request starts early instead
  of last. Expected sizes come from finished siblings of the same GRPO group (same prompt
  tokens), from the same prompt in past steps (the same key: its statistics persist, newer
  observations weighing more), and from the mean response length the servers report.
* **Expected-work placement.** Among replicas with room, with ``siblings='spread'`` (the
  default) one holding the fewest siblings of the request's GRPO group (a group's lengths are
  correlated: spread out, its long tail is shared by many replicas instead of decoded by one),
  then the one whose expected final tokens are the smallest share of its KV capacity (request
  counts when the capacity is unknown). ``siblings='pack'`` instead prefers a replica already
  running a sibling (its prefix cache holds the shared prompt); the simulator measures both.

What it observes, and from where (the router reads nothing it cannot get from verl or vLLM):
a finished request's *duration* (acquire to release: verl's release RPC carries no token
count), converted to a *relative* size against the running mean duration; each replica's KV
cache size and usage and the servers' mean generated tokens per request from vLLM's
Prometheus ``/metrics`` (``router.py``); slots from the server's rollout config.

Multi-turn sessions stay sticky: a request id seen before goes straight back to its replica,
unqueued (its prefix cache is there). ``deterministic`` (verl's ``rollout.full_determinism``)
keeps verl's meaning: a replica chosen from the request id alone, independent of arrival
timing and load, with a stable hash (verl's own uses Python's ``hash``, salted per process
unless ``PYTHONHASHSEED`` is fixed), over the replicas in registration order; no queue.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

SIBLINGS = ("spread", "pack")
ORDER = ("longest_first", "arrival")
NO_SERVERS = "No available servers in load balancer"  # verl's text: its fully-async client retries on it
REQUEUED_AHEAD = -1e12  # queue key of a handed-back request (plus its generated tokens)


@dataclass(frozen=True)
class RouterSettings:
    """How the router decides. Every field is validated here; ``router.settings_from``
    reads them from the YAML verl loads and the ``ASCEND_RL_ROUTER_*`` flags."""

    siblings: str = "spread"  # 'spread': fewest siblings, then load; 'pack': prefer a sibling's replica
    order: str = "longest_first"  # shared-queue order: 'longest_first' or 'arrival'
    kv_budget: float = 1.5  # expected final tokens in flight per replica, x its KV tokens
    kv_reserve: int = 2048  # and only while its KV in use leaves each request this many tokens to grow
    slots: int = 0  # requests in flight per replica; 0: the server's max_num_seqs
    prior_response_tokens: int = 0  # expected response tokens before any report; 0: half the max
    deterministic: bool = False  # verl's rollout.full_determinism
    sticky_entries: int = 100_000  # request ids remembered for multi-turn stickiness
    history_entries: int = 1_000_000  # prompt keys remembered across steps

    def __post_init__(self) -> None:
        if self.siblings not in SIBLINGS:
            raise ValueError(f"siblings={self.siblings!r}: accepted {', '.join(map(repr, SIBLINGS))}")
        if self.order not in ORDER:
            raise ValueError(f"order={self.order!r}: accepted {', '.join(map(repr, ORDER))}")
        if not (isinstance(self.kv_budget, (int, float)) and 0.05 <= self.kv_budget <= 16):
            raise ValueError(f"kv_budget={self.kv_budget!r}: accepted a number in [0.05, 16]")
        for name in ("slots", "prior_response_tokens", "kv_reserve"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"{name}={value!r}: accepted an integer >= 0")


@dataclass
class ReplicaState:
    """What the router knows about one replica."""

    server_id: str
    slots: int  # requests it may run (its max_num_seqs, or the slots setting)
    kv_capacity_tokens: int = 0  # 0: unknown (the server publishes no metrics)
    kv_used_tokens: int = 0  # last reported
    inflight: dict = field(default_factory=dict)  # request_id -> expected final tokens
    groups: Counter = field(default_factory=Counter)  # group key -> siblings in flight
    expected_tokens: float = 0.0  # sum of ``inflight``
    # tokens bound here since its last KV report (prompts, and a handed-back request's
    # generated tokens: its replica re-prefills them)
    tokens_bound_since_report: int = 0

    def drop(self, request_id: str, group) -> float:
        """The request leaves this replica (released, or moved away): its expected tokens and its
        group's sibling count go with it (``group`` None: not counted in a group). Returns its
        expected tokens."""
        expected = self.inflight.pop(request_id)
        self.expected_tokens = self.expected_tokens - expected if self.inflight else 0.0  # no float residue
        if group is not None:
            self.groups[group] -= 1
            if self.groups[group] <= 0:
                del self.groups[group]
        return expected

    def projected_tokens(self) -> float:
        """Tokens it will hold: what its requests are expected to grow to, or what it reports
        holding now if that is more (its requests are longer than expected)."""
        return max(self.expected_tokens, float(self.kv_used_tokens))

    def load(self) -> float:
        if self.kv_capacity_tokens > 0:
            return self.projected_tokens() / self.kv_capacity_tokens
        return len(self.inflight) / max(self.slots, 1)


@dataclass
class _Pending:
    request_id: str
    prompt_tokens: int
    group: str
    seq: int  # arrival order


@dataclass(frozen=True)
class _Bound:
    """Where a request in flight runs, and what it needs again if it goes back to the queue."""

    server_id: str
    prompt_tokens: int
    group: str


@dataclass
class Dispatch:
    """One decision: ``request_id`` goes to ``server_id`` (``queued``: it waited in the queue)."""

    request_id: str
    server_id: str
    queued: bool


class LengthModel:
    """Expected response size of a request, relative to the mean, by its prompt (group) key.

    Observes durations (acquire to release) and keeps a running mean duration per prompt key
    and over all requests: siblings finished in this step and the same prompt's past steps
    feed the same statistic (weights ``1/n``, at least ``1/8``, so recent observations keep
    counting as the policy changes a prompt's lengths). A prompt's expected size is its mean
    over the overall mean, with one pseudo-observation at the overall mean."""

    def __init__(self, history_entries: int = 1_000_000):
        self.mean_duration = 0.0
        self.observed = 0
        self.by_group: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self.history_entries = history_entries

    def observe(self, group: str, duration: float) -> None:
        if duration <= 0:
            return
        self.observed += 1
        self.mean_duration += max(1.0 / self.observed, 1.0 / 512) * (duration - self.mean_duration)
        mean, n = self.by_group.pop(group, (0.0, 0))
        n += 1
        mean += max(1.0 / n, 1.0 / 8) * (duration - mean)
        self.by_group[group] = (mean, n)
        if len(self.by_group) > self.history_entries:
            self.by_group.popitem(last=False)

    def relative(self, group: str) -> float:
        """Expected size relative to the mean (1.0 when nothing is known about the prompt)."""
        entry = self.by_group.get(group)
        if entry is None or self.mean_duration <= 0:
            return 1.0
        mean, n = entry
        return (n * mean + self.mean_duration) / ((n + 1) * self.mean_duration)


def stable_index(request_id: str, count: int) -> int:
    """A replica position from the request id alone, the same in every process and run."""
    digest = hashlib.blake2b(str(request_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % count


class RoutingPolicy:
    """The router's decisions; callers pass the time (seconds, any monotonic origin)."""

    def __init__(self, settings: RouterSettings | None = None):
        self.settings = settings or RouterSettings()
        self.replicas: dict[str, ReplicaState] = {}
        self.lengths = LengthModel(self.settings.history_entries)
        self.sticky: OrderedDict[str, str] = OrderedDict()
        self.mean_response_tokens = 0.0  # reported by the servers; 0: not yet
        self.max_response_tokens = 0  # the rollout's response_length (0: unknown)
        self._queue: list = []  # (key, seq, _Pending); entries not in ``_pending`` are stale
        self._seq = 0
        self._pending: dict[str, _Pending] = {}  # request_id -> its live queue entry
        self._bound: dict[str, _Bound] = {}  # request_id -> where it runs now
        # request_id -> when it was first bound: kept while it is handed back or displaced by
        # a replica's death and bound again, so its duration (what ``lengths`` learns from)
        # covers its whole life, not its last hop; dropped when it is released or cancelled
        self._started: dict[str, float] = {}
        # request id -> tokens it had generated when its replica preempted it and its client
        # handed it back (``requeue``), until it is bound again
        self.requeued: dict[str, int] = {}

    # -- replicas ------------------------------------------------------------------------
    def add_replica(self, server_id: str, slots: int) -> None:
        if server_id not in self.replicas:
            self.replicas[server_id] = ReplicaState(server_id, self.settings.slots or max(int(slots), 1))

    def remove_replica(self, server_id: str) -> list[str]:
        """The replica leaves (it died, or verl removed it): it takes no new work, and every
        request bound to it goes back to the head of the queue (ahead of handed-back ones:
        its generated tokens are unknown here), keeping its first-bind time; their sticky
        entries go too. ``add_replica`` with the same id brings it back. Returns the ids
        displaced, in the order they were bound there."""
        replica = self.replicas.pop(server_id, None)
        if replica is None:
            return []
        displaced = list(replica.inflight)
        for request_id in displaced:
            bound = self._bound.pop(request_id)
            if self.sticky.get(request_id) == server_id:
                del self.sticky[request_id]
            self.requeued[request_id] = 0
            self._push(request_id, bound.prompt_tokens, bound.group)
        return displaced

    def report(self, server_id: str, *, kv_capacity_tokens: int | None = None,
               kv_used_tokens: int | None = None) -> None:
        """A replica's KV cache as its server reports it."""
        replica = self.replicas.get(server_id)
        if replica is None:
            return
        if kv_capacity_tokens is not None:
            replica.kv_capacity_tokens = int(kv_capacity_tokens)
        if kv_used_tokens is not None:
            replica.kv_used_tokens = int(kv_used_tokens)
            replica.tokens_bound_since_report = 0

    # -- requests ------------------------------------------------------------------------
    def expected_tokens(self, prompt_tokens: int, group: str) -> float:
        mean = self.mean_response_tokens or self.settings.prior_response_tokens or (
            self.max_response_tokens / 2 if self.max_response_tokens else 1.0)
        response = self.lengths.relative(group) * mean
        if self.max_response_tokens:
            response = min(response, self.max_response_tokens)
        return prompt_tokens + response

    def submit(self, request_id: str, prompt_tokens: int, group: str, now: float) -> list[Dispatch]:
        """Take a request: routed at once when sticky or deterministic, else queued. Returns
        every request bound now (this one, or queued ones ahead of it, or none)."""
        if not self.replicas:
            raise RuntimeError(NO_SERVERS)
        if request_id in self._pending:  # displaced by a replica's death, its caller asks again
            return self.dispatch(now)
        server_id = self.sticky.get(request_id)
        if server_id is not None and server_id in self.replicas:
            self.sticky.move_to_end(request_id)
            self._bind(request_id, server_id, prompt_tokens, group, now)
            return [Dispatch(request_id, server_id, False)]
        if self.settings.deterministic:
            server_id = list(self.replicas)[stable_index(request_id, len(self.replicas))]
            self._bind(request_id, server_id, prompt_tokens, group, now)
            return [Dispatch(request_id, server_id, False)]
        self._push(request_id, prompt_tokens, group)
        return self.dispatch(now)

    def release(self, server_id: str, request_id: str | None, now: float) -> None:
        """The request finished: off the books wherever the router holds it (``server_id`` is
        where its caller acquired it; a replica's death may have re-bound it since), its
        duration from its first bind observed. A request still queued (displaced, its caller
        giving up) leaves the queue, with nothing observed."""
        if request_id is None:
            return
        bound = self._bound.get(request_id)
        if bound is None:
            self._forget(request_id)
            return
        self._unbind(request_id)
        start = self._started.pop(request_id, None)
        if start is not None:
            self.lengths.observe(bound.group, now - start)

    def move(self, request_id: str, source: str, destination: str) -> bool:
        """A request in flight now runs on ``destination`` (tail migration moved it): its
        expected tokens, its group's sibling count and its sticky entry follow it, so the
        source's room and a later turn's replica are right. False (nothing changed) where
        ``source`` does not hold it or ``destination`` is unknown."""
        src, dst = self.replicas.get(source), self.replicas.get(destination)
        if src is None or dst is None or request_id not in src.inflight or source == destination:
            return False
        bound = self._bound[request_id]
        expected = src.drop(request_id, bound.group)
        dst.inflight[request_id] = expected
        dst.expected_tokens += expected
        dst.groups[bound.group] += 1
        self._bound[request_id] = _Bound(destination, bound.prompt_tokens, bound.group)
        if request_id in self.sticky:
            self.sticky[request_id] = destination
        return True

    def place(self, request_id: str, server_id: str, now: float) -> bool:
        """A request displaced by its replica's death (queued, its caller not asking again)
        turns out to run on ``server_id`` already (its client failed it over there first):
        bound there, out of queue order, so the router counts it where it runs. False (nothing
        changed) where it is not queued or ``server_id`` is unknown."""
        pending = self._pending.get(request_id)
        if pending is None or server_id not in self.replicas:
            return False
        self._forget_entry(request_id)
        self._bind(request_id, server_id, pending.prompt_tokens, pending.group, now)
        return True

    def requeue(self, request_id: str, server_id: str, generated_tokens: int) -> bool:
        """The preemption hand-back: ``server_id`` preempted the request, and its client takes
        it back to submit it again. It leaves that replica's books (no duration observed: it
        did not finish) and its sticky entry (it resumes wherever room comes first: vLLM's
        recompute preemption freed its KV, so every replica re-prefills it at the same cost),
        and once submitted again it goes ahead of every request that never started (the pooled
        engine's single queue does that for the requests it preempts), the **fewest generated
        tokens first**. Its first-bind time stays: the duration observed at its release runs
        from then (preempted requests are the long ones; timed from the re-bind they would
        teach ``lengths`` that their group is short). Why that order: requests of one rollout
        start together, so the one that had generated the least was preempted earliest and has
        waited longest; and a preempted
        request is one nothing distinguishes yet, so its remaining work is bounded only by the
        response cap minus what it generated, the largest for the fewest generated (the
        longest-first rule of the main queue, on the only bound known). Longest-generated first
        (close to vLLM's own order: a preempted request goes to the head of its replica's queue,
        the latest victim first) starves the early victims behind every later one: in the
        long-tail simulator a request preempted at 508 s waited until 3096 s and finished last
        (235B workload, seed 0; DESIGN.md, 'Preemption hand-back'). False (nothing changed)
        where ``server_id`` does not hold it."""
        replica = self.replicas.get(server_id)
        if replica is None or request_id not in replica.inflight:
            return False
        self._unbind(request_id)
        self.sticky.pop(request_id, None)
        self.requeued[request_id] = max(int(generated_tokens), 0)
        return True

    def dispatch(self, now: float) -> list[Dispatch]:
        """Bind queued requests, in queue order, while some replica has room for the next."""
        out = []
        while self._queue:
            pending = self._refreshed_head()
            if self._pending.get(pending.request_id) is not pending:  # cancelled or released
                heapq.heappop(self._queue)
                continue
            expected = self.expected_tokens(pending.prompt_tokens, pending.group)
            server_id = self._choose(expected, pending.group)
            if server_id is None:
                break
            heapq.heappop(self._queue)
            del self._pending[pending.request_id]
            self._bind(pending.request_id, server_id, pending.prompt_tokens, pending.group, now, expected)
            out.append(Dispatch(pending.request_id, server_id, True))
        return out

    def cancel(self, request_id: str) -> bool:
        """The request's caller gave up (its task was cancelled): queued, it is never bound;
        bound already (the router answered as the caller was cancelled, so nobody will release
        it), it leaves its replica's books, with no duration observed. Either way nothing of it
        stays: no queue entry, no slot, no hand-back record. True where it held a slot (the
        caller should dispatch: room was freed)."""
        held = request_id in self._bound
        if held:
            self._unbind(request_id)
        self._forget(request_id)
        return held

    def clear_sticky(self) -> int:
        cleared = len(self.sticky)
        self.sticky.clear()
        return cleared

    @property
    def queued(self) -> int:
        return len(self._pending)

    def inflight(self) -> int:
        return sum(len(r.inflight) for r in self.replicas.values())

    # -- internals -----------------------------------------------------------------------
    def _push(self, request_id: str, prompt_tokens: int, group: str) -> None:
        self._seq += 1
        pending = _Pending(request_id, int(prompt_tokens), group, self._seq)
        self._pending[request_id] = pending
        heapq.heappush(self._queue, (self._key(pending), pending.seq, pending))

    def _unbind(self, request_id: str) -> None:
        """Off the books of the replica it is bound to (its first-bind time stays)."""
        bound = self._bound.pop(request_id)
        replica = self.replicas.get(bound.server_id)
        if replica is not None and request_id in replica.inflight:
            replica.drop(request_id, bound.group)

    def _forget(self, request_id: str) -> None:
        """Nothing of a request that is not bound stays: its queue entry, its hand-back
        record, its first-bind time."""
        self._forget_entry(request_id)
        self.requeued.pop(request_id, None)
        self._started.pop(request_id, None)

    def _forget_entry(self, request_id: str) -> None:
        """Its queue entry goes (left stale in the heap, skipped when it reaches the head)."""
        self._pending.pop(request_id, None)
        if len(self._queue) > 2 * len(self._pending) + 64:  # stale entries: keep the heap bounded
            self._queue = [entry for entry in self._queue
                           if self._pending.get(entry[2].request_id) is entry[2]]
            heapq.heapify(self._queue)

    def _key(self, pending: _Pending) -> float:
        generated = self.requeued.get(pending.request_id)
        if generated is not None:   # ahead of every never-started request (keys >= -2 x max tokens)
            return REQUEUED_AHEAD + generated
        if self.settings.order == "arrival":
            return 0.0
        return -self.expected_tokens(pending.prompt_tokens, pending.group)

    def _refreshed_head(self) -> _Pending:
        """The queue head, its key re-evaluated (sizes change as siblings finish); a few
        re-insertions at most, so one dispatch stays cheap."""
        for _ in range(8):
            key, seq, pending = self._queue[0]
            fresh = self._key(pending)
            if fresh == key or len(self._queue) == 1:
                break
            heapq.heapreplace(self._queue, (fresh, seq, pending))
            if self._queue[0][2] is pending:
                break
        return self._queue[0][2]

    def _fits(self, replica: ReplicaState, expected: float) -> bool:
        if not replica.inflight:
            return True  # an idle replica always takes work: the queue always drains
        if len(replica.inflight) >= replica.slots:
            return False
        if replica.kv_capacity_tokens <= 0:
            return True
        if self.settings.kv_reserve and (replica.kv_used_tokens + replica.tokens_bound_since_report
                                         + (len(replica.inflight) + 1) * self.settings.kv_reserve
                                         > replica.kv_capacity_tokens):
            return False
        return replica.projected_tokens() + expected <= self.settings.kv_budget * replica.kv_capacity_tokens

    def _choose(self, expected: float, group: str) -> str | None:
        best = None
        best_key = None
        pack = self.settings.siblings == "pack"
        for position, replica in enumerate(self.replicas.values()):
            if not self._fits(replica, expected):
                continue
            siblings = replica.groups.get(group, 0)
            # pack: a replica running a sibling first; spread: the fewest siblings first (a
            # GRPO group's lengths are correlated: its siblings spread over the replicas share
            # its long tail out instead of one replica decoding several of them)
            key = (-min(siblings, 1) if pack else siblings, replica.load(), len(replica.inflight), position)
            if best_key is None or key < best_key:
                best, best_key = replica.server_id, key
        return best

    def _bind(self, request_id: str, server_id: str, prompt_tokens: int, group: str, now: float,
              expected: float | None = None) -> None:
        replica = self.replicas[server_id]
        resumed = self.requeued.pop(request_id, 0)  # a handed-back request re-prefills these too
        if expected is None:
            expected = self.expected_tokens(prompt_tokens, group)
        if request_id in self._bound:  # the same id twice in flight (a retry): count it once
            self._unbind(request_id)
        replica.groups[group] += 1
        replica.inflight[request_id] = expected
        replica.expected_tokens += expected
        replica.tokens_bound_since_report += int(prompt_tokens) + resumed
        self._bound[request_id] = _Bound(server_id, int(prompt_tokens), group)
        self._started.setdefault(request_id, now)  # a re-bind keeps the first bind's time
        self.sticky[request_id] = server_id
        self.sticky.move_to_end(request_id)
        if len(self.sticky) > self.settings.sticky_entries:
            self.sticky.popitem(last=False)
