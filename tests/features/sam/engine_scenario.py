"""SAM in real vLLM engines on CPU (tiny random Qwen3), run by tests/features/sam/test_engine.py.

:func:`run` builds, in this one process (vLLM is imported once), a plain engine and then an
engine with ``speculative_config={"method": "sam"}``, runs the same workloads on both and
returns what the tests compare. The SAM flags come from the environment the test gives
this process (:data:`ENV`, all but ``ASCEND_RL_SAM_GROUP`` different from their defaults);
nothing here assigns a drafter attribute: the engine's drafter and scheduler switch get
their values through the flags.
"""

from __future__ import annotations

import gc

ENV = {
    "ASCEND_RL_SAM_BATCH_THRESHOLD": "2",
    "ASCEND_RL_SAM_GROUP": "1",
    "ASCEND_RL_SAM_MIN_MATCH": "2",
    "ASCEND_RL_SAM_ADAPTIVE": "1",
    "ASCEND_RL_SAM_RECENT_LEN": "8",
    "ASCEND_RL_SAM_TOKEN_COST": "0.02",
    "ASCEND_RL_SAM_COMPUTE_BOUND_BATCH": "8",
    "ASCEND_RL_SAM_HISTORY_TOKENS": "4096",
    "ASCEND_RL_SAM_HISTORY_PER_PROMPT": "4",
    "ASCEND_RL_SAM_CROSS_PROMPT_TOKENS": "2048",
}
K = 3
MAX_MODEL_LEN = 256
ENGINE_ARGS = dict(enforce_eager=True, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, dtype="float32",
                   seed=0)

PROMPTS = [([5, 6, 7, 8, 9] * 8)[:40], list(range(10, 50)), ([300, 301, 302, 303] * 10)[:38]]
SIBLING = list(range(100, 133))  # no repeats: a request alone has nothing to draft from at first
LIMIT_PROMPT = ([60, 61, 62, 63, 64, 65, 66] * 40)[: MAX_MODEL_LEN - 14]

# workloads: {step: [(request id, prompt, max_tokens)]}; max_tokens None runs to max_model_len
STAGGER = {0: [("A", SIBLING, 40)], 12: [("B", SIBLING, 28)]}
# TA and TB reuse the batch workload's prompts, so history seeds them (and drafts their first 24
# tokens whole): 40 tokens keep them running when TC joins
SWITCH = {0: [("TA", PROMPTS[0], 40), ("TB", PROMPTS[2], 40)], 6: [("TC", PROMPTS[1], 10)]}
LIMIT = {0: [("L", LIMIT_PROMPT, None)]}
# AB is aborted at step 6, long before its 40 tokens (a migration hop ends so); AD runs on
ABORT = {0: [("AB", PROMPTS[1], 40), ("AD", PROMPTS[0], 16)]}
ABORT_AT = {6: ["AB"]}


