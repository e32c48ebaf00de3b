"""INT4 QAT: straight-through INT4 fake quantization in Megatron-Core's linears and experts.

With ``ASCEND_RL_INT4_QAT=1`` (slime: ``OPEN_TRAINING_INT4_FAKE_QAT_FLAG``) the forward of
``ColumnParallelLinear`` / ``RowParallelLinear`` (which ``SequentialMLP``'s experts are made of)
and of ``GroupedMLP`` uses ``quant.int4.fake_quantize(weight)`` -- the same quantizer, group
size and preset the W4A16 rollout weights come from -- and the backward passes the gradient
straight through to the master weight. Scope ``experts`` (slime's: routed experts only) or
``all`` (every linear of the decoder; never embedding, router or output layer).

Patches (all Megatron-Core >= 0.12, < 0.17):

- ``int4_qat.column_parallel_forward`` / ``int4_qat.row_parallel_forward`` (wrap): the layer's
  ``weight`` entry holds the straight-through fake-quantized tensor during the forward;
- ``int4_qat.grouped_mlp_forward`` (wrap): the same for ``weight1`` / ``weight2``, per expert
  in the rollout's ``[out, in]`` orientation; ``int4_qat.mindspeed_gmm_experts_forward`` the same
  for MindSpeed's ``GmmExpertsImpl`` (which replaces ``GroupedMLP`` on Ascend);
- ``int4_qat.gpt_output_layer`` (after ``GPTModel.__init__``): marks the output layer (a
  ``ColumnParallelLinear``) as never quantized, and refuses TransformerEngine linears in scope;
- ``int4_qat.config_check`` (after ``TransformerConfig.__post_init__``): every in-scope input
  dimension per partition must be a multiple of the group size -- a clear error at config time.

README.md beside this file: why, flags, formats per platform, verified where.

Remove when: Megatron-Core (or MindSpeed) offers INT4 fake-quant training whose quantizer is
bit-identical to the rollout's W4A16 checkpoint format.
"""

from __future__ import annotations

from ... import flags
from ...patching import Feature, Verified

SEED_ENABLE = "OPEN_TRAINING_INT4_FAKE_QAT_FLAG"
SEED_GROUP_SIZE = "OPEN_TRAINING_INT4_GROUP_SIZE"

ENABLE = flags.define(
    "ASCEND_RL_INT4_QAT", "bool", False,
    "Straight-through INT4 fake quantization (the W4A16 rollout's quantizer) in Megatron-Core's "
    "ColumnParallel/RowParallel linears, SequentialMLP and GroupedMLP experts.",
    aliases=(SEED_ENABLE,), feature="int4_qat")
GROUP_SIZE = flags.define(
    "ASCEND_RL_INT4_QAT_GROUP_SIZE", "enum", "128",
    "Input columns per INT4 scale; must equal the rollout checkpoint's group size (slime: 128 for "
    "most models, 32 for Kimi-K2).", aliases=(SEED_GROUP_SIZE,), choices=("32", "64", "128"),
    feature="int4_qat")
SCOPE = flags.define(
    "ASCEND_RL_INT4_QAT_SCOPE", "enum", "experts",
    "Which weights are fake-quantized: 'experts' (routed experts only, slime's INT4 scope) or 'all' "
    "(every decoder linear and expert; embedding, router and output layer never).",
    choices=("experts", "all"), feature="int4_qat")
PRESET = flags.define(
    "ASCEND_RL_INT4_QAT_PRESET", "enum", "ct",
    "INT4 formula (ascend_rl_plugins.quant.int4 presets): 'ct' (compressed-tensors W4A16, what vLLM loads) or "
    "'slime' (slime's scale amax/7 in bf16, codes -7..7). Unset: 'slime' when QAT was switched on "
    "with OPEN_TRAINING_INT4_FAKE_QAT_FLAG, else 'ct'. Must equal the rollout's preset.",
    choices=("ct", "slime"), feature="int4_qat")
FAKE_WEIGHT_CACHE = flags.define(
    "ASCEND_RL_INT4_QAT_FAKE_WEIGHT_CACHE", "enum", "off",
    "'step': fake-quantize each weight once per optimizer step and reuse it in every training "
    "micro-batch and recompute forward of that step (exact: the same tensor); costs up to one copy of "
    "the in-scope weights between micro-batches (fake_weight_cache.py). 'off': on every forward.",
    choices=("off", "step"), feature="int4_qat")

