"""Incremental (generalized) suffix automaton in flat integer arrays, numba-jitted.

Why this shape: the Qwen3 RL recipe's drafter kept one Python dict per automaton state
(~700 bytes and ~1.5 GC-tracked objects per token, GC stalls at 32K context) and drafted
from the *first* occurrence of the matched suffix. Here every automaton is a few flat
int32/int64 tables (no per-state or per-token Python object), all requests of a decode
step are handled by one jitted call, and drafts continue the *most recent* occurrence of
the recent context.

One automaton can hold several texts ("members") that grow in any interleaving: it is a
generalized suffix automaton, so GRPO siblings that share a prompt draft from each
other's generated text without any history being copied. A member's tokens live once, in
the automaton's token rows, as a linked list in insertion order (``T[pos] = token,
next position of the same member``).

Layout (bytes per token of context on real code text at 32K tokens: ~1.43 states,
~0.75 listed edges, ~0.4 hash entries): states are 6 int32 (LEN, LINK, FIRST, LAST and
the edge fields A, B); ~88% of states have exactly one outgoing edge, which lives inline
in the state row (A = token, B = target). States with more edges keep them in an edge
list (rows TOK, TO, NXT; A = LISTED, B = head); above ``SMALL_DEGREE`` edges they are also
indexed by a packed open-addressing hash whose 8-byte entries hold key and edge id.

Memory: each automaton's state, edge and token rows live in address space it reserves up
front up to the id limit (an anonymous no-reserve mapping: no memory until written), so
they never move and cost exactly the pages its text has filled; growing by copying made
one decode step in ~8 take 20-40 us at 2K tokens. Hash segments (small) share one arena
and grow x1.5 by rehashing inside the decode step; the arena itself is reallocated x2 or
compacted in Python, rarely. A decode step is one jitted call whose arrays are reached
through a descriptor of raw addresses, because numba unboxes each array argument
separately (~0.1-0.35 us each): ``_ingest_step`` takes new tokens laid out flat,
``_rows_step`` (what the request-level drafter calls) reads them straight from the
runner's token matrix and also settles the previous drafts, learns from them how often a
draft token is accepted (a small table in the drafter's tally, see ``_worth_drafting``),
cuts the new drafts where that estimate no longer pays for verification, and caps them.

Which occurrence is drafted from: FIRST (earliest end position) is kept for every state;
LAST (the most recent end position *that has a continuation*, -1: none yet) is kept exact
for every state whose shortest string is at most ``recent_len`` tokens long -- exactly the
states a draft consults. An end position gains its continuation when its member appends
its next token; each member tracks the state holding its last ``recent_len`` tokens (O(1)
per token) and, on appending, records its previous end as LAST on that state's <=
recent_len + 1 suffix-link ancestors, so the bookkeeping per token is bounded however long
the repeats are (the recipe's drafter walked every suffix link). The draft continues the
most recent earlier occurrence with a continuation of the last min(L, recent_len) tokens, L
being the longest earlier-occurring suffix; with the default recent_len (32) that is the
most recent occurrence of the longest match in all but long verbatim copies. An
occurrence without a continuation is a sibling's current end (a sibling level with this
member, e.g. GRPO siblings decoded in lockstep) or a finished sibling's last token; when
every occurrence of that string is such an end, the longest shorter suffix that has a
continued occurrence is drafted from (its length then bounds the draft where the
confidence cap is on). (Small recent_len values predict better token by token but worse in
a speculative replay: see ``benchmarks/bench_sam.py``.) Appending is amortized O(1) (the classic SAM bound),
drafting O(k). When the source occurrence overlaps the end of the member's own text (a
loop), the draft continues periodically.

Sources (a drafter's options): one more automaton gets every request's response (the
cross-prompt automaton, like the global tree of vLLM's ``suffix`` method), and a request whose
group has other live members keeps one of its own text; each step the candidate the
acceptance table values most is drafted (issue 46); see ``_rows_step``.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic

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
# automaton meta columns: counts, flags, then (address, rows) of its state, edge and token
# rows, and (base, capacity) of its segment of the shared hash arena
M_NS, M_NE, M_NT, M_NH, M_ALIVE, M_MEMBERS, M_FULL = 0, 1, 2, 3, 4, 5, 6
M_SP, M_SR, M_EP, M_ER, M_TP, M_TR, M_HB, M_HC = 7, 8, 9, 10, 11, 12, 13, 14
META_COLS = 15
# member columns: automaton, its text's state, its last arena position, tokens seen,
# alive, and the state holding its last min(n, recent_len) tokens (with that length)
B_AID, B_STATE, B_POS, B_NTOK, B_ALIVE, B_SHORT, B_SHORTLEN = 0, 1, 2, 3, 4, 5, 6
# ... and, for a drafter: tokens seen when its pending draft was made (-1: none), that
# draft's length, and the draft tokens accepted so far; then its first arena position
B_DEND, B_DLEN, B_ACC, B_HEAD = 7, 8, 9, 10
# ... and the acceptance estimate's: how its last two settled drafts fared (P_*, older * 4
# + newer), the table cell its pending draft was estimated in, the candidate token right
# after that draft's cut (-1: none), which the next step's bonus token settles (one position
# of exploration), and how many of its leading tokens an older occurrence's continuation
# agreed with
B_PREV, B_DCELL, B_NEXTC, B_DAGREE = 11, 12, 13, 14
# ... and its member in the drafter's cross-prompt automaton (-1: none), which gets the same
# tokens and is one of its draft sources (see ``_rows_step``)
B_CROSS = 15
# ... and the candidate its pending draft was chosen over (the other source's, see
# ``_rows_step``): its length (0: none), table cell and corroboration, and its first
# ALT_TOKENS tokens, which the tokens that arrive settle as well, so that the table learns
# both sources' acceptance on the steps where they compete, not only the chosen one's
B_ALTN, B_ALTCELL, B_ALTAGREE, B_ALTTOK = 16, 17, 18, 19
ALT_TOKENS = 8
# ... and its member in an automaton of its own text alone (-1: none), which a request whose
# group has other live members drafts from as a third source (see ``_rows_step``)
B_SOLO = B_ALTTOK + ALT_TOKENS
MEMBER_COLS = B_SOLO + 1
_FRESH_MEMBER = (0, 0, -1, 0, 1, 0, 0, -1, 0, 0, -1, 0, 0, -1, -1, -1, 0, 0, 0) + (0,) * ALT_TOKENS + (-1,)  # (automaton filled in) alive
_DEAD_MEMBER = (0, 0, -1, 0, 0, 0, 0, -1, 0, 0, -1, 0, 0, -1, -1, -1, 0, 0, 0) + (0,) * ALT_TOKENS + (-1,)
P_NONE, P_FULL, P_PARTIAL, P_REJECTED = 0, 1, 2, 3

SMALL_DEGREE = 4
TOKEN_BITS = 19  # token ids must be < 2**19 (524,288); checked in the kernel
ID_BITS = 22  # states and listed edges per automaton must be < 2**22 - 1
MAX_IDS = (1 << ID_BITS) - 2
_ID_MASK = np.int64((1 << ID_BITS) - 1)
_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)
# columns of the kernel's output rows: draft length, match length, the length L that
# bounds the draft (the match, or the shorter suffix drafted from), how many leading draft
# tokens the first occurrence's continuation agrees with (-1: no other occurrence to ask),
# then the draft
OUT_N, OUT_MATCH, OUT_BOUND, OUT_AGREE, OUT_DRAFT = 0, 1, 2, 3, 4
# where a draft comes from: the request's own automaton (its group's, history included), the
# cross-prompt automaton, the automaton of the request's own text alone. A draft's class in the
# acceptance table is SRC_STRIDE * source + 1 + a, a being how many of its leading tokens an
# older occurrence in the same automaton agreed with (-1: no other occurrence to ask)
SRC_GROUP, SRC_CROSS, SRC_SOLO = 0, 1, 2
N_SOURCES = 3
SRC_STRIDE = 1 << 20
# ingest return codes (>= 0: the automaton whose segments must grow); CROSS_FULL: the step is
# done and the cross-prompt automaton reached its budget (or its id limit)
DONE, BAD_TOKEN, DEAD_MEMBER, BAD_OFFSETS, CROSS_FULL = -1, -2, -3, -4, -5

# The pool's descriptor: one int64 array holding the address and row count of each of its
# arrays, its settings and the kernel's resume/need slots. A decode step passes it and the
# step's three input arrays, instead of ten arrays numba would unbox one by one (~0.35 us
# each on the reference machine, i.e. most of a step's cost at batch 8).
D_META, D_MEMBERS, D_H, D_OUT = 0, 2, 4, 6  # (address, rows)
D_OUT_COLS = 8
D_MIN_MATCH, D_RECENT_LEN, D_FROM_FIRST, D_ADAPTIVE = 9, 10, 11, 12
D_RESUME = 13  # 3 slots: member, token, hash slots the automaton's segment must grow to
D_HTOP = 16  # first free slot at the top of the hash arena
D_HWASTE = 17  # hash arena slots in holes left by moved or freed segments
D_PHASE = 18  # of the resume entry: 1: its own member is done; 2: its cross member too; + 4: it had new tokens
D_CROSS_AID, D_CROSS_BUDGET = 19, 20  # the cross-prompt automaton (-1: none), its token budget
D_SIZE = 21
# a drafter's tally (``_rows_step``): settings and counters it keeps across pool restarts;
# T_COST: this step's verification cost of one draft token in accepted tokens, x 1e6 (0:
# draft all k); then the acceptance table: per (bucket of L, previous outcome, bucket of
# the draft position, whether an older occurrence corroborates the token) the draft tokens
# verification reached and those it accepted
T_MAX_LEN, T_PROPOSALS, T_DRAFTED, T_ACCEPTED, T_VERIFIED, T_COST = 0, 1, 2, 3, 4, 5
T_CROSS_PROPOSALS = 6  # drafts taken from the cross-prompt automaton
T_TABLE = 7
N_LBUCKETS, N_PREV, N_JBUCKETS = 7, 16, 7  # L: 1, 2, 3-4, ..., 33+; position: 0, 1, 2, 3-4, ..., 17+
# per source: no older occurrence to ask / it agrees up to this token / it disagreed before
N_CORR = 3 * N_SOURCES
T_SIZE = T_TABLE + 2 * N_LBUCKETS * N_PREV * N_CORR * N_JBUCKETS
COST_SCALE = 1_000_000
TABLE_PRIOR = (2, 1)  # (reached, accepted) of a cell never observed: an estimate of 1/2
TABLE_HALVE_AT = 1 << 14  # a cell's counts are halved there: the estimate follows drift


@intrinsic
def _i32_at(typingctx, addr):
    """An int64 address as an int32 pointer (the pool keeps the array alive)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.int32)))
    return types.CPointer(types.int32)(types.int64), codegen


