"""EPLB lifecycle around sleep/wake-up, and warm start.

Real code: the three patch hooks, composed onto the worker/runner exactly as the framework
composes before/after patches; ``lifecycle`` (torch tensors on CPU); both vLLM-Ascend
sources (AST) for hook points, constructor signatures and the doubles' signatures.
Doubles (tests/doubles/vllm_ascend_eplb_double.py): NPUWorker,
NPUModelRunner, EplbProcess, EplbUpdator, D2DExpertWeightLoader, VllmEplbAdaptor, the
FusedMoE layer and the planner process, in a 0.13 and a 0.23 flavour.
"""

from __future__ import annotations

import ast
import inspect
import os

import pytest
import wrapt

torch = pytest.importorskip("torch")  # the lifecycle and the doubles hold torch tensors

from ascend_rl_plugins.features import eplb as feature  # noqa: E402
from ascend_rl_plugins.features.eplb import lifecycle  # noqa: E402
from ascend_rl_plugins.patching.core import _make_wrapper  # noqa: E402
from tests.doubles import vllm_ascend_eplb_double as d  # noqa: E402
from tests.features.upstream_source import (STACKS, decision, method, module_path, params, parse,  # noqa: E402
                                            python_files)

PATCHES = {p.name: p for p in feature.FEATURE.patches}
FLAVOURS = {
    "va13": (lifecycle.EplbClasses(d.EplbProcessDouble13, d.EplbUpdatorDouble13, d.D2DExpertWeightLoaderDouble),
             d.VllmEplbAdaptorDouble13),
    "va23": (lifecycle.EplbClasses(d.EplbProcessDouble23, d.EplbUpdatorDouble23, d.D2DExpertWeightLoaderDouble),
             d.VllmEplbAdaptorDouble23),
}


def _patched(cls, attribute, patch):
    """A subclass of ``cls`` whose ``attribute`` is wrapped as the framework would."""
    sub = type(cls.__name__, (cls,), {})
    setattr(sub, attribute, wrapt.FunctionWrapper(vars(cls)[attribute], _make_wrapper(patch)))
    return sub


@pytest.fixture(params=["va13", "va23"])
def engine(request, monkeypatch):
    """A worker + runner pair with the three patches installed; restarts use the doubles."""
    classes, adaptor_cls = FLAVOURS[request.param]
    real_restart = lifecycle.restart_eplb
    monkeypatch.setattr(lifecycle, "restart_eplb",
                        lambda runner, *, warm_start, classes=None: real_restart(runner, warm_start=warm_start,
                                                                                 classes=FLAVOURS[request.param][0]))
    runner_cls = _patched(d.NPUModelRunnerDouble, "eplb_warmup", PATCHES["eplb.record_initial_placement"])
    worker_cls = _patched(d.NPUWorkerDouble, "sleep", PATCHES["eplb.stop_before_sleep"])
    worker_cls.wake_up = wrapt.FunctionWrapper(vars(d.NPUWorkerDouble)["wake_up"],
                                               _make_wrapper(PATCHES["eplb.restart_after_wake_up"]))
    runner = runner_cls(request.param, classes, adaptor_cls)
    runner.eplb_warmup()  # what the engine does once at start-up
    d.EVENTS.clear()
    return request.param, worker_cls(runner), runner


def _placement(runner):
    return [{n: getattr(layer.mlp.experts, n).clone() for n in lifecycle.PLACEMENT_TENSORS}
            for layer in runner.model.model.layers]


def _learn_a_new_placement(runner):
    """What a finished EPLB cycle leaves: swapped experts 0<->2 in the published global maps
    and in log2phy; the updator idle again."""
    maps = runner.shared_dict["expert_maps"].clone()
    maps[:, :, [0, 2]] = maps[:, :, [2, 0]]
    runner.shared_dict["expert_maps"] = maps
    for layer in runner.model.model.layers:
        layer.mlp.experts.log2phy[[0, 2]] = layer.mlp.experts.log2phy[[2, 0]].clone()
    runner.eplb_updator.cur_iterations = 0
    return maps


