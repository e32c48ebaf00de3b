"""KV admission reserve in a real vLLM engine on CPU (both stacks), and its hook points in
vLLM-Ascend's own schedulers (read statically, both versions).

The engine run: 10 greedy requests of very different lengths on a KV cache of 11 blocks
(1408 tokens for ~3000 tokens of demand), so vLLM preempts. Preemptions are counted by a
counter the test wraps around ``Scheduler._preempt_request`` inside the subprocess."""

from __future__ import annotations

import ast
import glob
import os

import pytest

from helpers import ENGINE_ENV, run_python, stack_name
from upstream_source import STACKS, parse, source_root

RUN = r'''
import json
import wrapt
from vllm import LLM, SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from ascend_rl_plugins.devtools import tiny_qwen3
from ascend_rl_plugins.patching.core import REGISTRY

count = {"preempt": 0, "reserve_seen": []}

def _count(wrapped, instance, args, kwargs):
    count["preempt"] += 1
    return wrapped(*args, **kwargs)

wrapt.wrap_function_wrapper(Scheduler, "_preempt_request", _count)
llm = LLM(model=tiny_qwen3.cached(), enforce_eager=True, max_model_len=512, max_num_seqs=8,
          dtype="float32", seed=0, num_gpu_blocks_override=11, enable_prefix_caching=False)
lengths = [60, 420, 200, 380, 90, 300, 150, 400, 250, 330]
prompts = [{"prompt_token_ids": [(7 * i + j) % 900 + 5 for j in range(24 + 3 * i)]}
           for i in range(len(lengths))]
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
outs = llm.generate(prompts, params, use_tqdm=False)
pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
emit({"tokens": [list(o.outputs[0].token_ids) for o in outs], "preempt": count["preempt"],
      "state": REGISTRY.patches["kv_admission_reserve.allocate_slots"].outcome.state,
      "shadow_left": "get_num_free_blocks" in vars(pool),
      "free_after": pool.get_num_free_blocks(), "total": pool.num_gpu_blocks})
'''

needs_engine = pytest.mark.skipif(stack_name() is None, reason="needs a vLLM stack (recipe or current)")


@pytest.fixture(scope="module")
def runs():
    return {steps: run_python(RUN, env=dict(ENGINE_ENV, ASCEND_RL_KV_ADMISSION_RESERVE=str(steps)))
            for steps in (0, 64, 256)}


@needs_engine
def test_outputs_identical_and_preemptions_fall_with_the_reserve(runs):
    base = runs[0]
    assert base["state"] in ("inactive", "skipped")  # switched off: not applied
    assert base["preempt"] > 0, "the scenario must make vLLM preempt, or the test has no teeth"
    for steps in (64, 256):
        assert runs[steps]["state"] == "applied"
        assert runs[steps]["tokens"] == base["tokens"], steps
        assert [len(t) for t in runs[steps]["tokens"]] == [60, 420, 200, 380, 90, 300, 150, 400, 250, 330]
    assert runs[256]["preempt"] < runs[64]["preempt"] < base["preempt"], {s: r["preempt"] for s, r in runs.items()}


@needs_engine
def test_no_block_lost_and_no_shadow_left_behind(runs):
    for r in runs.values():
        assert not r["shadow_left"]
        assert r["free_after"] == r["total"] - 1  # vLLM keeps one null block


def test_reserve_arithmetic():
    from ascend_rl_plugins.features.kv_admission_reserve import reserve_blocks
    assert reserve_blocks(0, 256, 128) == 0  # nothing running: vLLM's rule, never starves
    assert reserve_blocks(5, 0, 128) == 0
    assert reserve_blocks(1, 1, 128) == 1
    assert reserve_blocks(256, 256, 128) == 512
    assert reserve_blocks(3, 100, 128) == 3  # ceil(300 / 128)


