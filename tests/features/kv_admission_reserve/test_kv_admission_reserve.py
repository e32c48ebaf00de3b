"""KV admission reserve in a real vLLM engine on CPU (both stacks), the admission rule
against vLLM's real block pool, and the hook points in vLLM-Ascend's own schedulers (read
statically, both versions)."""

from __future__ import annotations

import ast
import glob
import os

import pytest

from tests.support.child import ENGINE_ENV, GREEDY_ENGINE_ENV, run_scenario
from tests.support.stacks import STACKS, source, vllm_version

SCENARIO = "tests.features.kv_admission_reserve.scenario"
needs_vllm = pytest.mark.skipif(vllm_version() is None, reason="vLLM is not installed here")


@pytest.fixture(scope="module")
def runs(tiny_model_path):
    # one engine for every reserve: the flag starts non-zero so the plugin applies the
    # patch; reserve 0 runs with the patch reverted (stock vLLM); every request is greedy
    return run_scenario(SCENARIO, "engine_runs", [0, 64, 256],
                        env=dict(ENGINE_ENV, **GREEDY_ENGINE_ENV, ASCEND_RL_KV_ADMISSION_RESERVE="256"), timeout=900)


@needs_vllm
@pytest.mark.engine
def test_outputs_identical_and_preemptions_fall_with_the_reserve(runs):
    from tests.features.kv_admission_reserve.scenario import LENGTHS
    base = runs["0"]
    assert base["state"] == "reverted"
    assert base["preempt"] > 0, "the scenario must make vLLM preempt, or the test has no teeth"
    for steps in ("64", "256"):
        assert runs[steps]["state"] == "applied"
        assert runs[steps]["tokens"] == base["tokens"], steps
        assert [len(t) for t in runs[steps]["tokens"]] == LENGTHS
    assert runs["256"]["preempt"] < runs["64"]["preempt"] < base["preempt"], \
        {s: r["preempt"] for s, r in runs.items()}


@needs_vllm
@pytest.mark.engine
def test_no_block_lost_and_no_shadow_left_behind(runs):
    for r in runs.values():
        assert not r["shadow_left"]
        assert r["free_after"] == r["total"] - 1  # vLLM keeps one null block


@needs_vllm
def test_admission_sees_free_minus_reserve_running_and_migrated_requests_do_not():
    got = run_scenario(SCENARIO, "admission_rule", env={"ASCEND_RL_KV_ADMISSION_RESERVE": "100"},
                       timeout=300)
    # 100 free blocks (one is vLLM's null block); reserve ceil(4 * 100 / 16) = 25
    assert got == {"waiting": 75, "preempted": 75, "running": 100, "exempt_failed": 100,
                   "exempt_again": 100, "exempt_used": 75, "nothing_running": 100,
                   "shadow_left": False}, got


def test_reserve_arithmetic():
    from ascend_rl_plugins.features.kv_admission_reserve import reserve_blocks
    assert reserve_blocks(0, 256, 128) == 0  # nothing running: vLLM's rule, never starves
    assert reserve_blocks(5, 0, 128) == 0
    assert reserve_blocks(1, 1, 128) == 1
    assert reserve_blocks(256, 256, 128) == 512
    assert reserve_blocks(3, 100, 128) == 3  # ceil(300 / 128)


def test_bad_flag_value_is_a_clear_error():
    from ascend_rl_plugins import flags
    from ascend_rl_plugins.features import kv_admission_reserve as K
    for raw in ("-5", "lots"):
        with pytest.raises(flags.FlagError, match="ASCEND_RL_KV_ADMISSION_RESERVE"):
            K.STEPS.parse(raw)


@pytest.mark.parametrize("stack", STACKS)
def test_every_vllm_ascend_scheduler_inits_through_vllm_and_allocates_through_the_manager(stack):
    """vLLM-Ascend's schedulers override ``schedule`` (so a hook there would miss them) but
    call ``super().__init__`` (which leaves the weak reference) and allocate through
    ``self.kv_cache_manager.allocate_slots`` (the wrapped method)."""
    root = source(stack, "vllm_ascend", "vllm_ascend", "core")
    found = []
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path) as fh:
            tree = ast.parse(fh.read())
        for node in tree.body:
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