def test_sleep_stops_eplb_before_the_allocator_and_releases_memory(engine, flag_env):
    flag_env(ASCEND_RL_EPLB_WARM_START=0)
    flavour, worker, runner = engine
    old_process, old_adaptor = runner.process, runner.eplb_adaptor
    worker.sleep(1)
    assert d.EVENTS[:3] == ["EplbUpdator.shutdown", "process.terminate", "process.join"]
    assert d.EVENTS[-1] == "allocator.sleep(level=1)"
    assert not old_process.is_alive()
    assert runner.eplb_adaptor is None and old_adaptor.buffer_tensor_list in ([], {})
    assert runner.eplb_updator._gather_buffer is None


def test_wake_up_restarts_eplb_after_the_weight_transposes_with_fresh_loads(engine, flag_env):
    flag_env(ASCEND_RL_EPLB_WARM_START=0)
    flavour, worker, runner = engine
    for layer in runner.model.model.layers:
        layer.mlp.experts.moe_load.fill_(5)
    worker.sleep(1)
    d.EVENTS.clear()
    worker.wake_up(["weights"])
    order = d.EVENTS
    assert order.index("worker.transpose_moe_weights") < order.index("EplbProcess()")
    assert order.index("EplbProcess._launch_process") < order.index("EplbUpdator()")
    assert order.index("layer.clear_moe_load") < order.index("VllmEplbAdaptor()") < order.index(
        "EplbUpdator.warm_up_eplb")
    assert runner.process.is_alive() and runner.is_eplb_warmuped and runner.dynamic_eplb
    # loads gathered at warm-up are fresh (cleared), not the previous rollout's
    assert all(int(load.sum()) == 0 for load in runner.eplb_updator.loads_at_warm_up)
    # the new adaptor holds the woken (re-created) parameters, not the pre-sleep ones
    experts = runner.model.model.layers[0].mlp.experts
    assert runner.eplb_adaptor.expert_param_per_layer[0][0] is experts.w13_weight
    # per-version constructor arguments
    if flavour == "va23":
        assert runner.eplb_process.tp_size == 4
        assert runner.eplb_updator.eplb_config is runner.ascend_config.eplb_config
    else:
        assert runner.eplb_process.tp_size is None
        assert runner.eplb_updator.ascend_config is runner.ascend_config
    assert lifecycle.state_of(runner).restarts == 1


def test_only_a_weights_wake_up_restarts_and_only_once(engine, flag_env):
    flag_env(ASCEND_RL_EPLB_WARM_START=0)
    flavour, worker, runner = engine
    worker.sleep(1)
    worker.wake_up(["kv_cache"])
    assert not runner.process.is_alive()
    worker.wake_up(["weights"])
    process = runner.process
    worker.wake_up(["kv_cache"])
    worker.wake_up(None)  # no sleep in between: nothing to restart
    assert runner.process is process and lifecycle.state_of(runner).restarts == 1


@pytest.mark.parametrize("level", [1, 2])
def test_reset_mode_returns_to_the_initial_placement(engine, flag_env, level):
    flag_env(ASCEND_RL_EPLB_WARM_START=0)
    flavour, worker, runner = engine
    initial = _placement(runner)
    _learn_a_new_placement(runner)
    worker.sleep(level)
    worker.wake_up(None)
    for now, before in zip(_placement(runner), initial):
        for name in lifecycle.PLACEMENT_TENSORS:
            assert torch.equal(now[name], before[name]), name
    assert torch.equal(runner.shared_dict["expert_maps"], torch.stack([p["global_expert_map"] for p in initial]))


