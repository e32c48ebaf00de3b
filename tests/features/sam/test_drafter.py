"""The request-level drafter (``SamDrafter``), the API an engine calls every decode step:
the draft cap near ``max_model_len``, sibling groups, acceptance accounting, batch changes,
the batch-size switch, and equality with the automaton's own (oracle-checked) batch API."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("numba")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from ascend_rl_plugins.features.sam.automaton import AutomatonPool, fresh_tally  # noqa: E402
from ascend_rl_plugins.features.sam.drafter import FINISHED_RECORD, SamDrafter  # noqa: E402
from tests.features.sam.sam_oracle import BruteForceGroup  # noqa: E402

SETTINGS = settings(max_examples=int(os.environ.get("ARP_TEST_SAM_EXAMPLES", "60")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
WIDTH = 256


def matrix(*texts) -> np.ndarray:
    """Token rows as vLLM keeps them (int32, one request per row, zero padded)."""
    m = np.zeros((len(texts), WIDTH), np.int32)
    for i, t in enumerate(texts):
        m[i, : len(t)] = t
    return m


def counts(*n) -> np.ndarray:
    return np.array(n, np.int32)


# -- the cap near max_model_len ---------------------------------------------------------------

def scheduler_allows(max_model_len: int, num_tokens: int) -> int:
    """Draft tokens vLLM's scheduler verifies for a request holding ``num_tokens`` tokens (its
    last sampled token not computed yet): it schedules at most max_model_len - 1 -
    num_computed_tokens tokens (vllm/v1/core/sched/scheduler.py, 0.13 and 0.23; the
    vLLM-Ascend schedulers use the same rule), i.e. the last token plus
    max_model_len - num_tokens - 1 drafts, so that the accepted tokens plus the bonus token
    never take the request past max_model_len."""
    return max(0, (max_model_len - 1 - (num_tokens - 1)) - 1)


@pytest.mark.parametrize("k", [3, 5])
def test_draft_is_capped_to_what_the_scheduler_verifies_near_max_model_len(k):
    """A periodic text always has a full-length draft; near the limit the draft must be
    exactly as long as the scheduler will verify -- one more and the scheduler silently cuts
    it (and the drafter's accounting is wrong), one less and a token of speculation is lost
    in the last steps of every long rollout."""
    limit = 120
    text = ([7, 8, 9, 10, 11] * 40)[:limit]
    tokens = matrix(text)
    seen = []
    for n in range(limit - k - 4, limit + 1):
        d = SamDrafter(k, max_model_len=limit)
        got = d.propose_rows(["r"], [0], tokens, counts(n))
        draft = got.get(0, [])
        want = min(k, scheduler_allows(limit, n))
        seen.append((n, len(draft), want))
        assert len(draft) == want, seen
        assert draft == text[n:n + want]  # the true continuation of the periodic text
        assert d.stats.drafted_tokens == want
    assert [w for _, _, w in seen][-3:] == [1, 0, 0]  # L-2: one draft; L-1 and L: none


def test_cap_also_holds_when_a_request_grows_step_by_step():
    limit, k = 64, 4
    text = ([3, 1, 4, 1, 5] * 20)[:limit]
    tokens = matrix(text)
    d = SamDrafter(k, max_model_len=limit)
    n = 20
    while True:
        draft = d.propose_rows(["r"], [0], tokens, counts(n)).get(0, [])
        assert len(draft) == min(k, scheduler_allows(limit, n))
        if n == limit:
            break
        n += len(draft) + 1  # greedy: the periodic draft is right, plus the bonus token
        assert n <= limit  # a fully accepted draft never takes the request past the limit
    assert d.stats.accepted_tokens == d.stats.drafted_tokens > 0


# -- sibling groups ---------------------------------------------------------------------------------

PROMPT = list(range(10, 30))  # no token repeats: a request alone has nothing to match
A_OUT = [50, 51, 52, 53, 54, 55, 56]


@pytest.mark.parametrize("group", [True, False])
def test_a_sibling_drafts_the_other_siblings_continuation(group):
    """Same prompt, group sharing on: B, one token into its answer, drafts what A wrote after
    that token. Off (or a different prompt): B's own text has no earlier occurrence of its
    end, so it gets no draft at all."""
    d = SamDrafter(3, group=group)
    a = PROMPT + A_OUT
    b = PROMPT + A_OUT[:1]
    other = [99] + PROMPT[1:] + A_OUT[:1]  # a different prompt, same answer so far
    tokens = matrix(a, b, other)
    plens = counts(len(PROMPT), len(PROMPT), len(PROMPT))
    d.propose_rows(["A"], [0], tokens, counts(len(a), 0, 0), prompt_lens=plens)
    got = d.propose_rows(["A", "B", "C"], [0, 1, 2], tokens, counts(len(a), len(b), len(other)),
                         prompt_lens=plens)
    if group:
        assert got.get(1) == A_OUT[1:4]
        assert len(d.groups) == 2  # A and B share one automaton, C has its own
    else:
        assert 1 not in got
        assert len(d.groups) == 3
    assert 2 not in got  # C's prompt differs: never A's group


LOCKSTEP_TEXT = [1, 2, 10, 11, 12, 13, 20, 21, 10, 11, 12, 13, 30, 31, 10, 11]  # prompt 1 2


@pytest.mark.parametrize("group", [True, False])
def test_level_siblings_in_lockstep_both_draft(group):
    """Issue 29's reproduction: two siblings with the same text stepped together. The most
    recent earlier occurrence of sibling B's suffix is A's end, written in the same step,
    with nothing after it yet; B must draft from the most recent occurrence that has a
    continuation (its own earlier ``10 11``), as it does with grouping off."""
    d = SamDrafter(3, group=group)
    tokens = matrix(LOCKSTEP_TEXT, LOCKSTEP_TEXT)
    plens = counts(2, 2)
    for n in range(3, len(LOCKSTEP_TEXT) + 1):
        got = d.propose_rows(["a", "b"], [0, 1], tokens, counts(n, n), prompt_lens=plens)
    assert got == {0: [12, 13, 30], 1: [12, 13, 30]}


def _sibling_texts(base, edits, n):
    """``n`` near-identical answers: the base with a few sibling-specific token edits."""
    texts = [list(base) for _ in range(n)]
    for who, where, tok in edits:
        t = texts[who % n]
        if t:
            t[where % len(t)] = tok
    return texts


@SETTINGS
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 39), st.integers(0, 3)), max_size=6),
       st.integers(2, 4), st.integers(1, 4), st.integers(1, 3), st.booleans(),
       st.integers(1, 6))
def test_siblings_stepped_in_lockstep_match_the_oracle(base, edits, n_sib, k, min_match, adaptive,
                                                       recent_len):
    """Siblings of one prompt decoded together, as vLLM steps ``n > 1`` children: every step
    each sibling gets its accepted draft tokens plus one (greedy verification against its own
    text) and drafts again. Every draft equals the brute force's over the group's texts,
    fed the same tokens in the same order (batch order within a step)."""
    prompt = [7, 8]
    answers = _sibling_texts(base, edits, n_sib)
    texts = [prompt + a for a in answers]
    tokens = matrix(*texts)
    plens = counts(*[len(prompt)] * n_sib)
    d = SamDrafter(k, group=True, min_match=min_match, adaptive=adaptive, recent_len=recent_len)
    oracle = BruteForceGroup()
    for i in range(n_sib):
        oracle.add_member(i)
    seen = [0] * n_sib
    num = [len(prompt) + 1] * n_sib
    live = list(range(n_sib))
    while live:
        drafts, cnt = d.propose_arrays([f"s{i}" for i in live], live, tokens,
                                       counts(*[num[i] if i in live else 0 for i in range(n_sib)]),
                                       prompt_lens=plens)
        for j, i in enumerate(live):
            want = []
            for t in texts[i][seen[i]:num[i]]:
                _, _, want = oracle.append(i, t, k, min_match, recent_len=recent_len,
                                           adaptive=adaptive)
            seen[i] = num[i]
            got = drafts[j, :cnt[j]].tolist()
            assert got == want, (i, num[i], got, want)
            truth = texts[i][num[i]:num[i] + k]
            acc = 0
            while acc < min(len(got), len(truth)) and got[acc] == truth[acc]:
                acc += 1
            num[i] = min(num[i] + acc + 1, len(texts[i]))
        live = [i for i in live if num[i] < len(texts[i])]
    for i in range(n_sib):  # each sibling's text reads back whole from the shared automaton
        assert d.pool.member_text(d.member_of[f"s{i}"]).tolist() == texts[i][:seen[i]]


def test_a_finished_siblings_text_stays_for_the_group_then_goes_with_the_last_member():
    d = SamDrafter(3, group=True)
    a, b, c = PROMPT + A_OUT, PROMPT + A_OUT[:2], PROMPT + A_OUT[:3]
    tokens = matrix(a, b, c)
    plens = counts(*[len(PROMPT)] * 3)
    d.propose_rows(["A", "B"], [0, 1], tokens, counts(len(a), len(PROMPT)), prompt_lens=plens)
    d.retain_only(["B", "C"])  # A finished
    got = d.propose_rows(["B", "C"], [1, 2], tokens, counts(0, len(b), len(c)), prompt_lens=plens)
    assert got == {1: A_OUT[2:5], 2: A_OUT[3:6]}
    assert d.pool.live_automata() == 1
    d.retain_only([])
    assert d.pool.live_automata() == 0 and not d.groups and not d.member_of


# -- accounting and batch changes --------------------------------------------------------------------

def test_acceptance_is_settled_from_the_tokens_that_arrive_next():
    text = [1, 2, 3, 4] * 6 + [9, 9, 9, 9]
    tokens = matrix(text)
    d = SamDrafter(3)
    assert d.propose_rows(["r"], [0], tokens, counts(8)) == {0: [1, 2, 3]}
    # next step: 2 draft tokens accepted, then the bonus token
    assert d.propose_rows(["r"], [0], tokens, counts(11)) == {0: [4, 1, 2]}
    assert (d.stats.accepted_tokens, d.stats.verified_drafts) == (2, 1)
    d.propose_rows(["r"], [0], tokens, counts(11))  # no new token: the draft stays pending
    assert d.stats.verified_drafts == 1
    d.propose_rows(["r"], [0], tokens, counts(15))  # all 3 accepted + bonus
    assert (d.stats.accepted_tokens, d.stats.verified_drafts) == (5, 2)
    assert d.stats.per_request_accepted == {"r": 5}
    d.release("r")
    assert d.stats.per_request_accepted == {"r": 5}  # kept for finished requests


def test_finished_record_is_bounded():
    d = SamDrafter(2)
    tokens = matrix([1, 2, 1, 2])
    for i in range(FINISHED_RECORD + 10):
        d.propose_rows([f"r{i}"], [0], tokens, counts(4))
        d.release(f"r{i}")
    rec = d.stats.per_request_accepted
    assert len(rec) == FINISHED_RECORD and f"r{FINISHED_RECORD + 9}" in rec and "r0" not in rec


def test_requests_that_move_rows_or_replace_each_other_keep_their_own_text():
    """vLLM condenses its batch: a request's row changes, a new request takes a freed row."""
    x = [5, 6, 7, 5, 6, 7, 5, 6]
    y = [20, 21, 22, 23, 20, 21, 22, 23, 20]
    d = SamDrafter(2)
    tokens = matrix(x, y)
    assert d.propose_rows(["X", "Y"], [0, 1], tokens, counts(7, 8)) == {0: [6, 7], 1: [20, 21]}
    swapped = matrix(y, x)
    assert d.propose_rows(["Y", "X"], [0, 1], swapped, counts(9, 8)) == {0: [21, 22], 1: [7, 5]}
    d.retain_only(["X"])
    z = [40, 41, 40]
    got = d.propose_rows(["X", "Z"], [1, 0], matrix(z, x), counts(3, 8))
    assert got == {0: [41, 40]}  # Z's draft comes from Z's text, not from Y's automaton
    assert set(d.member_of) == {"X", "Z"}


def test_requests_that_swap_rows_keep_their_own_text():
    """The same requests in the same order, in each other's rows (vLLM's condense moves rows;
    the proposer drafts for a subset of rows): the step must read each request from its new
    row. A batch cache keyed on the ids alone would feed X with Y's tokens and Y with X's."""
    x = [5, 6, 7, 5, 6, 7, 5, 6]
    y = [20, 21, 22, 23, 20, 21, 22, 23, 20]
    d = SamDrafter(2)
    assert d.propose_rows(["X", "Y"], [0, 1], matrix(x, y), counts(7, 8)) == {0: [6, 7], 1: [20, 21]}
    got = d.propose_rows(["X", "Y"], [1, 0], matrix(y, x), counts(9, 8))
    assert got == {1: [7, 5], 0: [21, 22]}
    assert d.pool.member_text(d.member_of["X"]).tolist() == x
    assert d.pool.member_text(d.member_of["Y"]).tolist() == y


def test_batch_size_switch_ingests_without_drafting():
    text = [1, 2, 3] * 10
    tokens = matrix(text, text, text)
    d = SamDrafter(3, batch_threshold=2)
    assert d.propose_rows(["a", "b", "c"], [0, 1, 2], tokens, counts(9, 9, 9)) == {}
    assert d.stats.inactive_steps == 1
    # batch drained: the automata kept learning, so drafts come at once
    assert d.propose_rows(["a"], [0], tokens, counts(12)) == {0: [1, 2, 3]}
    # batch_size (the scheduled batch) rules, not the number of rows passed
    assert d.propose_rows(["a"], [0], tokens, counts(13), batch_size=3) == {}


def test_bad_input_is_refused_by_name():
    d = SamDrafter(2)
    with pytest.raises(ValueError, match="row"):
        d.propose_rows(["a"], [3], matrix([1, 2]), counts(2))
    with pytest.raises(ValueError, match="token ids"):
        d.propose_rows(["b"], [0], matrix([1, -5]), counts(2))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamDrafter(0)
    pool = AutomatonPool()
    batch = np.array([[pool.new_member(pool.new_automaton()), 0]])
    tally = fresh_tally()
    with pytest.raises(ValueError, match="C-contiguous int64"):
        pool.ingest_rows(batch.astype(np.int32), matrix([1, 2]), counts(2), 2, tally)
    drafts, n = pool.ingest_rows(batch, matrix([1, 2, 1]), counts(3), 2, tally)
    assert drafts[0, : n[0]].tolist() == [2, 1]
    assert d.propose_rows(["c"], [0], matrix([1, 2, 1]), counts(3)) == {0: [2, 1]}


# -- the drafter equals the automaton's batch API --------------------------------------------------

@SETTINGS
@given(st.lists(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4)), min_size=1, max_size=6),
                min_size=1, max_size=12),
       st.booleans(), st.integers(1, 4), st.integers(0, 3), st.booleans())
