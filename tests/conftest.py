import os

import pytest

os.environ.setdefault("ASCEND_RL_AUTOLOAD", "0")  # tests activate explicitly, in child processes
# verl 0.9 activates every `verl.plugins` entry point (this plugin) in any process that imports
# verl: keep the pytest process pristine; child scenarios get verl's default back
# (tests/support/child.py), as a user's process would have it.
os.environ["ARP_TEST_PARENT_VERL_PLUGINS"] = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "")
os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"

from tests.support import cpu_isa, process_hooks  # noqa: E402
from tests.support.stacks import running_stack, vllm_version  # noqa: E402

# ARP_TEST_CPU_ISA and the ISA-probe cache (tests/support/process_hooks.py): post-import hooks,
# applied when torch is imported, in this process ...
process_hooks.install_in_this_process()
# ... and in every process the suite starts, through a sitecustomize on PYTHONPATH
_repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (process_hooks.SITE_DIR, _repo, os.environ.get("PYTHONPATH", "")) if p)


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