@pytest.mark.parametrize("level", [1, 2])
def test_warm_start_keeps_the_learned_placement_across_sleep(engine, flag_env, level):
    flag_env(ASCEND_RL_EPLB_WARM_START=1)
    flavour, worker, runner = engine
    learned_maps = _learn_a_new_placement(runner)
    learned_log2phy = [layer.mlp.experts.log2phy.clone() for layer in runner.model.model.layers]
    worker.sleep(level)  # level 2 wipes the device tensors (double fills them with -7)
    worker.wake_up(["weights"])
    for index, layer in enumerate(runner.model.model.layers):
        experts = layer.mlp.experts
        assert torch.equal(experts.global_expert_map, learned_maps[index])
        assert torch.equal(experts._expert_map, learned_maps[index][0])  # this rank's row
        assert torch.equal(experts.log2phy, learned_log2phy[index])
    # the new planner starts from the learned maps (published again by warm-up)
    assert torch.equal(runner.shared_dict["expert_maps"], learned_maps)
    assert "restore_learned" in lifecycle.state_of(runner).events


def test_warm_start_does_not_snapshot_a_half_applied_cycle(engine, flag_env):
    flag_env(ASCEND_RL_EPLB_WARM_START=1)
    flavour, worker, runner = engine
    initial = _placement(runner)
    _learn_a_new_placement(runner)
    runner.eplb_updator.cur_iterations = 11  # planner woken at 9, weights not all swapped yet
    worker.sleep(2)
    worker.wake_up(None)
    assert "keep_previous_learned(in_flight)" in lifecycle.state_of(runner).events
    for now, before in zip(_placement(runner), initial):  # nothing learned before: initial
        assert torch.equal(now["log2phy"], before["log2phy"])


def test_a_failing_restart_turns_eplb_off_instead_of_breaking_the_engine(engine, flag_env, monkeypatch):
    flag_env(ASCEND_RL_EPLB_WARM_START=0)
    flavour, worker, runner = engine

    def boom(*a, **k):
        raise RuntimeError("no NPU")
    monkeypatch.setattr(lifecycle, "build_eplb_process", boom)
    worker.sleep(1)
    worker.wake_up(["weights"])  # must not raise
    assert runner.dynamic_eplb is False
    assert "disabled" in lifecycle.state_of(runner).events


def test_inactive_when_dynamic_eplb_is_off(engine):
    flavour, worker, runner = engine
    runner.dynamic_eplb = False
    worker.sleep(1)
    worker.wake_up(None)
    assert d.EVENTS == ["allocator.sleep(level=1)", "allocator.wake_up(tags=None)", "worker.transpose_moe_weights"]


# -- static conformance against both vLLM-Ascend sources --------------------------------

@pytest.mark.parametrize("stack", STACKS)
def test_hook_points_and_what_the_lifecycle_relies_on(stack):
    worker = parse(module_path(stack, "vllm_ascend", "vllm_ascend.worker.worker"))
    assert params(method(worker, "NPUWorker", "sleep")) == ["self", "level"]
    assert params(method(worker, "NPUWorker", "wake_up")) == ["self", "tags"]
    runner_tree = parse(module_path(stack, "vllm_ascend", "vllm_ascend.worker.model_runner_v1"))
    warmup = method(runner_tree, "NPUModelRunner", "eplb_warmup")
    called = {ast.unparse(n.func) for n in ast.walk(warmup) if isinstance(n, ast.Call)}
    assert {"VllmEplbAdaptor", "self.eplb_loader.set_adator", "self.eplb_updator.set_adaptor",
            "self.eplb_updator.warm_up_eplb"} <= called
    init = method(runner_tree, "NPUModelRunner", "__init__")
    assigned = {ast.unparse(t) for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets}
    assert {"self.dynamic_eplb", "self.is_eplb_warmuped", "self.policy_type", "self.eplb_loader",
            "self.shared_dict", "self.eplb_process", "self.process", "self.eplb_updator"} <= assigned
    updator = parse(module_path(stack, "vllm_ascend", "vllm_ascend.eplb.eplb_updator"))
    for name in ("shutdown", "set_adaptor", "warm_up_eplb", "update_iteration"):
        method(updator, "EplbUpdator", name)
    # vLLM-Ascend 0.23 uses its fused_moe_0_23_0 layer with vLLM 0.23.0
    moe_module = "vllm_ascend.ops.fused_moe." + ("fused_moe" if stack == "recipe" else "fused_moe_0_23_0")
    moe = parse(module_path(stack, "vllm_ascend", moe_module))
    src = ast.unparse(moe)
    for name in ("self.global_expert_map", "self._expert_map", "self.log2phy", "def clear_moe_load"):
        assert name in src, name