def test_drafter_matches_per_request_automaton_steps(steps, group, k, threshold, adaptive):
    """Random steps over 6 requests (two prompts, so siblings when grouped), each step a random
    subset growing by 0-4 tokens in shuffled rows: every draft equals what the automaton's own
    API gives for the same tokens, capped by max_model_len; the acceptance counters equal a
    recount."""
    rng = np.random.default_rng(len(steps) * 7 + k)
    limit = 60
    prompts = [[1, 2, 3], [3, 2, 1]]
    texts = [prompts[r % 2] + rng.integers(0, 4, limit).tolist() for r in range(6)]
    seen = [0] * 6
    d = SamDrafter(k, group=group, batch_threshold=threshold, adaptive=adaptive, max_model_len=limit)
    pool = AutomatonPool(adaptive=adaptive)
    ref_member, ref_group = {}, {}
    pending = {}  # request -> (tokens seen when drafted, draft length)
    accepted = 0
    for step in steps:
        chosen = {}
        for r, grow in step:
            chosen[r] = grow
        order = sorted(chosen, key=lambda r: (r * 5 + len(steps)) % 7)
        rows = list(range(len(order)))
        tokens = np.zeros((len(order), limit + 8), np.int32)
        num = np.zeros(len(order), np.int32)
        plens = np.zeros(len(order), np.int32)
        for row, r in enumerate(order):
            seen[r] = min(max(seen[r], 3) + chosen[r], limit)
            tokens[row, : len(texts[r])] = texts[r]
            num[row] = seen[r]
            plens[row] = 3
        got = d.propose_rows([f"q{r}" for r in order], rows, tokens, num, prompt_lens=plens)
        active = threshold == 0 or len(order) <= threshold
        for row, r in enumerate(order):
            if r not in ref_member:
                key = r % 2 if group else ("solo", r)
                if key not in ref_group:
                    ref_group[key] = pool.new_automaton()
                ref_member[r] = pool.new_member(ref_group[key])
            have = int(pool.members[ref_member[r], 3])
            new = texts[r][have:seen[r]]
            if r in pending and new:
                at, n = pending.pop(r)
                if at == have:
                    accepted += min(len(new) - 1, n)
            draft, _ = pool.extend_one(ref_member[r], new, k if active else 0)
            if not new:
                draft = []
            draft = draft[: max(0, min(len(draft), limit - seen[r] - 1))]
            assert got.get(row, []) == draft, (step, r)
            if draft:
                pending[r] = (seen[r], len(draft))
    assert d.stats.accepted_tokens == accepted


