"""rollout_torch_compile: vLLM's rollout is built with the real torch.compile under MindSpeed.

Real: verl 0.6.1's ``ActorRolloutRefWorker._build_rollout`` (recipe stack, child process; see
scenario.py for the two test pieces it runs with), torch. Double: MindSpeed
(tests/doubles/mindspeed_double), whose names and signatures are compared with MindSpeed's
source at 028de58, and whose MindSpeed facts this patch relies on are read there too.
"""

from __future__ import annotations

import ast
import sys

import pytest

from tests.doubles import mindspeed_double_check as ms
from tests.features.rollout_torch_compile.megatron_worker import MINDSPEED_DOUBLE, dist_env, require_verl_06
from tests.features.upstream_source import method, module_path, parse, top_level
from tests.support.child import free_port, run_scenario
from tests.support.stacks import mindspeed_source

PATCH = "rollout_torch_compile.build_rollout"


def test_rollout_is_built_with_the_real_compile_and_mindspeeds_is_back_after(tmp_path):
    require_verl_06("_build_rollout builds the rollout in-process only in verl 0.6 (recipe stack)")
    got = run_scenario("tests.features.rollout_torch_compile.scenario", "build_rollout", str(tmp_path), True,
                       env={"ASCEND_RL_AUTOLOAD": "0", **dist_env(free_port())}, timeout=600)
    assert got["mindspeed_loaded"] and got["replaced_at_start"], got  # the double did replace it
    assert got["patch_state"] == "applied", got
    assert got["real_during_build"] and got["copy_real_during_build"], got
    assert got["replacement_back_after"] and got["copy_back_after"], got


@pytest.mark.forked
def test_without_mindspeed_nothing_is_touched_or_imported():
    torch = pytest.importorskip("torch")
    from ascend_rl_plugins.features import rollout_torch_compile as feature
    assert "mindspeed.patch_utils" not in sys.modules
    before = torch.compile
    with feature.real_torch_compile():
        assert torch.compile is before
    assert torch.compile is before and feature.mindspeed_compile_patch() is None
    assert not any(name == "mindspeed" or name.startswith("mindspeed.") for name in sys.modules)


@pytest.mark.forked
def test_swap_follows_mindspeeds_patch_record(monkeypatch):
    """Against the double in this (forked) process: nothing happens before MindSpeed applied
    its patch or after it removed it; inside, the real function is everywhere MindSpeed put
    its replacement; after, the replacement is back only where the real one still sits."""
    torch = pytest.importorskip("torch")
    monkeypatch.syspath_prepend(MINDSPEED_DOUBLE)
    from mindspeed.patch_utils import MindSpeedPatchesManager
    from ascend_rl_plugins.features import rollout_torch_compile as feature
    real = torch.compile
    from mindspeed.core.megatron_basic.requirements_basic import dummy_compile
    MindSpeedPatchesManager.register_patch("torch.compile", dummy_compile)
    assert feature.mindspeed_compile_patch() is None  # registered, not applied
    MindSpeedPatchesManager.apply_patches()
    assert torch.compile is dummy_compile
    with feature.real_torch_compile():
        assert torch.compile is real
        torch.compile = "someone else's"  # changed meanwhile: left alone afterwards
    assert torch.compile == "someone else's"
    torch.compile = dummy_compile
    with feature.real_torch_compile():
        assert torch.compile is real
    assert torch.compile is dummy_compile
    MindSpeedPatchesManager.remove_patches()
    assert torch.compile is real and feature.mindspeed_compile_patch() is None


def test_mindspeed_replaces_torch_compile_and_keeps_what_the_patch_reads():
    """MindSpeed 028de58: RequirementsBasicFeature registers 'torch.compile' -> dummy_compile;
    the manager keeps records in the class attribute ``patches_info``; a record stores the
    original in ``orig_func``, the installed object in ``final_patch_func`` and a bool
    ``is_applied``."""
    root = mindspeed_source()
    feature = ms.parse_module(root, "mindspeed.features_manager.megatron_basic.requirements_basic")
    calls = [ast.unparse(n) for n in ast.walk(feature) if isinstance(n, ast.Call)
             and ast.unparse(n.func).endswith("register_patch") and n.args
             and isinstance(n.args[0], ast.Constant) and n.args[0].value == "torch.compile"]
    assert calls == ["pm.register_patch('torch.compile', dummy_compile)"], calls
    assert ms.signature(root, "mindspeed.core.megatron_basic.requirements_basic", "dummy_compile") == \
        ["*args", "**kwargs"]
    manager = ms.definition(root, "mindspeed.patch_utils", "MindSpeedPatchesManager")
    assert any(isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "patches_info" for n in manager.body)
    record = ms.definition(root, "mindspeed.patch_utils", "Patch")
    assigned = {ast.unparse(t): ast.unparse(n.value) for n in ast.walk(record) if isinstance(n, ast.Assign)
                for t in n.targets}
    assert {"self.orig_func", "self.final_patch_func", "self.is_applied"} <= set(assigned), assigned
    assert assigned["self.is_applied"] in ("True", "False")  # an attribute, not a method


def test_double_mirrors_mindspeeds_signatures():
    bad = ms.mismatches(mindspeed_source(), [
        ("mindspeed.patch_utils", "Patch.__init__"), ("mindspeed.patch_utils", "Patch.set_patch_func"),
        ("mindspeed.patch_utils", "Patch.apply_patch"), ("mindspeed.patch_utils", "Patch.remove_patch"),
        ("mindspeed.patch_utils", "MindSpeedPatchesManager.register_patch"),
        ("mindspeed.patch_utils", "MindSpeedPatchesManager.remove_patches"),
        ("mindspeed.patch_utils", "MindSpeedPatchesManager.apply_patches"),
        ("mindspeed.core.megatron_basic.requirements_basic", "dummy_compile"),
        ("mindspeed.megatron_adaptor", "repatch")])
    assert not bad, bad


@pytest.mark.parametrize("stack", ["recipe", "current"])
def test_where_verl_builds_the_rollout(stack):
    """verl 0.6.1 builds the rollout inside the Megatron worker (_build_rollout -> the class from
    get_rollout_class), after importing MindSpeed's adaptor; verl 0.9.1 has no such worker module
    and registers only server adapters (the vLLM engine runs in its own server process), which
    is what fixed_upstream says."""
    if stack == "recipe":
        tree = parse(module_path(stack, "verl", "verl.workers.megatron_workers"))
        assert any(isinstance(n, ast.ImportFrom) and n.module == "mindspeed.megatron_adaptor"
                   for n in ast.walk(tree))
        assert "get_rollout_class" in ast.unparse(method(tree, "ActorRolloutRefWorker", "_build_rollout"))
    else:
        with pytest.raises(FileNotFoundError):
            module_path(stack, "verl", "verl.workers.megatron_workers")
        registry = ast.literal_eval(top_level(parse(module_path(stack, "verl", "verl.workers.rollout.base")),
                                              "_ROLLOUT_REGISTRY").value)
        assert registry[("vllm", "async")].endswith("ServerAdapter") and ("vllm", "sync") not in registry
