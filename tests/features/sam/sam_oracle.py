"""Brute-force reference for the suffix automaton: longest earlier-occurring suffix, by scanning."""

from __future__ import annotations


class BruteForceGroup:
    """Texts of several members; positions numbered in insertion order, like the automaton."""

    def __init__(self):
        self.pos_member: list[int] = []
        self.pos_offset: list[int] = []
        self.texts: dict[int, list[int]] = {}

    def add_member(self, m: int) -> None:
        self.texts[m] = []

    def occurrences(self, pattern: list[int], exclude: int) -> list[int]:
        L = len(pattern)
        found = []
        for g, (m, o) in enumerate(zip(self.pos_member, self.pos_offset)):
            if g == exclude or o + 1 < L:
                continue
            if self.texts[m][o + 1 - L: o + 1] == pattern:
                found.append(g)
        return found

    def append(self, m: int, token: int, k: int, min_match: int, recent: bool = True,
               recent_len: int = 5):
        """Append and return (match_len, sources, draft) for the longest earlier suffix.

        The draft source: the first occurrence of the longest match (``recent=False``), or
        the most recent earlier occurrence of the last min(L, recent_len) tokens."""
        text = self.texts[m]
        text.append(token)
        g = len(self.pos_member)
        self.pos_member.append(m)
        self.pos_offset.append(len(text) - 1)
        best_len, best = 0, []
        for L in range(len(text), 0, -1):
            occ = self.occurrences(text[len(text) - L:], exclude=g)
            if occ:
                best_len, best = L, occ
                break
        if best_len == 0:
            return 0, [], []
        if recent:
            short = min(best_len, recent_len)
            src = max(self.occurrences(text[len(text) - short:], exclude=g))
        else:
            src = min(best)
        if best_len < min_match:
            return best_len, best, []
        draft = self.continuation(src, k, m)
        if not draft:  # most recent source is a level sibling's end: use the first one
            draft = self.continuation(min(best), k, m)
        return best_len, best, draft

    def continuation(self, src: int, k: int, m: int) -> list[int]:
        """Tokens after ``src``; inside the current member's own text the match overlaps its
        end, so the text is extrapolated periodically."""
        sm, so = self.pos_member[src], self.pos_offset[src]
        cont = self.texts[sm][so + 1:]
        if sm != m:
            return cont[:k]
        return [cont[j % len(cont)] for j in range(k)]
