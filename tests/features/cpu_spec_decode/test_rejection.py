"""The vectorized rejection sampler equals a per-request scalar reading of the algorithm."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings, strategies as st  # noqa: E402

from ascend_rl_plugins.features.cpu_spec_decode import rejection  # noqa: E402


def _reference(draft, counts, max_spec, draft_probs, target_probs, bonus, greedy, uniform, q):
    out = torch.full((len(counts), max_spec + 1), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(counts):
        rejected = False
        for p in range(n):
            t = start + p
            d = int(draft[t])
            if greedy[b]:
                tok = int(target_probs[t].argmax())
                out[b, p] = tok
                if tok != d:
                    rejected = True
                    break
            else:
                dp = 1.0 if draft_probs is None else float(draft_probs[t, d])
                tp = float(target_probs[t, d])
                if dp > 0 and tp / dp >= float(uniform[t]):
                    out[b, p] = d
                else:
                    if draft_probs is None:
                        resid = target_probs[t].clone()
                        resid[d] = 0
                    else:
                        resid = (target_probs[t] - draft_probs[t]).clamp_min(0)
                    out[b, p] = int((resid / q[b]).argmax())
                    rejected = True
                    break
        if not rejected:
            out[b, n] = int(bonus[b])
        start += n
    return out


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=6), st.integers(0, 2**31 - 1),
       st.sampled_from(["greedy", "random", "mixed"]), st.booleans())
def test_matches_scalar_reference(counts, seed, mode, with_draft_probs):
    gen = torch.Generator().manual_seed(seed)
    vocab, batch, total = 7, len(counts), sum(counts)
    max_spec = max(max(counts), 1)
    target = torch.softmax(torch.randn(total, vocab, generator=gen) * 2, -1)
    draft_probs = torch.softmax(torch.randn(total, vocab, generator=gen), -1) if with_draft_probs else None
    # drafts: often the argmax (so some get accepted), sometimes random
    draft = torch.where(torch.rand(total, generator=gen) < 0.6, target.argmax(-1),
                        torch.randint(0, vocab, (total,), generator=gen)).to(torch.int32)
    bonus = torch.randint(0, vocab, (batch, 1), generator=gen, dtype=torch.int32)
    greedy = {"greedy": [True] * batch, "random": [False] * batch,
              "mixed": [bool(i % 2) for i in range(batch)]}[mode]
    temperature = torch.tensor([0.0 if g else 1.0 for g in greedy])
    meta = SimpleNamespace(all_greedy=all(greedy), all_random=not any(greedy),
                           temperature=temperature, generators={})
    uniform = torch.rand(total, generator=gen, dtype=torch.float64)
    cu = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    torch.manual_seed(seed)
    q = torch.empty(batch, vocab).exponential_()
    want = _reference(draft, counts, max_spec, draft_probs, target, bonus.view(-1), greedy, uniform, q)
    torch.manual_seed(seed)
    got = rejection.rejection_sample(draft, counts, max_spec, cu, draft_probs, target, bonus, meta,
                                     uniform_probs_fn=lambda *a: uniform)
    assert torch.equal(got, want), (got, want)


def test_expand_batch_to_tokens():
    x = torch.tensor([5, 0, 7])
    cu = torch.tensor([2, 5, 6])
    assert rejection.expand_batch_to_tokens(x, cu, 6, replace_from=0, replace_to=1).tolist() == \
        [5, 5, 1, 1, 1, 7]
    with pytest.raises(ValueError):
        rejection.expand_batch_to_tokens(x, cu, 7)