@intrinsic
def _i64_at(typingctx, addr):
    """An int64 address as an int64 pointer (the pool keeps the array alive)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.int64)))
    return types.CPointer(types.int64)(types.int64), codegen


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

    cur = _new_state(S, meta, a, S[last, LEN] + 1, 0, pos, -1)
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
def _grown_hash_capacity(cap, need):
    return max(need, cap * 3 // 2)


@njit(cache=True)
def _move_hash(meta, HA, htop, a, need):
    """Rehash automaton ``a``'s hash segment into a larger one at the top of the hash arena.

    Returns False without writing anything when the arena lacks the room (the pool then
    compacts or reallocates it and calls again). Done inside the decode step: a round trip
    to Python costs ~20 us."""
    cap = meta[a, M_HC]
    new_cap = _grown_hash_capacity(cap, need)
    base = htop[0]
    if base + new_cap > HA.shape[0]:
        return False
    meta[a, M_NH] = _rehash_into(HA, meta[a, M_HB], cap, base, new_cap)
    htop[0] = base + new_cap
    htop[1] += cap  # the old segment is a hole now
    meta[a, M_HB] = base
    meta[a, M_HC] = new_cap
    return True


@njit(cache=True)
def _ingest_member(meta, members, HA, htop, m, toks, j, k, min_match, recent_len, from_first,
                   adaptive, out, i, need, resume):
    """Append ``toks[j:]`` to member ``m`` and, after the last token, draft up to ``k`` tokens
    into ``out[i]`` (k == 0: ingest only; no new token: no draft).

    Returns DONE, or BAD_TOKEN for a token id out of range, or the automaton whose hash
    segment must grow to ``need[2]`` slots when the hash arena lacks the room; then
    ``resume`` holds (i, the token index, need[2]): token ``j`` was not appended, so the
    caller resumes there."""
    out[i, OUT_N] = 0  # written again at the member's last new token
    out[i, OUT_MATCH] = 0
    out[i, OUT_BOUND] = 0
    out[i, OUT_AGREE] = -1
    limit = 1 << TOKEN_BITS
    a = members[m, B_AID]
    S = carray(_i32_at(meta[a, M_SP]), (meta[a, M_SR], S_COLS))
    E = carray(_i32_at(meta[a, M_EP]), (meta[a, M_ER], E_COLS))
    T = carray(_i32_at(meta[a, M_TP]), (meta[a, M_TR], T_COLS))
    H = HA[meta[a, M_HB]:meta[a, M_HB] + meta[a, M_HC]]
    end = toks.shape[0]
    while j < end:
        c = toks[j]
        if c < 0 or c >= limit:
            resume[0] = i
            resume[1] = j
            return BAD_TOKEN
        if meta[a, M_FULL]:  # at its id limit: keeps counting, stops learning
            members[m, B_NTOK] += 1
            j += 1
            continue
        last = members[m, B_STATE]
        ppos = members[m, B_POS]
        pos = meta[a, M_NT]
        if pos + 1 > T.shape[0]:
            new_last = np.int64(-2)  # its reserved token rows are full
            match = np.int64(0)
        else:
            new_last, match = _extend(S, E, H, meta, a, last, c, pos, need)
            if new_last == -1 and (need[0] > S.shape[0] or need[1] > E.shape[0]):
                new_last = np.int64(-2)  # its reserved state or edge rows are full
        if new_last == -2:
            meta[a, M_FULL] = 1
            members[m, B_NTOK] += 1
            j += 1
            continue
        if new_last < 0:  # the hash segment must grow
            if _move_hash(meta, HA, htop, a, need[2]):
                H = HA[meta[a, M_HB]:meta[a, M_HB] + meta[a, M_HC]]
                continue  # the same token again
            resume[0] = i
            resume[1] = j
            resume[2] = need[2]
            return a
        meta[a, M_NT] = pos + 1
        T[pos, TTOKEN] = c
        T[pos, TNEXT] = -1
        if ppos >= 0:
            T[ppos, TNEXT] = pos
        else:
            members[m, B_HEAD] = pos
        members[m, B_STATE] = new_last
        members[m, B_POS] = pos
        members[m, B_NTOK] += 1
        # the state holding the last min(n, recent_len) tokens. A split since the last
        # append may have moved that string into a clone (the state's new suffix link):
        # follow links while the link still holds strings that long.
        sh = np.int64(members[m, B_SHORT])
        vlen = members[m, B_SHORTLEN]
        while S[sh, LINK] >= 0 and S[S[sh, LINK], LEN] >= vlen:
            sh = np.int64(S[sh, LINK])
        # The member's previous end now has a continuation (this token): it becomes the
        # most recent continued end of every state holding one of its last vlen tokens'
        # suffixes. (Positions are numbered in insertion order; a sibling's later end may
        # have been continued first, hence the max.)
        if ppos >= 0:
            u = sh
            while u > 0:
                if S[u, LAST] < ppos:
                    S[u, LAST] = ppos
                u = S[u, LINK]
        v = _target(S, E, _find(S, E, H, sh, c))
        vlen += 1
        if vlen > recent_len:
            vlen = recent_len
            if S[S[v, LINK], LEN] >= recent_len:
                v = np.int64(S[v, LINK])
        members[m, B_SHORT] = v
        members[m, B_SHORTLEN] = vlen
        mlen = S[match, LEN]
        if j == end - 1:
            out[i, OUT_MATCH] = mlen
            out[i, OUT_BOUND] = 0
            out[i, OUT_AGREE] = -1
            n = 0
            other = np.int64(-1)  # an older occurrence's continuation, to corroborate
            if k > 0 and match != 0:
                if from_first:
                    bound = mlen
                    first = T[S[match, FIRST], TNEXT]
                else:
                    # the most recent earlier occurrence *that has a continuation* of the
                    # last min(L, recent_len) tokens. An occurrence without one is a
                    # sibling's (or a finished sibling's) end: a sibling level with this
                    # member. If no occurrence of that string has one, the longest shorter
                    # suffix whose occurrences do is used, and bounds the draft.
                    u = v if mlen >= recent_len else match
                    bound = mlen
                    while u > 0 and S[u, LAST] < 0:
                        u = S[u, LINK]
                        bound = S[u, LEN]
                    first = T[S[u, LAST], TNEXT] if u > 0 else -1
                    if u > 0 and S[u, FIRST] != S[u, LAST]:
                        other = T[S[u, FIRST], TNEXT]
                if bound >= min_match and first >= 0:
                    out[i, OUT_BOUND] = bound
                    p = first
                    # confidence: a match of length L proposes at most L tokens
                    kk = min(k, bound) if adaptive else k
                    agree = -1 if other < 0 else 0
                    while n < kk and p >= 0:
                        out[i, OUT_DRAFT + n] = T[p, TTOKEN]
                        if other >= 0 and agree == n and T[other, TTOKEN] == T[p, TTOKEN]:
                            agree += 1
                            other = T[other, TNEXT] if other != pos else np.int64(-1)
                        n += 1
                        # A match inside the member's own recent text overlaps its end:
                        # the text is periodic there, so continue from the source again.
                        p = first if p == pos else T[p, TNEXT]
                    out[i, OUT_AGREE] = agree
            out[i, OUT_N] = n
        j += 1
    return DONE


@njit(cache=True)
def _ingest_batch(meta, members, HA, member_ids, tok_flat, tok_off, k,
                  min_match, recent_len, from_first, adaptive, out, resume, htop):
    """Append each member's new tokens, then draft up to ``k`` tokens for it.

    member_ids[i]'s new tokens are tok_flat[tok_off[i]:tok_off[i+1]]; its draft goes to
    out[i, OUT_DRAFT:OUT_DRAFT + out[i, OUT_N]] and the matched suffix length to
    out[i, OUT_MATCH] (0: no match).
    k == 0 only ingests. Starts at (member resume[0], token resume[1]). Returns DONE, or
    BAD_TOKEN / DEAD_MEMBER / BAD_OFFSETS (resume[0:2] says where), or the automaton whose
    hash segment must grow to resume[2] slots when the hash arena lacks the room;
    resume[0:2] then says where to continue.
    """
    need = np.zeros(3, np.int64)
    b = member_ids.shape[0]
    if tok_off.shape[0] != b + 1 or out.shape[0] < b or out.shape[1] < OUT_DRAFT + k or k < 0:
        return BAD_OFFSETS
    prev = 0
    for i in range(b + 1):
        if tok_off[i] < prev or tok_off[i] > tok_flat.shape[0]:
            return BAD_OFFSETS
        prev = tok_off[i]
    for i in range(resume[0], b):
        m = member_ids[i]
        if m < 0 or m >= members.shape[0] or members[m, B_ALIVE] == 0:
            resume[0] = i
            return DEAD_MEMBER
        j = tok_off[i] if i != resume[0] else max(tok_off[i], resume[1])
        code = _ingest_member(meta, members, HA, htop, m, tok_flat[:tok_off[i + 1]], j, k,
                              min_match, recent_len, from_first, adaptive, out, i, need, resume)
        if code != DONE:
            return code
    resume[0] = 0
    resume[1] = 0
    return DONE


@njit(cache=True)
def _ingest_step(desc, member_ids, tok_flat, tok_off, k):
    """``_ingest_batch`` over the arrays the descriptor ``desc`` points at."""
    meta = carray(_i64_at(desc[D_META]), (desc[D_META + 1], META_COLS))
    members = carray(_i64_at(desc[D_MEMBERS]), (desc[D_MEMBERS + 1], MEMBER_COLS))
    HA = carray(_i64_at(desc[D_H]), (desc[D_H + 1],))
    out = carray(_i32_at(desc[D_OUT]), (desc[D_OUT + 1], desc[D_OUT_COLS]))
    return _ingest_batch(meta, members, HA, member_ids, tok_flat, tok_off, k,
                         desc[D_MIN_MATCH], desc[D_RECENT_LEN], desc[D_FROM_FIRST] != 0,
                         desc[D_ADAPTIVE] != 0, out, desc[D_RESUME:D_RESUME + 3],
                         desc[D_HTOP:D_HTOP + 2])


@njit(cache=True, inline="always")
def _log_bucket(x, n_buckets):
    """0 for x <= 1, 1 for 2, 2 for 3-4, 3 for 5-8, ... capped at n_buckets - 1."""
    b = 0
    top = 1
    while x > top and b < n_buckets - 1:
        b += 1
        top *= 2
    return b


@njit(cache=True, inline="always")
def _class_of(source, agree):
    """A draft's class: its source (SRC_*) and how many of its leading tokens an older
    occurrence in the same automaton corroborated (``agree``, -1: none to ask)."""
    return SRC_STRIDE * source + 1 + agree


@njit(cache=True, inline="always")
def _table_slot(cell, klass, j):
    """(reached, accepted) of draft position ``j`` for a draft of ``cell`` (L bucket and
    previous outcome) and class ``klass`` (see ``_class_of``)."""
    source = klass // SRC_STRIDE
    agree = klass - SRC_STRIDE * source - 1
    corr = 3 * source + (0 if agree < 0 else (1 if j < agree else 2))
    return T_TABLE + 2 * ((cell * N_CORR + corr) * N_JBUCKETS + _log_bucket(j + 1, N_JBUCKETS))


@njit(cache=True)
def _observe(tally, cell, agree, j, accepted):
    """Draft position ``j`` of a draft estimated in ``cell`` was reached by verification."""
    t = _table_slot(cell, agree, j)
    tally[t] += 1
    if accepted:
        tally[t + 1] += 1
    if tally[t] >= TABLE_HALVE_AT:
        tally[t] = tally[t] // 2
        tally[t + 1] = tally[t + 1] // 2


@njit(cache=True, inline="always")
def _remember(members, m, outcome):
    """B_PREV holds the member's last two outcomes (older * 4 + newer)."""
    members[m, B_PREV] = (members[m, B_PREV] % 4) * 4 + outcome