def test_a_step_that_outgrows_the_hash_arena_resumes_where_it_stopped():
    """Large alphabets make hashed states; a step ingesting thousands of tokens outgrows the
    shared hash arena, so the kernel returns to Python to grow it and resumes mid-request:
    nothing may be ingested twice or skipped (drafts equal the automaton's own API)."""
    rng = np.random.default_rng(5)
    texts = [rng.integers(0, 300, 3000).tolist() for _ in range(3)]
    width = 3100
    tokens = np.zeros((3, width), np.int32)
    for i, t in enumerate(texts):
        tokens[i, : len(t)] = t
    d = SamDrafter(4)
    arena = d.pool.HA.shape[0]
    got = d.propose_rows(["a", "b", "c"], [0, 1, 2], tokens, counts(2990, 2995, 3000))
    assert d.pool.HA.shape[0] > arena  # the arena grew inside the step
    ref = AutomatonPool()
    for row, (t, n) in enumerate(zip(texts, (2990, 2995, 3000))):
        draft, _ = ref.extend_one(ref.new_member(ref.new_automaton()), t[:n], 4)
        assert got.get(row, []) == draft
    assert [int(d.pool.members[d.member_of[r], 3]) for r in "abc"] == [2990, 2995, 3000]


# -- history: finished responses kept by prompt across steps ----------------------------------------