FINITE_CHECK = flags.define(
    "ASCEND_RL_INT4_QAT_FINITE_CHECK", "enum", "step",
    "When a non-finite (NaN/inf) weight is refused on an accelerator: 'step' reads every fake "
    "quantization's verdict at once before the optimizer step (one synchronization per step; the error "
    "names every such layer); 'immediate' at each layer's forward (one synchronization per layer). Both "
    "refuse; CPUs always check immediately (finite_checks.py).",
    choices=("step", "immediate"), feature="int4_qat")

FEATURE = Feature(
    "int4_qat", "INT4 quantization-aware training (straight-through fake quant) on Megatron-Core, "
                "bit-identical to the W4A16 rollout weights.",
    flag=ENABLE, replaces="slime's OPEN_TRAINING_INT4_FAKE_QAT_FLAG fake quantization (its own formula, "
                          "which differs from its rollout quantizer)",
    verified=Verified(
        cpu_runtime="real Megatron-Core GPTModel (0.12.1 and 0.16.1), bf16, on 2 gloo processes: TP2 dense "
                    "(ColumnParallel/RowParallel), EP2 SequentialMLP and EP2 GroupedMLP experts: the QAT "
                    "forward equals the model with fake-quantized weights bit for bit, gradients are "
                    "straight-through, exported weights quantize to codes/scales that dequantize to the "
                    "trainer's forward weights bit for bit; Megatron-Core 0.16.1 QAT weights reloaded in "
                    "place (flashrl) into a real vLLM 0.23 CPU W4A16 engine: the engine's codes/scales and "
                    "the weights its kernel multiplies by equal the trainer's, bit for bit",
        doubles="Megatron's fused weight-gradient kernel (fused_weight_gradient_mlp_cuda, "
                "gradient_accumulation_fusion) by a CPU double of its contract",
        static="MindSpeed 028de58's GmmExpertsImpl (replaces GroupedMLP on Ascend); TransformerEngine "
               "linears are refused (not installable here; MindSpeed on Ascend builds local-spec layers)"),
    stacks="recipe, current")

MEGATRON_RANGE = ">=0.12,<0.17"
LAYERS = "megatron.core.tensor_parallel.layers"
EXPERTS = "megatron.core.transformer.moe.experts"
REMOVE_WHEN = ("Megatron-Core or MindSpeed ships INT4 fake-quant training whose quantizer is bit-identical "
               "to the rollout's W4A16 format")
EXCLUDE_ATTR = "_ascend_rl_int4_qat_exclude"


def group_size() -> int:
    return int(GROUP_SIZE.value)


def preset() -> str:
    """The flag's value when set; otherwise slime's formula when QAT came on through slime's
    variable (a launch script written for slime expects slime's numbers), else ``ct``."""
    if PRESET.explicitly_set:
        return PRESET.value
    return "slime" if flags.source_of(ENABLE) == SEED_ENABLE else "ct"


def spec():
    from ...quant.int4 import Int4Spec
    return Int4Spec(group_size=group_size(), preset=preset())


def defer_finite_checks() -> bool:
    return FINITE_CHECK.value == "step"


def fake_weight_cache_enabled() -> bool:
    return FAKE_WEIGHT_CACHE.value == "step"


def scope() -> str:
    return SCOPE.value


def linear_in_scope(layer) -> bool:
    """A Column/RowParallelLinear is fake-quantized: experts always, others under scope ``all``
    (never a layer marked excluded: GPTModel's output layer)."""
    if getattr(layer, EXCLUDE_ATTR, False):
        return False
    return bool(getattr(layer, "is_expert", False)) or scope() == "all"


def _param_names(args, kwargs, names):
    return {n: (args[i] if i < len(args) else kwargs.get(n)) for i, n in enumerate(names)}


