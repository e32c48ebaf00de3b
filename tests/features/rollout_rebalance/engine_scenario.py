"""Real vLLM engines (tiny Qwen3, CPU, one per gloo rank) rebalanced by rollout_rebalance.

Run on every rank by ``tests.support.child.run_group`` with ``ASCEND_RL_ROLLOUT_REBALANCE=1``,
rounds every 4 steps and the ladder 2,4,6,8 (see the test modules). One engine per rank runs
every check of its test module, so each module pays for its engines once.
"""

from __future__ import annotations

import random

from . import faults

ENGINE_KW = dict(distributed_executor_backend="external_launcher", enforce_eager=True,
                 max_model_len=512, max_num_seqs=8, seed=0, dtype="float32", block_size=16,
                 enable_prefix_caching=True)


def _engine():
    from vllm import LLM

    from ascend_rl_plugins.devtools import tiny_qwen3
    return LLM(tiny_qwen3.cached(), **ENGINE_KW)


def _prompts(rng: random.Random, n: int) -> list:
    return [{"prompt_token_ids": [rng.randrange(5, 500) for _ in range(rng.randrange(18, 40))]}
            for _ in range(n)]


def _generate(llm, prompts, params, **settings):
    from ascend_rl_plugins.features.rollout_rebalance import engine as rr
    llm.reset_prefix_cache()
    with rr.overridden(**settings):
        outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, (None if settings.get("paused") else rr.last_stats())


def _greedy(llm, prompts, params, **settings) -> dict:
    outs, stats = _generate(llm, prompts, params, **settings)
    return {"ids": [o.request_id for o in outs],
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "text": [o.outputs[0].text for o in outs],
            "prompts": [list(o.prompt_token_ids) for o in outs],
            "finish": [o.outputs[0].finish_reason for o in outs],
            "stats": stats}


def _sampled(llm, prompts, params, **settings) -> dict:
    outs, stats = _generate(llm, prompts, params, **settings)
    return {"ids": [o.request_id for o in outs],
            "prompts": [list(o.prompt_token_ids) for o in outs],
            "completions": [[{"index": c.index, "tokens": list(c.token_ids),
                              "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                              "n_logprobs": len(c.logprobs), "cumulative": c.cumulative_logprob,
                              "finish": c.finish_reason} for c in o.outputs] for o in outs],
            "stats": stats}


def _stop_strings(llm, rank: int, ref: dict, moved: dict) -> dict:
    """For each request the run ``moved`` migrated after ``b`` generated tokens: a stop string
    made of the last 3 characters before the boundary and the first one after it (requests
    are matched by position: ids differ between generate calls)."""
    tok = llm.get_tokenizer()
    position = {rid: i for i, rid in enumerate(moved["ids"])}
    boundary = {}
    for origin_rank, rid, _index, b in moved["stats"]["moves"]:
        if origin_rank == rank:
            boundary.setdefault(position[rid], b)  # the first move of the request
    stops = {}
    for i, b in boundary.items():
        text, tokens = ref["text"][i], ref["tokens"][i]
        head, more = (tok.decode(tokens[:k], skip_special_tokens=True) for k in (b, b + 1))
        cut, nxt = len(head), len(more)
        if cut < 3 or nxt <= cut or text[:nxt] != more:
            continue
        stop = text[cut - 3:cut + 1]
        if text.find(stop) == cut - 3:
            stops[i] = stop
    return stops


def _stop_run(llm, rank: int, prompts, params, **settings) -> dict:
    outs, stats = _generate(llm, prompts, params, **settings)
    where = {o.request_id: i for i, o in enumerate(outs)}
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "text": [o.outputs[0].text for o in outs],
            "finish": [o.outputs[0].finish_reason for o in outs],
            "stop_reason": [o.outputs[0].stop_reason for o in outs],
            "first_move": None if stats is None else
            {where[rid]: b for origin_rank, rid, _index, b in reversed(stats["moves"])
             if origin_rank == rank}}


def _live_requests(llm, rank: int) -> list:
    """(origin rank, caller's request id) of every unfinished request this engine holds."""
    from ascend_rl_plugins.features.rollout_rebalance.engine import MIGRATED_PREFIX, _parse_origin
    engine = llm.llm_engine
    states = engine.output_processor.request_states
    live = []
    for iid, request in engine.engine_core.engine_core.scheduler.requests.items():
        if request.is_finished():
            continue
        external = getattr(states.get(iid), "external_req_id", None) or iid
        if external.startswith(MIGRATED_PREFIX):
            origin = _parse_origin(external)
            live.append([origin.rank, origin.request_id])
        else:
            live.append([rank, external])
    return sorted(live)


