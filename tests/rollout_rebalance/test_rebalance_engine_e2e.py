"""End to end: two real vLLM engines (tiny Qwen3, CPU) in a gloo DP group, rebalanced.

Rank 0 gets eight prompts, rank 1 one; greedy decoding with staggered ``max_tokens`` makes a
long tail, and rounds every 4 steps with the ladder (2, 4, 6, 8) force requests to migrate
mid-decode (and back). Checked for KV migration ('on') and recompute ('off') against a run of
the same engines with rebalancing paused: every request's output exactly once, in the caller's
order, with its own prompt, full length, and token-identical greedy output.

Token identity is asserted where the engine itself is batch-invariant: vLLM 0.23's CPU
attention is; vLLM 0.13's (recipe) is not (the same prompt decodes differently in different
batches, without any rebalancing, see the README), so on recipe the test asserts everything
but token identity and reports how many outputs matched.
"""

from __future__ import annotations

import pytest

from helpers import requires_vllm
from helpers import ENGINE_ENV, stack_name
from rr_launch import run_group

SCRIPT = r"""
import os, random
from ascend_rl_plugins.devtools import tiny_qwen3
from vllm import LLM, SamplingParams
from ascend_rl_plugins.features.rollout_rebalance import engine as rr
from ascend_rl_plugins.plugin import status
llm = LLM(tiny_qwen3.cached(), distributed_executor_backend="external_launcher",
          enforce_eager=True, max_model_len=512, max_num_seqs=8, seed=0, dtype="float32",
          block_size=16, enable_prefix_caching=True)
rng = random.Random(RANK)
n = 8 if RANK == 0 else 1
prompts = [{"prompt_token_ids": [rng.randrange(5, 500) for _ in range(rng.randrange(18, 40))]}
           for _ in range(n)]
params = [SamplingParams(max_tokens=30 + 6 * i, temperature=0, ignore_eos=True) for i in range(n)]

def run(**kw):
    llm.reset_prefix_cache()
    with rr.overridden(**kw):
        outs = llm.generate(prompts, params, use_tqdm=False)
    return {"ids": [o.request_id for o in outs],
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "prompts": [list(o.prompt_token_ids) for o in outs],
            "finish": [o.outputs[0].finish_reason for o in outs],
            "stats": None if kw.get("paused") else rr.last_stats()}

result = {"ref": run(paused=True), "on": run(kv="on"), "off": run(kv="off"),
          "ref2": run(paused=True),
          "patches": {s["patch"]: s["state"] for s in status() if s["feature"] == "rollout_rebalance"},
          "sent_prompts": [p["prompt_token_ids"] for p in prompts],
          "max_tokens": [p.max_tokens for p in params]}
emit(result)
"""

ENV = dict(ENGINE_ENV, VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1",
           ASCEND_RL_AUTOLOAD="0", ASCEND_RL_ROLLOUT_REBALANCE="1",
           ASCEND_RL_ROLLOUT_REBALANCE_INTERVAL="4",
           ASCEND_RL_ROLLOUT_REBALANCE_GRAPH_SIZES="2,4,6,8", ASCEND_RL_STRICT="1")


@pytest.fixture(scope="module")
def two_ranks(tiny_model_path):
    return run_group(SCRIPT, 2, env=ENV, timeout=1200)


pytestmark = requires_vllm


def test_patches_applied(two_ranks):
    for rank in two_ranks:
        applied = {k for k, v in rank["patches"].items() if v == "applied"}
        assert "rollout_rebalance._rebalance_after_step" in applied
        assert applied & {"rollout_rebalance.run_engine_013", "rollout_rebalance.run_engine_023"}


@pytest.mark.parametrize("mode", ["on", "off"], ids=["kv-migration", "recompute"])
def test_every_output_exactly_once_in_caller_order(two_ranks, mode):
    for rank in two_ranks:
        ref, got = rank["ref"], rank[mode]
        n = len(rank["sent_prompts"])
        assert len(got["ids"]) == n == len(set(got["ids"]))
        assert [int(i) for i in got["ids"]] == sorted(int(i) for i in got["ids"])  # caller order
        assert got["prompts"] == rank["sent_prompts"]  # each output carries its own prompt
        assert [len(t) for t in got["tokens"]] == rank["max_tokens"]
        assert got["finish"] == ref["finish"] == ["length"] * n
    # requests really moved, both ways, mid-decode
    out = [r[mode]["stats"]["moved_out"] for r in two_ranks]
    into = [r[mode]["stats"]["moved_in"] for r in two_ranks]
    assert out[0] > 0 and into[1] > 0 and sum(out) == sum(into)
    kv = [r[mode]["stats"]["kv_bytes_in"] for r in two_ranks]
    assert (sum(kv) > 0) if mode == "on" else (sum(kv) == 0)


@pytest.mark.parametrize("mode", ["on", "off"], ids=["kv-migration", "recompute"])
def test_token_identical_to_no_rebalance(two_ranks, mode):
    if stack_name() == "recipe":
        matched = sum(a == b for r in two_ranks for a, b in zip(r["ref"]["tokens"], r[mode]["tokens"]))
        pytest.skip(f"vLLM 0.13 CPU attention is batch-variant ({matched}/9 outputs matched; "
                    f"run without rebalance twice: "
                    f"{'same' if all(r['ref']['tokens'] == r['ref2']['tokens'] for r in two_ranks) else 'different'} tokens)")
    for rank in two_ranks:
        assert rank["ref"]["tokens"] == rank["ref2"]["tokens"]  # the engine is deterministic
        assert rank[mode]["tokens"] == rank["ref"]["tokens"]