HIST_PROMPT = [5, 6, 7]
HIST_ANSWER = [40, 41, 42, 43, 44, 45, 46, 47]


def _one_step_rollout(d: SamDrafter, req_id: str, text, prompt_len: int) -> list:
    """A request decoded token by token (no draft accepted) to its end, then finished;
    returns the drafts it got, one per step."""
    tokens = matrix(text)
    plens = counts(prompt_len)
    got = []
    for n in range(prompt_len + 1, len(text) + 1):
        d.retain_only([req_id])  # as the proposer does every step
        got.append(d.propose_rows([req_id], [0], tokens, counts(n), prompt_lens=plens).get(0, []))
    d.retain_only([], finished=[req_id])
    return got


@pytest.mark.parametrize("group", [True, False])
def test_a_prompt_seen_in_an_earlier_step_drafts_from_that_steps_responses(group):
    """Step 1 answers the prompt and finishes (its automaton is freed); in step 2 a request
    with the same prompt, one token into its answer, drafts step 1's continuation, but only
    with history on."""
    text = HIST_PROMPT + HIST_ANSWER
    for history in (0, 1024):
        d = SamDrafter(3, group=group, history_tokens=history)
        _one_step_rollout(d, "step1", text, len(HIST_PROMPT))
        assert d.pool.live_automata() == 0
        second = _one_step_rollout(d, "step2", text, len(HIST_PROMPT))
        if history:
            assert second[0] == HIST_ANSWER[1:4]
            assert d.history.counters.seeded == 1 and d.history.responses_kept() == 2
        else:
            assert second[0] == []
            assert d.history is None


def test_history_of_another_prompt_changes_nothing():
    """History on but holding only other prompts' responses (or nothing): every draft and
    every counter is the same as with history off."""
    rng = np.random.default_rng(3)
    texts = [[100 + i] + rng.integers(0, 4, 60).tolist() for i in range(6)]
    runs = []
    for history in (0, 1 << 16):
        d = SamDrafter(4, group=True, history_tokens=history)
        runs.append(([_one_step_rollout(d, f"r{i}", t, 1) for i, t in enumerate(texts)],
                     d.stats.as_dict()))
    assert runs[0] == runs[1]


def test_a_request_that_leaves_without_finishing_leaves_no_history():
    """Issue 44: B leaves the batch (preempted, aborted, or a migration hop moved away) and
    comes back: nothing is stored for it, neither when it leaves nor when it returns; a
    partial response stored under a migration hop's prompt (prompt + earlier tokens) is a
    key no later request has. Only a request named as finished leaves its response."""
    d = SamDrafter(3, group=True, history_tokens=1024)
    a, b = HIST_PROMPT + HIST_ANSWER, HIST_PROMPT + HIST_ANSWER[:6]
    tokens = matrix(a, b)
    plens = counts(len(HIST_PROMPT), len(HIST_PROMPT))
    for live, n in ((["A", "B"], (5, 5)), (["A"], (6,)), (["A", "B"], (7, 7))):
        d.retain_only(live)
        d.propose_rows(live, list(range(len(live))), tokens, counts(*n), prompt_lens=plens)
    assert (d.history.counters.stored, d.history.responses_kept()) == (0, 0)
    d.retain_only([], finished=["A"])  # A finished, B was aborted
    assert d.history.counters.stored == 1
    assert [r.tolist() for r in d.history.responses(bytes(np.array(HIST_PROMPT, np.int32)))] == \
        [HIST_ANSWER[:4]]


