"""Incremental (generalized) suffix automaton in flat integer arrays, numba-jitted.

Why this shape: the seed's drafter kept one Python dict per automaton state (~700 bytes
and ~1.5 GC-tracked objects per token, GC stalls at 32K context) and drafted from the
*first* occurrence of the matched suffix. Here every automaton is a few rows of shared
numpy int32/int64 arenas (no per-state or per-token Python object), all requests of a
decode step are handled by one jitted call, and drafts continue the *most recent*
occurrence of the recent context.

One automaton can hold several texts ("members") that grow in any interleaving: it is a
generalized suffix automaton, so GRPO siblings that share a prompt draft from each
other's generated text without any history being copied. A member's tokens live once, in
the automaton's token arena, as a linked list in insertion order (``T[pos] = token,
next position of the same member``).

Layout (bytes per token of context on real code text at 32K tokens: ~1.43 states,
~0.75 listed edges, ~0.4 hash entries): states are 6 int32 (LEN, LINK, FIRST, LAST and
the edge fields A, B); ~88% of states have exactly one outgoing edge, which lives inline
in the state row (A = token, B = target). States with more edges keep them in an edge
list (rows TOK, TO, NXT; A = LISTED, B = head); above ``SMALL_DEGREE`` edges they are also
indexed by a packed open-addressing hash whose 8-byte entries hold key and edge id.

All automata of a pool share four arenas (states, edges, tokens, hash); an automaton owns
one segment of each, relocated (x1.25, the hash x1.5) when full and returned when it is
freed, with compaction once holes dominate. A decode step is one jitted call over plain
numpy arrays through numba's compiled entry point (a typed list of per-automaton arrays
costs ~8 us per argument just to unbox).

Which occurrence is drafted from: FIRST (earliest end position) is kept for every state;
LAST (most recent end position) is kept exact for every state whose shortest string is at
most ``recent_len`` tokens long -- exactly the states a draft consults. Each member tracks
the state holding its last ``recent_len`` tokens (O(1) per token) and refreshes LAST on
that state's <= recent_len + 1 suffix-link ancestors, so the bookkeeping per token is
bounded however long the repeats are (the seed walked every suffix link). The draft
continues the most recent earlier occurrence of the last min(L, recent_len) tokens, L
being the longest earlier-occurring suffix; with the default recent_len (32) that is the
most recent occurrence of the longest match in all but long verbatim copies. (Small
recent_len values predict better token by token but worse in a speculative replay: see
``benchmarks/bench_sam.py``.) Appending is amortized O(1) (the classic SAM bound),
drafting O(k). When the source occurrence overlaps the end of the member's own text (a
loop), the draft continues periodically.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# state columns; EDGE_A >= 0: one edge (token EDGE_A -> state EDGE_B), else a mode below
LEN, LINK, FIRST, LAST, EDGE_A, EDGE_B = 0, 1, 2, 3, 4, 5
S_COLS = 6
NO_EDGES, LISTED, HASHED = -1, -2, -3  # LISTED/HASHED: EDGE_B heads the state's edge list
# edge columns
TOK, TO, NXT = 0, 1, 2
E_COLS = 3
# token arena columns
TTOKEN, TNEXT = 0, 1
T_COLS = 2
# automaton meta columns: counts, flags, then (base, capacity) of its segment in each arena
M_NS, M_NE, M_NT, M_NH, M_ALIVE, M_MEMBERS, M_FULL = 0, 1, 2, 3, 4, 5, 6
M_SB, M_SC, M_EB, M_EC, M_TB, M_TC, M_HB, M_HC = 7, 8, 9, 10, 11, 12, 13, 14
META_COLS = 15
_ARENAS = ("S", "E", "T", "H")
_BASE_COL = {"S": M_SB, "E": M_EB, "T": M_TB, "H": M_HB}
# member columns: automaton, its text's state, its last arena position, tokens seen,
# alive, and the state holding its last min(n, recent_len) tokens (with that length)
B_AID, B_STATE, B_POS, B_NTOK, B_ALIVE, B_SHORT, B_SHORTLEN = 0, 1, 2, 3, 4, 5, 6
MEMBER_COLS = 7

SMALL_DEGREE = 4
TOKEN_BITS = 19  # token ids must be < 2**19 (524,288); checked in the kernel
ID_BITS = 22  # states and listed edges per automaton must be < 2**22 - 1
MAX_IDS = (1 << ID_BITS) - 2
_ID_MASK = np.int64((1 << ID_BITS) - 1)
_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)
# columns of the kernel's output rows: draft length, match length, then the draft
OUT_N, OUT_MATCH, OUT_DRAFT = 0, 1, 2
# ingest return codes (>= 0: the automaton whose segments must grow)
DONE, BAD_TOKEN, DEAD_MEMBER = -1, -2, -3


@njit(cache=True, inline="always")
def _key(s, c):
    return ((np.int64(s) + 1) << TOKEN_BITS) | c


@njit(cache=True, inline="always")
def _slot(key, cap):
    """Multiplicative hash mapped onto [0, cap) without a power-of-two size (fastrange)."""
    h = (np.uint64(key) * _HASH_MUL) >> np.uint64(32)
    return np.int64((h * np.uint64(cap)) >> np.uint64(32))


@njit(cache=True)
def _hash_get(H, key):
    """Edge id stored under ``key``, or -1. An entry packs (key << ID_BITS) | edge; 0 = empty."""
    cap = H.shape[0]
    i = _slot(key, cap)
    while True:
        v = H[i]
        if v == 0:
            return np.int64(-1)
        if (v >> ID_BITS) == key:
            return v & _ID_MASK
        i += 1
        if i == cap:
            i = 0


@njit(cache=True)
def _hash_put(H, key, e):
    cap = H.shape[0]
    i = _slot(key, cap)
    while H[i] != 0:
        i += 1
        if i == cap:
            i = 0
    H[i] = (key << ID_BITS) | e


# An edge "handle": >= 0 is a row of E; <= -2 is the inline edge of state (-2 - handle).
@njit(cache=True)
def _find(S, E, H, s, c):
    """Handle of the transition (s, c), or -1."""
    a = S[s, EDGE_A]
    if a >= 0:
        return np.int64(-2 - s) if a == c else np.int64(-1)
    if a == NO_EDGES:
        return np.int64(-1)
    if a == HASHED:
        return _hash_get(H, _key(s, c))
    e = np.int64(S[s, EDGE_B])
    while e != -1:
        if E[e, TOK] == c:
            return e
        e = np.int64(E[e, NXT])
    return np.int64(-1)


@njit(cache=True, inline="always")
def _target(S, E, h):
    return np.int64(S[-2 - h, EDGE_B]) if h <= -2 else np.int64(E[h, TO])


@njit(cache=True, inline="always")
def _retarget(S, E, h, to):
    if h <= -2:
        S[-2 - h, EDGE_B] = to
    else:
        E[h, TO] = to


@njit(cache=True)
def _degree(S, E, s):
    a = S[s, EDGE_A]
    if a >= 0:
        return 1
    if a == NO_EDGES:
        return 0
    d = 0
    e = S[s, EDGE_B]
    while e != -1:
        d += 1
        e = E[e, NXT]
    return d


@njit(cache=True)
def _push_edge(E, meta, a, c, to, nxt):
    e = meta[a, M_NE]
    meta[a, M_NE] = e + 1
    E[e, TOK] = c
    E[e, TO] = to
    E[e, NXT] = nxt
    return e


@njit(cache=True)
def _add_edge(S, E, H, meta, a, s, c, to):
    """Add edge (s, c) -> to. Capacity for edge rows and hash entries is ensured by the caller."""
    mode = S[s, EDGE_A]
    if mode == NO_EDGES:
        S[s, EDGE_A] = c
        S[s, EDGE_B] = to
        return
    if mode >= 0:  # second edge: move the inline one into a list
        e1 = _push_edge(E, meta, a, mode, S[s, EDGE_B], -1)
        S[s, EDGE_B] = _push_edge(E, meta, a, c, to, e1)
        S[s, EDGE_A] = LISTED
        return
    e = _push_edge(E, meta, a, c, to, S[s, EDGE_B])
    S[s, EDGE_B] = e
    if mode == HASHED:
        _hash_put(H, _key(s, c), e)
        meta[a, M_NH] += 1
        return
    d = 0
    f = e
    while f != -1 and d <= SMALL_DEGREE:
        d += 1
        f = E[f, NXT]
    if d > SMALL_DEGREE:  # becomes a hashed state: index all its edges
        S[s, EDGE_A] = HASHED
        f = e
        while f != -1:
            _hash_put(H, _key(s, E[f, TOK]), f)
            meta[a, M_NH] += 1
            f = E[f, NXT]


@njit(cache=True)
def _copy_edges(S, E, H, meta, a, q, dst):
    mode = S[q, EDGE_A]
    if mode >= 0:
        S[dst, EDGE_A] = mode
        S[dst, EDGE_B] = S[q, EDGE_B]
    elif mode != NO_EDGES:
        f = S[q, EDGE_B]
        while f != -1:
            _add_edge(S, E, H, meta, a, dst, E[f, TOK], E[f, TO])
            f = E[f, NXT]


@njit(cache=True)
def _new_state(S, meta, a, length, link, first, last):
    s = meta[a, M_NS]
    meta[a, M_NS] = s + 1
    S[s, LEN] = length
    S[s, LINK] = link
    S[s, FIRST] = first
    S[s, LAST] = last
    S[s, EDGE_A] = NO_EDGES
    S[s, EDGE_B] = -1
    return s


@njit(cache=True)
def _rehash_into(HA, ob, ocap, nb, ncap):
    new = HA[nb:nb + ncap]
    new[:] = 0
    used = 0
    for i in range(ob, ob + ocap):
        v = HA[i]
        if v != 0:
            _hash_put(new, v >> ID_BITS, v & _ID_MASK)
            used += 1
    return used


@njit(cache=True)
def _split(S, E, H, meta, a, p, q, c, length):
    """Clone q as a state of LEN ``length``; redirect p's suffix chain (c -> q) to it."""
    clone = _new_state(S, meta, a, length, S[q, LINK], S[q, FIRST], S[q, LAST])
    _copy_edges(S, E, H, meta, a, q, clone)
    while p != -1:
        h = _find(S, E, H, p, c)
        if h == -1 or _target(S, E, h) != q:
            break
        _retarget(S, E, h, clone)
        p = S[p, LINK]
    S[q, LINK] = clone
    return clone