@njit(cache=True)
def _settle(members, m, tally, token_ids, row, start, end):
    """The tokens that arrived since member ``m``'s pending draft (``end - start``: the
    accepted ones plus the bonus) settle it: counters, the member's outcome, the table."""
    dlen = members[m, B_DLEN]
    if dlen == 0:
        # a draft cut to nothing: its first candidate against the token that came instead
        # (so a request whose drafts stopped paying can win them back)
        if members[m, B_NEXTC] < 0:  # pending only for the candidate it was chosen over
            return
        held = token_ids[row, start] == members[m, B_NEXTC]
        _observe(tally, members[m, B_DCELL], members[m, B_DAGREE], 0, held)
        _remember(members, m, P_FULL if held else P_REJECTED)
        return
    acc = min(end - start - 1, dlen)  # the last token is the bonus
    tally[T_ACCEPTED] += acc
    members[m, B_ACC] += acc
    tally[T_VERIFIED] += 1
    cell = members[m, B_DCELL]
    agree = members[m, B_DAGREE]
    for j in range(min(acc + 1, dlen)):
        _observe(tally, cell, agree, j, j < acc)
    if acc == dlen and members[m, B_NEXTC] >= 0:
        # the draft was cut short and held whole: the bonus token says whether the
        # candidate after the cut would have held too
        _observe(tally, cell, agree, dlen, token_ids[row, start + dlen] == members[m, B_NEXTC])
    if acc == dlen:
        _remember(members, m, P_FULL)
    elif acc > 0:
        _remember(members, m, P_PARTIAL)
    else:
        _remember(members, m, P_REJECTED)


