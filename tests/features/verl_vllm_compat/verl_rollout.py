"""Runs tests/features/verl_vllm_compat/verl_rollout_scenario.py once per test session (one
child process, ~1 min on 2 cores: verl's real vLLM rollout is imported and built once) and
hands each feature its stage. Only on the recipe stack (verl 0.6 with vLLM 0.13)."""

from __future__ import annotations

import functools
import tempfile

import pytest

from tests.support.child import ENGINE_ENV, free_port, run_scenario

ENV = {**ENGINE_ENV, "ASCEND_RL_AUTOLOAD": "0", "ASCEND_RL_ROLLOUT_PROGRESS_BAR": "1",
       "ASCEND_RL_ROLLOUT_PROGRESS_BAR_RANKS": "first", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}


def require_verl_06_on_vllm_013() -> None:
    from tests.features.rollout_torch_compile.megatron_worker import require_verl_06
    from tests.support.stacks import vllm_version
    why = "these checks need verl 0.6 on vLLM 0.13 (the recipe stack)"
    require_verl_06(why)
    if not (vllm_version() or "").startswith("0.13"):
        pytest.skip(f"vLLM {vllm_version()}: {why}")
    pytest.importorskip("transformers")


@functools.lru_cache(maxsize=None)
def _results() -> dict:
    workdir = tempfile.mkdtemp(prefix="ascend-rl-verl-rollout-")
    return run_scenario("tests.features.verl_vllm_compat.verl_rollout_scenario", "run", workdir,
                        env={**ENV, "MASTER_PORT": str(free_port())}, timeout=900)


def stage(name: str) -> dict:
    """The result of one stage (``compat``, ``engine``, ``options``, ``revert``); a stage that
    raised fails the asking test with its traceback."""
    require_verl_06_on_vllm_013()
    got = _results()[name]
    if "traceback" in got:
        raise AssertionError(f"stage {name} raised in the child process:\n{got['traceback']}")
    return got
