import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("ASCEND_RL_AUTOLOAD", "0")  # tests activate explicitly, in subprocesses

from helpers import stack_name, vllm_version  # noqa: E402


def pytest_report_header(config):
    return f"ascend-rl stack: {stack_name() or 'none'} (vLLM {vllm_version() or 'not installed'})"


@pytest.fixture(scope="session")
def tiny_model_path():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ascend_rl_plugins.devtools import tiny_qwen3
    return tiny_qwen3.cached()