@njit(cache=True)
def _extend(S, E, H, meta, a, last, c, pos, need):
    """Append token ``c`` (at arena position ``pos``) to the member whose state is ``last``.

    Returns (state of the member's new text, match state): the match state's strings are
    the suffixes of the new text that also end at an earlier position; its LAST/FIRST are
    still the pre-append values when this returns. Returns (-1, -1) without writing
    anything when a segment is too small (``need`` then holds the required states, edge
    rows and hash slots), (-2, -2) when the automaton reached its id limit.
    """
    # -- read-only pass: how many edge rows and hash entries can this append create? ------
    h0 = _find(S, E, H, last, c)
    walk = 0
    copied = 0
    if h0 == -1:
        p = last
        h = np.int64(-1)
        while p != -1:
            h = _find(S, E, H, p, c)
            if h != -1:
                break
            walk += 1
            p = S[p, LINK]
        if p != -1:
            q = _target(S, E, h)
            if S[p, LEN] + 1 != S[q, LEN]:
                copied = _degree(S, E, q) + 1  # q may itself gain an edge in the walk
    else:
        q = _target(S, E, h0)
        if S[last, LEN] + 1 != S[q, LEN]:
            copied = _degree(S, E, q)
    need_s = meta[a, M_NS] + 2
    need_e = meta[a, M_NE] + 2 * walk + copied
    need_h = meta[a, M_NH] + walk * (SMALL_DEGREE + 1) + copied
    if need_s > MAX_IDS or need_e > MAX_IDS:
        return np.int64(-2), np.int64(-2)
    if need_s > S.shape[0] or need_e > E.shape[0] or need_h * 10 > H.shape[0] * 7:
        need[0] = need_s
        need[1] = need_e
        need[2] = need_h * 10 // 7 + 1
        return np.int64(-1), np.int64(-1)

    if h0 != -1:
        # The member's whole new text already occurred elsewhere (e.g. a sibling's prompt).
        q = _target(S, E, h0)
        if S[last, LEN] + 1 == S[q, LEN]:
            return q, q
        clone = _split(S, E, H, meta, a, last, q, c, S[last, LEN] + 1)
        return clone, clone

    cur = _new_state(S, meta, a, S[last, LEN] + 1, 0, pos, pos)
    p = last
    while p != -1:
        h = _find(S, E, H, p, c)
        if h != -1:
            break
        _add_edge(S, E, H, meta, a, p, c, cur)
        p = S[p, LINK]
    if p == -1:
        return cur, np.int64(0)
    q = _target(S, E, h)
    if S[p, LEN] + 1 == S[q, LEN]:
        S[cur, LINK] = q
        return cur, q
    clone = _split(S, E, H, meta, a, p, q, c, S[p, LEN] + 1)
    S[cur, LINK] = clone
    return cur, clone


