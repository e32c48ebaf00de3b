"""Megatron-Bridge on a CPU machine without TransformerEngine (test support, not the product).

Megatron-Bridge 0.3.1 (installed ``--no-deps`` by ``.ci/stack.sh current``) imports
``transformer_engine.pytorch`` at module import (its LoRA layers), and TransformerEngine
cannot be installed here. :func:`import_megatron_bridge` makes it importable with the TE
*double* of ``tests/support/transformer_engine_double`` (README there), in an order that keeps
Megatron-Core on its local (non-TE) code paths:

1. Megatron-Core's modules that probe for TransformerEngine at import (``HAVE_TE``-style
   flags: layer specs, attention, MoE experts, tensor-parallel layers, optimizer, utils) are
   imported first, while ``import transformer_engine`` still fails -- so they record "no TE".
   Imported after the double, Megatron-Core would take TE paths (e.g. ``attention.py`` checks
   ``isinstance(..., TELinear)``) and fail.
2. Then the double's directory goes on ``sys.path`` and ``megatron.bridge`` is imported.
3. Every ``megatron.core`` module first loaded in step 2 is checked to have no true ``HAVE_TE``
   flag (the double leaked into none), else ``RuntimeError`` naming it. (Some modules set the
   flag true without TransformerEngine -- ``multi_latent_attention`` only probes Megatron-Core's
   own ``extensions.transformer_engine`` -- which is why step 1 imports them too.)

Where the real TransformerEngine is installed this does nothing special (the double is never
put on the path).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys

DOUBLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformer_engine_double")

# Megatron-Core modules whose import-time TransformerEngine probe must see "absent" (read in
# Megatron-Core 0.16.1: each does ``try: import transformer_engine ... HAVE_TE = True``)
TE_PROBING_MODULES = (
    "megatron.core.utils", "megatron.core.fp8_utils", "megatron.core.fp4_utils",
    "megatron.core.tensor_parallel.layers", "megatron.core.tensor_parallel.random",
    "megatron.core.transformer.attention", "megatron.core.transformer.mlp",
    "megatron.core.transformer.transformer_layer", "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.moe.experts", "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.moe_utils", "megatron.core.transformer.multi_token_prediction",
    "megatron.core.transformer.multi_latent_attention", "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs", "megatron.core.models.multimodal.llava_model",
    "megatron.core.optimizer", "megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer", "megatron.core.optimizer.optimizer_config",
    "megatron.core.dist_checkpointing.strategies.torch",
)


def real_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None and DOUBLE_PATH not in sys.path


def import_megatron_bridge():
    """``megatron.bridge``, importable on this machine (module docstring); returns the module."""
    if "megatron.bridge" in sys.modules:
        return sys.modules["megatron.bridge"]
    if importlib.util.find_spec("megatron.bridge") is None:
        raise ImportError("megatron-bridge is not installed in this stack (.ci/stack.sh current installs "
                          "megatron-bridge==0.3.1 --no-deps)")
    double = not real_transformer_engine()
    if double:
        for name in TE_PROBING_MODULES:
            importlib.import_module(name)
        sys.path.append(DOUBLE_PATH)
    before = set(sys.modules)
    bridge = importlib.import_module("megatron.bridge")
    leaked = sorted(n for n, m in list(sys.modules.items())
                    if double and n not in before and n.startswith("megatron.core") and getattr(m, "HAVE_TE", False))
    if leaked:
        raise RuntimeError(f"the TransformerEngine double reached Megatron-Core modules imported after it: {leaked}; "
                           "add them to tests.support.megatron_bridge.TE_PROBING_MODULES")
    return bridge


@contextlib.contextmanager
def module_cuda_stays_on_cpu():
    """Test shim for building a model through Megatron-Bridge on a CPU machine: while active,
    ``torch.nn.Module.cuda`` returns the module unchanged.

    Why: ``megatron.bridge.models.model_provider.get_model`` moves every model chunk to the
    current CUDA device unless ``use_cpu_initialization`` is passed to
    ``provide_distributed_model``, and verl 0.9.1's ``make_megatron_module`` does not pass it
    (the provider's own flag is overwritten with ``False`` there). On this machine the chunks
    are built on the CPU (``use_cpu_initialization`` in the layer config) and stay there; the
    shim changes where the parameters live, never a value."""
    import torch
    original = torch.nn.Module.cuda

    def stay(self, device=None):
        return self
    torch.nn.Module.cuda = stay
    try:
        yield
    finally:
        torch.nn.Module.cuda = original


@contextlib.contextmanager
def bridge_load_skips_unmapped_params():
    """Test shim for building a legacy ``GroupedMLP`` model through Megatron-Bridge 0.3.1: while
    active, ``MegatronModelBridge.build_conversion_tasks`` returns its task list without the
    ``None`` entries it leaves for parameters that have no mapping.

    Why: the bridge has no mapping for ``GroupedMLP``'s ``weight1`` / ``weight2`` (its Qwen3-MoE
    patterns name ``experts.linear_fc<N>.weight*`` (TEGroupedMLP) and
    ``experts.local_experts.*.linear_fc<N>.weight`` (SequentialMLP)), so their tasks stay ``None``
    and ``load_weights_hf_to_megatron`` fails on the first with ``AttributeError: 'NoneType'
    object has no attribute 'megatron_module'`` -- verl 0.9.1's ``MegatronEngine.initialize()``
    cannot build such a model at all (README of moe_reshard, upstream failure (b);
    ``test_verl09_mcore_engine.py`` pins it on the built engine with the shim off). With the
    shim the load skips exactly those parameters, as it already skips the ones it finds no HF
    tensor for, and loads every other one as stock does; the skipped ``weight1`` / ``weight2``
    keep their uninitialized storage until the test puts the checkpoint's experts in. Active
    only around ``initialize()``: the export path (``get_conversion_tasks``) stays stock.
    Changes which parameters the bridge loads, never a value it loads (the same tasks, in the
    same order, on every rank, so the collectives of the tasks kept still pair up)."""
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    original = MegatronModelBridge.build_conversion_tasks

    def mapped_only(self, hf_pretrained, megatron_model):
        return [task for task in original(self, hf_pretrained, megatron_model) if task is not None]
    MegatronModelBridge.build_conversion_tasks = mapped_only
    try:
        yield
    finally:
        MegatronModelBridge.build_conversion_tasks = original
