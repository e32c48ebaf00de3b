"""Property tests of the SAM core against a brute-force longest-suffix-match oracle."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

pytest.importorskip("numba")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from ascend_rl_plugins.features.sam.automaton import B_NTOK, AutomatonPool  # noqa: E402
from tests.features.sam.sam_oracle import BruteForceGroup  # noqa: E402

# ARP_TEST_SAM_EXAMPLES=3000 for a deeper search than CI affords
SETTINGS = settings(max_examples=int(os.environ.get("ARP_TEST_SAM_EXAMPLES", "60")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
K = 4


def _ops(max_members=1, alphabet=3, max_len=50):
    return st.lists(st.tuples(st.integers(0, max_members - 1), st.integers(0, alphabet - 1)),
                    min_size=1, max_size=max_len)


def _check_sequence(ops, n_members, min_match, from_first=False, adaptive=False, recent_len=5):
    pool = AutomatonPool(min_match=min_match, recent_len=recent_len, from_first=from_first,
                         adaptive=adaptive)
    a = pool.new_automaton()
    members = [pool.new_member(a) for _ in range(n_members)]
    oracle = BruteForceGroup()
    for m in members:
        oracle.add_member(m)
    for idx, tok in ops:
        m = members[idx]
        draft, mlen = pool.extend_one(m, [tok], k=K)
        want_len, _, want = oracle.append(m, tok, K, min_match, recent=not from_first,
                                          recent_len=recent_len, adaptive=adaptive)
        assert mlen == want_len
        assert draft == want, (draft, want)
    return pool


@SETTINGS
@given(_ops(1, 2), st.integers(1, 3))
def test_single_text_binary_alphabet(ops, min_match):
    _check_sequence(ops, 1, min_match)


@SETTINGS
@given(_ops(1, 6, 80), st.integers(1, 3))
def test_single_text_larger_alphabet(ops, min_match):
    _check_sequence(ops, 1, min_match)


@SETTINGS
@given(_ops(2, 3, 60), st.integers(1, 3))
def test_adaptive_draft_length(ops, min_match):
    _check_sequence(ops, 2, min_match, adaptive=True)


@SETTINGS
@given(_ops(1, 3), st.integers(1, 3))
def test_first_occurrence_mode(ops, min_match):
    _check_sequence(ops, 1, min_match, from_first=True)


@SETTINGS
@given(_ops(3, 3, 70), st.integers(1, 3))
def test_group_mode_interleaved_siblings(ops, min_match):
    """Several texts growing in any interleaving share one automaton; each member's match
    and draft are those of the brute force over all members' texts."""
    _check_sequence(ops, 3, min_match)


@SETTINGS
@given(st.lists(st.integers(0, 2), min_size=1, max_size=12), _ops(2, 3, 40))
def test_group_mode_shared_prompt(prompt, ops):
    """Siblings with the same prompt: the second sibling's prompt is found whole."""
    ops = [(0, t) for t in prompt] + [(1, t) for t in prompt] + ops
    _check_sequence(ops, 2, 1)


@SETTINGS
@given(st.lists(st.dictionaries(st.integers(0, 3), st.lists(st.integers(0, 2), min_size=1, max_size=5),
                                min_size=1, max_size=4), min_size=1, max_size=8))
def test_batch_api_matches_sequential(rounds):
    """One ingest call over many members (two groups, several tokens each) equals
    appending the tokens one by one."""
    pool = AutomatonPool(min_match=1, recent_len=5)
    groups = [pool.new_automaton(), pool.new_automaton()]
    members = [pool.new_member(groups[i % 2]) for i in range(4)]
    oracles = [BruteForceGroup(), BruteForceGroup()]
    for i, m in enumerate(members):
        oracles[i % 2].add_member(m)
    for rnd in rounds:
        order = sorted(rnd)
        ids = np.array([members[i] for i in order])
        flat = np.array([t for i in order for t in rnd[i]], np.int32)
        off = np.cumsum([0] + [len(rnd[i]) for i in order])
        drafts, counts, mlen = pool.ingest(ids, flat, off, K)
        for j, i in enumerate(order):
            for t in rnd[i]:
                want_len, _, want = oracles[i % 2].append(members[i], t, K, 1)
            assert int(mlen[j]) == want_len
            assert drafts[j, : counts[j]].tolist() == want


def test_recent_state_follows_a_split_made_by_a_sibling():
    """Found by hypothesis: a sibling's append split the state holding member 1's last two
    tokens; the member must follow the string into the clone, or its most-recent bookkeeping
    goes stale and it drafts from an older occurrence ([0, 1, 0, 1] instead of [0])."""
    _check_sequence([(0, 0), (1, 1), (1, 0), (1, 1), (0, 1), (0, 0), (1, 0), (1, 1)], 2, 1,
                    recent_len=2)


@SETTINGS
@given(_ops(2, 2, 60), st.integers(1, 8))
def test_recent_len_picks_the_most_recent_occurrence_of_the_recent_context(ops, recent_len):
    """For every recent_len the match length is exact and the draft continues the most
    recent earlier occurrence of the last min(L, recent_len) tokens (groups included)."""
    _check_sequence(ops, 2, 1, recent_len=recent_len)


@SETTINGS
@given(st.lists(st.integers(0, 3), min_size=1, max_size=300), st.integers(1, 3))
def test_high_degree_states_match_the_oracle(tokens, seed):
    """Larger alphabets make hashed (high-degree) states and clones of them."""
    rng = np.random.default_rng(seed)
    ops = [(0, int(t) * 7 + int(rng.integers(0, 7))) for t in tokens]
    _check_sequence(ops, 1, 1)