@njit(cache=True)
def _ingest_batch(meta, members, SA, EA, TA, HA, member_ids, tok_flat, tok_off, k,
                  min_match, recent_len, from_first, adaptive, out, resume):
    """Append each member's new tokens, then draft up to ``k`` tokens for it.

    member_ids[i]'s new tokens are tok_flat[tok_off[i]:tok_off[i+1]]; its draft goes to
    out[i, OUT_DRAFT:OUT_DRAFT + out[i, OUT_N]] and the matched suffix length to
    out[i, OUT_MATCH] (0: no match).
    k == 0 only ingests. Starts at (member resume[0], token resume[1]). Returns DONE, or
    BAD_TOKEN / DEAD_MEMBER (resume[0:2] says where), or the automaton whose segments must
    grow to resume[2:6] rows (states, edges, tokens, hash slots); resume[0:2] then says
    where to continue.
    """
    need = np.zeros(3, np.int64)
    limit = 1 << TOKEN_BITS
    for i in range(resume[0], member_ids.shape[0]):
        m = member_ids[i]
        if m < 0 or m >= members.shape[0] or members[m, B_ALIVE] == 0:
            resume[0] = i
            return DEAD_MEMBER
        a = members[m, B_AID]
        S = SA[meta[a, M_SB]:meta[a, M_SB] + meta[a, M_SC]]
        E = EA[meta[a, M_EB]:meta[a, M_EB] + meta[a, M_EC]]
        T = TA[meta[a, M_TB]:meta[a, M_TB] + meta[a, M_TC]]
        H = HA[meta[a, M_HB]:meta[a, M_HB] + meta[a, M_HC]]
        j0 = tok_off[i] if i != resume[0] else max(tok_off[i], resume[1])
        out[i, OUT_N] = 0
        out[i, OUT_MATCH] = 0
        for j in range(j0, tok_off[i + 1]):
            c = tok_flat[j]
            if c < 0 or c >= limit:
                resume[0] = i
                resume[1] = j
                return BAD_TOKEN
            if meta[a, M_FULL]:  # at its id limit: keeps counting, stops learning
                members[m, B_NTOK] += 1
                continue
            last = members[m, B_STATE]
            ppos = members[m, B_POS]
            pos = meta[a, M_NT]
            if pos + 1 > T.shape[0]:
                resume[0] = i
                resume[1] = j
                resume[2] = 0
                resume[3] = 0
                resume[4] = pos + 1
                resume[5] = 0
                return a
            new_last, match = _extend(S, E, H, meta, a, last, c, pos, need)
            if new_last == -2:
                meta[a, M_FULL] = 1
                members[m, B_NTOK] += 1
                continue
            if new_last < 0:
                resume[0] = i
                resume[1] = j
                resume[2] = need[0]
                resume[3] = need[1]
                resume[4] = 0
                resume[5] = need[2]
                return a
            meta[a, M_NT] = pos + 1
            T[pos, TTOKEN] = c
            T[pos, TNEXT] = -1
            if ppos >= 0:
                T[ppos, TNEXT] = pos
            members[m, B_STATE] = new_last
            members[m, B_POS] = pos
            members[m, B_NTOK] += 1
            # the state holding the last min(n, recent_len) tokens
            v = _target(S, E, _find(S, E, H, members[m, B_SHORT], c))
            vlen = members[m, B_SHORTLEN] + 1
            if vlen > recent_len:
                vlen = recent_len
                if S[S[v, LINK], LEN] >= recent_len:
                    v = np.int64(S[v, LINK])
            members[m, B_SHORT] = v
            members[m, B_SHORTLEN] = vlen
            mlen = S[match, LEN]
            if from_first:
                src = S[match, FIRST]
            elif mlen >= recent_len:
                src = S[v, LAST]  # most recent earlier end of the last recent_len tokens
            else:
                src = S[match, LAST]
            u = v
            while u > 0:
                S[u, LAST] = pos
                u = S[u, LINK]
            if j == tok_off[i + 1] - 1:
                out[i, OUT_MATCH] = mlen
                n = 0
                if k > 0 and match != 0 and mlen >= min_match:
                    first = T[src, TNEXT]
                    if first < 0:
                        # the most recent occurrence is the current end of a sibling that
                        # is level with this member (nothing follows it yet): use the
                        # first occurrence of the match, which has a continuation
                        first = T[S[match, FIRST], TNEXT]
                    p = first
                    # confidence: a match of length L proposes at most L tokens
                    kk = min(k, mlen) if adaptive else k
                    while n < kk and p >= 0:
                        out[i, OUT_DRAFT + n] = T[p, TTOKEN]
                        n += 1
                        # A match inside the member's own recent text overlaps its end:
                        # the text is periodic there, so continue from the source again.
                        p = first if p == pos else T[p, TNEXT]
                out[i, OUT_N] = n
    return DONE