@njit(cache=True)
def _settle_alternative(members, m, tally, token_ids, row, start, end):
    """The candidate the pending draft was chosen over, against the tokens that arrived (the
    accepted draft tokens and the bonus: as far as they go, the text it would have met)."""
    n = min(members[m, B_ALTN], end - start)
    members[m, B_ALTN] = 0
    cell, agree = members[m, B_ALTCELL], members[m, B_ALTAGREE]
    for j in range(n):
        held = token_ids[row, start + j] == members[m, B_ALTTOK + j]
        _observe(tally, cell, agree, j, held)
        if not held:
            break


@njit(cache=True)
def _worth_drafting(tally, cell, agree, n, cost):
    """How many of ``n`` candidate tokens to draft: while the estimated probability that
    every token so far is accepted (the product of the cell's per-position acceptance rates)
    is at least this step's ``cost`` of verifying one more token."""
    return _draft_value(tally, cell, agree, n, cost)[0]


@njit(cache=True)
def _draft_value(tally, cell, agree, n, cost):
    """(how many of ``n`` candidate tokens to draft, what drafting them is worth): the draft is
    cut as ``_worth_drafting`` says, and its worth is the expected number of accepted tokens
    (the sum over its positions of the estimated probability that every token up to there
    is accepted) less what verifying its tokens costs (``cost`` each, in accepted tokens
    x COST_SCALE). Every kept token adds at least 0: a draft's worth is >= 0."""
    keep = 0
    prob = 1.0
    worth = 0.0
    price = cost / COST_SCALE
    while keep < n:
        t = _table_slot(cell, agree, keep)
        prob *= tally[t + 1] / max(tally[t], 1)
        if prob * COST_SCALE < cost:
            break
        worth += prob - price
        keep += 1
    return keep, worth


@njit(cache=True)
def _candidate_value(tally, out, r, klass, prev, cost):
    """What the candidate in ``out[r]`` of class ``klass`` is worth (see ``_draft_value``)."""
    cell = _log_bucket(out[r, OUT_BOUND], N_LBUCKETS) * N_PREV + prev
    return cell, _draft_value(tally, cell, klass, out[r, OUT_N], cost)[1]


