"""Features compose: every pair of patches on one target says how (framework check), and
with every feature switched on together doctor reports no conflict and a real Megatron-Core
model builds and trains a step (a user who wants them all must not meet a ConflictError)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.child import run_group
from tests.support.stacks import require_installed, require_stack
from tests.support.switches import every_switch_on

ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "ASCEND_RL_AUTOLOAD": "0", "NUMBA_NUM_THREADS": "1"}


def test_every_pair_of_patches_on_one_target_declares_how_they_compose():
    """Two patches on one target (for overlapping versions) must not both replace it, and
    wrappers need distinct ``order``s: checked for every pair, whatever the flags."""
    from ascend_rl_plugins import plugin
    from ascend_rl_plugins.patching.core import REGISTRY, undeclared_compositions
    plugin.load_features()
    assert undeclared_compositions(REGISTRY.patches.values()) == []


def test_the_every_switch_environment_switches_every_feature_on(monkeypatch):
    from ascend_rl_plugins import flags
    from ascend_rl_plugins.patching.core import REGISTRY
    env = every_switch_on()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    flags.reset_cache()
    try:
        off = [f.name for f in REGISTRY.features.values() if f.flag is not None and not f.switched_on()]
    finally:
        flags.reset_cache()
    assert off == []


def _doctor(stack: str, env: dict) -> tuple[int, dict, str]:
    full = dict(os.environ, **env)
    proc = subprocess.run([sys.executable, "-m", "ascend_rl_plugins", "doctor", "--stack", stack, "--json"],
                          capture_output=True, text=True, env=full, timeout=600)
    return proc.returncode, (json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}), proc.stderr


@pytest.mark.parametrize("stack", ["recipe", "current"])
def test_doctor_reports_no_conflict_with_every_feature_on(stack):
    require_stack(stack)
    code, report, err = _doctor(stack, every_switch_on())
    assert report, err[-3000:]
    assert report["conflicts"] == [], report["conflicts"]


@pytest.mark.forked
def test_a_real_megatron_model_builds_and_trains_a_step_with_every_feature_on():
    require_installed("torch", "megatron-core")
    env = dict(ENV, **every_switch_on())
    (result,) = run_group("tests.every_feature_scenario", "megatron_model_with_every_feature_on", 1,
                          env=env, timeout=600)
    assert result["finite"], result
    assert result["failed"] == {}, result
    assert result["megatron_patches"]["hdp.model_support"] == "applied", result
    assert result["megatron_patches"]["int4_qat.gpt_output_layer"] == "applied", result


@pytest.mark.engine
def test_a_real_vllm_engine_starts_and_generates_with_every_feature_on(tiny_model_path):
    from tests.support.child import ENGINE_ENV, run_scenario
    from tests.support.stacks import vllm_version
    if vllm_version() is None:
        pytest.skip("needs vLLM")
    env = dict(ENGINE_ENV, ASCEND_RL_AUTOLOAD="0", **every_switch_on())
    result = run_scenario("tests.every_feature_scenario", "vllm_engine_with_every_feature_on", tiny_model_path,
                          env=env, timeout=900)
    assert result["tokens"] == 8 and result["failed"] == {}, result
    assert result["activated_by"][0] == "vllm.general_plugins", result
    assert "gc_off.llm_engine_step" in result["applied"], result