def _with_fault(kind: str, run):
    """``run()`` with fault ``kind`` injected into this rank's protocol and adapter."""
    from ascend_rl_plugins.features.rollout_rebalance.engine import VllmAdapter
    injector = faults.Injector(kind, VllmAdapter).install()
    try:
        return run(), injector.report()
    finally:
        injector.uninstall()


def two_ranks() -> dict:
    """Rank 0 gets eight prompts, rank 1 one: greedy (KV migration and recompute), seeded
    sampling with n=2 and logprobs, stop strings across the migration boundary, then the
    protocol's failure paths on these real engines (extract raising at the source; the
    acknowledgement exchange raising on every rank, last: it leaves the rollout broken)."""
    import torch.distributed as dist
    from vllm import SamplingParams

    from ascend_rl_plugins.plugin import status
    rank = dist.get_rank()
    llm = _engine()
    rng = random.Random(rank)
    n = 8 if rank == 0 else 1
    prompts = _prompts(rng, n)
    params = [SamplingParams(max_tokens=30 + 6 * i, temperature=0, ignore_eos=True) for i in range(n)]
    result = {"ref": _greedy(llm, prompts, params, paused=True),
              "on": _greedy(llm, prompts, params, kv="on"),
              "off": _greedy(llm, prompts, params, kv="off"),
              "ref2": _greedy(llm, prompts, params, paused=True),
              "patches": {s["patch"]: s["state"] for s in status()
                          if s["feature"] == "rollout_rebalance"},
              "sent_prompts": [p["prompt_token_ids"] for p in prompts],
              "max_tokens": [p.max_tokens for p in params]}

    sampled = [SamplingParams(max_tokens=30 + 6 * i, temperature=0.8, seed=1000 + 10 * rank + i,
                              n=2 if i in (1, 4) else 1, logprobs=2, ignore_eos=True)
               for i in range(n)]
    result["sampled"] = {"ref": _sampled(llm, prompts, sampled, paused=True),
                         "on": _sampled(llm, prompts, sampled, kv="on"),
                         "off": _sampled(llm, prompts, sampled, kv="off"),
                         "n": [p.n for p in sampled], "max_tokens": [p.max_tokens for p in sampled]}

    stops = _stop_strings(llm, rank, result["ref"], result["on"])
    stop_params = [SamplingParams(max_tokens=p.max_tokens, temperature=0, ignore_eos=True,
                                  stop=[stops[i]] if i in stops else None)
                   for i, p in enumerate(params)]
    result["stop"] = {"stops": stops, "ref": _stop_run(llm, rank, prompts, stop_params, paused=True),
                      "on": _stop_run(llm, rank, prompts, stop_params, kv="on")}

    got, report = _with_fault("extract", lambda: _greedy(llm, prompts, params, kv="on"))
    result["extract_fault"] = dict(got, fault=report)

    def broken_round():
        try:
            _generate(llm, prompts, params, kv="on")
            return None
        except faults.InjectedFault as exc:
            return str(exc)
    error, report = _with_fault("ack", broken_round)
    live = [None] * dist.get_world_size()
    dist.all_gather_object(live, _live_requests(llm, rank))
    result["ack_fault"] = {"error": error, "fault": report, "live": live}
    return result


def four_ranks() -> dict:
    """Two loaded ranks (8 and 5 requests) and two nearly idle ones (1 each): greedy, with
    rebalancing paused, with KV migration and with recompute."""
    import torch.distributed as dist
    from vllm import SamplingParams
    rank = dist.get_rank()
    llm = _engine()
    rng = random.Random(100 + rank)
    n = {0: 8, 1: 5}.get(rank, 1)
    prompts = _prompts(rng, n)
    params = [SamplingParams(max_tokens=24 + 5 * i + 3 * rank, temperature=0, ignore_eos=True)
              for i in range(n)]
    return {"ref": _greedy(llm, prompts, params, paused=True),
            "on": _greedy(llm, prompts, params, kv="on"),
            "off": _greedy(llm, prompts, params, kv="off"),
            "sent_prompts": [p["prompt_token_ids"] for p in prompts],
            "max_tokens": [p.max_tokens for p in params]}
