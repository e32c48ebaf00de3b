"""MoE expert reshard: every expert slice moves once, straight to the rollout rank that needs it.

Stock verl 0.6.1 syncs Megatron-Core expert weights to vLLM by all-gathering every expert over
the expert-parallel group (after a pipeline broadcast), so every rank receives every expert and
vLLM's loader then throws most of them away. This feature plans, from the training layout and
each rollout rank's expert map, which training rank sends which expert rows to which rollout
rank (``planner.py``), and moves them with uneven all-to-alls in bounded rounds
(``executor.py``). The dense part of the model keeps verl's own path.

Hooks (README.md beside this file has the details and what each covers):

- verl 0.6.1 ``per_tensor_generator`` (and the copies other verl modules made with
  ``from ... import``, rebound by the framework): dense tensors from verl's own generator over a
  dense-only view of the model, experts from the reshard (``hooks_verl06.py``).
- verl 0.6.1 ``vLLMRollout.update_weights`` / ``vLLMAsyncRollout.update_weights``: tells the
  generator which vLLM model it feeds (expert maps, rollout rank, pre-narrowed loading) and
  re-runs vLLM's post-load processing after ``load_weights`` (the recipe's verl 0007).
- verl 0.9.x: a checkpoint-engine backend ``ascend_rl_alltoallv`` registered through verl's own
  ``CheckpointEngineRegistry`` from the module ``custom_backend_module`` names
  (``verl09_backend.py``), and one patch, ``ActorRolloutRefWorker.update_weights``, that hands it
  the training engine (local expert shards) as verl hands its ``delta_sharded`` backend: experts
  go by the reshard from the trainer ranks straight to the rollout ranks hosting them, dense
  tensors by broadcast from trainer rank 0.
- verl 0.9.x colocated (``checkpoint_engine.backend: naive``, no checkpoint engine and no
  extension point): ``hand_training_engine`` marks verl's naive sync, and one more patch,
  ``MegatronEngine.get_per_tensor_param`` (only inside that mark), yields the dense tensors and
  exactly the experts the trainer rank's co-located vLLM worker hosts, moved by all-to-all-v over
  the trainer's own group (``verl09_colocated.py``).

Every fallback is collective (``agreement.py``): a plan that fails validation, a planner
refusal, an exception while preparing, or plan inputs that differ, on any one rank, make every
rank fall back to the stock path together, with a one-line WARNING naming the rank and reason;
under ``ASCEND_RL_MOE_RESHARD=on`` that is an error on every rank instead. Plans are made once
per layout and expert map (``planner.PlanCache``).

Remove when: verl's Megatron weight export sends each rollout rank only the experts it hosts.
"""

from __future__ import annotations

from ... import flags
from ...patching import Feature, Verified
from .cli import register_cli  # noqa: F401  (``ascend-rl moe-reshard ...``)

__all__ = ["FEATURE", "MODE", "BUCKET_MB", "POST_LOAD", "register_cli", "reshard_requested", "bucket_bytes",
           "verl09_config_lines", "BACKEND", "BACKEND_MODULE",
           "WORKER_EXTENSION"]

MODES = ("off", "auto", "on")


MODE = flags.define(
    "ASCEND_RL_MOE_RESHARD", "enum", "off",
    "Weight sync of MoE experts by all-to-all-v (each expert slice moves once, only to the rollout "
    "ranks whose vLLM hosts it): 'off' (verl's all-gather), 'auto' (when the model has experts and "
    "the plan is valid; otherwise verl's path with a one-line reason), 'on' (an invalid plan is an "
    "error).", aliases=("ALL_TO_ALL_RESHARD",), choices=MODES, feature="moe_reshard")
# The recipe's ALL_TO_ALL_RESHARD was a switch (1/0): an off|auto|on flag takes the bool spellings
# under either name (flags.Flag.is_mode_switch), so 1 means 'on' whichever name carries it.
BUCKET_MB = flags.define(
    "ASCEND_RL_MOE_RESHARD_BUCKET_MB", "int", 512,
    "Largest send (and receive) volume per rank of one all-to-all round, in MiB; the executor keeps "
    "at most two rounds in flight.", minimum=1, maximum=1 << 20, feature="moe_reshard")
POST_LOAD = flags.define(
    "ASCEND_RL_MOE_RESHARD_POST_LOAD", "bool", True,
    "After verl 0.6.1's rollout update_weights loads new weights into a vLLM MoE model, re-run "
    "vLLM's post-load processing (repacking / transposing the fused expert weights), as the "
    "engine does after its initial load.", feature="moe_reshard")


def reshard_requested() -> bool:
    """Is the reshard switched on (auto or on)?"""
    return MODE.switched_on


