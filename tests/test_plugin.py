"""The plugin is loaded through the real ``vllm.general_plugins`` path inside real engines,
``import ascend_rl_plugins`` activates in a custom trainer, and importing stays cheap."""

import json

import pytest

from tests.support.child import ENGINE_ENV, run_scenario
from tests.support.stacks import vllm_version

SCENARIO = "tests.plugin_scenario"


def test_import_activates_without_pulling_heavy_packages():
    result = run_scenario(SCENARIO, "import_package",
                          env={"ASCEND_RL_AUTOLOAD": "1", "ASCEND_RL_DIAGNOSTICS": "/dev/null"})
    assert result["heavy"] == []
    assert result["activated"] == ["import ascend_rl_plugins"]
    assert result["patches"] > 0


def test_autoload_off_leaves_activation_to_the_entry_points():
    result = run_scenario(SCENARIO, "import_package", env={"ASCEND_RL_AUTOLOAD": "0"})
    assert result["activated"] == []


def test_entry_points_are_declared():
    from importlib.metadata import entry_points
    vllm_eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    verl_eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert vllm_eps.get("ascend_rl") == "ascend_rl_plugins.plugin:vllm_general_plugin"
    assert verl_eps.get("ascend_rl") == "ascend_rl_plugins.verl_entry"


def test_loading_the_verl_entry_point_activates():
    assert run_scenario(SCENARIO, "load_verl_entry_point", env={"ASCEND_RL_AUTOLOAD": "0"}) == ["verl.plugins"]


@pytest.mark.engine
@pytest.mark.skipif(vllm_version() is None, reason="needs vLLM")
def test_vllm_loads_the_plugin_in_the_engine_core_process(tmp_path, tiny_model_path):
    """Multiprocess engine core (verl 0.9 server style) and in-process engine (verl 0.6
    spmd style): in both, the process that runs EngineCore.step has ascend-rl active,
    activated by vLLM's general-plugin loader, with the diagnostic patch applied."""
    report = tmp_path / "diag.jsonl"
    env = dict(ENGINE_ENV, ASCEND_RL_DIAGNOSTICS=str(report), ASCEND_RL_AUTOLOAD="0")
    result = run_scenario(SCENARIO, "engines_in_both_modes", tiny_model_path, env=env)
    records = [json.loads(line) for line in report.read_text().splitlines()]
    driver = result["pid"]
    pids = {r["pid"] for r in records}
    assert len(records) == 2 and driver in pids and len(pids - {driver}) == 1, records
    for r in records:
        assert r["activated_by"][0] == "vllm.general_plugins"
        states = {p["patch"]: p["state"] for p in r["patches"]}
        assert "applied" in (states["diagnostics.report_on_first_step"],
                             states["diagnostics.report_on_first_step_with_batch_queue"])