@njit(cache=True)
def _rows_step(desc, batch, token_ids, num_tokens, k, tally):
    """One decode step of a drafter, read straight from the runner's token matrix.

    ``batch[i] = (member, row)``: member ``batch[i, 0]`` has seen ``members[., B_NTOK]`` tokens
    of ``token_ids[row]`` and now gets those up to ``num_tokens[row]``; then it drafts up to
    ``k`` tokens, capped so that the step's tokens fit ``tally[T_MAX_LEN]`` (0: no cap).
    Before ingesting, the member's previous draft is settled: the tokens that arrived since
    it was made say how many of it were accepted (``tally`` counts proposals, drafted,
    accepted and verified drafts; ``members[., B_ACC]`` per member) and update the
    acceptance table. With ``tally[T_COST]`` > 0 each new draft is cut where the table's
    estimate that all its tokens so far are accepted falls below that cost.

    Sources: a member with a cross-prompt member (``B_CROSS``) feeds it the same tokens right
    after its own, and one with a member of its own (``B_SOLO``: a request whose group has other
    live members) feeds that one too; each drafts into a scratch row (b, b + 1). With the
    draft-length rule on (``tally[T_COST]`` > 0) the candidate worth most by the acceptance
    table is drafted (expected accepted tokens less verification, each source in its own
    table classes), and the runner-up is settled against the tokens that arrive as well, so
    every source keeps learning where they compete. With it off, the own automaton's candidate
    is drafted, else (a token its group never saw, or saw only at a level sibling's end) the
    cross-prompt automaton's.

    Returns DONE, CROSS_FULL (done; the cross-prompt automaton reached its budget), DEAD_MEMBER
    / BAD_TOKEN / BAD_OFFSETS (``desc`` resume slot 0 says which entry), or the automaton whose
    hash segment must grow (then call again: members already settled and ingested are not
    redone, since a member's start is its token count; when the growth was one of the entry's
    other members', ``desc[D_PHASE]`` keeps its parts already done from being redone).
    """
    meta = carray(_i64_at(desc[D_META]), (desc[D_META + 1], META_COLS))
    members = carray(_i64_at(desc[D_MEMBERS]), (desc[D_MEMBERS + 1], MEMBER_COLS))
    HA = carray(_i64_at(desc[D_H]), (desc[D_H + 1],))
    out = carray(_i32_at(desc[D_OUT]), (desc[D_OUT + 1], desc[D_OUT_COLS]))
    resume = desc[D_RESUME:D_RESUME + 3]
    htop = desc[D_HTOP:D_HTOP + 2]
    min_match, recent_len = desc[D_MIN_MATCH], desc[D_RECENT_LEN]
    from_first, adaptive = desc[D_FROM_FIRST] != 0, desc[D_ADAPTIVE] != 0
    max_len = tally[T_MAX_LEN]
    cost = tally[T_COST]
    need = np.zeros(3, np.int64)
    b = batch.shape[0]
    if out.shape[0] < b + 2 or out.shape[1] < OUT_DRAFT + k or k < 0:
        return BAD_OFFSETS  # rows b, b + 1: the cross-prompt and own-text candidates' scratch
    xr, sr = b, b + 1
    for i in range(resume[0], b):
        m = batch[i, 0]
        row = batch[i, 1]
        if m < 0 or m >= members.shape[0] or members[m, B_ALIVE] == 0:
            resume[0] = i
            return DEAD_MEMBER
        if row < 0 or row >= token_ids.shape[0] or row >= num_tokens.shape[0]:
            resume[0] = i
            return BAD_OFFSETS
        start = members[m, B_NTOK]
        end = max(np.int64(num_tokens[row]), start)
        if end > token_ids.shape[1]:
            resume[0] = i
            return BAD_OFFSETS
        phase = 0
        fresh = end > start  # new tokens: a draft is made (none without)
        if desc[D_PHASE] and i == resume[0]:
            # resumed after another member's hash grew: the entry's parts before are done
            phase = desc[D_PHASE] & 3
            fresh = desc[D_PHASE] >= 4
            desc[D_PHASE] = 0
        if phase == 0:
            out[xr, OUT_N] = 0
            out[sr, OUT_N] = 0
            if members[m, B_DEND] >= 0 and end > start:
                # settle the previous draft once tokens arrived (then it is cleared, so a call
                # resumed after a hash growth does not count it twice), and the candidate it
                # was chosen over
                if members[m, B_DEND] == start:
                    _settle(members, m, tally, token_ids, row, start, end)
                    if members[m, B_ALTN] > 0:
                        _settle_alternative(members, m, tally, token_ids, row, start, end)
                members[m, B_DEND] = -1
                members[m, B_ALTN] = 0
            code = _ingest_member(meta, members, HA, htop, m, token_ids[row, :end], start, k,
                                  min_match, recent_len, from_first, adaptive, out, i, need,
                                  resume)
            if code != DONE:
                return code
        own_bound = out[i, OUT_BOUND]
        x = members[m, B_CROSS]
        if phase <= 1 and x >= 0 and members[x, B_ALIVE] != 0 and members[x, B_NTOK] < end:
            # the cross-prompt automaton holds every request's response: it gets the same tokens
            kx = k if (own_bound == 0 or cost > 0) else 0
            code = _ingest_member(meta, members, HA, htop, x, token_ids[row, :end],
                                  members[x, B_NTOK], kx, min_match, recent_len, from_first,
                                  adaptive, out, xr, need, resume)
            if code != DONE:
                resume[0] = i
                if code >= 0:
                    desc[D_PHASE] = 1 + 4 * fresh
                return code
        y = members[m, B_SOLO]
        if y >= 0 and members[y, B_ALIVE] != 0 and members[y, B_NTOK] < end:
            # the request's own text alone: where its group's recency order puts a sibling's
            # text first, this is the most recent occurrence in its own
            code = _ingest_member(meta, members, HA, htop, y, token_ids[row, :end],
                                  members[y, B_NTOK], k if cost > 0 else 0, min_match, recent_len,
                                  from_first, adaptive, out, sr, need, resume)
            if code != DONE:
                resume[0] = i
                if code >= 0:
                    desc[D_PHASE] = 2 + 4 * fresh
                return code
        # the candidates: own automaton (row i), cross-prompt (row xr), own text (row sr)
        klass = _class_of(SRC_GROUP, out[i, OUT_AGREE])
        if fresh and (own_bound > 0 or out[xr, OUT_N] > 0 or out[sr, OUT_N] > 0):
            best, best_class, best_cell, best_worth = -1, 0, 0, -1.0
            alt, alt_class, alt_cell, alt_worth = -1, 0, 0, -1.0
            prev = members[m, B_PREV]
            for src in (SRC_GROUP, SRC_SOLO, SRC_CROSS):  # a tie goes to the earlier one
                r = i if src == SRC_GROUP else (xr if src == SRC_CROSS else sr)
                if (out[r, OUT_BOUND] if src == SRC_GROUP else out[r, OUT_N]) <= 0:
                    continue
                c = _class_of(src, out[r, OUT_AGREE])
                if cost > 0:
                    cell, worth = _candidate_value(tally, out, r, c, prev, cost)
                else:  # the rule off: the group's candidate, else the cross-prompt one's
                    cell, worth = 0, 1.0 if src == SRC_GROUP else 0.0
                if worth > best_worth:
                    alt, alt_class, alt_cell, alt_worth = best, best_class, best_cell, best_worth
                    best, best_class, best_cell, best_worth = r, c, cell, worth
                elif worth > alt_worth:
                    alt, alt_class, alt_cell, alt_worth = r, c, cell, worth
            if cost > 0 and alt >= 0:
                # the runner-up is settled too when the tokens arrive
                na = min(out[alt, OUT_N], ALT_TOKENS)
                members[m, B_ALTN] = na
                members[m, B_ALTCELL] = alt_cell
                members[m, B_ALTAGREE] = alt_class
                for t in range(na):
                    members[m, B_ALTTOK + t] = out[alt, OUT_DRAFT + t]
            klass = best_class
            if best != i:
                nx = out[best, OUT_N]
                out[i, OUT_N] = nx
                out[i, OUT_BOUND] = out[best, OUT_BOUND]
                for t in range(nx):
                    out[i, OUT_DRAFT + t] = out[best, OUT_DRAFT + t]
        n = out[i, OUT_N]
        members[m, B_NEXTC] = -1
        if n > 0:
            cell = (_log_bucket(out[i, OUT_BOUND], N_LBUCKETS) * N_PREV + members[m, B_PREV])
            members[m, B_DCELL] = cell
            members[m, B_DAGREE] = klass
            if cost > 0:
                keep = _worth_drafting(tally, cell, klass, n, cost)
                if keep < n:
                    members[m, B_NEXTC] = out[i, OUT_DRAFT + keep]
                    n = keep
                    out[i, OUT_N] = n
        if max_len > 0 and n > max_len - end - 1:
            # the step schedules the last token plus the draft, and vLLM's scheduler keeps
            # num_computed + scheduled <= max_model_len - 1: at most max_len - end - 1 drafts
            n = max(max_len - end - 1, 0)
            out[i, OUT_N] = n
            members[m, B_NEXTC] = -1
            members[m, B_ALTN] = 0
        if n > 0:
            members[m, B_DEND] = end
            members[m, B_DLEN] = n
            tally[T_PROPOSALS] += 1
            tally[T_DRAFTED] += n
            if klass // SRC_STRIDE == SRC_CROSS:
                tally[T_CROSS_PROPOSALS] += 1
        elif end > start and (members[m, B_NEXTC] >= 0 or members[m, B_ALTN] > 0):
            # cut to nothing by the estimate: settled as a shadow
            members[m, B_DEND] = end
            members[m, B_DLEN] = 0
    resume[0] = 0
    resume[1] = 0
    xa = desc[D_CROSS_AID]
    if xa >= 0 and (meta[xa, M_NT] >= desc[D_CROSS_BUDGET] or meta[xa, M_FULL]):
        return CROSS_FULL
    return DONE


