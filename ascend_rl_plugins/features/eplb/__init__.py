"""EPLB lifecycle across RL train/rollout switches, with an optional warm start.

Before ``NPUWorker.sleep`` vLLM-Ascend's dynamic EPLB process is stopped and its buffers are
released; after ``NPUWorker.wake_up`` (weights) it is rebuilt with the installed version's
constructor arguments on the woken parameters, with fresh loads. The methods the Qwen3 RL
recipe's verl patch 0009 called, absent upstream, are implemented in :mod:`.lifecycle`; the
warm-start placement model and simulator are in :mod:`.placement`. README.md beside this file:
why, flags, the simulator's figures, verified where.

Remove when: vLLM-Ascend stops/restarts dynamic EPLB around sleep/wake-up itself.
"""

from __future__ import annotations

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_EPLB", "bool", False,
    "Stop vLLM-Ascend's dynamic EPLB when the rollout engine sleeps and restart it (fresh "
    "expert loads) when it wakes up. Dynamic EPLB itself is enabled in vLLM-Ascend's "
    "additional_config.", aliases=("VLLM_ENABLE_EPLB",), feature="eplb")
WARM_START = flags.define(
    "ASCEND_RL_EPLB_WARM_START", "bool", False,
    "With ASCEND_RL_EPLB: keep the learned expert placement across RL steps instead of "
    "returning to the initial placement at every wake-up.", feature="eplb")

FEATURE = Feature(
    "eplb", "Stop/restart vLLM-Ascend dynamic EPLB around sleep/wake-up; optional warm start.",
    flag=ENABLE, replaces="Qwen3 RL recipe verl patch 0009-verl-feature-support_EPLB",
    verified=Verified(
        cpu_runtime="warm-start placement and simulator (property tests)",
        doubles="lifecycle against doubles of the worker/runner/EPLB classes whose signatures "
                "equal vLLM-Ascend 0.13's and 0.23's",
        static="hook points and the decision (VLLM_ENABLE_EPLB=1 -> all three apply) in vLLM-Ascend "
               "0.13 and 0.23"),
    stacks="recipe, current (vLLM-Ascend not importable on CPU)")

VA_RANGE = ">=0.13,<0.24"
REMOVE_WHEN = "vLLM-Ascend stops and restarts dynamic EPLB around sleep/wake-up itself"


@FEATURE.before("vllm_ascend.worker.worker:NPUWorker.sleep", dist="vllm-ascend", versions=VA_RANGE,
                order=60, params=("self", "level"), name="eplb.stop_before_sleep",
                reason="the EPLB planner process and its transfer buffers outlive the rollout and "
                       "hold host/device memory through training",
                replaces="recipe verl patch 0009: trainer_mode -> rollout.eplb_end()", remove_when=REMOVE_WHEN)
def _stop_before_sleep(instance, args, kwargs):
    from . import lifecycle
    lifecycle.stop_eplb(instance.model_runner, warm_start=WARM_START.value)


@FEATURE.after("vllm_ascend.worker.worker:NPUWorker.wake_up", dist="vllm-ascend", versions=VA_RANGE,
               order=60, params=("self", "tags"), name="eplb.restart_after_wake_up",
               reason="after wake-up EPLB must run again on the woken (re-created) expert "
                      "parameters with fresh loads; restarted after the worker's own MoE "
                      "weight transposes",
               replaces="recipe verl patch 0009: rollout_mode -> rollout.eplb_start()", remove_when=REMOVE_WHEN)
def _restart_after_wake_up(result, instance, args, kwargs):
    from . import lifecycle
    tags = args[0] if args else kwargs.get("tags")
    if tags is None or "weights" in tags:
        lifecycle.restart_eplb(instance.model_runner, warm_start=WARM_START.value)
    return result


@FEATURE.after("vllm_ascend.worker.model_runner_v1:NPUModelRunner.eplb_warmup", dist="vllm-ascend",
               versions=VA_RANGE, order=60, params=("self",), name="eplb.record_initial_placement",
               reason="the reset-per-rollout mode needs the placement the engine started with, "
                       "before EPLB moves any expert",
               replaces="recipe verl patch 0009 (get_init_expert_map, absent upstream)", remove_when=REMOVE_WHEN)
def _record_initial_placement(result, instance, args, kwargs):
    from . import lifecycle
    lifecycle.record_initial_placement(instance)
    return result