def test_cleanup_frees_memory_and_reuses_slots():
    pool = AutomatonPool(min_match=1)
    base = pool.memory_bytes()
    a = pool.new_automaton()
    m1, m2 = pool.new_member(a), pool.new_member(a)
    rng = np.random.default_rng(0)
    pool.extend_one(m1, rng.integers(0, 50, 3000), k=0)
    pool.extend_one(m2, rng.integers(0, 50, 3000), k=0)
    grown = pool.memory_bytes()
    assert grown > base + 6000 * 4
    # the automaton's segments account for its 6000 tokens, states and edges
    assert 6000 * 8 < pool.automaton_used_bytes(a) <= pool.automaton_bytes(a) <= pool.memory_bytes()
    pool.release_member(m1)  # a finished sibling's text stays for the other one
    assert pool.live_automata() == 1 and pool.tokens(a) == 6000
    pool.release_member(m2)  # last member: the automaton goes
    assert pool.live_automata() == 0 and pool.live_members() == 0
    assert pool.memory_bytes() < base + 1024
    # a recycled slot behaves like a fresh automaton
    b = pool.new_automaton()
    assert b == a
    m = pool.new_member(b)
    assert pool.extend_one(m, [1, 2, 3, 1, 2], k=3) == ([3, 1, 2], 2)
    with pytest.raises(ValueError):
        pool.ingest(np.array([m + 1]), np.array([1], np.int32), np.array([0, 1]), 2)


def test_no_python_objects_per_token():
    pool = AutomatonPool(min_match=2)
    a = pool.new_automaton()
    m = pool.new_member(a)
    rng = np.random.default_rng(1)
    pool.extend_one(m, rng.integers(0, 200, 100), k=3)
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(50):
        pool.extend_one(m, rng.integers(0, 200, 400), k=3)
    gc.collect()
    assert len(gc.get_objects()) - before < 50  # 20,000 tokens later


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="min_match"):
        AutomatonPool(min_match=0)
    pool = AutomatonPool()
    m = pool.new_member(pool.new_automaton())
    with pytest.raises(ValueError, match="token ids"):
        pool.extend_one(m, [-1])
    with pytest.raises(ValueError, match="tok_off"):
        pool.ingest(np.array([m]), np.array([1, 2], np.int32), np.array([0, 3]), 2)
    with pytest.raises(ValueError, match="tok_off"):
        pool.ingest(np.array([m]), np.array([1, 2], np.int32), np.array([0, 1, 2]), 2)
    with pytest.raises(ValueError, match="k"):
        pool.ingest(np.array([m]), np.array([1], np.int32), np.array([0, 1]), -1)
    with pytest.raises(ValueError, match="reserved_rows"):
        AutomatonPool(reserved_rows=1)
    # the pool still works after every refusal
    assert pool.extend_one(m, [5, 6, 5], k=2) == ([6, 5], 1)


def test_rows_never_move_and_memory_follows_the_text():
    """State, edge and token rows live in reserved address space: they keep their address
    however long the text grows, and the pool holds only the pages the text filled."""
    from ascend_rl_plugins.features.sam import automaton as A
    pool = AutomatonPool()
    a = pool.new_automaton()
    m = pool.new_member(a)
    where = pool.meta[a, [A.M_SP, A.M_EP, A.M_TP]].copy()
    rng = np.random.default_rng(2)
    sizes = []
    for _ in range(6):
        pool.extend_one(m, rng.integers(0, 300, 5000), k=0)
        sizes.append(pool.automaton_bytes(a))
        assert (pool.meta[a, [A.M_SP, A.M_EP, A.M_TP]] == where).all()
    per_token = [b / ((i + 1) * 5000) for i, b in enumerate(sizes)]
    assert max(per_token) < 1.2 * min(per_token)  # linear, no doubling steps
    assert pool.automaton_used_bytes(a) <= pool.automaton_bytes(a) < pool.automaton_used_bytes(a) + 4 * 4096 + 1


def test_reserved_rows_cap_stops_learning_not_working():
    """An automaton whose reserved rows are full (the id-limit behaviour) keeps counting its
    members' tokens but neither learns them nor drafts for them -- the end of their text is
    no longer in the automaton, so any match would be a wrong one -- instead of failing the
    decode step; other automata of the pool are unaffected."""
    pool = AutomatonPool(reserved_rows=64)
    m = pool.new_member(pool.new_automaton())
    assert pool.extend_one(m, [1, 2, 3] * 10, k=3) == ([1, 2, 3], 27)  # learns, drafts
    assert not pool.is_full(0)
    pool.extend_one(m, list(range(10, 80)), k=0)  # 70 new distinct tokens: > 64 states
    assert pool.is_full(0)
    assert pool.members[m, B_NTOK] == 100  # every token counted
    learned = pool.tokens(0)
    assert learned < 100
    # [1, 2] occurred (learned) before, but the member's text end is unknown now: no draft
    assert pool.extend_one(m, [1, 2], k=3) == ([], 0)
    assert pool.tokens(0) == learned and pool.members[m, B_NTOK] == 102
    other = pool.new_member(pool.new_automaton())
    assert pool.extend_one(other, [1, 2, 3, 1, 2], k=3) == ([3, 1, 2], 2)


def test_limited_address_space_reserves_less_instead_of_failing(monkeypatch):
    from ascend_rl_plugins.features.sam import automaton as A
    real = A._reserve_rows

    def limited(rows, cols):  # as under `ulimit -v`: big reservations fail
        if rows > 100_000:
            raise MemoryError("no address space")
        return real(rows, cols)
    monkeypatch.setattr(A, "_reserve_rows", limited)
    pool = AutomatonPool()
    m = pool.new_member(pool.new_automaton())
    assert pool.reserved_rows <= 100_000
    assert pool.extend_one(m, [1, 2, 3, 1, 2], k=3) == ([3, 1, 2], 2)