def _linear_forward(wrapped, instance, args, kwargs):
    if instance is None or not linear_in_scope(instance) or instance._parameters.get("weight") is None:
        return wrapped(*args, **kwargs)
    if _param_names(args, kwargs, ("input_", "weight"))["weight"] is not None:
        return wrapped(*args, **kwargs)   # a weight supplied by the caller (tied output layer)
    from .fake_quant import already_replaced, fake_parameters, linear_replacements
    if already_replaced(instance, ("weight",)):
        return wrapped(*args, **kwargs)
    with fake_parameters(instance, linear_replacements(instance, spec())):
        return wrapped(*args, **kwargs)


def _row_forward(wrapped, instance, args, kwargs):
    if instance is None or not linear_in_scope(instance) or instance._parameters.get("weight") is None:
        return wrapped(*args, **kwargs)
    from .fake_quant import already_replaced, fake_parameters, linear_replacements
    if already_replaced(instance, ("weight",)):
        return wrapped(*args, **kwargs)
    with fake_parameters(instance, linear_replacements(instance, spec())):
        return wrapped(*args, **kwargs)


def _grouped_forward(wrapped, instance, args, kwargs):
    if instance is None:
        return wrapped(*args, **kwargs)
    from .fake_quant import already_replaced, fake_parameters, grouped_replacements
    if already_replaced(instance, ("weight1", "weight2")):
        return wrapped(*args, **kwargs)
    with fake_parameters(instance, grouped_replacements(instance, spec())):
        return wrapped(*args, **kwargs)


FEATURE.wrap(f"{LAYERS}:ColumnParallelLinear.forward", _linear_forward, name="int4_qat.column_parallel_forward",
             dist="megatron-core", versions=MEGATRON_RANGE, order=60, params=("self", "input_", "weight"),
             reason="QAT: the column-parallel linear (QKV, fc1 of dense MLPs and of SequentialMLP experts) "
                    "computes with the INT4 fake-quantized weight, gradient straight through",
             remove_when=REMOVE_WHEN)
FEATURE.wrap(f"{LAYERS}:RowParallelLinear.forward", _row_forward, name="int4_qat.row_parallel_forward",
             dist="megatron-core", versions=MEGATRON_RANGE, order=60, params=("self", "input_"),
             reason="QAT: the row-parallel linear (attention output, fc2 of dense MLPs and of "
                    "SequentialMLP experts) computes with the INT4 fake-quantized weight",
             remove_when=REMOVE_WHEN)
FEATURE.wrap(f"{EXPERTS}:GroupedMLP.forward", _grouped_forward, name="int4_qat.grouped_mlp_forward",
             dist="megatron-core", versions=MEGATRON_RANGE, order=60,
             params=("self", "permuted_local_hidden_states", "tokens_per_expert"),
             reason="QAT: GroupedMLP's weight1/weight2 are fake-quantized per expert in the rollout's "
                    "[out, in] orientation (groups along each expert's input dimension)",
             remove_when=REMOVE_WHEN)


# MindSpeed (Ascend) replaces GroupedMLP by MindSpeedGmmExperts(GmmExpertsImpl, GroupedMLP) when
# --moe-grouped-gemm is set; GmmExpertsImpl.forward comes first in its MRO and reads self.weight1 /
# self.weight2 as GroupedMLP does, so the same wrapper covers it.
FEATURE.wrap("mindspeed.core.transformer.moe.moe_feature.gmm.experts:GmmExpertsImpl.forward", _grouped_forward,
             name="int4_qat.mindspeed_gmm_experts_forward", dist="mindspeed", versions=">=0.12,<0.17", order=60,
             params=("self", "permuted_local_hidden_states", "tokens_per_expert"),
             reason="QAT on Ascend: MindSpeed's grouped-GEMM experts (which replace GroupedMLP under "
                    "--moe-grouped-gemm) are fake-quantized like GroupedMLP",
             remove_when=REMOVE_WHEN)


def te_layers_in_scope(model) -> list[str]:
    """Names of TransformerEngine linears QAT would have to cover (it does not)."""
    out = []
    for name, module in model.named_modules():
        cls = type(module)
        if not cls.__module__.startswith("megatron.core.extensions.transformer_engine"):
            continue
        if "Linear" not in cls.__name__ or getattr(module, EXCLUDE_ATTR, False):
            continue
        if scope() == "all" or getattr(module, "is_expert", False) or "experts" in name:
            out.append(f"{name} ({cls.__name__})")
    return out


