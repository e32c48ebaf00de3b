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

    def occurrences(self, pattern: list[int], exclude: int, continued: bool = False) -> list[int]:
        """End positions of ``pattern`` other than ``exclude``; ``continued``: only those
        with a token after them (not a member's current end)."""
        L = len(pattern)
        found = []
        for g, (m, o) in enumerate(zip(self.pos_member, self.pos_offset)):
            if g == exclude or o + 1 < L:
                continue
            if continued and o + 1 >= len(self.texts[m]):
                continue
            if self.texts[m][o + 1 - L: o + 1] == pattern:
                found.append(g)
        return found

    def append(self, m: int, token: int, k: int, min_match: int, recent: bool = True,
               recent_len: int = 5, adaptive: bool = False):
        """Append and return (match_len, sources, draft) for the longest earlier suffix.

        The draft source: the first occurrence of the longest match (``recent=False``), or
        the most recent earlier occurrence *with a continuation* of the last
        min(L, recent_len) tokens; when that string has none (its occurrences are level
        siblings' ends), the longest shorter suffix with a continued occurrence, whose
        length L' then stands for L in the ``min_match`` gate and the ``adaptive`` cap."""
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
        bound = best_len
        if recent:
            short = min(best_len, recent_len)
            cont = self.occurrences(text[len(text) - short:], exclude=g, continued=True)
            while not cont and short > 1:
                short -= 1
                bound = short
                cont = self.occurrences(text[len(text) - short:], exclude=g, continued=True)
            if not cont:
                return best_len, best, []
            src = max(cont)
        else:
            src = min(best)
        if bound < min_match:
            return best_len, best, []
        draft = self.continuation(src, k, m)
        return best_len, best, draft[:bound] if adaptive else draft

    def continuation(self, src: int, k: int, m: int) -> list[int]:
        """Tokens after ``src``; inside the current member's own text the match overlaps its
        end, so the text is extrapolated periodically."""
        sm, so = self.pos_member[src], self.pos_offset[src]
        cont = self.texts[sm][so + 1:]
        if sm != m:
            return cont[:k]
        return [cont[j % len(cont)] for j in range(k)]
