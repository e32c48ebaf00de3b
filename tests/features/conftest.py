"""Session fixtures shared by the feature tests: the shared real vLLM engines.

``shared_engine`` / ``multiprocess_engine`` each build one engine in a child process and run
every participating feature's checks on it (tests/features/shared_engine.py lists them);
a feature's tests read their part with ``shared_engine.part(results, "<feature>")``.
"""

from __future__ import annotations

import os

import pytest

from tests.features import shared_engine as engines
from tests.support.child import ENGINE_ENV, run_scenario
from tests.support.stacks import vllm_version


def _run(tmp_path_factory, kind: str, steps, extra_env: dict) -> dict:
    if vllm_version() is None:
        pytest.skip("vLLM is not installed in this interpreter")
    pytest.importorskip("transformers")
    workdir = str(tmp_path_factory.mktemp(kind))
    multiprocess = kind == "multiprocess"
    env = dict(ENGINE_ENV, ASCEND_RL_AUTOLOAD="0", **extra_env)
    env.update(engines.env_for(steps, workdir, multiprocess=multiprocess))
    return run_scenario("tests.features.shared_engine", kind, workdir, env=env, timeout=900)


@pytest.fixture(scope="session")
def shared_engine(tmp_path_factory) -> dict:
    """One in-process engine, checked by every feature of ``IN_PROCESS_STEPS``."""
    return _run(tmp_path_factory, "in_process", engines.IN_PROCESS_STEPS, {})


@pytest.fixture(scope="session")
def multiprocess_engine(tmp_path_factory) -> dict:
    """One engine with a spawned engine-core process, checked by ``MULTIPROCESS_STEPS``."""
    pythonpath = os.pathsep.join([engines.SITE_DIR] + ([os.environ["PYTHONPATH"]]
                                                       if os.environ.get("PYTHONPATH") else []))
    return _run(tmp_path_factory, "multiprocess", engines.MULTIPROCESS_STEPS,
                {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
                 "PYTHONPATH": pythonpath})


@pytest.fixture
def flag_env(monkeypatch):
    """``flag_env(NAME="value", ...)`` sets product flags in the environment for this test
    (``None`` unsets one); flag values are re-read, and the cache is cleared afterwards."""
    from ascend_rl_plugins import flags

    def set_flags(**values):
        for name, value in values.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, str(value))
        flags.reset_cache()
    yield set_flags
    monkeypatch.undo()
    flags.reset_cache()