def _mark_output_layer(result, instance, args, kwargs):
    layer = getattr(instance, "output_layer", None)
    if layer is not None:
        setattr(layer, EXCLUDE_ATTR, True)
    te = te_layers_in_scope(instance)
    if te:
        from .fake_quant import Int4QatError
        raise Int4QatError(
            "ASCEND_RL_INT4_QAT covers Megatron-Core's local layers (ColumnParallelLinear, RowParallelLinear, "
            "SequentialMLP, GroupedMLP), not TransformerEngine's; this model has TE linears in scope: "
            + ", ".join(te[:4]) + (" ..." if len(te) > 4 else "")
            + ". Build it with the local layer spec (as MindSpeed does on Ascend) or switch QAT off.")
    return result


# order 60: after hdp.model_support (order 40), which only reads the config; this one marks the
# built model's output layer, whatever ran before it.
FEATURE.after("megatron.core.models.gpt.gpt_model:GPTModel.__init__", _mark_output_layer,
              name="int4_qat.gpt_output_layer", order=60, dist="megatron-core", versions=MEGATRON_RANGE,
              params=("self", "config", "transformer_layer_spec"),
              reason="the output layer is a ColumnParallelLinear that must stay high precision (as the "
                     "rollout's lm_head), and TransformerEngine linears are not covered by QAT",
              remove_when=REMOVE_WHEN)


def config_problems(config, group: int, which: str) -> list[str]:
    """In-scope input dimensions per partition of a TransformerConfig that are not a multiple of
    ``group`` (empty: fine)."""
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    etp = getattr(config, "expert_tensor_parallel_size", None) or tp
    dims = []
    if getattr(config, "num_moe_experts", None):
        moe_ffn = getattr(config, "moe_ffn_hidden_size", None) or config.ffn_hidden_size
        dims += [("hidden_size (expert fc1 input)", config.hidden_size, 1),
                 ("moe_ffn_hidden_size / expert_tensor_parallel_size (expert fc2 input)", moe_ffn, etp)]
    if which == "all":
        dims += [("hidden_size (qkv / fc1 input)", config.hidden_size, 1),
                 ("num_attention_heads * kv_channels / tensor_model_parallel_size (attention output input)",
                  config.num_attention_heads * (config.kv_channels or config.hidden_size // config.num_attention_heads),
                  tp)]
        if config.ffn_hidden_size:
            dims.append(("ffn_hidden_size / tensor_model_parallel_size (dense fc2 input)", config.ffn_hidden_size, tp))
        shared = getattr(config, "moe_shared_expert_intermediate_size", None)
        if shared:
            dims.append(("moe_shared_expert_intermediate_size / tensor_model_parallel_size (shared expert fc2 "
                         "input)", shared, tp))
    out = []
    for what, size, parts in dims:
        if size % parts or (size // parts) % group:
            out.append(f"{what} = {size} / {parts}")
    return out


def _check_config(result, instance, args, kwargs):
    problems = config_problems(instance, group_size(), scope())
    if problems:
        from .fake_quant import Int4QatError
        raise Int4QatError(
            f"ASCEND_RL_INT4_QAT_GROUP_SIZE={group_size()} (scope {scope()}) does not divide every quantized "
            f"input dimension per partition: {'; '.join(dict.fromkeys(problems))}. Accepted group sizes: 32, 64, "
            "128 -- pick one that divides these, or change the parallel sizes.")
    return result


FEATURE.after("megatron.core.transformer.transformer_config:TransformerConfig.__post_init__", _check_config,
              name="int4_qat.config_check", dist="megatron-core", versions=MEGATRON_RANGE, params=("self",),
              reason="a tensor-parallel shard must hold whole INT4 groups (in_features per partition % group "
                     "size == 0); fail when the model is configured, not in the first forward",
              remove_when=REMOVE_WHEN)



def selftest_checks(ctx):
    """``ascend-rl selftest``: fake quantization on the device, bit-identical to the CPU kernel and
    cheap next to the layer's matmul (:mod:`.device_check`)."""
    from .device_check import run
    return run(ctx)