EOS = 2


@pytest.mark.parametrize("conditions, output, kept", [
    # a stop token ends it; the runner's tokens after it (the rest of an accepted draft) do not count
    ({"stop_token_ids": frozenset({EOS})}, [40, 41, EOS, 43, 44], [40, 41, EOS]),
    # no stop token before min_tokens counts
    ({"stop_token_ids": frozenset({EOS, 9}), "min_tokens": 3}, [40, EOS, 41, 9, 42], [40, EOS, 41, 9]),
    ({"max_tokens": 3}, [40, 41, 42, 43], [40, 41, 42]),  # max_tokens
    ({}, [40, 41, 42, 43, 44], [40, 41, 42, 43, 44]),  # max_model_len (8 tokens)
    ({"stop_token_ids": frozenset({EOS}), "max_tokens": 9}, [40, 41, 42], None),  # left before its end
    (None, [40, 41, EOS], None),  # conditions unknown: never kept
])
def test_a_response_is_kept_when_its_text_ends_by_its_stop_conditions(conditions, output, kept):
    """How the vLLM proposers tell a finished request from one that only left the batch (the
    runner's finished ids include aborted requests): its stop conditions, given when it first
    shows up. The response is kept up to where the scheduler ended it."""
    from ascend_rl_plugins.features.sam.drafter import StopConditions
    prompt = [5, 6, 7]
    stop = None if conditions is None else StopConditions(**conditions)
    d = SamDrafter(3, history_tokens=1024, max_model_len=len(prompt) + 5,
                   stop_conditions_of={"r": stop}.get)
    text = prompt + output
    d.propose_rows(["r"], [0], matrix(text), counts(len(text)), prompt_lens=counts(len(prompt)))
    d.retain_only([])
    got = [r.tolist() for r in d.history.responses(bytes(np.array(prompt, np.int32)))]
    assert got == ([kept] if kept else [])


def test_history_is_bounded_and_evicts_the_least_recently_used_prompt():
    from ascend_rl_plugins.features.sam.history import ResponseHistory
    h = ResponseHistory(max_tokens=100, per_prompt=2)
    for i in range(3):
        h.add(b"p", np.full(10, i, np.int32))
    assert [int(r[0]) for r in h.responses(b"p")] == [1, 2]  # per prompt: the oldest went
    h.add(b"q", np.zeros(40, np.int32))
    h.responses(b"p")  # p used: q is now the least recently used
    h.add(b"r", np.zeros(45, np.int32))  # 20 + 40 + 45 > 100: q's response goes
    assert h.tokens <= 100 and h.responses(b"q") == [] and len(h.responses(b"p")) == 2
    h.add(b"s", np.zeros(101, np.int32))  # longer than the whole budget: not kept
    assert h.counters.skipped == 1 and h.tokens <= 100
    big = ResponseHistory(max_tokens=1 << 20, per_prompt=16)
    for i in range(16):
        big.add(bytes([i]) * 400, np.zeros(4096, np.int32))
    per_token = big.memory_bytes() / big.tokens
    assert 4.0 <= per_token < 4.5, per_token  # int32 tokens plus per-response and per-prompt overhead


def _refused_by_name(monkeypatch, cases):
    """Each (flag, bad value): reading the flag raises an error naming it."""
    from ascend_rl_plugins import flags
    for flag, bad in cases:
        monkeypatch.setenv(flag.name, bad)
        flags._REGISTRY.reset_cache()
        with pytest.raises(Exception, match=flag.name):
            flag.value
        monkeypatch.delenv(flag.name)
        flags._REGISTRY.reset_cache()


def test_history_flags_are_refused_by_name_when_out_of_range(monkeypatch):
    from ascend_rl_plugins.features.sam import HISTORY_PER_PROMPT, HISTORY_TOKENS
    _refused_by_name(monkeypatch, ((HISTORY_TOKENS, "-1"), (HISTORY_PER_PROMPT, "0"), (HISTORY_TOKENS, "many")))


# -- draft only what will be accepted -------------------------------------------------------------

def test_verification_cost_is_flat_while_memory_bound_then_rises_to_one():
    from ascend_rl_plugins.features.sam.drafter import verification_cost
    assert [verification_cost(0.1, 64, b) for b in (1, 16, 32)] == [0.1, 0.1, 0.1]
    assert verification_cost(0.1, 64, 48) == pytest.approx(0.55)
    assert verification_cost(0.1, 64, 64) == verification_cost(0.1, 64, 500) == 1.0
    assert verification_cost(0.0, 64, 500) == 0.0  # off: every candidate is drafted


def _feed_one_token_per_step(d: SamDrafter, text, batch_size=None) -> list:
    tokens = np.array([text], np.int32)
    return [d.propose_rows(["r"], [0], tokens, counts(n), batch_size=batch_size).get(0, [])
            for n in range(1, len(text) + 1)]


@SETTINGS
@given(st.lists(st.integers(0, 3), min_size=1, max_size=120), st.integers(1, 6), st.integers(1, 3),
       st.booleans(), st.floats(0.01, 0.9))