def _update_hook_wanted() -> bool:
    return bool(POST_LOAD.value) or reshard_requested()


def bucket_bytes() -> int:
    return int(BUCKET_MB.value) << 20


FEATURE = Feature(
    "moe_reshard", "MoE expert weight sync by all-to-all-v: each expert slice goes once, straight to "
                   "the rollout rank that hosts it.",
    flag=MODE, replaces="the recipe's verl patches 0005 (moe_alltoallv), 0006 (weight converter for "
                        "grouped GEMM), 0007 (post-load processing after update_weights)",
    verified=Verified(
        cpu_runtime="verl 0.9.1 (current stack): the checkpoint-engine backend built through verl's real "
                    "CheckpointEngineRegistry / import_external_libs between 4 trainer processes with real "
                    "Megatron-Core 0.16.1 MoE models (local layers; SequentialMLP TP2/EP2/ETP2 and GroupedMLP "
                    "EP2 with 2 expert-DP copies) and 2 rollout processes over gloo: each rollout rank "
                    "receives exactly its hosted experts once and every dense tensor, bit-identical to the "
                    "stock export; one rank of six refusing -> every rank falls back together; real vLLM 0.23 "
                    "CPU engines behind 2 rollout ranks (Megatron-Core EP2 trainers): loaded through vLLM's "
                    "layerwise reload, every parameter and greedy token equal to an engine started on the "
                    "weights, expert maps read from the live engines at each sync (a sync keyed on the "
                    "configured map leaves experts stale and changes generations; the live one re-plans); in a "
                    "real verl 0.9.1 deployment on Ray (LLMServerManager, CheckpointEngineWorker, vLLMHttpServer "
                    "with the feature's vLLM worker extension) the rollout rank votes its vLLM worker's live map "
                    "at every sync and receives exactly those experts; verl 0.9.1's "
                    "real ActorRolloutRefWorker.update_weights hands the backend the training engine with "
                    "the patch; verl 0.9.1 colocated ('naive') sync: the real MegatronEngine's "
                    "get_per_tensor_param called as verl's naive update_weights calls it, inside the worker patch's "
                    "scope, on 4 gloo ranks (SequentialMLP TP1/EP2/ETP2 and TP2/EP2/ETP1, GroupedMLP EP2 with ETP1 "
                    "and ETP2; rollouts EP2 round_robin in 2 replicas, EP4 linear and round_robin, no EP): each rank yields every dense tensor and exactly the experts of its "
                    "co-located vLLM worker, once, bit-identical to the checkpoint; one rank refusing -> every "
                    "rank the stock export (no vLLM engine behind it). verl 0.6.1 (recipe stack): real per_tensor_generator on a real "
                    "Megatron-Core 0.12.1 MoE model "
                    "(CPU harness, TP2xEP2xETP2 on 4 gloo processes; SequentialMLP and GroupedMLP), "
                    "stock vs patched, and with one rank of four refusing (every rank falls back "
                    "together); real vLLM 0.13 and 0.23 CPU engines "
                    "with a tiny Qwen3-MoE receiving the resharded weights, token- and "
                    "parameter-identical to an engine started on them; verl 0.6.1's real "
                    "vLLMAsyncRollout.update_weights on a real vLLM 0.13 engine",
        static="CheckpointEngineManager's prepare / topology order, the rollout-side engine construction "
               "(verl 0.9.1's MegatronEngine.get_per_tensor_param through Megatron-Bridge 0.3.1, where the "
               "backend's dense tensors come from, runs for real on CPU: test_verl09_mcore_engine.py)",
        npu="not run: HCCL all-to-all-v speed (the verl 0.9 backend's group is gloo, host buffers), "
            "vLLM-Ascend's w13/w2 transposes after wake-up, MC2 dispatch after an in-place update (README)"),
    stacks="recipe (verl 0.6.1 hooks, vLLM 0.13 engine), current (verl 0.9.1 checkpoint-engine backend "
           "from real Megatron-Core shards into vLLM 0.23 CPU engines, one per rollout rank, EP 1: vLLM's CPU "
           "MoE has no expert parallelism)")

VERL06 = ">=0.6,<0.7"
REMOVE_WHEN = ("verl's Megatron weight export sends each rollout rank only the expert weights its "
               "vLLM hosts (no all-gather of every expert over EP)")

VERL09 = ">=0.9,<0.10"
BACKEND = "ascend_rl_alltoallv"
BACKEND_MODULE = "ascend_rl_plugins.features.moe_reshard.verl09_backend"
# verl's vLLM worker extension plus the method that reports a worker's live expert map (verl09_rollout.py)
WORKER_EXTENSION = "ascend_rl_plugins.features.moe_reshard.verl09_worker.ReshardWorkerExtension"


