"""EPLB lifecycle across RL train/rollout switches, with an optional warm start.

Why: vLLM-Ascend's dynamic EPLB (expert-parallel load balancing) runs a planner in a
separate process and moves expert weights between devices while the engine decodes. In RL
the rollout engine sleeps during every training phase and wakes for the next rollout;
EPLB knows nothing about that: its process keeps running (and holding memory) through
training, and after a wake-up it works on stale state (its adaptor still points at the
expert parameters that ``NPUWorker.wake_up`` has just replaced). Seed 003 (verl patch
0009) stopped/started EPLB from verl's ``rollout_mode``/``trainer_mode``, calling three
methods that exist in neither vLLM-Ascend 0.13 nor 0.23 and constructors whose arguments
changed in 0.23.

Here the hook is the NPU worker itself, which covers verl's in-process (0.6.x) and server
(0.9.x) rollouts alike: before ``NPUWorker.sleep`` the EPLB process is stopped and its
device buffers are released; after ``NPUWorker.wake_up`` (once weights are awake) a new
EPLB process, updator and adaptor are built with the constructor arguments of the
installed version, expert loads are cleared and gathered afresh. The missing methods are
implemented in :mod:`.lifecycle`.

Warm start (``ASCEND_RL_EPLB_WARM_START``, beyond the seed): the seed returned to the
initial expert placement at every wake-up, so each rollout started unbalanced and paid a
full EPLB cycle before the first rebalance. The policy moves little between RL steps, so
the learned placement is a better starting point: it is kept across the sleep (also a
level-2 sleep that discards device memory) and installed as the layers' placement, the
same state vLLM-Ascend reaches when it starts from an expert-map file.
``benchmarks/bench_eplb_warm_start.py`` simulates both on drifting expert-load traces.

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
    flag=ENABLE, replaces="seed 003 verl 0009-verl-feature-support_EPLB",
    verified=Verified(
        doubles="lifecycle against doubles of the worker/runner/EPLB classes mirroring vLLM-Ascend "
                "0.13 and 0.23 signatures; warm start in a simulator",
        static="hook points in vLLM-Ascend 0.13 and 0.23"),
    stacks="recipe, current (vLLM-Ascend not importable on CPU)")

VA_RANGE = ">=0.13,<0.24"
REMOVE_WHEN = "vLLM-Ascend stops and restarts dynamic EPLB around sleep/wake-up itself"


@FEATURE.before("vllm_ascend.worker.worker:NPUWorker.sleep", dist="vllm-ascend", versions=VA_RANGE,
                order=60, params=("self", "level"), name="eplb.stop_before_sleep",
                reason="the EPLB planner process and its transfer buffers outlive the rollout and "
                       "hold host/device memory through training",
                replaces="seed verl 0009 trainer_mode -> rollout.eplb_end()", remove_when=REMOVE_WHEN)
def _stop_before_sleep(instance, args, kwargs):
    from . import lifecycle
    lifecycle.stop_eplb(instance.model_runner, warm_start=WARM_START.value)


@FEATURE.after("vllm_ascend.worker.worker:NPUWorker.wake_up", dist="vllm-ascend", versions=VA_RANGE,
               order=60, params=("self", "tags"), name="eplb.restart_after_wake_up",
               reason="after wake-up EPLB must run again on the woken (re-created) expert "
                      "parameters with fresh loads; restarted after the worker's own MoE "
                      "weight transposes",
               replaces="seed verl 0009 rollout_mode -> rollout.eplb_start()", remove_when=REMOVE_WHEN)
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
               replaces="seed verl 0009 (get_init_expert_map, absent upstream)", remove_when=REMOVE_WHEN)
def _record_initial_placement(result, instance, args, kwargs):
    from . import lifecycle
    lifecycle.record_initial_placement(instance)
    return result