def _greedy(n):
    from vllm import SamplingParams
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _tokens(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _run_steps(llm, adds, aborts=None) -> dict:
    """Add requests (and abort them, ``aborts``: {step: [request id]}) at given engine steps;
    returns {request id: output tokens} of the requests that finished."""
    eng, done, step = llm.llm_engine, {}, 0
    pending = dict(adds)
    while pending or eng.has_unfinished_requests():
        for rid, prompt, n in pending.pop(step, []):
            eng.add_request(rid, {"prompt_token_ids": prompt}, _greedy(n))
        if aborts and step in aborts:
            eng.abort_request(aborts[step])
        for out in eng.step():
            if out.finished:
                done[out.request_id.split("-")[0]] = list(out.outputs[0].token_ids)
        step += 1
    return done


def _workloads(llm) -> dict:
    from vllm import SamplingParams
    out = {"batch": _tokens(llm.generate([{"prompt_token_ids": p} for p in (PROMPTS[0], PROMPTS[2])],
                                         _greedy(24), use_tqdm=False))}
    # n=2 children sampled with top-k 1: the random (rejection) path, deterministic outputs
    n2 = SamplingParams(n=2, temperature=1.0, top_k=1, max_tokens=24, ignore_eos=True)
    out["n2"] = _tokens(llm.generate([{"prompt_token_ids": PROMPTS[1]}], n2, use_tqdm=False))
    out["stagger"] = _run_steps(llm, STAGGER)
    out["switch"] = _run_steps(llm, SWITCH)
    out["abort"] = _run_steps(llm, ABORT, ABORT_AT)
    out["limit"] = _run_steps(llm, LIMIT)
    return out


def _engine(spec=None):
    from vllm import LLM
    from ascend_rl_plugins.devtools import tiny_qwen3
    kw = {"speculative_config": spec} if spec else {}
    return LLM(model=tiny_qwen3.cached(), **ENGINE_ARGS, **kw)


class _Recorder:
    """What the engine's drafter proposed and what its scheduler then scheduled, in order:
    ``["propose", request, tokens, draft length, match length]`` per drafted row,
    ``["schedule", running, {request: [pending drafts, scheduled drafts]}]`` per step and
    ``["release", request, whether its response went to the history]`` per request leaving."""

    def __init__(self, core, drafter):
        from ascend_rl_plugins.features.sam.automaton import OUT_MATCH
        self.events = []
        sam = drafter.sam
        propose = sam.propose_arrays
        sched = core.scheduler
        schedule = sched.schedule

        def recording_propose(req_ids, rows, token_ids, num_tokens, *a, **kw):
            drafts, counts = propose(req_ids, rows, token_ids, num_tokens, *a, **kw)
            match = sam.pool._out[: len(rows), OUT_MATCH]
            for i, r in enumerate(req_ids):
                self.events.append(["propose", r.split("-")[0], int(num_tokens[rows[i]]),
                                    int(counts[i]), int(match[i])])
            return drafts, counts

        def recording_schedule(*a, **kw):
            pending = {r.request_id: len(r.spec_token_ids) for r in sched.running}
            out = schedule(*a, **kw)
            got = {rid: len(v) for rid, v in out.scheduled_spec_decode_tokens.items()}
            self.events.append(["schedule", len(sched.running),
                                {rid.split("-")[0]: [n, got.get(rid, 0)] for rid, n in pending.items()}])
            return out

        release = sam.release

        def recording_release(req_id, *a, **kw):
            stored = sam.history.counters.stored
            release(req_id, *a, **kw)
            self.events.append(["release", req_id.split("-")[0], sam.history.counters.stored > stored])

        sam.propose_arrays = recording_propose
        sched.schedule = recording_schedule
        sam.release = recording_release


def run() -> dict:
    """Both engines, one after the other, in this process."""
    from ascend_rl_plugins.patching.core import REGISTRY

    plain = _engine()
    baseline = _workloads(plain)
    del plain
    gc.collect()

    llm = _engine({"method": "sam", "num_speculative_tokens": K})
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    drafter = runner.drafter
    sam = drafter.sam
    rec = _Recorder(core, drafter)
    res = {"drafter": type(drafter).__name__,
           "spec": [runner.speculative_config.method, runner.speculative_config.model],
           "settings": {"k": sam.k, "batch_threshold": sam.batch_threshold, "group": sam.group,
                        "min_match": sam.min_match, "adaptive": sam.adaptive,
                        "recent_len": sam.recent_len, "max_model_len": sam.max_model_len,
                        "token_cost": sam.token_cost,
                        "compute_bound_batch": sam.compute_bound_batch,
                        "history_tokens": sam.history.max_tokens if sam.history else 0,
                        "history_per_prompt": sam.history.per_prompt if sam.history else 0,
                        "cross_prompt_tokens": sam.cross_prompt_tokens}}
    res["outputs"] = _workloads(llm)
    res["stats"] = sam.stats.as_dict()
    res["accepted"] = {r.split("-")[0]: n for r, n in sam.stats.per_request_accepted.items()}
    res["events"] = rec.events
    res["live_members_after"] = sam.pool.live_members()
    res["cross"] = {"tokens": sam.pool.tokens(sam._cross) if sam._cross >= 0 else 0,
                    "replaced": sam.cross_rotations,
                    "proposals": sam.stats.cross_proposals}
    res["history"] = {"stored": sam.history.counters.stored, "seeded": sam.history.counters.seeded}
    res["patches"] = {p.name: p.outcome.state for p in REGISTRY.patches.values()
                      if p.feature.name in ("sam", "cpu_spec_decode")}
    return {"baseline": baseline, "sam": res}


def replay_accepted(tokens, prompt_len: int, **drafter_kwargs) -> int:
    """Draft tokens a lone request accepts when a SamDrafter drafts from its own text only,
    replayed over its final tokens with greedy verification (the control for group mode)."""
    import numpy as np
    from ascend_rl_plugins.features.sam.drafter import SamDrafter
    d = SamDrafter(K, group=False, **drafter_kwargs)
    row = np.array([tokens], np.int32)
    n, accepted = prompt_len + 1, 0
    while n < len(tokens):
        draft = d.propose_rows(["solo"], [0], row, np.array([n], np.int32)).get(0, [])
        a = 0
        while a < len(draft) and n + a < len(tokens) and draft[a] == tokens[n + a]:
            a += 1
        accepted += a
        n += a + 1
    return accepted