@njit(cache=True)
def _linked_text(T, head, out):
    """Follow a member's token list from arena position ``head`` into ``out``; returns the
    count written."""
    n = 0
    p = head
    while p >= 0 and n < out.shape[0]:
        out[n] = T[p, TTOKEN]
        n += 1
        p = T[p, TNEXT]
    return n


def fresh_tally() -> np.ndarray:
    """A drafter's tally: zero counters, no cost, every acceptance-table cell at its prior."""
    tally = np.zeros(T_SIZE, np.int64)
    table = tally[T_TABLE:].reshape(-1, 2)
    table[:, 0], table[:, 1] = TABLE_PRIOR
    return tally


_ENTRY = [None, None]  # compiled entry points of _ingest_step and _rows_step (see _entry)
_HASH_INIT = 16
_PAGE = mmap.PAGESIZE
# Every automaton reserves address space for rows up to the id limit (~185 MB of address
# space, no memory): the OS backs a page when it is first written, so rows never move, a
# segment never grows by copying and an automaton holds only the pages its text filled.
RESERVED_ROWS = MAX_IDS + 2
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def _reserve_rows(rows: int, cols: int) -> np.ndarray:
    """A zero int32 array of ``rows`` x ``cols`` whose pages exist once written."""
    nbytes = rows * cols * 4
    try:
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (AttributeError, OSError, ValueError) as exc:  # no anonymous mmap / no address space
        raise MemoryError(f"SAM drafter: cannot reserve {nbytes >> 10} KiB of address space for "
                          f"an automaton ({type(exc).__name__}: {exc})") from exc
    try:  # 4 KiB pages: a 2 MiB page zeroed inside a decode step would be a spike
        mm.madvise(mmap.MADV_NOHUGEPAGE)
    except (AttributeError, OSError):
        pass
    return np.frombuffer(mm, np.int32).reshape(rows, cols)


_I32, _I64 = np.dtype(np.int32), np.dtype(np.int64)
_ndarray = np.ndarray


_SIGNATURES = (
    (types.int64[::1], types.int64[:], types.int32[:], types.int64[:], types.int64),
    (types.int64[::1], types.int64[:, ::1], types.int32[:, :], types.int32[:], types.int64,
     types.int64[::1]),
)


def _entry(which: int):
    """The compiled entry point of ``_ingest_step`` (0) or ``_rows_step`` (1).

    Calling it skips numba's per-call type dispatch (~1 us); the price is that nothing
    checks the argument types, so ``ingest`` and ``ingest_rows`` check dtype and rank of the
    inputs themselves (layouts and offsets are the kernels' business)."""
    fn = _ENTRY[which]
    if fn is None:
        kernel, sig = (_ingest_step, _rows_step)[which], _SIGNATURES[which]
        kernel.compile(sig)
        fn = _ENTRY[which] = kernel.overloads[sig].entry_point
    return fn


def compile_step_kernel() -> None:
    """Compile the drafter's decode-step kernel now (or load it from numba's on-disk cache).

    An engine calls this when it builds its proposer, as vLLM's n-gram proposer warms its
    own kernel, so the compilation (seconds on a cold cache) is paid at start-up and not
    inside the first decode step. A cold compile (a fresh machine: 15-25 s) says so while it
    runs; loading from the cache stays silent."""
    from ...patching.progress import slow_step
    with slow_step("ascend-rl sam: compiling the drafter's numba kernel (first use here; numba caches it "
                   "for later runs)"):
        _entry(1)
        _warm_up()


def _warm_up() -> None:
    """Run every compiled function a drafter calls once, on a throwaway pool: each loads from
    numba's cache at its first call (5-10 ms apiece on the reference machine), which would
    otherwise land inside the decode step that first seeds history (``_ingest_step``), grows
    the hash arena from Python (``_move_hash``) or reads a response back (``_linked_text``)."""
    toks = (np.arange(4096, dtype=np.int64) * 7919 % 509).astype(np.int32)  # many branching states
    pool = AutomatonPool()
    pool.extend_one(pool.new_member(pool.new_automaton()), toks, k=3)
    batch = np.array([[pool.new_member(pool.new_automaton()), 0]], np.int64)
    pool.ingest_rows(batch, toks[None, :], np.array([toks.size], np.int32), 3, fresh_tally())
    pool.member_text(int(batch[0, 0]))


def _as_1d(x, dtype):
    """``x`` as a 1-d array of ``dtype`` (any strides); free when it already is one."""
    if type(x) is _ndarray and x.dtype is dtype and x.ndim == 1:
        return x
    return np.asarray(x, dtype).reshape(-1)


def _array_slot(name: str, slot: int, cols_slot: int = -1):
    """A pool attribute holding a C-contiguous array whose address and shape the descriptor
    mirrors: every assignment, wherever it happens, refreshes the descriptor."""
    def get(self):
        return self.__dict__[name]

    def put(self, arr):
        arr = np.ascontiguousarray(arr)
        self.__dict__[name] = arr
        desc = self._desc
        desc[slot] = arr.ctypes.data
        desc[slot + 1] = arr.shape[0]
        if cols_slot >= 0:
            desc[cols_slot] = arr.shape[1]
        self._views.clear()
    return property(get, put)


