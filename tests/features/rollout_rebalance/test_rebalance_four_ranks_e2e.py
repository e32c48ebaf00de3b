"""End to end with four real vLLM engines (tiny Qwen3, CPU) in one gloo DP group.

The two-rank test covers the sampling state in depth; this one checks what only more ranks
exercise: flows between several pairs at once (two loaded ranks, two nearly idle ones), a
request moving more than once, and every output still coming back exactly once, in the
caller's order, token-identical to the same engines with rebalancing paused — for KV
migration and for migration by recompute.
"""

from __future__ import annotations

import pytest

from helpers import ENGINE_ENV, requires_vllm
from rr_launch import run_group

SCRIPT = r"""
import random
from ascend_rl_plugins.devtools import tiny_qwen3
from vllm import LLM, SamplingParams
from ascend_rl_plugins.features.rollout_rebalance import engine as rr
llm = LLM(tiny_qwen3.cached(), distributed_executor_backend="external_launcher",
          enforce_eager=True, max_model_len=512, max_num_seqs=8, seed=0, dtype="float32",
          block_size=16, enable_prefix_caching=True)
rng = random.Random(100 + RANK)
n = {0: 8, 1: 5}.get(RANK, 1)
prompts = [{"prompt_token_ids": [rng.randrange(5, 500) for _ in range(rng.randrange(18, 40))]}
           for _ in range(n)]
params = [SamplingParams(max_tokens=24 + 5 * i + 3 * RANK, temperature=0, ignore_eos=True)
          for i in range(n)]

def run(**kw):
    llm.reset_prefix_cache()
    with rr.overridden(**kw):
        outs = llm.generate(prompts, params, use_tqdm=False)
    return {"ids": [o.request_id for o in outs],
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "prompts": [list(o.prompt_token_ids) for o in outs],
            "stats": None if kw.get("paused") else rr.last_stats()}

emit({"ref": run(paused=True), "on": run(kv="on"), "off": run(kv="off"),
      "sent_prompts": [p["prompt_token_ids"] for p in prompts],
      "max_tokens": [p.max_tokens for p in params]})
"""

ENV = dict(ENGINE_ENV, VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1",
           ASCEND_RL_AUTOLOAD="0", ASCEND_RL_ROLLOUT_REBALANCE="1",
           ASCEND_RL_ROLLOUT_REBALANCE_INTERVAL="4",
           ASCEND_RL_ROLLOUT_REBALANCE_GRAPH_SIZES="2,4,6,8", ASCEND_RL_STRICT="1")

pytestmark = requires_vllm


@pytest.fixture(scope="module")
def four_ranks(tiny_model_path):
    return run_group(SCRIPT, 4, env=ENV, timeout=1500)


@pytest.mark.parametrize("mode", ["on", "off"], ids=["kv-migration", "recompute"])
def test_four_ranks_every_output_once_in_order_and_identical(four_ranks, mode):
    for rank in four_ranks:
        got = rank[mode]
        n = len(rank["sent_prompts"])
        assert len(got["ids"]) == n == len(set(got["ids"]))
        assert [int(i) for i in got["ids"]] == sorted(int(i) for i in got["ids"])
        assert got["prompts"] == rank["sent_prompts"]
        assert [len(t) for t in got["tokens"]] == rank["max_tokens"]
        assert got["tokens"] == rank["ref"]["tokens"]
    stats = [r[mode]["stats"] for r in four_ranks]
    assert sum(s["moved_out"] for s in stats) == sum(s["moved_in"] for s in stats) > 0
    # both nearly idle ranks took work, from the loaded ones
    assert stats[2]["moved_in"] > 0 and stats[3]["moved_in"] > 0
    assert stats[0]["moved_out"] > 0
    kv = sum(s["kv_bytes_in"] for s in stats)
    assert (kv > 0) if mode == "on" else (kv == 0)
