"""Rollout engine options: speculative decoding and graph options of verl 0.6's vLLM rollout.

verl 0.6.1 passes ``actor_rollout_ref.rollout.engine_kwargs.vllm`` to ``vllm.LLM(...)``, yet
speculative decoding configured there drafts nothing (verl asks vLLM for ``logprobs=0``, which
excludes every request from drafting), ``rollout.cudagraph_capture_sizes`` never reaches the
engine, and npugraph_ex needs a graph mode and a release-specific switch. Two patches:

* ``verl.utils.config.validate_config`` (the trainer's config check, before any worker starts):
  the engine options are checked there, errors name the config key and the accepted values;
* ``vLLMRollout.__init__``: the same check, then the engine is built from a copy of the
  rollout config with the merged options (capture sizes in ``compilation_config``, npugraph_ex
  switched on the way the installed vLLM-Ascend reads it, a FULL graph for it), and with
  speculative decoding the rollout's sampling parameters stop asking for logprobs.

The logic is in ``options.py`` (no heavy import at module level). README.md beside this file:
why, flags, verified where.

Remove when: running verl >= 0.9 (server rollout; its engine options are passed differently).
"""

from __future__ import annotations

import logging

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_ROLLOUT_ENGINE_OPTIONS", "bool", True,
    "Check verl 0.6's vLLM rollout engine options (engine_kwargs.vllm: speculative_config, "
    "compilation_config, additional_config; cudagraph_capture_sizes) at config time and make "
    "them take effect: speculative decoding without logprobs, capture sizes passed to vLLM.",
    feature="rollout_engine_options")
NPUGRAPH_EX = flags.define(
    "ASCEND_RL_ROLLOUT_ENGINE_OPTIONS_NPUGRAPH_EX", "bool", False,
    "Build the rollout engine with vLLM-Ascend's npugraph_ex graph backend (needs "
    "rollout.enforce_eager=False; uses cudagraph_mode FULL unless compilation_config sets "
    "FULL or FULL_DECODE_ONLY), as the recipe's rollout always did.",
    feature="rollout_engine_options")
STATIC_KERNEL = flags.define(
    "ASCEND_RL_ROLLOUT_ENGINE_OPTIONS_NPUGRAPH_EX_STATIC_KERNEL", "bool", False,
    "With ASCEND_RL_ROLLOUT_ENGINE_OPTIONS_NPUGRAPH_EX: static-shape kernels. vLLM-Ascend 0.13 "
    "always builds them under npugraph_ex; later releases read ascend_compilation_config."
    "enable_static_kernel, which this sets.",
    aliases=("NPUGRAPH_EX_ENABLE_STATIC_KERNEL",), feature="rollout_engine_options")

FEATURE = Feature(
    "rollout_engine_options",
    "verl 0.6 rollout: speculative decoding and graph options checked at config time and effective.",
    flag=ENABLE,
    requires=("sam",),   # reads SAM's switch (whether method 'sam' is accepted)
    replaces="the recipe's verl patch 0012-verl-feature-enabled_sam_spec_decode / "
             "0012-verl-feature-npugraph_ex_for_spec_decode",
    verified=Verified(
        cpu_runtime="real verl 0.6.1 vLLMRollout with SAM speculative decoding (vLLM 0.13 on CPU): drafts "
                    "scheduled only with the patch; LLM keyword arguments of the real constructor "
                    "recorded for capture sizes and npugraph_ex (LLM intercepted); real validate_config",
        static="vLLM-Ascend 0.13 / 0.23 read the npugraph_ex switch this writes"),
    stacks="recipe")

VERL_RANGE = ">=0.6,<0.9"
REMOVE_WHEN = "verl 0.6 (the SPMD vLLMRollout) is no longer run"
log = logging.getLogger("ascend_rl_plugins")


def request():
    """What the flags ask for (ascend-rl side of the options)."""
    from .options import Request
    sam = FEATURE.required("sam").flag   # ASCEND_RL_SAM
    return Request(npugraph_ex=bool(NPUGRAPH_EX.value), static_kernel=bool(STATIC_KERNEL.value),
                   sam=bool(sam.value))


def plan_for(rollout):
    """Check ``rollout`` (verl's rollout config) against the installed vLLM; the plan to build with.
    vLLM is imported (for the names it accepts) only when the config sets the option concerned."""
    from . import options
    from ...patching import versions
    found = versions.installed_version("vllm", "vllm")
    req = request()
    engine = (rollout.get("engine_kwargs", None) or {}).get("vllm", None) or {}
    asks = set(engine) if hasattr(engine, "keys") else set()
    return options.plan(rollout, req, vllm_version=found[1] if found else None,
                        methods=options.accepted_methods(req.sam) if "speculative_config" in asks else None,
                        graph_modes=options.accepted_graph_modes() if "compilation_config" in asks else None)


def _is_vllm_sync(rollout) -> bool:
    get = rollout.get
    return get("name", None) == "vllm" and get("mode", "sync") == "sync"


@FEATURE.after("verl.utils.config:validate_config", name="rollout_engine_options.validate_config",
               dist="verl", versions=VERL_RANGE, params=("config",), order=50,
               reason="check the rollout's engine options with the rest of the trainer config, in the "
                      "driver, before any rollout worker starts",
               replaces="recipe verl 0012 (no checks)", remove_when=REMOVE_WHEN)
def _check_trainer_config(result, instance, args, kwargs):
    config = args[0] if args else kwargs["config"]
    rollout = config.actor_rollout_ref.rollout
    if _is_vllm_sync(rollout):
        plan_for(rollout)
    return result


@FEATURE.wrap("verl.workers.rollout.vllm_rollout.vllm_rollout_spmd:vLLMRollout.__init__",
              name="rollout_engine_options.vllm_rollout_init", dist="verl", versions=VERL_RANGE, order=50,
              params=("self", "config", "model_config", "device_mesh"),
              reason="build the rollout engine with the checked, merged engine options; with "
                     "speculative decoding, stop asking vLLM for logprobs (it drafts nothing for "
                     "requests that do)",
              replaces="recipe verl 0012 (edits vLLMRollout.__init__)", remove_when=REMOVE_WHEN)
def _build_with_engine_options(wrapped, instance, args, kwargs):
    from .options import with_engine_options
    config = args[0] if args else kwargs["config"]
    plan = plan_for(config)
    config = with_engine_options(config, plan)
    if args:
        args = (config,) + tuple(args[1:])
    else:
        kwargs = dict(kwargs, config=config)
    result = wrapped(*args, **kwargs)
    params = getattr(instance, "sampling_params", None)
    if plan.speculative and params is not None and params.logprobs is not None:
        params.logprobs = None
        log.info("ascend-rl rollout_engine_options: speculative decoding configured, rollout requests "
                 "no longer ask for logprobs (vLLM drafts nothing for requests that do)")
    return result
