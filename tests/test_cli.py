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


@pytest.mark.parametrize("argv", [
    ["flashrl", "quantize", "-m", "{tmp}", "-o", "{tmp}/out"],
    ["flashrl", "profile", "-m", "{tmp}", "-q", "{tmp}", "-o", "{tmp}/p"],
    ["moe-reshard", "convert", "--direction", "hf-to-mcore", "-i", "{tmp}", "-o", "{tmp}/out"],
], ids=["flashrl-quantize", "flashrl-profile", "moe-reshard-convert"])
def test_a_command_needing_an_absent_package_says_which_and_how_to_install(argv, tmp_path):
    argv = [a.format(tmp=tmp_path) for a in argv]
    result = run_scenario("tests.plugin_scenario", "cli_without", ["torch", "safetensors"], argv)
    assert result["uncaught"] is None and result["code"] == 2, result
    line = result["stderr"].strip()
    assert "\n" not in line and "needs torch, safetensors" in line and "pip install torch safetensors" in line, line
    assert line.startswith("ascend-rl " + " ".join(argv[:2]) + ": error:"), line


def test_mismatch_on_a_non_numeric_value_is_one_line_naming_the_argument(tmp_path):
    (tmp_path / "t.jsonl").write_text('[0.1, "x"]\n')
    (tmp_path / "r.jsonl").write_text("[0.1, 0.2]\n")
    result = run_scenario("tests.plugin_scenario", "cli_without", [],
                          ["mismatch", "--trainer", str(tmp_path / "t.jsonl"), "--rollout", str(tmp_path / "r.jsonl")])
    assert result["uncaught"] is None and result["code"] == 2, result
    line = result["stderr"].strip()
    assert "\n" not in line and line.startswith("ascend-rl mismatch: error: --trainer:") and "'x' is not a number" in line
    clip = run_scenario("tests.plugin_scenario", "cli_without", [],
                        ["mismatch", "--trainer", str(tmp_path / "r.jsonl"), "--rollout", str(tmp_path / "r.jsonl"),
                         "--clip", "wide"])
    assert clip["code"] == 2 and "argument --clip: invalid float value: 'wide'" in clip["stderr"], clip


def test_docs_outside_a_checkout_says_so_and_writes_nothing(tmp_path):
    """It printed 'rewrote README.md (missing)' and exited 0, having written nothing."""
    proc = _run([sys.executable, "-m", "ascend_rl_plugins"], "docs", "--repo", str(tmp_path), "--write")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "rewrote" not in proc.stdout and os.listdir(tmp_path) == []
    assert proc.stderr.startswith(f"ascend-rl docs: error: --repo {tmp_path} is not a checkout"), proc.stderr