class AutomatonPool:
    """Many suffix automata (one per request, or one per sibling group).

    Python objects exist per automaton and per member, never per token or per state.
    ``ingest`` appends tokens to many members and drafts for all of them in one jitted call.
    """

    meta = _array_slot("meta", D_META)
    members = _array_slot("members", D_MEMBERS)
    HA = _array_slot("HA", D_H)
    _out = _array_slot("_out", D_OUT, D_OUT_COLS)

    def __init__(self, *, min_match: int = 1, recent_len: int = 32, from_first: bool = False,
                 adaptive: bool = False, reserved_rows: int = RESERVED_ROWS):
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        if recent_len < 1:
            raise ValueError(f"recent_len must be >= 1, got {recent_len}")
        if not 2 <= reserved_rows <= RESERVED_ROWS:
            raise ValueError(f"reserved_rows must be in [2, {RESERVED_ROWS}], got {reserved_rows}")
        self.reserved_rows = int(reserved_rows)
        self.min_match = int(min_match)
        self.recent_len = int(recent_len)
        self.from_first = bool(from_first)
        self.adaptive = bool(adaptive)
        self._desc = np.zeros(D_SIZE, np.int64)
        self._desc[[D_MIN_MATCH, D_RECENT_LEN, D_FROM_FIRST, D_ADAPTIVE]] = (
            self.min_match, self.recent_len, self.from_first, self.adaptive)
        self._desc[D_CROSS_AID] = -1
        self.on_cross_full = None  # called after a step that filled the cross-prompt automaton
        self._views: dict = {}
        self._rows: list = []  # per automaton: its (S, E, T) arrays, kept alive here
        self.HA = np.zeros(1024, np.int64)
        self.meta = np.zeros((8, META_COLS), np.int64)
        self.members = np.zeros((8, MEMBER_COLS), np.int64)
        self._free_automata: list[int] = []
        self._free_members: list[int] = []
        self._n_automata = 0
        self._n_members = 0
        self._out = np.zeros((8, OUT_DRAFT + 4), np.int32)

    # -- hash arena -------------------------------------------------------------------------
    def _reserve_hash(self, slots: int) -> int:
        """Base of ``slots`` fresh zero slots at the top of the hash arena."""
        self._make_hash_room(slots)
        base = int(self._desc[D_HTOP])
        self._desc[D_HTOP] = base + slots
        self.HA[base:base + slots] = 0
        return base

    def _make_hash_room(self, slots: int) -> None:
        """Ensure ``slots`` free slots at the top of the hash arena: compact it once holes are
        more than half of it, else reallocate it x2."""
        top = int(self._desc[D_HTOP])
        if top + slots <= self.HA.shape[0]:
            return
        if self._desc[D_HWASTE] > top // 2:
            self._compact_hash()
            top = int(self._desc[D_HTOP])
        if top + slots > self.HA.shape[0]:
            new = np.empty(max(top + slots, self.HA.shape[0] * 2), np.int64)
            new[:top] = self.HA[:top]
            new[top:] = 0  # touch every page now, not one page fault at a time in a decode step
            self.HA = new

    def _compact_hash(self) -> None:
        """Move every live hash segment down over the holes."""
        live = [a for a in range(self._n_automata) if self.meta[a, M_ALIVE]]
        live.sort(key=lambda a: self.meta[a, M_HB])
        top = 0
        for a in live:
            b, cap = int(self.meta[a, M_HB]), int(self.meta[a, M_HC])
            if b != top:
                self.HA[top:top + cap] = self.HA[b:b + cap].copy()
                self.meta[a, M_HB] = top
            top += cap
        self._desc[D_HTOP] = top
        self._desc[D_HWASTE] = 0

    def _grow_hash(self, a: int, slots: int) -> None:
        """The kernel stopped because the hash arena itself was too small."""
        self._make_hash_room(int(_grown_hash_capacity(int(self.meta[a, M_HC]), slots)))
        moved = _move_hash(self.meta, self.HA, self._desc[D_HTOP:D_HTOP + 2], a, slots)
        assert moved, "hash arena room was made"

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
        while True:
            rows = self.reserved_rows
            try:
                S, E, T = (_reserve_rows(rows, S_COLS), _reserve_rows(rows, E_COLS),
                           _reserve_rows(rows, T_COLS))
                break
            except MemoryError:
                # address space is limited here (ulimit -v, strict overcommit): reserve less
                # rather than fail a decode step; such automata stop learning sooner
                if rows <= 4096:
                    raise
                self.reserved_rows = rows // 8
        while len(self._rows) <= a:
            self._rows.append(None)
        self._rows[a] = (S, E, T)
        for col, arr in ((M_SP, S), (M_EP, E), (M_TP, T)):
            self.meta[a, col] = arr.ctypes.data
            self.meta[a, col + 1] = rows
        self.meta[a, M_HB] = self._reserve_hash(_HASH_INIT)
        self.meta[a, M_HC] = _HASH_INIT
        S[0] = (0, -1, -1, -1, NO_EDGES, -1)  # root
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
        self.members[m] = _FRESH_MEMBER
        self.members[m, B_AID] = automaton
        self.meta[automaton, M_MEMBERS] += 1
        return m

    def set_cross(self, automaton: int, budget: int, on_full) -> None:
        """``automaton`` is the cross-prompt one: after a decode step that leaves it holding
        ``budget`` tokens or more (or at its id limit), ``on_full()`` is called."""
        self._desc[D_CROSS_AID] = automaton
        self._desc[D_CROSS_BUDGET] = budget
        self.on_cross_full = on_full

    def link_cross(self, member: int, automaton: int, from_token: int = 0) -> int:
        """Give ``member`` a member of ``automaton`` (a cross-prompt automaton) that gets the
        same tokens from its token ``from_token`` on (0: all of them; a drafter passes the
        prompt's length: the cross-prompt automaton holds responses) and is one of its draft
        sources. Returns that member."""
        x = self.new_member(automaton)
        self.members[x, B_NTOK] = from_token
        self.members[member, B_CROSS] = x
        return x

    def link_solo(self, member: int) -> int:
        """Give ``member`` a member of a fresh automaton that gets the same tokens (all of
        them, from its first: the next step reads them from the member's token row) and holds
        nothing else: the member's own text as a source of its own. Returns that member."""
        y = self.new_member(self.new_automaton())
        self.members[member, B_SOLO] = y
        return y

    def release_member(self, member: int, *, keep_text: bool = False) -> None:
        """Forget a member; its automaton is freed with its last member unless ``keep_text``."""
        if not self.members[member, B_ALIVE]:
            return
        a = int(self.members[member, B_AID])
        self.members[member] = _DEAD_MEMBER
        self._free_members.append(member)
        self.meta[a, M_MEMBERS] -= 1
        if self.meta[a, M_MEMBERS] == 0 and not keep_text:
            self.free_automaton(a)

    def free_automaton(self, automaton: int) -> None:
        a = automaton
        if not self.meta[a, M_ALIVE]:
            return
        if a == self._desc[D_CROSS_AID]:
            self._desc[D_CROSS_AID] = -1
        for m in np.nonzero((self.members[:, B_ALIVE] == 1) & (self.members[:, B_AID] == a))[0]:
            self.members[m] = _DEAD_MEMBER
            self._free_members.append(int(m))
        self._desc[D_HWASTE] += int(self.meta[a, M_HC])
        self.meta[a] = 0
        self._rows[a] = None  # its pages go back to the OS
        self._free_automata.append(a)
        if not self.meta[: self._n_automata, M_ALIVE].any():  # empty pool: start over small
            self.__init__(min_match=self.min_match, recent_len=self.recent_len,
                          from_first=self.from_first, adaptive=self.adaptive,
                          reserved_rows=self.reserved_rows)

    # -- work --------------------------------------------------------------------------------
    def ingest(self, member_ids, tok_flat, tok_off, k: int):
        """Append tokens and draft. Returns (drafts[B, k], n_draft[B], match_len[B]).

        ``member_ids[i]`` gets ``tok_flat[tok_off[i]:tok_off[i + 1]]``. The returned arrays
        are views of a buffer the pool reuses: read them before the next call. Bad token
        ids, released members and inconsistent offsets raise ValueError.
        """
        if not (type(member_ids) is _ndarray and member_ids.dtype is _I64 and member_ids.ndim == 1):
            member_ids = _as_1d(member_ids, _I64)
        if not (type(tok_flat) is _ndarray and tok_flat.dtype is _I32 and tok_flat.ndim == 1):
            tok_flat = _as_1d(tok_flat, _I32)
        if not (type(tok_off) is _ndarray and tok_off.dtype is _I64 and tok_off.ndim == 1):
            tok_off = _as_1d(tok_off, _I64)
        views = self._views.get((member_ids.shape[0], k))
        if views is None:
            views = self._make_views(member_ids.shape[0], k)
        fn = _ENTRY[0] or _entry(0)
        desc = self._desc
        while True:
            a = fn(desc, member_ids, tok_flat, tok_off, k)
            if a == DONE:
                return views
            self._slow_return(
                a, lambda i, j: int(tok_flat[j]), lambda i: int(member_ids[i]),
                lambda i: f"tok_off must be {member_ids.shape[0] + 1} non-decreasing offsets into "
                          f"tok_flat (length {tok_flat.shape[0]}), got {tok_off.tolist()[:16]}")

    def _make_views(self, b: int, k: int):
        if not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"k (draft length) must be an int >= 0, got {k!r}")
        k = int(k)
        out = self._out
        if out.shape[0] < b + 2 or out.shape[1] < OUT_DRAFT + k:  # + 2: scratch rows
            self._out = np.zeros((max(b + 2, 2 * out.shape[0]), OUT_DRAFT + max(k, out.shape[1] - OUT_DRAFT)),
                                 np.int32)  # clears the cached views
            out = self._out
        if len(self._views) > 256:
            self._views.clear()
        views = self._views[(b, k)] = (out[:b, OUT_DRAFT:OUT_DRAFT + k], out[:b, OUT_N],
                                       out[:b, OUT_MATCH])
        return views

    def _slow_return(self, a: int, token_at, member_at, bad_offsets) -> None:
        """Grow the automaton the kernel stopped at, or raise for bad input: ``token_at(i, j)``,
        ``member_at(i)`` and ``bad_offsets(i)`` describe the input at the kernel's resume slots
        (entry ``i``, token ``j``)."""
        resume = self._desc[D_RESUME:D_RESUME + 3]
        if a >= 0:
            self._grow_hash(int(a), int(resume[2]))
            return
        i, j = int(resume[0]), int(resume[1])
        resume[:] = 0
        self._desc[D_PHASE] = 0
        if a == BAD_TOKEN:
            raise ValueError(f"token ids must be in [0, {1 << TOKEN_BITS}); got {token_at(i, j)} "
                             f"for member {member_at(i)}")
        if a == DEAD_MEMBER:
            raise ValueError(f"got a released member id: {member_at(i)}")
        raise ValueError(bad_offsets(i))

    def ingest_rows(self, batch, token_ids, num_tokens, k: int, tally):
        """A drafter's decode step: ``batch[i] = (member, row)`` gets ``token_ids[row]`` up to
        ``num_tokens[row]`` and drafts (see ``_rows_step``). Returns (drafts[B, k], n_draft[B])
        views of the pool's reused output buffer. ``batch`` (int64, C-contiguous [B, 2]) and
        ``tally`` (int64[T_SIZE]) belong to the caller; ``token_ids`` (2-d) and ``num_tokens``
        (1-d) are int32 as vLLM keeps them, any strides (other dtypes are converted)."""
        if not (type(batch) is _ndarray and batch.dtype is _I64 and batch.ndim == 2
                and batch.shape[1] == 2 and batch.flags.c_contiguous
                and type(tally) is _ndarray and tally.dtype is _I64 and tally.shape == (T_SIZE,)):
            raise ValueError("ingest_rows: batch must be a C-contiguous int64 [B, 2] array of "
                             "(member, row), tally an int64 array of T_SIZE counters")
        return self.ingest_own_rows(batch, token_ids, num_tokens, k, tally)

    def ingest_own_rows(self, batch, token_ids, num_tokens, k: int, tally):
        """:meth:`ingest_rows` for a caller whose ``batch`` and ``tally`` are known to be right
        (a drafter's own arrays): those two are not checked."""
        if not (type(token_ids) is _ndarray and token_ids.dtype is _I32 and token_ids.ndim == 2):
            token_ids = np.asarray(token_ids, np.int32)
            if token_ids.ndim != 2:
                raise ValueError(f"token_ids must be a 2-d matrix of token rows, got shape "
                                 f"{token_ids.shape}")
        if not (type(num_tokens) is _ndarray and num_tokens.dtype is _I32 and num_tokens.ndim == 1):
            num_tokens = _as_1d(num_tokens, _I32)
        b = batch.shape[0]
        views = self._views.get((b, k))
        if views is None:
            views = self._make_views(b, k)
        fn = _ENTRY[1] or _entry(1)
        desc = self._desc
        while True:
            a = fn(desc, batch, token_ids, num_tokens, k, tally)
            if a == DONE:
                return views[0], views[1]
            if a == CROSS_FULL:
                self.on_cross_full()  # replaces it; the step's drafts are in views already
                return views[0], views[1]
            self._slow_return(
                a, lambda i, j: int(token_ids[batch[i, 1], j]), lambda i: int(batch[i, 0]),
                lambda i: f"ingest_rows: row {int(batch[i, 1])} (entry {i}) is outside token_ids "
                          f"{token_ids.shape} / num_tokens {num_tokens.shape}, or its token count "
                          f"exceeds the row")

    def extend_one(self, member: int, tokens, k: int = 0):
        """Convenience: one member, returns (draft list, match length)."""
        toks = np.asarray(tokens, np.int32)
        d, n, mlen = self.ingest(np.array([member], np.int64), toks,
                                 np.array([0, toks.size], np.int64), k)
        return d[0, : n[0]].tolist(), int(mlen[0])

    def member_text(self, member: int) -> np.ndarray:
        """The tokens a live member holds in its automaton, in order (those it counted after
        its automaton reached the id limit are not stored)."""
        if not self.members[member, B_ALIVE]:
            raise ValueError(f"member {member} is not alive")
        a = int(self.members[member, B_AID])
        out = np.empty(int(self.members[member, B_NTOK]), np.int32)
        n = _linked_text(self._rows[a][2], np.int64(self.members[member, B_HEAD]), out)
        return out[:n]

    # -- accounting --------------------------------------------------------------------------
    def automaton_bytes(self, a: int) -> int:
        """Memory this automaton holds: the pages its state, edge and token rows have
        filled (rows are written in order, so that is the used rows rounded up to pages)
        plus its hash segment (up to 1.5x its entries / 0.7)."""
        if not self.meta[a, M_ALIVE]:
            return 0
        m = self.meta[a]
        pages = sum(-(-int(m[n]) * width * 4 // _PAGE)
                    for n, width in ((M_NS, S_COLS), (M_NE, E_COLS), (M_NT, T_COLS)))
        return pages * _PAGE + int(m[M_HC]) * 8

    def automaton_used_bytes(self, a: int) -> int:
        """Bytes of rows actually in use (the hash counted at its capacity)."""
        if not self.meta[a, M_ALIVE]:
            return 0
        m = self.meta[a]
        return int(m[M_NS] * S_COLS * 4 + m[M_NE] * E_COLS * 4 + m[M_NT] * T_COLS * 4
                   + m[M_HC] * 8)

    def memory_bytes(self) -> int:
        """Every byte of memory this pool holds: its automata's filled pages, the hash arena
        (holes included) and its tables."""
        rows = sum(self.automaton_bytes(a) - int(self.meta[a, M_HC]) * 8
                   for a in range(self._n_automata) if self.meta[a, M_ALIVE])
        return int(rows + self.HA.nbytes + self.meta.nbytes + self.members.nbytes)

    def is_full(self, a: int) -> bool:
        """An automaton at its id limit keeps counting tokens but no longer learns them."""
        return bool(self.meta[a, M_FULL])

    def tokens(self, a: int) -> int:
        return int(self.meta[a, M_NT])

    def live_automata(self) -> int:
        return int(self.meta[: self._n_automata, M_ALIVE].sum())

    def live_members(self) -> int:
        return int(self.members[: self._n_members, B_ALIVE].sum())
