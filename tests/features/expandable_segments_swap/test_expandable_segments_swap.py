"""expandable_segments_swap: verl 0.6's rollout/trainer switches reach the NPU allocator.

Real (recipe stack, child processes): verl 0.6.1's Megatron ``rollout_mode`` / ``trainer_mode``
and ``set_expandable_segments`` as its modules hold it. Doubles: ``torch.npu``
(torch_npu_memory_double.py) and, for the CUDA case, the CUDA allocator call; see scenario.py.
"""

from __future__ import annotations

import ast

import pytest

from ascend_rl_plugins.features import expandable_segments_swap as feature
from tests.features.rollout_torch_compile.megatron_worker import dist_env, require_verl_06
from tests.features.upstream_source import module_path, parse, top_level
from tests.support.child import free_port, run_scenario

SCENARIO = "tests.features.expandable_segments_swap.scenario"


@pytest.fixture(scope="module")
def cycle() -> dict:
    require_verl_06("sets the NPU allocator itself (fixed upstream); the patch is for verl 0.6")
    return run_scenario(SCENARIO, "run", env={"ASCEND_RL_AUTOLOAD": "0", **dist_env(free_port())}, timeout=600)


def test_rollout_and_trainer_modes_switch_the_npu_allocator_in_order(cycle):
    assert cycle["patch_state"] == "applied", cycle
    assert cycle["npu"] == [
        ["npu allocator", "expandable_segments:False"],  # before the engine takes its memory back
        ["rollout resume", ["weights"]],
        ["rollout update_weights", 0],
        ["rollout resume", ["kv_cache"]],
        ["generate"],
        ["rollout release"],
        ["npu allocator", "expandable_segments:True"],  # training again, engine asleep
    ], cycle["npu"]
    assert all(cycle["copies_patched"].values()), cycle["copies_patched"]


def test_cpu_and_cuda_paths_are_unchanged(cycle):
    assert cycle["cpu"] == []
    assert cycle["cuda"] == [["cuda allocator", "expandable_segments:False"],
                             ["cuda allocator", "expandable_segments:True"]]


def test_setting_text_is_what_torch_allocators_parse():
    assert feature.npu_allocator_setting(True) == "expandable_segments:True"
    assert feature.npu_allocator_setting(False) == "expandable_segments:False"


def test_verl_06_is_cuda_only_and_verl_09_calls_the_npu_allocator():
    """The facts behind the patch and its fixed_upstream, read in both verl trees."""
    old = ast.unparse(top_level(parse(module_path("recipe", "verl", "verl.utils.device")), "set_expandable_segments"))
    assert "torch.cuda.memory._set_allocator_settings" in old and "npu" not in old
    npu = parse(module_path("current", "verl", "verl.plugin.platform.platform_npu"))
    calls = [ast.unparse(n.func) for n in ast.walk(npu) if isinstance(n, ast.Call)]
    assert "torch.npu.memory._set_allocator_settings" in calls