def test_the_estimate_only_shortens_drafts_and_the_confidence_flags_still_apply(
        text, k, min_match, adaptive, cost):
    """Fed the same tokens, a drafter with the draft-length rule drafts a prefix of what the
    same drafter without it drafts (the candidate is the same, only its length is chosen), so
    min match and the cap act first, as overrides."""
    plain = _feed_one_token_per_step(SamDrafter(k, min_match=min_match, adaptive=adaptive), text)
    ruled = _feed_one_token_per_step(
        SamDrafter(k, min_match=min_match, adaptive=adaptive, token_cost=cost), text)
    for p, r in zip(plain, ruled):
        assert r == p[: len(r)]


def _greedy_replay(d: SamDrafter, text, batch_size=None) -> list:
    """Drafts of a request whose every step brings its accepted draft tokens plus one."""
    tokens = np.array([text], np.int32)
    n, drafts = 1, []
    while n < len(text):
        draft = d.propose_rows(["r"], [0], tokens, counts(n), batch_size=batch_size).get(0, [])
        drafts.append(draft)
        a = 0
        while a < len(draft) and n + a < len(text) and draft[a] == text[n + a]:
            a += 1
        n += a + 1
    return drafts


def test_drafts_that_keep_failing_are_cut_and_drafts_that_hold_are_kept_whole():
    """Text with a period of 5 accepts every draft: drafts stay k long. A text whose repeats
    never continue alike (each occurrence of a token is followed by a new token) rejects
    every first draft token: the estimate learns it and stops drafting, while a drafter
    without the rule keeps drafting."""
    k = 4
    periodic = [1, 2, 3, 4, 5] * 60
    d = SamDrafter(k, token_cost=0.2)
    drafts = _greedy_replay(d, periodic)
    assert all(len(x) == k for x in drafts[-30:])
    rng = np.random.default_rng(0)
    noisy = [int(t) for t in rng.integers(0, 6, 400)]
    ruled = SamDrafter(k, token_cost=0.2)
    plain = SamDrafter(k)
    tail_ruled = _greedy_replay(ruled, noisy)[-100:]
    tail_plain = _greedy_replay(plain, noisy)[-100:]
    assert sum(map(len, tail_ruled)) < sum(map(len, tail_plain)) / 4
    # the batch size raises the cost: at the compute-bound batch nothing is drafted
    big = SamDrafter(k, token_cost=0.2, compute_bound_batch=8)
    assert not any(_greedy_replay(big, periodic, batch_size=8))
    assert big.stats.inactive_steps == big.stats.steps == len(periodic) - 1


def test_draft_length_flags_are_refused_by_name_when_out_of_range(monkeypatch):
    from ascend_rl_plugins.features.sam import COMPUTE_BOUND_BATCH, TOKEN_COST
    _refused_by_name(monkeypatch, ((TOKEN_COST, "1.5"), (TOKEN_COST, "-0.1"), (COMPUTE_BOUND_BATCH, "0")))
    with pytest.raises(ValueError, match="token_cost"):
        SamDrafter(3, token_cost=2.0)
    with pytest.raises(ValueError, match="compute_bound_batch"):
        SamDrafter(3, compute_bound_batch=0)


# -- the cross-prompt automaton: drafts where a request's own automaton has no candidate ----------

def test_a_token_new_to_its_group_drafts_from_another_prompts_text():
    """Request b (prompt B) writes what request a (prompt A, finished) wrote. Its own group
    never saw ``10``: no candidate, so the cross-prompt automaton drafts a's continuation;
    with it off b drafts nothing. Once b's own text has a candidate, that one is used."""
    a_text, b_text = [1, 2, 10, 11, 12, 13, 14], [3, 4, 10, 11, 12, 13, 14]
    for cross in (0, 1024):
        d = SamDrafter(3, group=True, cross_prompt_tokens=cross)
        _one_step_rollout(d, "a", a_text, 2)
        got = _one_step_rollout(d, "b", b_text, 2)
        assert got[0] == ([11, 12, 13] if cross else [])
        assert (d.stats.cross_proposals > 0) == bool(cross)
        if cross:
            assert d.pool.live_automata() == 1  # only the cross-prompt one stays
        else:
            assert d.pool.live_automata() == 0


@SETTINGS
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=2, max_size=3),
       st.lists(st.integers(1, 3), min_size=3, max_size=3), st.integers(1, 4), st.integers(1, 3),
       st.booleans(), st.integers(1, 6))
def test_with_prompts_decoded_together_drafts_are_the_groups_else_the_cross_prompt_oracles(
        answers, siblings, k, min_match, adaptive, recent_len):
    """Several prompts, each with 1-3 siblings writing the same answer, all decoded in one
    batch (greedy verification). Every draft is the brute force's over the request's own
    group when that has a candidate, else the brute force's over every request's response
    in the order the batch fed it (the cross-prompt automaton, which holds no prompt)."""
    rows = []  # (prompt index, text)
    for p, ans in enumerate(answers):
        prompt = [20 + p, 30 + p]
        rows += [(p, prompt + ans)] * siblings[p]
    tokens = matrix(*[t for _, t in rows])
    plens = counts(*[2] * len(rows))
    d = SamDrafter(k, group=True, min_match=min_match, adaptive=adaptive, recent_len=recent_len,
                   cross_prompt_tokens=1 << 16)
    groups = [BruteForceGroup() for _ in answers]
    everyone = BruteForceGroup()
    for i, (p, _) in enumerate(rows):
        groups[p].add_member(i)
        everyone.add_member(i)
    seen = [0] * len(rows)
    num = [3] * len(rows)
    live = list(range(len(rows)))
    while live:
        drafts, cnt = d.propose_arrays([f"r{i}" for i in live], live, tokens,
                                       counts(*[num[i] if i in live else 0 for i in range(len(rows))]),
                                       prompt_lens=plens)
        for j, i in enumerate(live):
            p, text = rows[i]
            own = cross = []
            for at in range(seen[i], num[i]):
                t = text[at]
                _, _, own = groups[p].append(i, t, k, min_match, recent_len=recent_len,
                                             adaptive=adaptive)
                if at >= 2:  # the cross-prompt automaton gets responses only
                    _, _, cross = everyone.append(i, t, k, min_match, recent_len=recent_len,
                                                  adaptive=adaptive)
            seen[i] = num[i]
            got = drafts[j, :cnt[j]].tolist()
            assert got == (own or cross), (i, num[i], got, own, cross)
            truth = text[num[i]:num[i] + k]
            acc = 0
            while acc < min(len(got), len(truth)) and got[acc] == truth[acc]:
                acc += 1
            num[i] = min(num[i] + acc + 1, len(text))
        live = [i for i in live if num[i] < len(rows[i][1])]


