"""KV admission reserve scenarios, run in fresh interpreters by ``tests.support.child``."""

from __future__ import annotations

import os

LENGTHS = [60, 420, 200, 380, 90, 300, 150, 400, 250, 330]
FLAG = "ASCEND_RL_KV_ADMISSION_RESERVE"


def engine_runs(reserves: list) -> dict:
    """One real engine, 10 greedy requests of very different lengths on a KV cache of 11
    blocks (1408 tokens for ~3000 tokens of demand), so vLLM preempts. Run once per reserve
    in ``reserves`` (0: with the patch reverted, i.e. stock vLLM); the process must start with
    the flag set to a non-zero value so the plugin applies the patch. Preemptions are counted
    by a wrapper on ``Scheduler._preempt_request``."""
    import wrapt
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    from ascend_rl_plugins import flags
    from ascend_rl_plugins.devtools import tiny_qwen3
    from ascend_rl_plugins.patching.core import REGISTRY

    count = {"preempt": 0}

    def counting(wrapped, instance, args, kwargs):
        count["preempt"] += 1
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(Scheduler, "_preempt_request", counting)
    llm = LLM(model=tiny_qwen3.cached(), enforce_eager=True, max_model_len=512, max_num_seqs=8,
              dtype="float32", seed=0, num_gpu_blocks_override=11, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 900 + 5 for j in range(24 + 3 * i)]}
               for i in range(len(LENGTHS))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in LENGTHS]
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    patch = REGISTRY.patches["kv_admission_reserve.allocate_slots"]
    runs = {}
    for reserve in reserves:
        os.environ[FLAG] = str(reserve)
        flags.reset_cache()
        if reserve == 0:
            REGISTRY.revert(patch)
        elif patch.outcome.state != "applied":
            REGISTRY.apply(patch)
        count["preempt"] = 0
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[str(reserve)] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs], "preempt": count["preempt"],
            "state": patch.outcome.state, "shadow_left": "get_num_free_blocks" in vars(pool),
            "free_after": pool.get_num_free_blocks(), "total": pool.num_gpu_blocks}
    return runs


def admission_rule() -> dict:
    """The hook against vLLM's real ``BlockPool`` (100 usable blocks, 4 running requests,
    block size 16, the flag at 100 tokens): what free count vLLM's ``allocate_slots`` sees
    for each kind of request."""
    import types

    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.request import RequestStatus

    from ascend_rl_plugins.features import kv_admission_reserve as K

    pool = BlockPool(num_gpu_blocks=101, enable_caching=False, hash_block_size=16)
    manager = types.SimpleNamespace(block_pool=pool)  # allocate_slots reads only block_pool

    class SchedulerState:  # what the hook reads of vLLM's Scheduler
        running = [object()] * 4
        block_size = 16
        kv_cache_manager = manager

    scheduler = SchedulerState()
    K.link_scheduler(None, scheduler, (), {})

    def allocate(request, succeed=True):
        seen = []

        def upstream(request, num_new_tokens):  # what vLLM's allocate_slots compares against
            seen.append(pool.get_num_free_blocks())
            return [] if succeed else None
        K.allocate_with_reserve(upstream, manager, (request, 8), {})
        return seen[0]

    def req(status):
        return types.SimpleNamespace(status=status)

    out = {"waiting": allocate(req(RequestStatus.WAITING)),
           "preempted": allocate(req(RequestStatus.PREEMPTED)),
           "running": allocate(req(RequestStatus.RUNNING))}
    moved = req(RequestStatus.WAITING)
    K.admit_without_reserve(moved)
    out["exempt_failed"] = allocate(moved, succeed=False)
    out["exempt_again"] = allocate(moved)
    out["exempt_used"] = allocate(moved)
    scheduler.running = []
    out["nothing_running"] = allocate(req(RequestStatus.WAITING))
    out["shadow_left"] = "get_num_free_blocks" in vars(pool)
    return out
