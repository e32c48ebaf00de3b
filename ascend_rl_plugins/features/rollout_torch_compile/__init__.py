"""Rollout torch.compile: vLLM gets the real ``torch.compile`` although MindSpeed replaced it.

MindSpeed (``features_manager/megatron_basic/requirements_basic.py``) registers
``torch.compile -> dummy_compile`` with its ``MindSpeedPatchesManager`` and installs it in
``torch`` and in every module that holds a copy; verl 0.6's Megatron worker builds the vLLM
rollout engine in the same process (``ActorRolloutRefWorker._build_rollout``), so vLLM's graph
compilation gets the no-op. ``_build_rollout`` is wrapped: while it runs, every place that holds
MindSpeed's installed replacement gets the original back (MindSpeed keeps both on its patch
record: ``orig_func``, ``final_patch_func``); afterwards MindSpeed's replacement is put back
where the original still sits, so training keeps MindSpeed's behaviour.

Without MindSpeed loaded (no ``mindspeed.patch_utils`` module, or no applied ``torch.compile``
patch) this does nothing and imports nothing. README.md beside this file: why, flags,
verified where.

Remove when: MindSpeed stops replacing torch.compile process-wide, or verl builds the rollout
engine outside the training process (verl 0.9 does).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_ROLLOUT_TORCH_COMPILE", "bool", True,
    "While verl 0.6's Megatron worker builds the vLLM rollout, give torch.compile back its real "
    "function where MindSpeed replaced it with a no-op, and re-install MindSpeed's afterwards. "
    "Does nothing unless MindSpeed has patched torch.compile.",
    feature="rollout_torch_compile")

FEATURE = Feature(
    "rollout_torch_compile", "Real torch.compile for the vLLM rollout under MindSpeed (verl 0.6).",
    flag=ENABLE, replaces="the recipe's verl patch 0008-verl-bugfix-enable_compile",
    verified=Verified(cpu_runtime="real verl 0.6.1 ActorRolloutRefWorker._build_rollout (a probe rollout "
                                  "registered in verl's rollout registry; RNG calls of the CPU device "
                                  "shimmed); a no-op without MindSpeed",
                      doubles="MindSpeed's patch manager, dummy_compile and megatron_adaptor "
                              "(tests/doubles/mindspeed_double)",
                      static="MindSpeed 028de58: the patch record, its attributes and the "
                             "torch.compile registration"),
    stacks="recipe + MindSpeed")

MINDSPEED_PATCH_KEY = "torch.compile"  # the name MindSpeed registers its replacement under
log = logging.getLogger("ascend_rl_plugins")


def mindspeed_compile_patch():
    """(real, installed replacement) from MindSpeed's applied ``torch.compile`` patch, or None
    when MindSpeed is not loaded or has not replaced ``torch.compile``. Imports nothing."""
    patch_utils = sys.modules.get("mindspeed.patch_utils")
    manager = getattr(patch_utils, "MindSpeedPatchesManager", None)
    record = (getattr(manager, "patches_info", None) or {}).get(MINDSPEED_PATCH_KEY)
    if record is None:
        return None
    applied = getattr(record, "is_applied", False)
    if callable(applied):  # an attribute in MindSpeed 028de58; tolerate a method
        applied = applied()
    real, installed = getattr(record, "orig_func", None), getattr(record, "final_patch_func", None)
    if not applied or real is None or installed is None or real is installed:
        return None
    return real, installed


@contextlib.contextmanager
def real_torch_compile():
    """Inside: every module attribute ``compile`` that holds MindSpeed's replacement holds the
    real ``torch.compile``; after: the replacement again, wherever the real one still sits."""
    found = mindspeed_compile_patch()
    if found is None:
        yield
        return
    real, installed = found
    swapped = [mod for mod in list(sys.modules.values())
               if isinstance(mod, types.ModuleType) and vars(mod).get("compile") is installed]
    for mod in swapped:
        mod.compile = real
    log.debug("ascend-rl rollout_torch_compile: real torch.compile in %d module(s) for the rollout build",
              len(swapped))
    try:
        yield
    finally:
        for mod in swapped:
            if vars(mod).get("compile") is real:
                mod.compile = installed


@FEATURE.wrap("verl.workers.megatron_workers:ActorRolloutRefWorker._build_rollout",
              name="rollout_torch_compile.build_rollout", dist="verl", versions=">=0.6,<0.9", order=50,
              params=("self",),
              reason="MindSpeed replaces torch.compile with a no-op process-wide; verl 0.6 builds the "
                     "vLLM engine in the training process, so vLLM's graph compilation would get it",
              replaces="recipe verl 0008 (removes MindSpeed's patch at import, swaps torch.compile in "
                       "_build_rollout)",
              fixed_upstream="verl 0.9 (the vLLM engine runs in its own server process, without MindSpeed)",
              remove_when="MindSpeed no longer replaces torch.compile process-wide, or verl builds the "
                          "rollout engine outside the training process (verl 0.9)")
def _build_rollout_with_real_compile(wrapped, instance, args, kwargs):
    with real_torch_compile():
        return wrapped(*args, **kwargs)