def test_a_step_that_outgrows_the_hash_arena_in_the_cross_prompt_automaton_resumes():
    """The cross-prompt automaton gets every request's tokens after its own automaton did; it
    holds the most text, so its hash outgrows the shared arena inside a step and the kernel
    returns to Python to grow it. The step resumes with the request's own draft kept (not
    replaced by the cross-prompt one, which differs: c copies a, and b's own text is more
    recent in its own automaton than in the shared one) and no token ingested twice or
    skipped."""
    rng = np.random.default_rng(5)
    a, b, lead = (rng.integers(0, 300, n).tolist() for n in (3000, 3000, 100))
    texts = [a, b, lead + a[:2900]]  # c writes what a wrote, 100 tokens later
    tokens = np.zeros((3, 3100), np.int32)
    for i, t in enumerate(texts):
        tokens[i, : len(t)] = t
    plain, d = SamDrafter(4), SamDrafter(4, cross_prompt_tokens=1 << 16)
    growths = 0
    for n in range(500, 3001, 500):
        want = plain.propose_rows(["a", "b", "c"], [0, 1, 2], tokens, counts(n, n, n))
        arena = d.pool.HA.shape[0]
        got = d.propose_rows(["a", "b", "c"], [0, 1, 2], tokens, counts(n, n, n))
        growths += d.pool.HA.shape[0] > arena
        for row in range(3):
            assert got.get(row) == want.get(row) or not want.get(row), (n, row)
        members = d.pool.members
        for r in "abc":
            m = d.member_of[r]
            assert int(members[m, 3]) == n and int(members[int(members[m, 15]), 3]) == n
        assert d.pool.tokens(d._cross) == 3 * n
    assert growths >= 2


def test_the_cross_prompt_automaton_is_replaced_at_its_budget():
    """Its tokens stay within the budget plus one step's tokens; live requests go on in the
    fresh one from their next token, and its memory does not grow with the stream."""
    rng = np.random.default_rng(7)
    texts = [[50 + i, 60 + i] + rng.integers(0, 6, 600).tolist() for i in range(2)]
    tokens = np.zeros((2, 700), np.int32)
    for i, t in enumerate(texts):
        tokens[i, : len(t)] = t
    d = SamDrafter(3, group=True, cross_prompt_tokens=100)
    sizes, drafted_after = [], 0
    for n in range(3, 600):
        got = d.propose_rows(["x", "y"], [0, 1], tokens, counts(n, n), prompt_lens=counts(2, 2))
        assert d.pool.tokens(d._cross) < 100  # replaced after the step that reached it
        sizes.append(d.memory_bytes())
        drafted_after += bool(got) and d.cross_rotations > 0
    assert d.cross_rotations >= 10 and drafted_after > 0
    assert d.pool.live_automata() == 3  # two groups and one cross-prompt automaton
    assert max(sizes[300:]) <= 2 * max(sizes[:300])
    with pytest.raises(ValueError, match="cross_prompt_tokens"):
        SamDrafter(3, cross_prompt_tokens=-1)


def test_cross_prompt_flag_is_refused_by_name_when_out_of_range(monkeypatch):
    from ascend_rl_plugins.features.sam import CROSS_PROMPT_TOKENS
    _refused_by_name(monkeypatch, ((CROSS_PROMPT_TOKENS, "-1"), (CROSS_PROMPT_TOKENS, "lots")))


# -- the candidate choice: the source worth most by the acceptance table ---------------------------

def _greedy_request(d: SamDrafter, req_id: str, text, prompt_len: int) -> list:
    """Decode ``text`` after its prompt as the only request, greedy verification (accepted draft
    tokens plus one each step), then finish it; returns the drafts, one per step."""
    tokens = matrix(text)
    n, drafts = prompt_len + 1, []
    while n < len(text):
        d.retain_only([req_id])
        draft = d.propose_rows([req_id], [0], tokens, counts(n), prompt_lens=counts(prompt_len)).get(0, [])
        drafts.append(draft)
        a = 0
        while a < len(draft) and n + a < len(text) and draft[a] == text[n + a]:
            a += 1
        n += a + 1
    d.retain_only([], finished=[req_id])
    return drafts


