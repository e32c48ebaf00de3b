import os

import pytest

os.environ.setdefault("ASCEND_RL_AUTOLOAD", "0")  # tests activate explicitly, in child processes
# verl 0.9 activates every `verl.plugins` entry point (this plugin) in any process that imports
# verl: keep the pytest process pristine; child scenarios get verl's default back
# (tests/support/child.py), as a user's process would have it.
os.environ["ARP_TEST_PARENT_VERL_PLUGINS"] = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "")
os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"

from tests.support import cpu_isa  # noqa: E402
from tests.support.stacks import running_stack, vllm_version  # noqa: E402

if os.environ.get(cpu_isa.ENV):  # a post-import hook: applied when torch is imported
    cpu_isa.apply_from_env()
    # ... and in every process the suite starts, through a sitecustomize on PYTHONPATH
    _repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.join(_repo, "tests", "support", "simulated_cpu_site"), _repo,
                    os.environ.get("PYTHONPATH", "")) if p)


def pytest_report_header(config):
    simulated = os.environ.get(cpu_isa.ENV)
    return (f"ascend-rl stack: {running_stack() or 'none'} (vLLM {vllm_version() or 'not installed'})"
            + (f"; CPU simulated as {simulated}-only ({cpu_isa.ENV})" if simulated else ""))


@pytest.fixture(scope="session")
def tiny_model_path():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ascend_rl_plugins.devtools import tiny_qwen3
    return tiny_qwen3.cached()
