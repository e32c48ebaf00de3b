"""Finished responses kept across RL steps, keyed by prompt, to seed a new group's automaton.

Why: an RL run samples the same prompts every epoch, and GRPO sends a prompt's siblings as
separate requests; a group's automaton is freed with its last member, so without a store a
prompt's next rollouts (the next epoch, or a sibling that starts after the others finished)
draft from their own text only. vLLM's ``suffix`` method keeps a global tree of finished
responses for the same reason (10,000 requests by default); RhymeRL's HistoSpec drafts
from the previous epoch's rollouts of the same prompt.

Bound and eviction: at most ``max_tokens`` response tokens in all and ``per_prompt``
responses per prompt. A prompt's oldest response goes first when it has more than
``per_prompt``; when the total is over budget, the least recently used prompt's oldest
response goes (a prompt is used when a response is added or when it seeds an automaton).
Memory: each token is one int32 (4 bytes) plus, per response, one numpy array header and
deque slot, and per prompt its key (4 bytes per prompt token) and a dict entry:
``memory_bytes`` counts all of them; the benchmark reports bytes per stored token.
"""

from __future__ import annotations

import sys
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np


@dataclass
class HistoryCounters:
    """What the store did, for the drafter's stats and the tests."""
    stored: int = 0  # responses added
    evicted: int = 0  # responses dropped (per-prompt limit or token budget)
    skipped: int = 0  # empty responses, or longer than the whole budget
    seeded: int = 0  # responses handed out to seed an automaton


class ResponseHistory:
    """Finished responses per prompt (prompt token ids as bytes), bounded in tokens."""

    def __init__(self, max_tokens: int, per_prompt: int):
        if max_tokens < 1:
            raise ValueError(f"history max_tokens must be >= 1, got {max_tokens}")
        if per_prompt < 1:
            raise ValueError(f"history per_prompt must be >= 1, got {per_prompt}")
        self.max_tokens = int(max_tokens)
        self.per_prompt = int(per_prompt)
        self._store: OrderedDict[bytes, deque] = OrderedDict()
        self.tokens = 0
        self.counters = HistoryCounters()

    def add(self, prompt: bytes, response: np.ndarray) -> None:
        """Keep ``response`` (int32 token ids after the prompt) for ``prompt``."""
        n = int(response.size)
        if n == 0 or n > self.max_tokens:
            self.counters.skipped += 1
            return
        kept = self._store.get(prompt)
        if kept is None:
            kept = self._store[prompt] = deque()
        else:
            self._store.move_to_end(prompt)
        kept.append(np.array(response, np.int32))  # an owned copy, never a view of a buffer
        self.tokens += n
        self.counters.stored += 1
        if len(kept) > self.per_prompt:
            self._drop_oldest(prompt)
        while self.tokens > self.max_tokens:
            self._drop_oldest(next(iter(self._store)))

    def _drop_oldest(self, prompt: bytes) -> None:
        kept = self._store[prompt]
        self.tokens -= int(kept.popleft().size)
        self.counters.evicted += 1
        if not kept:
            del self._store[prompt]

    def responses(self, prompt: bytes) -> list[np.ndarray]:
        """The prompt's kept responses, oldest first (marks the prompt used)."""
        kept = self._store.get(prompt)
        if not kept:
            return []
        self._store.move_to_end(prompt)
        self.counters.seeded += len(kept)
        return list(kept)

    def prompts(self) -> int:
        return len(self._store)

    def responses_kept(self) -> int:
        return sum(len(v) for v in self._store.values())

    def memory_bytes(self) -> int:
        """Every byte the store holds: token arrays (header and data), deques, keys, the dict."""
        total = sys.getsizeof(self._store)
        for key, kept in self._store.items():
            total += sys.getsizeof(key) + sys.getsizeof(kept)
            total += sum(sys.getsizeof(r) for r in kept)  # an owning array counts its data
        return total

    def clear(self) -> None:
        self._store.clear()
        self.tokens = 0
