"""The wheel is what users install (README: build it from a clone, install it on the NPU
machines), while the tests otherwise run against an editable checkout, which hides every
file the wheel forgets. These tests build the wheel from the tracked files, check that it
carries every non-Python file of the package, install it into a bare directory and run the
import, doctor and HDP's default cost model from there, outside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.support.child import REPO, run_scenario

PACKAGE = "ascend_rl_plugins"


def tracked_files() -> list[str]:
    """The repository's tracked files (what a fresh clone has), relative to the root."""
    if not os.path.isdir(os.path.join(REPO, ".git")) and not os.path.isfile(os.path.join(REPO, ".git")):
        pytest.skip("not a git checkout: cannot tell which files a clone would have")
    out = subprocess.run(["git", "-C", REPO, "ls-files", "-z"], capture_output=True, text=True, check=True)
    return [f for f in out.stdout.split("\0") if f and os.path.isfile(os.path.join(REPO, f))]


def package_data_files() -> list[str]:
    """Every tracked non-Python file under the package: the files it reads at run time
    (HDP's default_cost_model.json) and the feature READMEs."""
    return sorted(f for f in tracked_files()
                  if f.startswith(PACKAGE + "/") and not f.endswith(".py"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """The wheel built from a copy of the tracked files (a building pip writes build/ and
    *.egg-info next to pyproject.toml: never into the checkout)."""
    pytest.importorskip("setuptools")
    clone = tmp_path_factory.mktemp("clone")
    for rel in tracked_files():
        if rel.startswith((PACKAGE + "/", "pyproject.toml", "README.md")):
            os.makedirs(os.path.dirname(clone / rel) or clone, exist_ok=True)
            shutil.copy2(os.path.join(REPO, rel), clone / rel)
    dist = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(dist), str(clone)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = [f for f in os.listdir(dist) if f.endswith(".whl")]
    assert len(wheels) == 1, wheels
    return str(dist / wheels[0])


def test_the_wheel_carries_every_data_file_of_the_package(wheel):
    with zipfile.ZipFile(wheel) as zf:
        inside = set(zf.namelist())
    expected = package_data_files()
    assert f"{PACKAGE}/features/hdp/default_cost_model.json" in expected
    missing = [f for f in expected if f not in inside]
    assert missing == [], f"{len(missing)} data file(s) missing from {os.path.basename(wheel)}: {missing}"


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> str:
    """``pip install --target`` of the wheel into a bare directory (not the checkout)."""
    site = tmp_path_factory.mktemp("installed") / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                           "--target", str(site), wheel], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return str(site)


def test_the_installed_wheel_imports_runs_doctor_and_loads_hdps_default_cost_model(installed, tmp_path):
    """A fresh interpreter whose working directory is outside the checkout finds the package
    in the install directory (first on its path), not in the checkout."""
    site = installed
    result = run_scenario("tests.installed_wheel_scenario", "check_installed", site,
                          cwd=str(tmp_path), path_first=site,
                          env={"ASCEND_RL_AUTOLOAD": "1"}, timeout=600)
    assert result["from_site"], result
    assert result["activated_by"] == ["import ascend_rl_plugins"], result
    assert result["cost_model_fields"], result
    assert result["doctor_patches"] > 0 and result["doctor_exit"] == 0, result


@pytest.mark.engine
def test_a_vllm_engine_loads_the_installed_wheel_through_its_plugin_loader(installed, tmp_path, tiny_model_path):
    from tests.support.child import ENGINE_ENV, GREEDY_ENGINE_ENV
    from tests.support.stacks import vllm_version
    if vllm_version() is None:
        pytest.skip("needs vLLM")
    result = run_scenario("tests.installed_wheel_scenario", "engine_from_installed", installed, tiny_model_path,
                          cwd=str(tmp_path), path_first=installed,
                          env=dict(ENGINE_ENV, **GREEDY_ENGINE_ENV, ASCEND_RL_AUTOLOAD="0", ASCEND_RL_GC_OFF="1"),
                          timeout=900)  # one greedy request
    assert result["from_site"] and result["tokens"] == 4, result
    assert result["activated_by"][0] == "vllm.general_plugins" and result["gc_off"] == "applied", result
