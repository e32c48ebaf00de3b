"""SAM in a real vLLM engine on CPU (tiny random Qwen3): token identity, acceptance,
group-aware drafting, the batch-size switch. One engine per configuration, in a subprocess."""

from __future__ import annotations

import pytest

from helpers import ENGINE_ENV, run_python, stack_name

pytestmark = pytest.mark.skipif(stack_name() is None, reason="needs a vLLM stack (recipe or current)")

COMMON = r'''
import os
from vllm import LLM, SamplingParams
from ascend_rl_plugins.devtools import tiny_qwen3

PROMPTS = [([5, 6, 7, 8, 9] * 8)[:40], list(range(10, 50)), ([300, 301, 302, 303] * 10)[:38]]
STAGGER = ([40, 41, 42, 43, 44, 45] * 6)[:33]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

def make_llm(spec):
    kw = {"speculative_config": spec} if spec else {}
    return LLM(model=tiny_qwen3.cached(), enforce_eager=True, max_model_len=512, max_num_seqs=8,
               dtype="float32", seed=0, **kw)

def toks(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]

def run_engine(llm, adds):
    """adds: {step_index: [(request_id, prompt, max_tokens)]}; returns {request_id: tokens}."""
    eng, done, step = llm.llm_engine, {}, 0
    pending = dict(adds)
    while pending or eng.has_unfinished_requests():
        for rid, prompt, n in pending.pop(step, []):
            eng.add_request(rid, {"prompt_token_ids": prompt},
                            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        for out in eng.step():
            if out.finished:
                done[out.request_id.split("-")[0]] = list(out.outputs[0].token_ids)
        step += 1
    return done
'''

BASELINE = COMMON + r'''
llm = make_llm(None)
res = {"batch": toks(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)),
       "n3": toks(llm.generate([{"prompt_token_ids": PROMPTS[1]}],
                               SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=24, ignore_eos=True))),
       "stagger": run_engine(llm, {0: [("A", STAGGER, 40)]})}
emit(res)
'''

SAM = COMMON + r'''
from ascend_rl_plugins import flags
from ascend_rl_plugins.patching.core import REGISTRY
llm = make_llm({"method": "sam", "num_speculative_tokens": 3})
core = llm.llm_engine.engine_core.engine_core
runner = core.model_executor.driver_worker.worker.model_runner
sam = runner.drafter.sam
res = {"drafter": type(runner.drafter).__name__,
       "spec": [runner.speculative_config.method, runner.speculative_config.model]}

def stats():
    return dict(sam.stats.as_dict())

def delta(before):
    now = stats()
    return {k: now[k] - before[k] for k in ("proposals", "drafted_tokens", "accepted_tokens",
                                            "inactive_steps")}

sam.group = False
s0 = stats()
res["batch"] = toks(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
res["batch_stats"] = delta(s0)
sam.group = True
s0 = stats()
res["n3"] = toks(llm.generate([{"prompt_token_ids": PROMPTS[1]}],
                              SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=24, ignore_eos=True)))
res["n3_stats"] = delta(s0)

# a sibling that starts 12 steps later drafts from the first one's text (group mode)
for mode in (False, True):
    sam.group = mode
    sam.stats.per_request_accepted.clear()
    out = run_engine(llm, {0: [("A" + str(mode), STAGGER, 40)], 12: [("B" + str(mode), STAGGER, 28)]})
    acc = {k.split("-")[0]: v for k, v in sam.stats.per_request_accepted.items()}
    res["stagger_group" if mode else "stagger_solo"] = {
        "A": out["A" + str(mode)], "B": out["B" + str(mode)], "B_accepted": acc.get("B" + str(mode), 0)}
res["live_members_after"] = sam.pool.live_members()

# batch-size switch: threshold 1; A speculates alone, then B joins
os.environ["ASCEND_RL_SAM_BATCH_THRESHOLD"] = "1"
flags.reset_cache()
sam.batch_threshold = 1
log = []
sched = core.scheduler
orig_schedule = sched.schedule
def schedule(*a, **k):
    out = orig_schedule(*a, **k)
    log.append((len(sched.running), sum(len(v) for v in out.scheduled_spec_decode_tokens.values())))
    return out
sched.schedule = schedule
s0 = stats()
out = run_engine(llm, {0: [("TA", STAGGER, 20)], 8: [("TB", PROMPTS[0], 10)]})
sched.schedule = orig_schedule
res["threshold"] = {"log": log, "stats": delta(s0), "out": out}
res["patches"] = {p.name: p.outcome.state for p in REGISTRY.patches.values() if p.feature.name == "sam"}
emit(res)
'''


@pytest.fixture(scope="module")
def engines():
    env = dict(ENGINE_ENV, ASCEND_RL_AUTOLOAD="0")
    # on vLLM 0.13 the identity also needs cpu_rms_norm (autoloaded in the engine process)
    base = run_python(BASELINE, env=env, timeout=900)
    sam = run_python(SAM, env=env, timeout=900)
    return base, sam


def test_sam_proposer_is_selected(engines):
    _, sam = engines
    assert sam["drafter"] == "SamNgramProposer"
    assert sam["spec"] == ["ngram", "sam"]  # method rewritten, vLLM validation kept


def test_greedy_outputs_identical_to_no_speculation(engines):
    base, sam = engines
    assert sam["batch"] == base["batch"]
    assert sam["n3"] == base["n3"]
    A = base["stagger"]["A"]
    for key in ("stagger_solo", "stagger_group"):
        assert sam[key]["A"] == A
        assert sam[key]["B"] == A[:28]


def test_acceptance_on_repetitive_prompts(engines):
    _, sam = engines
    st = sam["batch_stats"]
    assert st["proposals"] > 0 and st["drafted_tokens"] > 0
    assert st["accepted_tokens"] > 0


def test_group_mode_raises_acceptance(engines):
    _, sam = engines
    assert sam["stagger_group"]["B_accepted"] > sam["stagger_solo"]["B_accepted"]
    assert sam["n3_stats"]["accepted_tokens"] > 0


def test_finished_requests_are_cleaned_up(engines):
    _, sam = engines
    assert sam["live_members_after"] <= 1  # only what the last step still saw


def test_batch_size_switch(engines):
    _, sam = engines
    thr = sam["threshold"]
    # while A ran alone, drafts were scheduled; once two requests ran, none were
    assert any(running == 1 and spec > 0 for running, spec in thr["log"])
    assert all(spec == 0 for running, spec in thr["log"] if running > 1)
    assert thr["stats"]["inactive_steps"] > 0
    assert sam["patches"]["sam.batch_size_switch"] == "applied"