@pytest.mark.parametrize("stack,flavour", [("recipe", "va13"), ("current", "va23")])
def test_doubles_mirror_the_real_signatures(stack, flavour):
    classes, adaptor_cls = FLAVOURS[flavour]
    pairs = [("vllm_ascend.eplb.core.eplb_worker", "EplbProcess", classes.EplbProcess, "__init__"),
             ("vllm_ascend.eplb.eplb_updator", "EplbUpdator", classes.EplbUpdator, "__init__"),
             ("vllm_ascend.eplb.core.eplb_device_transfer_loader", "D2DExpertWeightLoader",
              classes.D2DExpertWeightLoader, "set_adator"),
             ("vllm_ascend.eplb.adaptor.vllm_adaptor", "VllmEplbAdaptor", adaptor_cls, "__init__"),
             ("vllm_ascend.worker.worker", "NPUWorker", d.NPUWorkerDouble, "sleep"),
             ("vllm_ascend.worker.worker", "NPUWorker", d.NPUWorkerDouble, "wake_up")]
    for module, cls_name, double, name in pairs:
        real = method(parse(module_path(stack, "vllm_ascend", module)), cls_name, name)
        real_names = params(real) + ([f"**{real.args.kwarg.arg}"] if real.args.kwarg else [])
        sig = inspect.signature(vars(double)[name] if name in vars(double) else getattr(double, name))
        double_names = [("**" if p.kind == p.VAR_KEYWORD else "") + p.name for p in sig.parameters.values()]
        assert double_names == real_names, (cls_name, name)


@pytest.mark.parametrize("stack", STACKS)
def test_the_methods_the_seed_called_do_not_exist_upstream(stack):
    """Why lifecycle.py implements them: neither version has them."""
    updator = parse(module_path(stack, "vllm_ascend", "vllm_ascend.eplb.eplb_updator"))
    adaptor = parse(module_path(stack, "vllm_ascend", "vllm_ascend.eplb.adaptor.vllm_adaptor"))
    with pytest.raises(LookupError):
        method(updator, "EplbUpdator", "get_init_expert_map")
    with pytest.raises(LookupError):
        method(adaptor, "VllmEplbAdaptor", "release_memory")
    package = os.path.dirname(module_path(stack, "vllm_ascend", "vllm_ascend.eplb.eplb_updator"))
    for path in python_files(os.path.dirname(package)):
        with open(path, encoding="utf-8", errors="replace") as fh:
            assert "def reset_all_expert_map_and_log2phy(" not in fh.read(), path


@pytest.mark.parametrize("stack", STACKS)
def test_the_seed_variable_switches_all_three_hooks_on_in_both_stacks(stack, flag_env):
    """What activation and doctor decide: off by default; the seed recipe's VLLM_ENABLE_EPLB
    switches every hook on, and each resolves in the stack's vLLM-Ascend."""
    flag_env(ASCEND_RL_EPLB=None, VLLM_ENABLE_EPLB=None)
    assert not any(decision(p, stack).apply for p in PATCHES.values())
    flag_env(VLLM_ENABLE_EPLB=1)
    for p in PATCHES.values():
        d = decision(p, stack)
        assert d.apply and d.target_found, (p.name, d.reason)
