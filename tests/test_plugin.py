"""The plugin is loaded through the real ``vllm.general_plugins`` path inside real engines,
``import ascend_rl_plugins`` activates in a custom trainer, and importing stays cheap."""

import json

import pytest

from tests.support.child import ENGINE_ENV, GREEDY_ENGINE_ENV, Exited, run_scenario, run_scenario_to_exit
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
    env = dict(ENGINE_ENV, **GREEDY_ENGINE_ENV, ASCEND_RL_DIAGNOSTICS=str(report), ASCEND_RL_AUTOLOAD="0")
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


# -- a bad flag stops the process at plugin load, whichever loader loaded the plugin ----------

BAD_VALUE = {"ASCEND_RL_STRICT": "sometimes"}
BAD_VALUE_MESSAGE = "ASCEND_RL_STRICT='sometimes' is not valid"


def assert_stopped_once(exited: Exited, message: str) -> None:
    """The process stopped at plugin load (exit 2, the scenario never finished), saying
    ``message`` exactly once, with no traceback and no loader carrying on without us."""
    output = exited.stdout + exited.stderr
    assert (exited.returncode, exited.finished) == (2, False), output[-4000:]
    assert exited.stderr.count(message) == 1, exited.stderr[-4000:]
    assert "Traceback" not in output and "Failed to load plugin" not in output, output[-4000:]


@pytest.mark.skipif(vllm_version() is None, reason="needs vLLM")
@pytest.mark.parametrize("autoload", ["1", "0"], ids=["activated-at-import", "activated-by-the-hook"])
def test_a_bad_flag_stops_the_process_under_vllms_plugin_loader(autoload):
    """vLLM's loader catches any Exception of an entry point's import and runs on without
    the plugin: the bad flag must stop the process, not switch every feature off. With
    autoload on, the entry point's import activates; with it off, the hook function does."""
    exited = run_scenario_to_exit(SCENARIO, "vllm_plugin_loader", timeout=300,
                                  env=dict(BAD_VALUE, ASCEND_RL_AUTOLOAD=autoload))
    assert_stopped_once(exited, BAD_VALUE_MESSAGE)


@pytest.mark.skipif(vllm_version() is None, reason="needs vLLM")
def test_a_good_environment_activates_under_vllms_plugin_loader():
    """The same loader with valid flags: activated once, by vLLM's hook, and the process runs on."""
    assert run_scenario(SCENARIO, "vllm_plugin_loader", env={"ASCEND_RL_AUTOLOAD": "0"},
                        timeout=300) == ["vllm.general_plugins"]


@pytest.mark.skipif(vllm_version() is None, reason="needs vLLM")
def test_a_misspelled_flag_name_stops_the_process_and_says_which_flag_was_meant():
    """``ASCEND_RL_SAMM=1`` asks for SAM and would silently not get it."""
    exited = run_scenario_to_exit(SCENARIO, "vllm_plugin_loader", timeout=300,
                                  env={"ASCEND_RL_SAMM": "1", "ASCEND_RL_AUTOLOAD": "0"})
    assert_stopped_once(exited, "ASCEND_RL_SAMM is set but no ascend-rl flag has that name; "
                                "did you mean ASCEND_RL_SAM?")


def test_a_bad_flag_stops_import_ascend_rl_plugins_with_one_message():
    assert_stopped_once(run_scenario_to_exit(SCENARIO, "import_package",
                                             env=dict(BAD_VALUE, ASCEND_RL_AUTOLOAD="1")),
                        BAD_VALUE_MESSAGE)


def test_debug_log_level_adds_the_traceback_to_the_message():
    exited = run_scenario_to_exit(SCENARIO, "import_package",
                                  env=dict(BAD_VALUE, ASCEND_RL_AUTOLOAD="1", ASCEND_RL_LOG_LEVEL="debug"))
    assert exited.returncode == 2 and not exited.finished, exited.stderr[-4000:]
    assert "Traceback" in exited.stderr and "FlagError" in exited.stderr, exited.stderr[-4000:]


def test_an_unknown_name_unlike_any_flag_only_warns():
    """A name that resembles no flag may belong to another tool or version: a warning."""
    result = run_scenario(SCENARIO, "import_package",
                          env={"ASCEND_RL_AUTOLOAD": "1", "ASCEND_RL_ZZZZZZZZ_QQ": "1"})
    assert result["activated"] == ["import ascend_rl_plugins"]