_ENTRY = [None]  # compiled entry point of _ingest_batch (see ingest)
_INIT = {"S": 32, "E": 16, "T": 32, "H": 16}
_COLS = {"S": S_COLS, "E": E_COLS, "T": T_COLS}
_USED_COL = {"S": M_NS, "E": M_NE, "T": M_NT}
_ROW_BYTES = {"S": S_COLS * 4, "E": E_COLS * 4, "T": T_COLS * 4, "H": 8}


_I32, _I64 = np.dtype(np.int32), np.dtype(np.int64)


def _as_1d(x, dtype):
    """``x`` as a contiguous 1-d array of ``dtype``; free when it already is one (the
    compiled entry point does not check layouts, so this must)."""
    if type(x) is np.ndarray and x.dtype is dtype and x.strides == (dtype.itemsize,):
        return x
    return np.ascontiguousarray(x, dtype).reshape(-1)


class AutomatonPool:
    """Many suffix automata (one per request, or one per sibling group) in shared arenas.

    Python objects exist per automaton and per member, never per token or per state.
    ``ingest`` appends tokens to many members and drafts for all of them in one jitted call.
    """

    def __init__(self, *, min_match: int = 1, recent_len: int = 32, from_first: bool = False,
                 adaptive: bool = False):
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        if recent_len < 1:
            raise ValueError(f"recent_len must be >= 1, got {recent_len}")
        self.min_match = int(min_match)
        self.recent_len = int(recent_len)
        self.from_first = bool(from_first)
        self.adaptive = bool(adaptive)
        self.SA = np.zeros((1024, S_COLS), np.int32)
        self.EA = np.zeros((1024, E_COLS), np.int32)
        self.TA = np.zeros((1024, T_COLS), np.int32)
        self.HA = np.zeros(1024, np.int64)
        self._top = {"S": 0, "E": 0, "T": 0, "H": 0}
        self._waste = {"S": 0, "E": 0, "T": 0, "H": 0}
        self.meta = np.zeros((8, META_COLS), np.int64)
        self.members = np.zeros((8, MEMBER_COLS), np.int64)
        self._free_automata: list[int] = []
        self._free_members: list[int] = []
        self._n_automata = 0
        self._n_members = 0
        self._resume = np.zeros(6, np.int64)
        self._out = np.zeros((8, OUT_DRAFT + 4), np.int32)

    # -- arenas ---------------------------------------------------------------------------------
    def _arena(self, kind):
        return {"S": self.SA, "E": self.EA, "T": self.TA, "H": self.HA}[kind]

    def _set_arena(self, kind, arr):
        setattr(self, {"S": "SA", "E": "EA", "T": "TA", "H": "HA"}[kind], arr)

    def _reserve(self, kind: str, rows: int) -> int:
        """Base of ``rows`` fresh rows at the top of an arena (compacting or growing it)."""
        arena = self._arena(kind)
        if self._top[kind] + rows > arena.shape[0]:
            if self._waste[kind] > self._top[kind] // 2:
                self._compact(kind)
                arena = self._arena(kind)
            if self._top[kind] + rows > arena.shape[0]:
                size = max(self._top[kind] + rows, arena.shape[0] * 3 // 2)
                new = np.zeros((size,) + arena.shape[1:], arena.dtype)
                new[: self._top[kind]] = arena[: self._top[kind]]
                self._set_arena(kind, new)
        base = self._top[kind]
        self._top[kind] += rows
        return base

    def _compact(self, kind: str) -> None:
        """Move every live segment of one arena down over the holes."""
        bcol = _BASE_COL[kind]
        live = [a for a in range(self._n_automata) if self.meta[a, M_ALIVE]]
        live.sort(key=lambda a: self.meta[a, bcol])
        arena = self._arena(kind)
        top = 0
        for a in live:
            b, cap = int(self.meta[a, bcol]), int(self.meta[a, bcol + 1])
            if b != top:
                arena[top:top + cap] = arena[b:b + cap].copy()
                self.meta[a, bcol] = top
            top += cap
        self._top[kind] = top
        self._waste[kind] = 0

    def _grow(self, a: int, states: int, edges: int, tokens: int, hash_slots: int) -> None:
        for kind, need in (("S", states), ("E", edges), ("T", tokens)):
            bcol = _BASE_COL[kind]
            cap = int(self.meta[a, bcol + 1])
            if need <= cap:
                continue
            new_cap = max(need, cap + cap // 4 + 16)
            base = self._reserve(kind, new_cap)
            old = int(self.meta[a, bcol])  # after _reserve: compaction may have moved it
            arena = self._arena(kind)
            used = int(self.meta[a, _USED_COL[kind]])
            arena[base:base + used] = arena[old:old + used]
            self._waste[kind] += cap
            self.meta[a, bcol] = base
            self.meta[a, bcol + 1] = new_cap
        cap = int(self.meta[a, M_HC])
        if hash_slots > cap:
            new_cap = max(hash_slots, cap * 3 // 2)
            base = self._reserve("H", new_cap)
            self.meta[a, M_NH] = _rehash_into(self.HA, int(self.meta[a, M_HB]), cap, base, new_cap)
            self._waste["H"] += cap
            self.meta[a, M_HB] = base
            self.meta[a, M_HC] = new_cap

    # -- lifecycle -------------------------------------------------------------------------
    def new_automaton(self) -> int:
        if self._free_automata:
            a = self._free_automata.pop()
        else:
            a = self._n_automata
            self._n_automata += 1
            if a >= self.meta.shape[0]:
                self.meta = np.concatenate([self.meta, np.zeros_like(self.meta)])
        self.meta[a] = 0
        for kind in _ARENAS:
            bcol = _BASE_COL[kind]
            self.meta[a, bcol] = self._reserve(kind, _INIT[kind])
            self.meta[a, bcol + 1] = _INIT[kind]
        hb = int(self.meta[a, M_HB])
        self.HA[hb:hb + _INIT["H"]] = 0
        sb = int(self.meta[a, M_SB])
        self.SA[sb] = (0, -1, -1, -1, NO_EDGES, -1)  # root
        self.meta[a, M_NS] = 1
        self.meta[a, M_ALIVE] = 1
        return a

    def new_member(self, automaton: int) -> int:
        if not self.meta[automaton, M_ALIVE]:
            raise ValueError(f"automaton {automaton} is not alive")
        if self._free_members:
            m = self._free_members.pop()
        else:
            m = self._n_members
            self._n_members += 1
            if m >= self.members.shape[0]:
                self.members = np.concatenate([self.members, np.zeros_like(self.members)])
        self.members[m] = (automaton, 0, -1, 0, 1, 0, 0)
        self.meta[automaton, M_MEMBERS] += 1
        return m

    def release_member(self, member: int, *, keep_text: bool = False) -> None:
        """Forget a member; its automaton is freed with its last member unless ``keep_text``."""
        if not self.members[member, B_ALIVE]:
            return
        a = int(self.members[member, B_AID])
        self.members[member] = (0, 0, -1, 0, 0, 0, 0)
        self._free_members.append(member)
        self.meta[a, M_MEMBERS] -= 1
        if self.meta[a, M_MEMBERS] == 0 and not keep_text:
            self.free_automaton(a)

    def free_automaton(self, automaton: int) -> None:
        a = automaton
        if not self.meta[a, M_ALIVE]:
            return
        for m in np.nonzero((self.members[:, B_ALIVE] == 1) & (self.members[:, B_AID] == a))[0]:
            self.members[m] = (0, 0, -1, 0, 0, 0, 0)
            self._free_members.append(int(m))
        for kind in _ARENAS:
            self._waste[kind] += int(self.meta[a, _BASE_COL[kind] + 1])
        self.meta[a] = 0
        self._free_automata.append(a)
        if not self.meta[: self._n_automata, M_ALIVE].any():  # empty pool: start over small
            self.__init__(min_match=self.min_match, recent_len=self.recent_len,
                          from_first=self.from_first, adaptive=self.adaptive)

    # -- work --------------------------------------------------------------------------------
    def ingest(self, member_ids, tok_flat, tok_off, k: int):
        """Append tokens and draft. Returns (drafts[B, k], n_draft[B], match_len[B]).

        ``member_ids[i]`` gets ``tok_flat[tok_off[i]:tok_off[i + 1]]``. The returned arrays
        are views of a buffer the pool reuses: read them before the next call. Bad token
        ids and released members raise ValueError.
        """
        member_ids = _as_1d(member_ids, _I64)
        tok_flat = _as_1d(tok_flat, _I32)
        tok_off = _as_1d(tok_off, _I64)
        b = member_ids.shape[0]
        out = self._out
        if out.shape[0] < b or out.shape[1] < OUT_DRAFT + k:
            out = self._out = np.zeros((max(b, 2 * out.shape[0]), OUT_DRAFT + max(k, out.shape[1] - OUT_DRAFT)),
                                       np.int32)
        resume = self._resume
        resume[0] = resume[1] = 0
        while True:
            args = (self.meta, self.members, self.SA, self.EA, self.TA, self.HA, member_ids,
                    tok_flat, tok_off, k, self.min_match, self.recent_len, self.from_first,
                    self.adaptive, out, resume)
            fn = _ENTRY[0]
            if fn is None:
                a = _ingest_batch(*args)
                # every argument's type is fixed above, so later calls can skip numba's
                # per-call type dispatch (~1 us per argument) and enter the compiled code
                from numba import typeof
                _ENTRY[0] = _ingest_batch.overloads[tuple(typeof(x) for x in args)].entry_point
            else:
                a = fn(*args)
            if a == DONE:
                return out[:b, OUT_DRAFT:OUT_DRAFT + k], out[:b, OUT_N], out[:b, OUT_MATCH]
            if a == BAD_TOKEN:
                raise ValueError(f"token ids must be in [0, {1 << TOKEN_BITS}); got "
                                 f"{int(tok_flat[resume[1]])} for member {int(member_ids[resume[0]])}")
            if a == DEAD_MEMBER:
                raise ValueError(f"ingest got a released member id: {int(member_ids[resume[0]])}")
            self._grow(int(a), int(resume[2]), int(resume[3]), int(resume[4]), int(resume[5]))

    def extend_one(self, member: int, tokens, k: int = 0):
        """Convenience: one member, returns (draft list, match length)."""
        toks = np.asarray(tokens, np.int32)
        d, n, mlen = self.ingest(np.array([member], np.int64), toks,
                                 np.array([0, toks.size], np.int64), k)
        return d[0, : n[0]].tolist(), int(mlen[0])

    # -- accounting --------------------------------------------------------------------------
    def automaton_bytes(self, a: int) -> int:
        """Bytes of the segments this automaton owns (capacity: up to 1.25x what it uses,
        the hash up to 1.5x)."""
        if not self.meta[a, M_ALIVE]:
            return 0
        m = self.meta[a]
        return int(sum(m[_BASE_COL[kind] + 1] * _ROW_BYTES[kind] for kind in _ARENAS))

    def automaton_used_bytes(self, a: int) -> int:
        """Bytes of rows actually in use (the hash counted at its capacity)."""
        if not self.meta[a, M_ALIVE]:
            return 0
        m = self.meta[a]
        return int(m[M_NS] * _ROW_BYTES["S"] + m[M_NE] * _ROW_BYTES["E"]
                   + m[M_NT] * _ROW_BYTES["T"] + m[M_HC] * _ROW_BYTES["H"])

    def memory_bytes(self) -> int:
        """Every byte this pool holds in its arrays (arena capacity, holes included)."""
        return int(self.SA.nbytes + self.EA.nbytes + self.TA.nbytes + self.HA.nbytes
                   + self.meta.nbytes + self.members.nbytes)

    def is_full(self, a: int) -> bool:
        """An automaton at its id limit keeps counting tokens but no longer learns them."""
        return bool(self.meta[a, M_FULL])

    def tokens(self, a: int) -> int:
        return int(self.meta[a, M_NT])

    def live_automata(self) -> int:
        return int(self.meta[: self._n_automata, M_ALIVE].sum())

    def live_members(self) -> int:
        return int(self.members[: self._n_members, B_ALIVE].sum())
