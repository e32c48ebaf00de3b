"""Request-level SAM drafter: request ids -> automaton members, sibling groups, cleanup.

Shared by the vLLM proposer (GPU/CPU model runner, both vLLM versions) and the
vLLM-Ascend proposers, and usable on its own by any engine that keeps its requests' tokens
in a matrix (one row per request) -- see the feature README.

Per decode step the Python side does almost nothing: when the batch is the one of the
previous step (the same request ids in the same rows, the common case in a decode loop)
it makes one jitted call that, for every request, settles its previous draft (how many of
its tokens the model accepted), reads its new tokens straight from the token matrix,
appends them to its automaton and drafts, capped to what the scheduler can verify before
``max_model_len``. Only when requests join, leave or move rows is there Python work per
request (dict lookups, a new automaton or member for a new request).

Group mode: requests whose prompt token ids are identical (vLLM ``n > 1`` children, or GRPO
rollouts sent as separate requests with the same prompt) share one generalized automaton;
each drafts from its own text and from every sibling's text, live or finished. A group's
memory is released when its last member finishes.

Sources: besides its group's automaton, a request drafts from one automaton that holds every
request's response (``cross_prompt_tokens``, like suffix's global tree) and, while its group
has other live members, from one of its own text alone. With the draft-length rule on
(``token_cost`` > 0) each step drafts the candidate the acceptance table values most (issue 46:
a short match in the group's text no longer wins over a long one in other prompts' text); with
it off, the group's candidate, else the cross-prompt one (see DESIGN.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .automaton import (B_ACC, B_CROSS, B_NTOK, B_SOLO, COST_SCALE, M_ALIVE, M_MEMBERS,
                        T_ACCEPTED, T_COST, T_CROSS_PROPOSALS, T_DRAFTED, T_MAX_LEN, T_PROPOSALS,
                        T_VERIFIED, AutomatonPool, fresh_tally)
from .history import ResponseHistory

# how many finished requests keep their accepted-token count in ``stats.per_request_accepted``
# (a long rollout finishes millions of requests: the record must not grow with them)
FINISHED_RECORD = 1024


@dataclass(frozen=True)
class StopConditions:
    """When a request ends by itself: once it has ``min_tokens`` output tokens, at a token of
    ``stop_token_ids``, or when it holds ``max_tokens`` output tokens (None: no such limit) or
    the drafter's ``max_model_len`` tokens in all. That is the order in which vLLM's scheduler
    checks each new token (``check_stop`` in vllm/v1/core/sched/utils.py, 0.13 and 0.23).
    Not recognized, so not kept: a stop string (the front end finds it and aborts the
    request) and 0.23's ``repetition_detection``.

    Why the drafter needs them: the history must keep only responses that finished, and a
    request leaves the batch in the same way whether it finished or was preempted, aborted (a
    migration hop ends in an abort) or moved. vLLM's runner is told ``finished_req_ids``, but
    aborted requests are in that set too. A text that ends by these conditions finished."""

    stop_token_ids: frozenset = frozenset()
    min_tokens: int = 0
    max_tokens: int | None = None

    def finished_length(self, response: np.ndarray, room: int | None) -> int | None:
        """How many tokens of ``response`` (the output tokens in order) the request held when it
        finished, or None if it did not finish. ``room``: ``max_model_len`` minus the prompt
        length (None: no limit). The runner may hold tokens past the end (the rest of an
        accepted draft after a stop token), which the scheduler dropped: they are not counted."""
        first = max(self.min_tokens, 1)  # the first output count the scheduler checks
        limits = [x for x in (self.max_tokens, room) if x is not None]
        end = max(min(limits), first) if limits else None
        if self.stop_token_ids and response.size >= first:
            stops = np.fromiter(self.stop_token_ids, np.int64, len(self.stop_token_ids))
            hits = np.flatnonzero(np.isin(response[first - 1:], stops))
            if hits.size:
                at_stop = first + int(hits[0])
                end = at_stop if end is None else min(end, at_stop)
        return end if end is not None and end <= response.size else None


class DrafterStats:
    """Counters of a drafter, read live from the arrays its kernel updates."""

    def __init__(self, drafter: "SamDrafter"):
        self._d = drafter

    @property
    def steps(self) -> int:
        return self._d._steps

    @property
    def inactive_steps(self) -> int:  # steps over the batch-size threshold (ingest only)
        return self._d._inactive_steps

    @property
    def proposals(self) -> int:  # request-steps that got a non-empty draft
        return int(self._d._tally[T_PROPOSALS])

    @property
    def cross_proposals(self) -> int:  # of them, drafts from the cross-prompt automaton
        return int(self._d._tally[T_CROSS_PROPOSALS])

    @property
    def drafted_tokens(self) -> int:
        return int(self._d._tally[T_DRAFTED])

    @property
    def accepted_tokens(self) -> int:  # draft tokens confirmed by the next step's tokens
        return int(self._d._tally[T_ACCEPTED])

    @property
    def verified_drafts(self) -> int:  # drafts whose outcome was observed
        return int(self._d._tally[T_VERIFIED])

    @property
    def per_request_accepted(self) -> dict:
        """Accepted draft tokens per request id: live requests, and the last
        ``FINISHED_RECORD`` finished ones."""
        d = self._d
        out = dict(d._finished_accepted)
        for r, m in d.member_of.items():
            out[r] = int(d.pool.members[m, B_ACC])
        return out

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("steps", "proposals", "cross_proposals", "drafted_tokens",
                                           "accepted_tokens", "verified_drafts", "inactive_steps")}
        d["acceptance_share"] = d["accepted_tokens"] / d["drafted_tokens"] if d["drafted_tokens"] else 0.0
        return d


def verification_cost(token_cost: float, compute_bound_batch: int, batch_size: int) -> float:
    """What verifying one more draft token costs this step, in accepted tokens: a draft
    token is proposed only while the estimated probability that it and every token before
    it are accepted is at least this.

    Model (not calibrated on an NPU; its shape is a roofline): while a decode step is bound
    by reading the weights, an extra token in it costs only its own attention, sampling and
    KV write, ``token_cost`` of an accepted token, whatever the batch: up to half of
    ``compute_bound_batch`` running requests. From there the step turns compute-bound and a
    verified token comes to cost what generating it would: the cost rises linearly to 1 at
    ``compute_bound_batch``, where nothing is drafted any more. With the default 64 the
    knee is the recipe's fixed threshold (32 requests, chosen on A3), and drafting fades out
    above it instead of stopping at once. ``token_cost`` 0: every candidate is drafted."""
    if token_cost <= 0.0:
        return 0.0
    knee = compute_bound_batch / 2.0
    rise = max(0.0, batch_size - knee) / knee
    return min(1.0, token_cost + (1.0 - token_cost) * rise)


class SamDrafter:
    """Drafts for a batch of requests identified by id, given their token rows.

    ``k``: draft tokens per step; ``group``: siblings with identical prompts share one
    automaton; ``adaptive``: a match of length L drafts at most L tokens; ``max_model_len``:
    drafts stop where the scheduler could not verify them; ``history_tokens`` (0: off) and
    ``history_per_prompt``: finished responses kept per prompt (see ``history.py``) seed the
    automaton of that prompt's later requests; ``token_cost`` (0: draft all k) and
    ``compute_bound_batch``: the draft-length rule (see :func:`verification_cost`);
    ``cross_prompt_tokens`` (0: off): an automaton shared by all prompts, holding every
    request's response (finished ones' too) up to that many tokens (then a fresh one replaces
    it), drafts for a request where the acceptance table values its candidate most (the rule
    on), or where the request's own automaton has no candidate. The flags of the ``sam``
    feature map one to one onto these arguments (see ``vllm_proposer.build_drafter``).

    The history keeps only responses of requests that finished: named as finished to
    :meth:`release` / :meth:`retain_only`, or whose text ends by their
    :class:`StopConditions`, which ``stop_conditions_of(request id)`` (None: none known) gives
    when a request first shows up (the vLLM proposers read them from the runner's sampling
    parameters). A request that leaves the batch otherwise (preempted, aborted, moved to
    another engine) leaves nothing in it: its text is partial, and an aborted migration hop's
    prompt (the original prompt and the tokens before the hop) is a key no later request has."""

    def __init__(self, k: int, *, min_match: int = 1, group: bool = False,
                 batch_threshold: int = 0, recent_len: int = 32, adaptive: bool = False,
                 max_model_len: int | None = None, history_tokens: int = 0,
                 history_per_prompt: int = 8, token_cost: float = 0.0,
                 compute_bound_batch: int = 64, cross_prompt_tokens: int = 0,
                 stop_conditions_of: Callable[[str], StopConditions | None] | None = None):
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 for SAM, got {k}")
        self.k = int(k)
        self.group = bool(group)
        self.batch_threshold = int(batch_threshold)
        self.pool = AutomatonPool(min_match=min_match, recent_len=recent_len, adaptive=adaptive)
        self.member_of: dict[str, int] = {}
        self.group_of: dict[str, bytes | str] = {}
        self.groups: dict[bytes | str, int] = {}  # group key -> automaton id
        self._group_reqs: dict[bytes | str, list] = {}  # group key -> its live requests (solo sources)
        # finished responses by prompt (None: off); a request's prompt bytes and length
        self.history = (ResponseHistory(history_tokens, history_per_prompt)
                        if history_tokens > 0 else None)
        self.stop_conditions_of = stop_conditions_of
        # with history on: a request's prompt bytes, prompt length and stop conditions
        self._prompt_of: dict[str, tuple[bytes, int, StopConditions | None]] = {}
        if cross_prompt_tokens < 0:
            raise ValueError(f"cross_prompt_tokens must be >= 0, got {cross_prompt_tokens}")
        # the cross-prompt automaton (-1: none yet or off) and its token budget
        self.cross_prompt_tokens = int(cross_prompt_tokens)
        self._cross = -1
        self.cross_rotations = 0  # times the cross-prompt automaton reached its budget
        self._tally = fresh_tally()
        if not 0.0 <= token_cost <= 1.0:
            raise ValueError(f"token_cost must be in [0, 1], got {token_cost}")
        if compute_bound_batch < 1:
            raise ValueError(f"compute_bound_batch must be >= 1, got {compute_bound_batch}")
        self.token_cost = float(token_cost)
        self.compute_bound_batch = int(compute_bound_batch)
        self._cost_of: dict[int, int] = {}  # batch size -> T_COST value
        self._cost_now = 0  # the value in the tally now
        self.max_model_len = max_model_len
        self._steps = 0
        self._inactive_steps = 0
        self._finished_accepted: dict[str, int] = {}
        self.stats = DrafterStats(self)
        # the batch of the previous step: (request ids, rows) and its (member, row) array
        self._key_ids: list = []
        self._key_rows: list = []
        self._batch = np.zeros((0, 2), np.int64)
        self._live_key: list | None = None

    @property
    def max_model_len(self) -> int | None:
        return int(self._tally[T_MAX_LEN]) or None

    @max_model_len.setter
    def max_model_len(self, value: int | None) -> None:
        self._tally[T_MAX_LEN] = int(value or 0)

    @property
    def adaptive(self) -> bool:
        return self.pool.adaptive

    @property
    def min_match(self) -> int:
        return self.pool.min_match

    @property
    def recent_len(self) -> int:
        return self.pool.recent_len

    # -- membership -----------------------------------------------------------------------------
    def _member_for(self, req_id: str, prompt: np.ndarray | None) -> int:
        m = self.member_of.get(req_id)
        if m is not None:
            return m
        key: bytes | str = req_id
        prompt_key = None
        if prompt is not None and prompt.size:
            prompt = np.ascontiguousarray(prompt, np.int32)
            prompt_key = prompt.tobytes()
            if self.group:
                key = prompt_key
            if self.history is not None:
                stop = self.stop_conditions_of(req_id) if self.stop_conditions_of else None
                self._prompt_of[req_id] = (prompt_key, int(prompt.size), stop)
        a = self.groups.get(key)
        if a is None:
            a = self.pool.new_automaton()
            self.groups[key] = a
            if self.history is not None and prompt_key is not None:
                self._seed(a, prompt, self.history.responses(prompt_key))
        m = self.pool.new_member(a)
        self.member_of[req_id] = m
        self.group_of[req_id] = key
        if self.group and self.token_cost > 0:
            self._link_solo(req_id, key, a)
        if self.cross_prompt_tokens:
            if self._cross < 0:
                self._cross = self.pool.new_automaton()
                self.pool.set_cross(self._cross, self.cross_prompt_tokens, self._rotate_cross)
            self.pool.link_cross(m, self._cross, from_token=0 if prompt is None else int(prompt.size))
        return m

    def _link_solo(self, req_id: str, key, automaton: int) -> None:
        """A request whose group has other live members also drafts from its own text alone
        (its group's recency order may put a sibling's text first where its own would be
        right): each such member gets an automaton of its own text, which learns it from the
        request's token row at its next step. With the draft-length rule on only (the table
        chooses between the sources); a group's single live member needs none (its own text is
        the most recent in the group's automaton)."""
        live = self._group_reqs.setdefault(key, [])
        live.append(req_id)
        if self.pool.meta[automaton, M_ALIVE] and self.pool.meta[automaton, M_MEMBERS] >= 2:
            for r in live:
                m = self.member_of[r]
                if self.pool.members[m, B_SOLO] < 0:
                    self.pool.link_solo(m)

    def _rotate_cross(self) -> None:
        """The cross-prompt automaton reached its budget: a fresh one replaces it (its memory
        goes back at once), and live requests continue in it from their next token."""
        old, pool = self._cross, self.pool
        self._cross = pool.new_automaton()
        pool.set_cross(self._cross, self.cross_prompt_tokens, self._rotate_cross)
        for m in self.member_of.values():
            pool.link_cross(m, self._cross, from_token=int(pool.members[m, B_NTOK]))
        pool.free_automaton(old)
        self.cross_rotations += 1

    def _seed(self, automaton: int, prompt: np.ndarray, responses) -> None:
        """Put earlier responses to ``prompt`` (each after the prompt, as it was generated)
        into a new automaton, as finished members: they come before every live request's
        text, so a live sibling's more recent occurrence is still preferred."""
        for response in responses:
            seed = self.pool.new_member(automaton)
            self.pool.extend_one(seed, np.concatenate([prompt, response]), k=0)
            self.pool.release_member(seed, keep_text=True)

    def release(self, req_id: str, finished: bool = False) -> None:
        """Forget a request that left (its group goes with its last member). With history on,
        its response is kept for its prompt's later requests if it finished: ``finished``
        (the caller knows it did), or its text ends by its stop conditions (then only up to
        that end). A preempted, aborted or moved request leaves nothing there."""
        m = self.member_of.pop(req_id, None)
        key = self.group_of.pop(req_id, None)
        prompt = self._prompt_of.pop(req_id, None)
        if m is None:
            return
        x = int(self.pool.members[m, B_CROSS])
        if x >= 0:  # its text stays in the cross-prompt automaton for later requests
            self.pool.release_member(x, keep_text=True)
        y = int(self.pool.members[m, B_SOLO])
        if y >= 0:
            self.pool.release_member(y)
        live = self._group_reqs.get(key)
        if live is not None:
            live.remove(req_id)
            if not live:
                del self._group_reqs[key]
        if prompt is not None:
            self._keep_if_finished(m, prompt, finished)
        self._key_ids = []  # the cached batch may hold this member
        record = self._finished_accepted
        record[req_id] = int(self.pool.members[m, B_ACC])
        if len(record) > FINISHED_RECORD:
            del record[next(iter(record))]
        self.pool.release_member(m)
        if key is not None and not self.pool.meta[self.groups[key], M_ALIVE]:
            del self.groups[key]

    def _keep_if_finished(self, member: int, prompt: tuple, finished: bool) -> None:
        """Store a leaving request's response only if it finished, up to where it ended: a
        partial text under a key no later request has would only take the history's budget."""
        key, prompt_len, stop = prompt
        response = self.pool.member_text(member)[prompt_len:]
        end = None
        if stop is not None:
            limit = self.max_model_len
            end = stop.finished_length(response, None if limit is None else limit - prompt_len)
        if end is None and finished:
            end = int(response.size)
        if end:
            self.history.add(key, response[:end])

    def retain_only(self, live_req_ids, finished=()) -> None:
        """Release every request not in ``live_req_ids`` (finished, aborted or preempted;
        a preempted request is simply re-ingested from its token row when it returns).
        ``finished``: ids of requests known to have finished (see :meth:`release`). Free
        when the ids are those of the previous call."""
        if type(live_req_ids) is not list:
            live_req_ids = list(live_req_ids)
        if live_req_ids == self._live_key:
            return
        live = set(live_req_ids)
        for r in [r for r in self.member_of if r not in live]:
            self.release(r, finished=r in finished)
        self._live_key = list(live_req_ids)

    def _set_batch(self, req_ids, rows, token_ids, prompt_lens) -> None:
        """(member, row) of every request of this step; new requests get their member."""
        n = len(req_ids)
        batch = np.empty((n, 2), np.int64)
        for i, r in enumerate(req_ids):
            m = self.member_of.get(r)
            if m is None:
                prompt = None
                if (self.group or self.history is not None) and prompt_lens is not None:
                    prompt = np.asarray(token_ids[rows[i], : int(prompt_lens[rows[i]])])
                m = self._member_for(r, prompt)
            batch[i, 0] = m
            batch[i, 1] = rows[i]
        self._batch = batch
        self._key_ids = list(req_ids)  # copies: a runner mutates its lists in place
        self._key_rows = list(rows)

    # -- the step ---------------------------------------------------------------------------------
    def propose_arrays(self, req_ids, rows, token_ids, num_tokens, prompt_lens=None,
                       batch_size: int | None = None):
        """Ingest each request's tokens up to ``num_tokens[row]`` and draft.

        ``req_ids[i]`` lives in ``token_ids[rows[i]]`` (a 2-d int32 matrix, vLLM's
        ``token_ids_cpu``); ``num_tokens`` and ``prompt_lens`` (optional) are indexed by row
        (vLLM's ``num_tokens_no_spec`` and ``num_prompt_tokens``): a request's prompt is its
        sibling-group key, read once, when the request first shows up. Returns (drafts[B, k], counts[B]): request ``i``'s draft is
        ``drafts[i, :counts[i]]``. Both are views of a buffer reused by the next call."""
        self._steps += 1
        if type(rows) is not list:
            rows = list(rows)
        if type(req_ids) is not list:
            req_ids = list(req_ids)
        if req_ids != self._key_ids or rows != self._key_rows:
            self._set_batch(req_ids, rows, token_ids, prompt_lens)
        threshold = self.batch_threshold
        k = self.k
        size = len(rows) if batch_size is None else batch_size
        if threshold > 0 and size > threshold:
            self._inactive_steps += 1
            k = 0
        cost = self._cost_of.get(size)
        if cost is None:
            cost = self._cost_of[size] = round(COST_SCALE * verification_cost(
                self.token_cost, self.compute_bound_batch, size))
        if cost >= COST_SCALE and k:  # compute-bound: no draft pays for its verification
            self._inactive_steps += 1
            k = 0
        if cost != self._cost_now:  # a numpy write costs more than the compare
            self._tally[T_COST] = self._cost_now = cost
        return self.pool.ingest_own_rows(self._batch, token_ids, num_tokens, k, self._tally)

    def propose_rows(self, req_ids, rows, token_ids, num_tokens, prompt_lens=None,
                     batch_size: int | None = None) -> dict[int, list[int]]:
        """:meth:`propose_arrays`, returned as {row: draft} for the non-empty drafts."""
        drafts, counts = self.propose_arrays(req_ids, rows, token_ids, num_tokens, prompt_lens,
                                             batch_size)
        out: dict[int, list[int]] = {}
        cl = counts.tolist()
        if any(cl):
            rows = self._key_rows
            for i, (c, d) in enumerate(zip(cl, drafts.tolist())):
                if c:
                    out[rows[i]] = d[:c]
        return out

    def memory_bytes(self) -> int:
        """Every byte the drafter's arrays hold (automata, hash arena, pool tables)."""
        return self.pool.memory_bytes() + self._batch.nbytes + self._tally.nbytes

    def history_bytes(self) -> int:
        """Bytes the store of finished responses holds (0 when history is off)."""
        return self.history.memory_bytes() if self.history is not None else 0