def verl09_config_lines() -> list[str]:
    """The verl 0.9 overrides that select the checkpoint-engine backend (``ascend-rl moe-reshard
    verl09`` and doctor print them)."""
    key = "actor_rollout_ref.rollout.checkpoint_engine"
    return [f"{key}.backend={BACKEND}",
            f"{key}.custom_backend_module={BACKEND_MODULE}",
            f"+{key}.engine_kwargs.{BACKEND}.replica_world_size=<vLLM workers per rollout replica>",
            f"+{key}.engine_kwargs.{BACKEND}.expert_placement=linear  (or round_robin: vLLM's "
            "expert_placement_strategy)",
            f"+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls={WORKER_EXTENSION}  (live "
            "expert maps at every sync)"]


FEATURE.does_not_apply(
    dist="verl", versions=">=0.7,<0.9",
    why="verl 0.7 / 0.8 export Megatron weights through Megatron-Bridge (experts already gathered over "
        "EP) and their checkpoint-engine hand-off was not read for this feature; the reshard is hooked on "
        "verl 0.6.1 (per_tensor_generator) and verl 0.9.x (checkpoint-engine backend)")

FEATURE.applies_through(
    dist="verl", versions=VERL09, point="verl's checkpoint-engine registry (rollout.checkpoint_engine."
                                        "custom_backend_module)",
    how=lambda: ("set ASCEND_RL_MOE_RESHARD=auto and add `" + " ".join(verl09_config_lines()[:2]) + "` plus the "
                 f"engine_kwargs.{BACKEND} keys replica_world_size / expert_placement (print all: "
                 "`ascend-rl moe-reshard verl09`); the trainer hands the backend its local expert shards "
                 "(patch moe_reshard.hand_training_engine) and each rollout rank receives exactly its hosted "
                 "experts (README, verl 0.9). Colocated rollout (checkpoint_engine.backend=naive): "
                 "ASCEND_RL_MOE_RESHARD=auto alone; each trainer rank streams its vLLM worker the dense tensors "
                 "and exactly the experts it hosts (patch moe_reshard.colocated_export; maps from rollout."
                 "expert_parallel_size and engine_kwargs.vllm.expert_placement_strategy)"))


@FEATURE.wrap("verl.workers.engine_workers:ActorRolloutRefWorker.update_weights", dist="verl", versions=VERL09,
              order=50, enabled_by=reshard_requested, name="moe_reshard.hand_training_engine",
              params=("self", "global_steps", "mode"),
              reason="verl 0.9.1 hands a checkpoint-engine backend Megatron-Bridge's HF export (every expert "
                     "already gathered over EP on every trainer rank); only its own 'delta_sharded' backend "
                     "receives the training engine and with it the local shards. The reshard backend needs "
                     "those: this hands the engine to a backend whose class sets takes_training_engine, "
                     "exactly as verl does for delta_sharded, and leaves every other backend untouched. In the "
                     "colocated 'naive' branch (no checkpoint engine, no extension point) it only marks the "
                     "call as a colocated sync feeding this rank's vLLM worker (verl09_colocated.scope), for "
                     "moe_reshard.colocated_export; verl's own code runs unchanged",
              remove_when="verl hands a registered checkpoint engine the training engine (or the local "
                          "shards) itself, not only 'delta_sharded', and its colocated sync sends each vLLM "
                          "worker only the experts it hosts")
def _hand_training_engine(wrapped, instance, args, kwargs):
    def bind(worker, global_steps=None, mode="auto"):
        return worker, global_steps, mode
    # bound (a worker's method) or called on the class with the worker first
    worker, global_steps, mode = bind(instance, *args, **kwargs) if instance is not None else bind(*args, **kwargs)
    effective = mode if mode != "auto" else worker.config.rollout.checkpoint_engine.backend
    if effective == "naive":
        from . import agreement
        from .verl09_colocated import ColocatedRollout, scope
        rollout, why = agreement.attempt("colocated rollout", ColocatedRollout.from_worker, worker)
        rollout = rollout if rollout is not None else ColocatedRollout(reason=why)   # a vote against, not a raise

        async def colocated():
            with scope(rollout):
                return await wrapped(*args, **kwargs)
        return colocated()
    engine = getattr(worker, "checkpoint_engine", None)
    if not getattr(type(engine), "takes_training_engine", False):
        return wrapped(*args, **kwargs)
    sending = engine.send_weights(worker.actor.engine, global_steps=global_steps)

    async def handed():
        return (await sending) or {}
    return handed()


