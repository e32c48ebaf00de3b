"""The ``ascend-rl`` command inspects and never applies: not as the console script, not as
``python -m ascend_rl_plugins``, and it leaves nothing behind in the environment."""

import json
import os
import subprocess
import sys

import pytest

from ascend_rl_plugins import plugin
from ascend_rl_plugins.patching.core import REGISTRY
from tests.support.child import run_scenario

plugin.load_features()
# with autoload on and a default-off feature switched on, an activation would arm patches
ARMED = {"ASCEND_RL_AUTOLOAD": "1", "ASCEND_RL_GC_OFF": "1", "ASCEND_RL_DIAGNOSTICS": "/dev/null"}


def _run(command, *args):
    env = dict(os.environ, **ARMED)
    return subprocess.run([*command, *args], capture_output=True, text=True, env=env, timeout=600)


def _console_script():
    path = os.path.join(os.path.dirname(sys.executable), "ascend-rl")
    if not os.path.exists(path):
        pytest.skip(f"no ascend-rl console script next to {sys.executable} (pip install -e .)")
    return [path]


@pytest.mark.parametrize("how", ["python -m", "console script"])
def test_doctor_leaves_every_patch_unapplied_in_its_process(how):
    command = [sys.executable, "-m", "ascend_rl_plugins"] if how == "python -m" else _console_script()
    proc = _run(command, "doctor", "--json")
    assert proc.returncode in (0, 1), proc.stderr
    data = json.loads(proc.stdout)
    assert data["activated_in_this_process"] == []
    assert data["applied_in_this_process"] == []
    assert {r["patch"] for r in data["patches"]} == set(REGISTRY.patches)


def test_importing_the_cli_neither_activates_nor_marks_the_environment():
    result = run_scenario("tests.plugin_scenario", "import_cli", env={"ASCEND_RL_AUTOLOAD": "0"})
    assert result == {"marker": [], "activated": []}


def test_removal_ledger_names_every_patch_with_its_condition():
    proc = _run([sys.executable, "-m", "ascend_rl_plugins"], "doctor", "--removal", "--json")
    assert proc.returncode == 0, proc.stderr
    ledger = {e["patch"]: e for e in json.loads(proc.stdout)["removal"]}
    assert set(ledger) == set(REGISTRY.patches)
    for name, entry in ledger.items():
        assert entry["remove_when"] == REGISTRY.patches[name].remove_when
        assert entry["this_stack"]


def test_docs_check_fails_on_a_stale_block_and_write_repairs_it(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README.md").write_text("# x\n<!-- status:begin -->\nold\n<!-- status:end -->\n")
    check = _run([sys.executable, "-m", "ascend_rl_plugins"], "docs", "--repo", str(repo))
    assert check.returncode == 1 and "stale: README.md" in check.stdout
    _run([sys.executable, "-m", "ascend_rl_plugins"], "docs", "--repo", str(repo), "--write")
    text = (repo / "README.md").read_text()
    assert "| [gc_off](ascend_rl_plugins/features/gc_off/README.md) |" in text and "\nold\n" not in text
