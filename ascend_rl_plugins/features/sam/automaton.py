"""Incremental (generalized) suffix automaton in flat integer arrays, numba-jitted.

Why this shape: the seed's drafter kept one Python dict per automaton state (~700 bytes
and ~1.5 GC-tracked objects per token, GC stalls at 32K context) and drafted from the
*first* occurrence of the matched suffix. Here every automaton is a handful of numpy
int32/int64 arrays (no per-state or per-token Python object), all requests of a decode
step are handled by one jitted call, and drafts come from the *most recent* occurrence.

One automaton can hold several texts ("members") that grow in any interleaving: it is a
generalized suffix automaton, so GRPO siblings that share a prompt draft from each
other's generated text without any history being copied. A member's tokens live once, in
the automaton's token arena, as a linked list in insertion order (``T[pos] = token,
next position of the same member``).

All automata of a pool live in five shared arenas (states, edges, tokens, hash keys,
hash values); an automaton owns one segment of each, relocated (doubled) when full and
returned when the automaton is freed, with compaction once holes dominate. A decode step
is then one jitted call over plain numpy arrays (a numba typed list of per-automaton
arrays costs ~8 us per argument just to unbox).

Per state (S, int32 rows): LEN (longest string), LINK (suffix link), FIRST (earliest end
position = first occurrence), LAST (most recent end position), HEAD (edge list), DEG.
Edges (E, int32 rows): TOK, TO, NEXT (next edge of the same state). States with more than
``SMALL_DEGREE`` edges are also indexed in an open-addressing hash ((state, token) ->
edge); smaller ones are scanned, which keeps the common 1-3 edge states cheap in memory.

Per appended token the work is amortized O(1) (the classic SAM bound: new edges and the
suffix-link walk are amortized constant), plus the LAST update, which walks at most
``walk_limit`` suffix links (exact "most recent" whenever the link chain above the new
state is no deeper than that; beyond it LAST keeps an older -- still genuine --
occurrence). Drafting is O(k) after the match: the match is the new state's suffix link,
whose LEN is the longest suffix that occurred before. When the source occurrence overlaps
the end of the member's own text (a loop), the draft continues periodically.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# state columns
LEN, LINK, FIRST, LAST, HEAD, DEG = 0, 1, 2, 3, 4, 5
S_COLS = 6
# edge columns
TOK, TO, NXT = 0, 1, 2
E_COLS = 3
# token arena columns
TTOKEN, TNEXT = 0, 1
T_COLS = 2
# automaton meta columns: counts, then (base, capacity) of its segment in each arena
M_NS, M_NE, M_NT, M_NH, M_ALIVE, M_MEMBERS = 0, 1, 2, 3, 4, 5
M_SB, M_SC, M_EB, M_EC, M_TB, M_TC, M_HB, M_HC = 6, 7, 8, 9, 10, 11, 12, 13
META_COLS = 14
_ARENAS = ("S", "E", "T", "H")
_BASE_COL = {"S": M_SB, "E": M_EB, "T": M_TB, "H": M_HB}
# member columns
B_AID, B_STATE, B_POS, B_NTOK, B_ALIVE = 0, 1, 2, 3, 4
MEMBER_COLS = 5

SMALL_DEGREE = 4
TOKEN_BITS = 21  # token ids must be < 2**21 (2M); checked in ingest
_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)
_EMPTY = np.int64(-1)


@njit(cache=True, inline="always")
def _slot(key, mask):
    h = np.uint64(key) * _HASH_MUL
    return np.int64((h >> np.uint64(29)) & np.uint64(mask))


@njit(cache=True)
def _hash_get(hk, hv, key):
    mask = hk.shape[0] - 1
    i = _slot(key, mask)
    while True:
        k = hk[i]
        if k == key:
            return hv[i]
        if k == _EMPTY:
            return -1
        i = (i + 1) & mask


@njit(cache=True)
def _hash_put(hk, hv, key, val):
    mask = hk.shape[0] - 1
    i = _slot(key, mask)
    while True:
        k = hk[i]
        if k == _EMPTY:
            hk[i] = key
            hv[i] = val
            return 1
        if k == key:
            hv[i] = val
            return 0
        i = (i + 1) & mask


@njit(cache=True)
def _find(S, E, hk, hv, s, c):
    """Edge id of the transition (s, c), or -1."""
    if S[s, DEG] > SMALL_DEGREE:
        return _hash_get(hk, hv, (np.int64(s) << TOKEN_BITS) | c)
    e = S[s, HEAD]
    while e != -1:
        if E[e, TOK] == c:
            return e
        e = E[e, NXT]
    return -1


@njit(cache=True)
def _add_edge(S, E, hk, hv, meta, a, s, c, to):
    """Append edge (s, c) -> to. Capacity for the edge and hash entries is ensured by the caller."""
    e = meta[a, M_NE]
    meta[a, M_NE] = e + 1
    E[e, TOK] = c
    E[e, TO] = to
    E[e, NXT] = S[s, HEAD]
    S[s, HEAD] = e
    d = S[s, DEG] + 1
    S[s, DEG] = d
    if d == SMALL_DEGREE + 1:  # becomes a hashed state: index all its edges
        f = e
        while f != -1:
            meta[a, M_NH] += _hash_put(hk, hv, (np.int64(s) << TOKEN_BITS) | E[f, TOK], f)
            f = E[f, NXT]
    elif d > SMALL_DEGREE + 1:
        meta[a, M_NH] += _hash_put(hk, hv, (np.int64(s) << TOKEN_BITS) | c, e)


@njit(cache=True)
def _new_state(S, meta, a, length, link, first, last):
    s = meta[a, M_NS]
    meta[a, M_NS] = s + 1
    S[s, LEN] = length
    S[s, LINK] = link
    S[s, FIRST] = first
    S[s, LAST] = last
    S[s, HEAD] = -1
    S[s, DEG] = 0
    return s



@njit(cache=True)
def _rehash_into(HKA, HVA, ob, ocap, nb, ncap):
    nk = HKA[nb:nb + ncap]
    nv = HVA[nb:nb + ncap]
    nk[:] = _EMPTY
    used = 0
    for i in range(ob, ob + ocap):
        if HKA[i] != _EMPTY:
            used += _hash_put(nk, nv, HKA[i], HVA[i])
    return used


@njit(cache=True)
def _extend(S, E, hk, hv, meta, a, last, c, pos, need):
    """Append token ``c`` (at arena position ``pos``) to the member whose state is ``last``.

    Returns (state of the member's new text, match state): the match state's strings are
    the suffixes of the new text that also end at an earlier position; its LAST/FIRST are
    still the pre-append values when this returns (the caller reads them, then calls
    _touch_last). Returns (-1, -1) without writing anything when a segment is too small;
    ``need`` then holds the required states, edges and hash entries.
    """
    # -- read-only pass: how many edges will this append create? ----------------------
    e0 = _find(S, E, hk, hv, last, c)
    new_edges = 0
    p = last
    if e0 == -1:
        while p != -1 and _find(S, E, hk, hv, p, c) == -1:
            new_edges += 1
            p = S[p, LINK]
        if p != -1:
            q = E[_find(S, E, hk, hv, p, c), TO]
            if S[p, LEN] + 1 != S[q, LEN]:
                new_edges += S[q, DEG] + 1  # q may itself gain an edge in the walk
    else:
        q = E[e0, TO]
        if S[last, LEN] + 1 != S[q, LEN]:
            new_edges += S[q, DEG]
    need_s = meta[a, M_NS] + 2
    need_e = meta[a, M_NE] + new_edges
    need_h = meta[a, M_NH] + new_edges * (SMALL_DEGREE + 2) + SMALL_DEGREE + 1
    if need_s > S.shape[0] or need_e > E.shape[0] or need_h * 2 > hk.shape[0]:
        need[0] = need_s
        need[1] = need_e
        need[2] = need_h * 2
        return np.int64(-1), np.int64(-1)

    if e0 != -1:
        # The member's whole new text already occurred elsewhere (e.g. a sibling's prompt).
        q = E[e0, TO]
        if S[last, LEN] + 1 == S[q, LEN]:
            return np.int64(q), np.int64(q)
        clone = _new_state(S, meta, a, S[last, LEN] + 1, S[q, LINK], S[q, FIRST], S[q, LAST])
        f = S[q, HEAD]
        while f != -1:
            _add_edge(S, E, hk, hv, meta, a, clone, E[f, TOK], E[f, TO])
            f = E[f, NXT]
        p = last
        while p != -1:
            e = _find(S, E, hk, hv, p, c)
            if e == -1 or E[e, TO] != q:
                break
            E[e, TO] = clone
            p = S[p, LINK]
        S[q, LINK] = clone
        return np.int64(clone), np.int64(clone)

    cur = _new_state(S, meta, a, S[last, LEN] + 1, 0, pos, pos)
    p = last
    while p != -1 and _find(S, E, hk, hv, p, c) == -1:
        _add_edge(S, E, hk, hv, meta, a, p, c, cur)
        p = S[p, LINK]
    if p == -1:
        S[cur, LINK] = 0
        return np.int64(cur), np.int64(0)
    q = E[_find(S, E, hk, hv, p, c), TO]
    if S[p, LEN] + 1 == S[q, LEN]:
        S[cur, LINK] = q
        return np.int64(cur), np.int64(q)
    clone = _new_state(S, meta, a, S[p, LEN] + 1, S[q, LINK], S[q, FIRST], S[q, LAST])
    f = S[q, HEAD]
    while f != -1:
        _add_edge(S, E, hk, hv, meta, a, clone, E[f, TOK], E[f, TO])
        f = E[f, NXT]
    while p != -1:
        e = _find(S, E, hk, hv, p, c)
        if e == -1 or E[e, TO] != q:
            break
        E[e, TO] = clone
        p = S[p, LINK]
    S[q, LINK] = clone
    S[cur, LINK] = clone
    return np.int64(cur), np.int64(clone)


@njit(cache=True)
def _touch_last(S, s, pos, walk_limit):
    """Record ``pos`` as the most recent end position of ``s`` and its suffix-link ancestors."""
    n = 0
    while s > 0 and (walk_limit <= 0 or n < walk_limit):
        S[s, LAST] = pos
        s = S[s, LINK]
        n += 1


@njit(cache=True)
def _ingest_batch(meta, members, SA, EA, TA, HKA, HVA, member_ids, tok_flat, tok_off, k,
                  min_match, walk_limit, from_first, adaptive, out_draft, out_n, out_match, resume):
    """Append each member's new tokens, then draft up to ``k`` tokens for it.

    member_ids[i]'s new tokens are tok_flat[tok_off[i]:tok_off[i+1]]; its draft goes to
    out_draft[i, :out_n[i]] and the matched suffix length to out_match[i] (0: no match).
    k == 0 only ingests. Starts at (member resume[0], token resume[1]). Returns -1 when
    done, else the automaton whose segments must grow to resume[2:6] rows (states, edges,
    tokens, hash slots); resume[0:2] then says where to continue.
    """
    need = np.zeros(3, np.int64)
    for i in range(resume[0], member_ids.shape[0]):
        m = member_ids[i]
        a = members[m, B_AID]
        S = SA[meta[a, M_SB]:meta[a, M_SB] + meta[a, M_SC]]
        E = EA[meta[a, M_EB]:meta[a, M_EB] + meta[a, M_EC]]
        T = TA[meta[a, M_TB]:meta[a, M_TB] + meta[a, M_TC]]
        hk = HKA[meta[a, M_HB]:meta[a, M_HB] + meta[a, M_HC]]
        hv = HVA[meta[a, M_HB]:meta[a, M_HB] + meta[a, M_HC]]
        j0 = tok_off[i] if i != resume[0] else max(tok_off[i], resume[1])
        if tok_off[i + 1] == tok_off[i]:
            out_n[i] = 0
            out_match[i] = 0
        for j in range(j0, tok_off[i + 1]):
            last = members[m, B_STATE]
            ppos = members[m, B_POS]
            c = tok_flat[j]
            pos = meta[a, M_NT]
            if pos + 1 > T.shape[0]:
                resume[0] = i
                resume[1] = j
                resume[2] = 0
                resume[3] = 0
                resume[4] = pos + 1
                resume[5] = 0
                return a
            new_last, match = _extend(S, E, hk, hv, meta, a, last, c, pos, need)
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
            ppos = pos
            last = new_last
            src = S[match, FIRST] if from_first else S[match, LAST]
            _touch_last(S, last, pos, walk_limit)
            members[m, B_STATE] = last
            members[m, B_POS] = ppos
            members[m, B_NTOK] += 1
            if j == tok_off[i + 1] - 1:
                out_match[i] = S[match, LEN]
                n = 0
                if k > 0 and match != 0 and S[match, LEN] >= min_match:
                    first = T[src, TNEXT]
                    if first < 0:
                        # the most recent occurrence is the current end of a sibling that
                        # is level with this member (nothing follows it yet): use the
                        # first occurrence, which always has a continuation
                        src = S[match, FIRST]
                        first = T[src, TNEXT]
                    p = first
                    # confidence: a match of length L proposes at most L tokens
                    kk = min(k, S[match, LEN]) if adaptive else k
                    while n < kk and p >= 0:
                        out_draft[i, n] = T[p, TTOKEN]
                        n += 1
                        # A match inside the member's own recent text overlaps its end:
                        # the text is periodic there, so continue from the source again.
                        p = first if p == ppos else T[p, TNEXT]
                out_n[i] = n
    return -1


_ENTRY = [None]  # compiled entry point of _ingest_batch (see ingest)
_INIT = {"S": 64, "E": 64, "T": 32, "H": 64}
_COLS = {"S": S_COLS, "E": E_COLS, "T": T_COLS}
_USED_COL = {"S": M_NS, "E": M_NE, "T": M_NT}


class AutomatonPool:
    """Many suffix automata (one per request, or one per sibling group) in shared arenas.

    Python objects exist per automaton and per member, never per token or per state.
    ``ingest`` appends tokens to many members and drafts for all of them in one jitted call.
    """

    def __init__(self, *, min_match: int = 2, walk_limit: int = 64, from_first: bool = False,
                 adaptive: bool = False):
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        if walk_limit < 0:
            raise ValueError(f"walk_limit must be >= 0 (0 = unlimited), got {walk_limit}")
        self.min_match = int(min_match)
        self.walk_limit = int(walk_limit)
        self.from_first = bool(from_first)
        self.adaptive = bool(adaptive)
        self.SA = np.zeros((1024, S_COLS), np.int32)
        self.EA = np.zeros((1024, E_COLS), np.int32)
        self.TA = np.zeros((512, T_COLS), np.int32)
        self.HKA = np.full(1024, -1, np.int64)
        self.HVA = np.zeros(1024, np.int32)
        self._top = {"S": 0, "E": 0, "T": 0, "H": 0}
        self._waste = {"S": 0, "E": 0, "T": 0, "H": 0}
        self.meta = np.zeros((8, META_COLS), np.int64)
        self.members = np.zeros((8, MEMBER_COLS), np.int64)
        self._free_automata: list[int] = []
        self._free_members: list[int] = []
        self._n_automata = 0
        self._n_members = 0
        self._resume = np.zeros(6, np.int64)

    # -- arenas ---------------------------------------------------------------------------------
    def _arena(self, kind):
        return {"S": self.SA, "E": self.EA, "T": self.TA, "H": self.HKA}[kind]

    def _set_arena(self, kind, arr, hv=None):
        if kind == "S":
            self.SA = arr
        elif kind == "E":
            self.EA = arr
        elif kind == "T":
            self.TA = arr
        else:
            self.HKA, self.HVA = arr, hv

    def _reserve(self, kind: str, rows: int) -> int:
        """Base of ``rows`` fresh rows at the top of an arena (compacting or doubling it)."""
        arena = self._arena(kind)
        if self._top[kind] + rows > arena.shape[0]:
            if self._waste[kind] > self._top[kind] // 2:
                self._compact(kind)
                arena = self._arena(kind)
            if self._top[kind] + rows > arena.shape[0]:
                size = arena.shape[0]
                while self._top[kind] + rows > size:
                    size *= 2
                if kind == "H":
                    hk = np.full(size, -1, np.int64)
                    hv = np.zeros(size, np.int32)
                    hk[: self._top[kind]] = self.HKA[: self._top[kind]]
                    hv[: self._top[kind]] = self.HVA[: self._top[kind]]
                    self._set_arena("H", hk, hv)
                else:
                    new = np.zeros((size, arena.shape[1]), np.int32)
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
        top = 0
        for a in live:
            b, cap = int(self.meta[a, bcol]), int(self.meta[a, bcol + 1])
            if b != top:
                if kind == "H":
                    self.HKA[top:top + cap] = self.HKA[b:b + cap].copy()
                    self.HVA[top:top + cap] = self.HVA[b:b + cap].copy()
                else:
                    arena = self._arena(kind)
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
            new_cap = max(need, 2 * cap)
            base = self._reserve(kind, new_cap)
            arena = self._arena(kind)
            old = int(self.meta[a, bcol])
            used = int(self.meta[a, _USED_COL[kind]])
            arena[base:base + used] = arena[old:old + used]
            self._waste[kind] += cap
            self.meta[a, bcol] = base
            self.meta[a, bcol + 1] = new_cap
        cap = int(self.meta[a, M_HC])
        if hash_slots > cap:
            new_cap = cap
            while new_cap < hash_slots:
                new_cap *= 2
            base = self._reserve("H", new_cap)
            self.meta[a, M_NH] = _rehash_into(self.HKA, self.HVA, int(self.meta[a, M_HB]), cap,
                                              base, new_cap)
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
        self.HKA[hb:hb + _INIT["H"]] = -1
        sb = int(self.meta[a, M_SB])
        self.SA[sb] = (0, -1, -1, -1, -1, 0)  # root
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
        self.members[m] = (automaton, 0, -1, 0, 1)
        self.meta[automaton, M_MEMBERS] += 1
        return m

    def release_member(self, member: int, *, keep_text: bool = False) -> None:
        """Forget a member; its automaton is freed with its last member unless ``keep_text``."""
        if not self.members[member, B_ALIVE]:
            return
        a = int(self.members[member, B_AID])
        self.members[member] = (0, 0, -1, 0, 0)
        self._free_members.append(member)
        self.meta[a, M_MEMBERS] -= 1
        if self.meta[a, M_MEMBERS] == 0 and not keep_text:
            self.free_automaton(a)

    def free_automaton(self, automaton: int) -> None:
        a = automaton
        if not self.meta[a, M_ALIVE]:
            return
        for m in np.nonzero((self.members[:, B_ALIVE] == 1) & (self.members[:, B_AID] == a))[0]:
            self.members[m] = (0, 0, -1, 0, 0)
            self._free_members.append(int(m))
        for kind in _ARENAS:
            self._waste[kind] += int(self.meta[a, _BASE_COL[kind] + 1])
        self.meta[a] = 0
        self._free_automata.append(a)
        if not self.meta[: self._n_automata, M_ALIVE].any():  # empty pool: start over small
            self.__init__(min_match=self.min_match, walk_limit=self.walk_limit,
                          from_first=self.from_first, adaptive=self.adaptive)

    # -- work --------------------------------------------------------------------------------
    def ingest(self, member_ids: np.ndarray, tok_flat: np.ndarray, tok_off: np.ndarray, k: int,
               out_draft: np.ndarray | None = None, *, check: bool = True):
        """Append tokens and draft. Returns (drafts[B, k], n_draft[B], match_len[B])."""
        member_ids = np.ascontiguousarray(member_ids, np.int64)
        tok_flat = np.ascontiguousarray(tok_flat, np.int32)
        tok_off = np.ascontiguousarray(tok_off, np.int64)
        b = member_ids.shape[0]
        if check:
            if tok_flat.size and (tok_flat.min() < 0 or tok_flat.max() >= (1 << TOKEN_BITS)):
                raise ValueError(f"token ids must be in [0, {1 << TOKEN_BITS}); got range "
                                 f"[{tok_flat.min()}, {tok_flat.max()}]")
            if b and not self.members[member_ids, B_ALIVE].all():
                raise ValueError("ingest got a released member id")
        if (out_draft is None or out_draft.shape[0] < b or out_draft.shape[1] < k
                or out_draft.dtype != np.int32 or not out_draft.flags.c_contiguous):
            out_draft = np.zeros((b, max(k, 1)), np.int32)
        out_n = np.zeros(b, np.int32)
        out_match = np.zeros(b, np.int32)
        resume = self._resume
        resume[:] = 0
        while True:
            args = (self.meta, self.members, self.SA, self.EA, self.TA, self.HKA, self.HVA,
                    member_ids, tok_flat, tok_off, int(k), self.min_match, self.walk_limit,
                    self.from_first, self.adaptive, out_draft, out_n, out_match, resume)
            fn = _ENTRY[0]
            if fn is None:
                a = _ingest_batch(*args)
                # every argument's type is fixed above, so later calls can skip numba's
                # per-call type dispatch (~1 us per argument) and enter the compiled code
                from numba import typeof
                _ENTRY[0] = _ingest_batch.overloads[tuple(typeof(x) for x in args)].entry_point
            else:
                a = fn(*args)
            if a < 0:
                return out_draft, out_n, out_match
            self._grow(int(a), int(resume[2]), int(resume[3]), int(resume[4]), int(resume[5]))

    def extend_one(self, member: int, tokens, k: int = 0):
        """Convenience: one member, returns (draft list, match length)."""
        toks = np.asarray(tokens, np.int32)
        d, n, mlen = self.ingest(np.array([member]), toks, np.array([0, toks.size]), k)
        return d[0, : n[0]].tolist(), int(mlen[0])

    # -- accounting --------------------------------------------------------------------------
    def automaton_bytes(self, a: int) -> int:
        """Bytes of the segments this automaton owns (capacity, up to 2x what it uses)."""
        if not self.meta[a, M_ALIVE]:
            return 0
        m = self.meta[a]
        return int(m[M_SC] * S_COLS * 4 + m[M_EC] * E_COLS * 4 + m[M_TC] * T_COLS * 4
                   + m[M_HC] * 12)

    def automaton_used_bytes(self, a: int) -> int:
        """Bytes of rows actually in use (hash counted at its capacity)."""
        if not self.meta[a, M_ALIVE]:
            return 0
        m = self.meta[a]
        return int(m[M_NS] * S_COLS * 4 + m[M_NE] * E_COLS * 4 + m[M_NT] * T_COLS * 4
                   + m[M_HC] * 12)

    def memory_bytes(self) -> int:
        """Every byte this pool holds in its arrays (arena capacity, holes included)."""
        return int(self.SA.nbytes + self.EA.nbytes + self.TA.nbytes + self.HKA.nbytes
                   + self.HVA.nbytes + self.meta.nbytes + self.members.nbytes)

    def tokens(self, a: int) -> int:
        return int(self.meta[a, M_NT])

    def live_automata(self) -> int:
        return int(self.meta[: self._n_automata, M_ALIVE].sum())

    def live_members(self) -> int:
        return int(self.members[: self._n_members, B_ALIVE].sum())