@FEATURE.wrap("verl.workers.engine.megatron.transformer_impl:MegatronEngine.get_per_tensor_param", dist="verl",
              versions=VERL09, order=50, enabled_by=reshard_requested, name="moe_reshard.colocated_export",
              params=("self", "base_sync_done"),
              reason="verl 0.9.1's colocated ('naive') sync streams get_per_tensor_param -- Megatron-Bridge's "
                     "export_hf_weights, every expert gathered over EP on every trainer rank (and failing for "
                     "SequentialMLP at EP > 1) -- into each rank's co-located vLLM worker, which keeps only its "
                     "hosted experts; the checkpoint-engine registry is not consulted for 'naive', so there is "
                     "no extension point. Inside a colocated sync marked by moe_reshard.hand_training_engine "
                     "(and only there: the checkpoint-engine backends and delta_sharded call it outside one) the "
                     "export yields the dense tensors from the bridge and exactly the experts the co-located "
                     "vLLM worker hosts, moved by all-to-all-v over the trainer's group",
              remove_when=REMOVE_WHEN)
def _colocated_export(wrapped, instance, args, kwargs):
    from .verl09_colocated import patched_export
    return patched_export(wrapped, instance, args, kwargs)


@FEATURE.wrap("verl.utils.megatron_utils:per_tensor_generator", dist="verl", versions=VERL06, order=50,
              enabled_by=reshard_requested, name="moe_reshard.per_tensor_generator",
              params=("actor_module", "model_config", "weight_converter", "transformer_config",
                      "layer_name_mapping"),
              reason="stock per_tensor_generator all-gathers every expert over EP (one local index at "
                     "a time, after a PP broadcast) so each rank receives every expert; the patched "
                     "generator yields the dense tensors exactly as stock and, for experts, only "
                     "the slices this rank's vLLM hosts, moved once by all-to-all-v",
              replaces="recipe verl 0005-verl-feature-moe_alltoallv and 0006 (Mcore->HF names of "
                       "GroupedMLP weight1/weight2, handled by the reshard's layout)",
              remove_when=REMOVE_WHEN)
def _per_tensor_generator(wrapped, instance, args, kwargs):
    from . import hooks_verl06
    return hooks_verl06.generator(wrapped, args, kwargs)


_UPDATE_REASON = ("the reshard needs the live vLLM model that load_weights fills (its expert maps, its "
                  "rollout rank, where pre-narrowed slices go); and weights written by load_weights "
                  "after the engine started are in checkpoint layout, so vLLM's post-load processing "
                  "(repacking on CPU, w13/w2 transposes on vLLM-Ascend) must run again")


@FEATURE.wrap("verl.workers.rollout.vllm_rollout.vllm_rollout_spmd:vLLMAsyncRollout.update_weights",
              dist="verl", versions=VERL06, order=50, enabled_by=_update_hook_wanted,
              name="moe_reshard.async_rollout_update_weights", params=("self", "weights"),
              reason=_UPDATE_REASON, replaces="recipe verl 0007-verl-bugfix-moe_update_weights",
              remove_when="verl runs vLLM's post-load processing after update_weights (verl 0.9.1's "
                          "vLLM worker extension does) and the reshard is upstream")
def _async_update_weights(wrapped, instance, args, kwargs):
    from . import hooks_verl06
    return hooks_verl06.update_weights(wrapped, instance, args, kwargs)


@FEATURE.wrap("verl.workers.rollout.vllm_rollout.vllm_rollout_spmd:vLLMRollout.update_weights",
              dist="verl", versions=VERL06, order=50, enabled_by=_update_hook_wanted,
              name="moe_reshard.rollout_update_weights", params=("self", "weights"),
              reason=_UPDATE_REASON, replaces="recipe verl 0007-verl-bugfix-moe_update_weights",
              remove_when="verl runs vLLM's post-load processing after update_weights (verl 0.9.1's "
                          "vLLM worker extension does) and the reshard is upstream")
def _sync_update_weights(wrapped, instance, args, kwargs):
    from . import hooks_verl06
    return hooks_verl06.update_weights(wrapped, instance, args, kwargs)


def selftest_checks(ctx):
    """``ascend-rl selftest``: the executor's pack, exchange and unpack for every rank of several
    layouts in one process (loopback exchange) on the device: deliveries bit-identical to the
    reference experts, every buffer on the device (:mod:`.device_check`)."""
    from ...selftest import CheckResult
    from .device_check import run
    r = run(ctx.device, quick=ctx.quick)
    return [CheckResult("moe_reshard", "executor on the device (all ranks, loopback exchange)", r.ok, r.detail,
                        {"MB moved": r.bytes_moved / 1e6, "seconds": r.seconds,
                         "buffers on device": r.buffers_on_device})]