def test_a_long_cross_prompt_match_is_drafted_over_a_short_one_of_the_group_once_the_table_says_so():
    """Issue 46: where a request's own (group's) automaton has a short match and the
    cross-prompt automaton a long one, the draft comes from the source worth more by the
    acceptance table, not from the group's whatever it is worth. Each round, request a_r
    (prompt A_r) writes 5 fresh tokens w_r and a fresh text x_r, and finishes; request b_r,
    whose prompt holds x_r's first token followed by a decoy and ends with w_r, then writes
    x_r: at its first step its group's automaton continues the 1-token match (x_r[0]) into the
    decoy, the cross-prompt one the 6-token match (w_r, x_r[0]) into x_r. The first round's
    tie goes to the group; the table learns both candidates from it (the one not drafted is
    settled too), and from then on the cross-prompt continuation is drafted. With the
    draft-length rule off (token cost 0) the group's candidate keeps precedence."""
    rng = np.random.default_rng(46)
    for cost in (0.06, 0.0):
        d = SamDrafter(3, group=True, cross_prompt_tokens=1 << 16, token_cost=cost)
        first, decoys, truths = [], [], []
        for r in range(6):
            w = (2000 + 5 * r + np.arange(5)).tolist()
            x = (1000 + 40 * r + rng.permutation(40)).tolist()  # text no earlier round wrote
            _greedy_request(d, f"a{r}", [10 + 2 * r, 11 + 2 * r] + w + x, 2)
            prompt = [500 + r, x[0], 999] + w
            first.append(_greedy_request(d, f"b{r}", prompt + x, len(prompt))[0])
            decoys.append([999] + w[:2])  # what follows x_r[0] in b_r's own text
            truths.append(x[1:4])  # what follows (w_r, x_r[0]) in a_r's
        if cost:
            assert first[0] == decoys[0]  # the tie (both cells at their prior): the group's
            assert first[1:] == truths[1:], first
            assert d.stats.cross_proposals >= 5
        else:
            assert first == decoys  # the group's candidate, every round


@SETTINGS
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=2, max_size=3),
       st.lists(st.integers(1, 3), min_size=3, max_size=3), st.integers(1, 4), st.integers(1, 6),
       st.floats(0.01, 0.5))
def test_with_the_draft_length_rule_every_draft_comes_from_one_of_the_sources_oracles(
        answers, siblings, k, recent_len, cost):
    """The same batches with the draft-length rule on, which picks the source worth most: every
    draft is a prefix (the rule may cut it) of the brute force's over the request's group,
    over its own text alone, or over every request's response (the cross-prompt automaton); a
    request drafts only where one of them has a candidate."""
    rows = []
    for p, ans in enumerate(answers):
        rows += [(p, [20 + p, 30 + p] + ans)] * siblings[p]
    tokens = matrix(*[t for _, t in rows])
    plens = counts(*[2] * len(rows))
    d = SamDrafter(k, group=True, recent_len=recent_len, cross_prompt_tokens=1 << 16, token_cost=cost)
    groups = [BruteForceGroup() for _ in answers]
    solos = [BruteForceGroup() for _ in rows]
    everyone = BruteForceGroup()
    for i, (p, _) in enumerate(rows):
        groups[p].add_member(i)
        solos[i].add_member(i)
        everyone.add_member(i)
    seen = [0] * len(rows)
    num = [3] * len(rows)
    live = list(range(len(rows)))
    while live:
        drafts, cnt = d.propose_arrays([f"r{i}" for i in live], live, tokens,
                                       counts(*[num[i] if i in live else 0 for i in range(len(rows))]),
                                       prompt_lens=plens)
        for j, i in enumerate(live):
            p, text = rows[i]
            want = [[], [], []]
            for at in range(seen[i], num[i]):
                want = [o.append(i, text[at], k, 1, recent_len=recent_len)[2]
                        for o in (groups[p], solos[i]) + ((everyone,) if at >= 2 else ())]
            seen[i] = num[i]
            got = drafts[j, :cnt[j]].tolist()
            assert any(w[:len(got)] == got for w in want if w) or not got, (i, num[i], got, want)
            truth = text[num[i]:num[i] + k]
            acc = 0
            while acc < min(len(got), len(truth)) and got[acc] == truth[acc]:
                acc += 1
            num[i] = min(num[i] + acc + 1, len(text))
        live = [i for i in live if num[i] < len(rows[i][1])]


def test_own_text_automata_exist_while_a_group_has_several_live_members_and_go_with_them():
    """With the draft-length rule on, a request whose group has other live members also
    drafts from its own text alone: one more automaton per such request (the first member
    gets its own when the second joins, and learns its text from its row), none for a
    group's single member, and each goes when its request leaves."""
    d = SamDrafter(3, group=True, token_cost=0.06)
    a, b = PROMPT + A_OUT, PROMPT + A_OUT[:3]
    tokens = matrix(a, b)
    plens = counts(len(PROMPT), len(PROMPT))
    d.propose_rows(["A"], [0], tokens, counts(len(a), 0), prompt_lens=plens)
    assert d.pool.live_automata() == 1  # the group's; A alone needs no other
    got = d.propose_rows(["A", "B"], [0, 1], tokens, counts(len(a), len(b)), prompt_lens=plens)
    assert 0 not in got  # A had no new token: no draft (its own text was learned, not drafted from)
    assert d.pool.live_automata() == 3  # the group's, A's own text, B's own text
    solo_a = int(d.pool.members[d.member_of["A"], -1])
    assert d.pool.member_text(solo_a).tolist() == a  # caught up from A's row
    d.retain_only(["B"], finished=["A"])
    assert d.pool.live_automata() == 2
    d.retain_only([])
    assert d.pool.live_automata() == 0
    off = SamDrafter(3, group=True)  # the rule off: no own-text automata
    off.propose_rows(["A", "B"], [0, 1], tokens, counts(len(a), len(b)), prompt_lens=plens)
    assert off.pool.live_automata() == 1