def test_bad_flag_value_is_a_clear_error():
    from ascend_rl_plugins import flags
    flag = flags.get("ASCEND_RL_KV_ADMISSION_RESERVE")
    with pytest.raises(flags.FlagError, match="ASCEND_RL_KV_ADMISSION_RESERVE"):
        flag.parse("-5")
    with pytest.raises(flags.FlagError, match="ASCEND_RL_KV_ADMISSION_RESERVE"):
        flag.parse("lots")


@pytest.mark.parametrize("stack", STACKS)
def test_every_vllm_ascend_scheduler_inits_through_vllm_and_allocates_through_the_manager(stack):
    """vLLM-Ascend's schedulers override ``schedule`` (so a hook there would miss them) but
    call ``super().__init__`` (which leaves the weak reference) and allocate through
    ``self.kv_cache_manager.allocate_slots`` (the wrapped method)."""
    root = source_root(stack, "vllm_ascend")
    found = []
    for path in sorted(glob.glob(os.path.join(root, "vllm_ascend", "core", "*.py"))):
        for node in parse(path).body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {ast.unparse(b) for b in node.bases}
            methods = {m.name: m for m in node.body if isinstance(m, ast.FunctionDef)}
            if "Scheduler" not in bases or "schedule" not in methods:
                continue
            found.append(node.name)
            init_calls = [ast.unparse(c.func) for c in ast.walk(methods["__init__"]) if isinstance(c, ast.Call)]
            assert "super().__init__" in init_calls, (path, node.name)
            calls = [ast.unparse(c.func) for c in ast.walk(methods["schedule"]) if isinstance(c, ast.Call)]
            assert "self.kv_cache_manager.allocate_slots" in calls, (path, node.name)
            assert "RequestStatus.PREEMPTED" in ast.unparse(methods["schedule"]), (path, node.name)
    assert "RecomputeScheduler" in found and "SchedulerDynamicBatch" in found, found


ADMISSION_LOGIC = r'''
import types
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import RequestStatus
from ascend_rl_plugins.features import kv_admission_reserve as K

pool = BlockPool(num_gpu_blocks=101, enable_caching=False, hash_block_size=16)
manager = types.SimpleNamespace(block_pool=pool)  # allocate_slots reads only block_pool
class SchedulerState:  # what the hook reads of vLLM's Scheduler
    running = [object()] * 4  # 4 running requests
    block_size = 16
    kv_cache_manager = manager

scheduler = SchedulerState()
K._link_scheduler(None, scheduler, (), {})

def allocate(request, succeed=True):
    seen = []
    def upstream(request, num_new_tokens):  # what vLLM's allocate_slots compares against
        seen.append(pool.get_num_free_blocks())
        return [] if succeed else None
    K._allocate_with_reserve(upstream, manager, (request, 8), {})
    return seen[0]

req = lambda status: types.SimpleNamespace(status=status)
out = {"waiting": allocate(req(RequestStatus.WAITING)), "preempted": allocate(req(RequestStatus.PREEMPTED)),
       "running": allocate(req(RequestStatus.RUNNING))}
moved = req(RequestStatus.WAITING)
K.admit_without_reserve(moved)
out["exempt_failed"] = allocate(moved, succeed=False)
out["exempt_again"] = allocate(moved)
out["exempt_used"] = allocate(moved)
scheduler.running = []
out["nothing_running"] = allocate(req(RequestStatus.WAITING))
out["shadow_left"] = "get_num_free_blocks" in vars(pool)
emit(out)
'''


@needs_engine
def test_admission_sees_free_minus_reserve_running_and_migrated_requests_do_not():
    got = run_python(ADMISSION_LOGIC, env={"ASCEND_RL_KV_ADMISSION_RESERVE": "100"})
    # 100 free blocks (one is vLLM's null block); reserve ceil(4 * 100 / 16) = 25
    assert got == {"waiting": 75, "preempted": 75, "running": 100, "exempt_failed": 100,
                   "exempt_again": 100, "exempt_used": 75, "nothing_running": 100,
                   "shadow_left": False}, got
