"""Request-level SAM drafter: request ids -> automaton members, sibling groups, cleanup.

Shared by the vLLM proposer (GPU/CPU model runner, both vLLM versions) and the
vLLM-Ascend proposers. Per decode step it does O(batch) Python bookkeeping (dict lookups)
and one jitted call that gathers each request's new tokens straight from the runner's
token matrix, appends them and drafts.

Group mode: requests whose prompt token ids are identical (vLLM ``n > 1`` children, or GRPO
rollouts sent as separate requests with the same prompt) share one generalized automaton;
each drafts from its own text and from every sibling's text, live or finished. A group's
memory is released when its last member finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import njit

from .automaton import B_NTOK, AutomatonPool


@njit(cache=True)
def _gather_rows(token_ids, rows, starts, ends, out_flat, out_off):
    n = 0
    for i in range(rows.shape[0]):
        out_off[i] = n
        r = rows[i]
        for j in range(starts[i], ends[i]):
            out_flat[n] = token_ids[r, j]
            n += 1
    out_off[rows.shape[0]] = n
    return n


@dataclass
class DrafterStats:
    """Counted by the drafter itself, so they exist on every vLLM version."""

    steps: int = 0
    proposals: int = 0  # requests that got a non-empty draft
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # draft tokens confirmed by the next step's tokens
    verified_drafts: int = 0  # drafts whose outcome was observed
    inactive_steps: int = 0  # steps over the batch-size threshold (ingest only)
    per_request_accepted: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k != "per_request_accepted"}
        d["acceptance_share"] = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
        return d


class SamDrafter:
    """Drafts for a batch of requests identified by id, given their token rows."""

    def __init__(self, k: int, *, min_match: int = 1, group: bool = False,
                 batch_threshold: int = 0, recent_len: int = 32, adaptive: bool = True,
                 max_model_len: int | None = None):
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 for SAM, got {k}")
        self.k = int(k)
        self.group = bool(group)
        self.batch_threshold = int(batch_threshold)
        self.max_model_len = max_model_len
        self.pool = AutomatonPool(min_match=min_match, recent_len=recent_len, adaptive=adaptive)
        self.member_of: dict[str, int] = {}
        self.group_of: dict[str, bytes | str] = {}
        self.groups: dict[bytes | str, int] = {}  # group key -> automaton id
        self.last_draft: dict[str, tuple[int, int]] = {}  # req -> (tokens seen, draft len)
        self.stats = DrafterStats()
        self._flat = np.zeros(4096, np.int32)

    # -- membership -----------------------------------------------------------------------------
    def _member_for(self, req_id: str, prompt: np.ndarray | None) -> int:
        m = self.member_of.get(req_id)
        if m is not None:
            return m
        key: bytes | str = req_id
        if self.group and prompt is not None and prompt.size:
            key = np.ascontiguousarray(prompt, np.int32).tobytes()
        a = self.groups.get(key)
        if a is None:
            a = self.pool.new_automaton()
            self.groups[key] = a
        m = self.pool.new_member(a)
        self.member_of[req_id] = m
        self.group_of[req_id] = key
        return m

    def release(self, req_id: str) -> None:
        """Forget a finished/aborted request (its group goes with its last member)."""
        m = self.member_of.pop(req_id, None)
        self.last_draft.pop(req_id, None)
        key = self.group_of.pop(req_id, None)
        if m is None:
            return
        self.pool.release_member(m)
        if key is not None and not self.pool.meta[self.groups[key], 4]:  # M_ALIVE
            del self.groups[key]

    def retain_only(self, live_req_ids) -> None:
        """Release every request not in ``live_req_ids`` (finished, aborted or preempted;
        a preempted request is simply re-ingested from its token row when it returns)."""
        if len(self.member_of) <= len(live_req_ids) and all(r in live_req_ids for r in self.member_of):
            return
        live = set(live_req_ids)
        for r in [r for r in self.member_of if r not in live]:
            self.release(r)

    # -- the step ---------------------------------------------------------------------------------
    def propose_rows(self, req_ids, rows, token_ids: np.ndarray, num_tokens: np.ndarray,
                     prompt_lens=None, batch_size: int | None = None) -> dict[int, list[int]]:
        """Ingest each request's tokens up to ``num_tokens[row]`` and draft.

        ``req_ids[i]`` lives in ``token_ids[rows[i]]``; ``prompt_lens[i]`` (optional) is its
        prompt length, used as the sibling-group key. Returns {row: draft} for non-empty drafts.
        """
        st = self.stats
        st.steps += 1
        n = len(req_ids)
        if n == 0:
            return {}
        rows = np.asarray(rows, np.int64)
        members = np.empty(n, np.int64)
        for i, r in enumerate(req_ids):
            m = self.member_of.get(r)
            if m is None:
                prompt = None
                if self.group and prompt_lens is not None:
                    prompt = token_ids[rows[i], : int(prompt_lens[i])]
                m = self._member_for(r, prompt)
            members[i] = m
        starts = self.pool.members[members, B_NTOK]
        ends = np.asarray(num_tokens, np.int64)[rows]
        ends = np.maximum(ends, starts)
        total = int((ends - starts).sum())
        if total > self._flat.size:
            self._flat = np.zeros(max(total, 2 * self._flat.size), np.int32)
        off = np.empty(n + 1, np.int64)
        _gather_rows(token_ids, rows, starts, ends, self._flat, off)
        # acceptance bookkeeping: tokens that arrived since the last draft
        for i, r in enumerate(req_ids):
            prev = self.last_draft.pop(r, None)
            if prev is not None and prev[0] == starts[i]:
                got = int(ends[i] - starts[i]) - 1
                acc = max(0, min(got, prev[1]))
                st.accepted_tokens += acc
                st.verified_drafts += 1
                st.per_request_accepted[r] = st.per_request_accepted.get(r, 0) + acc
        active = self.batch_threshold <= 0 or (batch_size if batch_size is not None else n) \
            <= self.batch_threshold
        if not active:
            st.inactive_steps += 1
        k = self.k if active else 0
        drafts, counts, _ = self.pool.ingest(members, self._flat[:total], off, k)
        out: dict[int, list[int]] = {}
        if not k:
            return out
        for i in np.nonzero(counts)[0]:
            c = int(counts[i])
            if self.max_model_len is not None:
                c = min(c, self.max_model_len - int(ends[i]) - 1)
            if c <= 0:
                continue
            r = req_ids[i]
            out[int(rows[i])] = drafts[i, :c].tolist()
            self.last_draft[r] = (int(ends[i]), c)
            st.proposals += 1
            st.drafted_tokens += c
        return out

    def memory_bytes(self) -> int:
        return self.pool.memory_bytes()
