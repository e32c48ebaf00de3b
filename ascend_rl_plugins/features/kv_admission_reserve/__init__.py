"""KV admission reserve: admit a queued request only if the running ones keep room to grow.

Why: vLLM's scheduler admits a waiting (or preempted) request as soon as its prompt fits in
the free KV blocks. In a long RL rollout the caches fill after a few thousand steps; from
then on every finish frees a little room, vLLM re-admits the newest preempted request
(prefilling its prompt *and* everything it had generated), the running requests' growth
fills the room again within a few steps and the same request is preempted again. The
long-tail simulator (``benchmarks/bench_rollout_rebalance.py``, the Qwen3 RL recipe's
Qwen3-235B DP=32 rollout) counts 4785 preemptions for 8192 responses, and re-prefill is
40% of the rollout (see the feature's README). Keeping room for the running requests' next
``STEPS`` tokens before admitting breaks that cycle: a queued request starts only when it can
run for a while.

How: ``KVCacheManager.allocate_slots`` is the single place every scheduler (vLLM's, and
vLLM-Ascend's subclasses that override ``schedule``) asks for blocks. For a request that is
being admitted (status WAITING or PREEMPTED), the block pool's free count is lowered by the
reserve for the duration of that call, so vLLM's own arithmetic (prefix hits, lookahead
slots, its own ``reserved_blocks`` on 0.23) decides with ``free - reserve``. Running requests
allocate against the real free count, so nothing is preempted because of the reserve. The
reserve is ``ceil(running * STEPS / block_size)`` blocks, O(1) per admission attempt; with
no request running it is 0, so a request that fits an empty cache is always admitted (no
starvation, no deadlock). The scheduler is found through a weak reference that
``Scheduler.__init__`` leaves on its KV cache manager.

Remove when: vLLM's scheduler keeps decode headroom when it admits (its 0.23
``scheduler_reserve_full_isl`` reserves the admitted request's own prompt, not the running
requests' growth).
"""

from __future__ import annotations

import weakref

from ... import flags
from ...patching import Feature, Verified
# the mark rollout rebalance leaves on a request it moved with its KV (see request_marks)
from ...request_marks import EXEMPT_FROM_RESERVE as _EXEMPT
from ...request_marks import admit_without_reserve  # noqa: F401 - this feature's API, as before

STEPS = flags.define(
    "ASCEND_RL_KV_ADMISSION_RESERVE", "int", 0,
    "Admit a waiting or preempted request only if, after its blocks, the KV cache keeps room "
    "for every running request to decode this many more tokens (0: vLLM's behaviour). Stops "
    "the re-admit / re-preempt cycle of long rollouts whose KV cache is full; 1024 was best "
    "for 32K responses in the long-tail simulator.", minimum=0, feature="kv_admission_reserve")

FEATURE = Feature(
    "kv_admission_reserve",
    "Admission keeps KV room for the running requests' growth (no re-admit/re-preempt cycle).",
    flag=STEPS, replaces="(new: no recipe patch; found with the rollout-rebalance simulator)",
    verified=Verified(
        cpu_runtime="real vLLM engines (0.13 and 0.23): same greedy outputs, fewer preemptions; "
                    "the admission rule against vLLM's own block arithmetic",
        static="vLLM-Ascend 0.13 and 0.23 schedulers allocate through the wrapped method"),
    stacks="recipe, current")

VLLM_RANGE = ">=0.13,<0.24"
REMOVE_WHEN = "vLLM's scheduler keeps decode headroom for running requests when it admits"
UPSTREAM = "https://github.com/vllm-project/vllm/pull/37337"  # admission with room for decode tokens
_ADMITTING = None  # (RequestStatus.WAITING, RequestStatus.PREEMPTED), resolved on first use
_SCHEDULER_REF = "_ascend_rl_scheduler"


@FEATURE.after("vllm.v1.core.sched.scheduler:Scheduler.__init__", dist="vllm", versions=VLLM_RANGE,
               name="kv_admission_reserve.scheduler_init",
               reason="lets the KV cache manager see how many requests run (a weak reference to "
                      "the scheduler; subclasses that override schedule() are covered too)",
               remove_when=REMOVE_WHEN, upstream=UPSTREAM)
def link_scheduler(result, instance, args, kwargs):
    manager = getattr(instance, "kv_cache_manager", None)
    if manager is not None:
        setattr(manager, _SCHEDULER_REF, weakref.ref(instance))
    return result


def reserve_blocks(num_running: int, steps: int, block_size: int) -> int:
    """Blocks kept free for ``num_running`` requests to grow ``steps`` tokens each."""
    return -(-num_running * steps // block_size) if num_running > 0 and steps > 0 else 0


@FEATURE.wrap("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots", dist="vllm",
              versions=VLLM_RANGE, params=("self", "request", "num_new_tokens"),
              name="kv_admission_reserve.allocate_slots",
              reason="an admitted request must leave the running requests room to grow, or it "
                     "is preempted again within steps (re-prefill of prompt + output each time)",
              remove_when=REMOVE_WHEN, upstream=UPSTREAM)
def allocate_with_reserve(wrapped, instance, args, kwargs):
    global _ADMITTING
    request = args[0] if args else kwargs.get("request")
    if _ADMITTING is None:
        from vllm.v1.request import RequestStatus
        _ADMITTING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    if getattr(request, "status", None) not in _ADMITTING:  # running requests: the hot path
        return wrapped(*args, **kwargs)
    ref = getattr(instance, _SCHEDULER_REF, None)
    scheduler = ref() if ref is not None else None
    if scheduler is None:
        return wrapped(*args, **kwargs)
    if getattr(request, _EXEMPT, False):
        blocks = wrapped(*args, **kwargs)
        if blocks is not None:
            del request.__dict__[_EXEMPT]
        return blocks
    reserve = reserve_blocks(len(scheduler.running), STEPS.value, scheduler.block_size)
    if reserve == 0:
        return wrapped(*args, **kwargs)
    pool = instance.block_pool
    shadowed = pool.__dict__.get("get_num_free_blocks")
    free_blocks = shadowed or type(pool).get_num_free_blocks.__get__(pool)
    pool.get_num_free_blocks = lambda: free_blocks() - reserve
    try:
        return wrapped(*args, **kwargs)
    finally:
        if shadowed is None:
            del pool.get_num_free_blocks
        else:
            pool.get_num_free_blocks = shadowed
