"""FlashRL: INT8 / FP8 (W8A8) and W4A16 rollout with online quantization of every weight update.

Why these patches exist: the Qwen3 RL recipe's docs 000/001 run RL rollouts in INT8 with FlashRL
(``flash-llm-rl``), which is CUDA-bound, edits ``usercustomize.py``, replaces
``BaseModelLoader.load_model`` with a 2-argument version that breaks on vLLM 0.23, and
copies raw storage with ``as_strided`` (wrong for oneDNN-prepacked CPU weights and for
vLLM-Ascend's NZ weights). Here the same capability is a set of small, version-ranged
hooks: the engine serves the W8A8 checkpoint named by the config, each BF16 weight update
is quantized online and reloaded through the quant method's own post-processing, and the
lm_head may be kept in float32.

W4A16 (seed doc 002's INT4 rollout): the engine serves a compressed-tensors pack-quantized
checkpoint on vLLM's CPUWNA16 kernel; updates are quantized with the converter's
``int4.quantize_pack`` and written straight into the kernel's post-processed storage.
Block FP8 (128x128) runs where vLLM serves it on CPU (0.23, AMX: CPUFp8BlockScaledMMKernel);
updates are quantized with the converter's ``block_fp8.quantize`` and written, VNNI-packed,
into the kernel's storage. It is refused at engine start elsewhere (vLLM 0.13, no AMX,
vLLM-Ascend, which keeps power-of-two block scales only).

When they can be removed: when vLLM's layerwise weight reload (0.23's
``model_loader/reload``) accepts BF16 updates for compressed-tensors INT8 layers with
an online quantization hook (then only the profile/quantizer remain), and verl drives it.

Heavy imports (torch, vllm, numba) happen only inside the hooks and submodules.
"""

from __future__ import annotations

import logging
import os

from ... import flags
from ...patching import Feature, Verified
# ASCEND_RL_FLASHRL_DEVICE_FUSED is declared by the quantizers it switches (INT4 QAT runs them
# too); it is listed as flashrl's and read here as flashrl.DEVICE_FUSED, as before
from ...quant.fused import DEVICE_FUSED  # noqa: F401

log = logging.getLogger("ascend_rl_plugins.flashrl")

CONFIG = flags.define(
    "ASCEND_RL_FLASHRL", "str", "",
    "FlashRL rollout: a config file written by `ascend-rl flashrl setup` (rank r uses config r mod n; "
    "fn int8*, fp8_channel/fp8_tensor, w4a16 or fp8_block), or the preset 'bf16'; empty = off. 'int8' and 'fp8' "
    "need a config file (it names the quantized checkpoint); a format the platform cannot serve (FP8 W8A8 or "
    "W4A16 on vLLM 0.13 CPU, block FP8 on vLLM-Ascend, vLLM 0.13 or a CPU without AMX ...) fails at engine start naming what is supported.",
    aliases=("FLASHRL_CONFIG",), feature="flashrl")
LOGGING_LEVEL = flags.define(
    "ASCEND_RL_FLASHRL_LOGGING_LEVEL", "enum", "info",
    "Log level of the ascend_rl_plugins.flashrl logger (config selection, reload statistics).",
    aliases=("FLASHRL_LOGGING_LEVEL",), choices=("debug", "info", "warning", "error"), feature="flashrl")
LMHEAD_FP32 = flags.define(
    "ASCEND_RL_FLASHRL_LMHEAD_FP32", "bool", False,
    "Keep lm_head in float32 (weights and logits), unquantized, so rollout log-probs used by truncated "
    "importance sampling lose no precision.",
    aliases=("FLASHRL_LMHEAD_FP32",), feature="flashrl")

INT4_GROUP_SIZE = flags.define(
    "ASCEND_RL_FLASHRL_INT4_GROUP_SIZE", "enum", "auto",
    "W4A16 rollout (fn w4a16): the INT4 group size the trainer uses (QAT); the served checkpoint must have it, "
    "else engine start fails naming both. 'auto': take the checkpoint's group size.",
    choices=("auto", "32", "64", "128"), feature="flashrl")
INT4_PRESET = flags.define(
    "ASCEND_RL_FLASHRL_INT4_PRESET", "enum", "ct",
    "W4A16 rollout: the INT4 quantizer formula of the online re-quantization, which must be the one the "
    "checkpoint was written with (`ascend-rl flashrl quantize --fn w4a16`): 'ct' (compressed-tensors, "
    "scale = amax/7.5, codes -8..7) or 'slime' (scale = bf16(amax/7), codes -7..7).",
    choices=("ct", "slime"), feature="flashrl")

FEATURE = Feature("flashrl", "INT8/FP8 W8A8 and W4A16 rollout with online-quantized weight reload (FlashRL)",
                  flag=CONFIG,
                  replaces="Qwen3 RL recipe docs 000/001 (FlashRL: flash-llm-rl profile/setup, FLASHRL_CONFIG); "
                           "seed doc 002's INT4 (W4A16) rollout",
                  verified=Verified(
                      cpu_runtime="vLLM 0.23's real oneDNN int8 kernel, real CPUWNA16 W4A16 kernel and real "
                                  "AMX block-FP8 kernel (CPUFp8BlockScaledMMKernel); verl "
                                  "0.9.1's real bucketed update path on vLLM 0.23",
                      doubles="vLLM 0.13 with a torch double of the oneDNN int8 ops missing from its "
                              "CPU wheel; FP8 on vLLM 0.23 with its capability check doubled; vLLM-Ascend "
                              "block-FP8 refusal on a signature-checked double",
                      static="vLLM-Ascend W8A8 layout hooks (0.13, 0.23), block-FP8 refusal target (0.23)"),
                  stacks="recipe, current")

_LM_HEAD_UPSTREAM = "https://github.com/vllm-project/vllm/pull/48390"  # head_dtype for generation models
INDEX_ENV = "_ASCEND_RL_FLASHRL_INDEX"  # the selected config, passed from the engine to its workers
_selected: dict = {}


def _configure_logging() -> None:
    log.setLevel(LOGGING_LEVEL.value.upper())
    if not log.handlers and not logging.getLogger("ascend_rl_plugins").handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)


def active_config(model_parallel_size: int | None = None):
    """(index, RolloutConfig) for this process, validated (raises ConfigError)."""
    if "cfg" in _selected:
        return _selected["cfg"]
    from . import config as cfgmod
    _configure_logging()
    configs = cfgmod.load_configs(CONFIG.value)
    raw = os.environ.get(INDEX_ENV)
    if raw is not None and model_parallel_size is None:
        index = int(raw) % len(configs)
    else:
        index, _ = cfgmod.select(configs, cfgmod.dp_rank(model_parallel_size or 1))
    chosen = configs[index]
    chosen.validate(f"{CONFIG.name} configs[{index}]")
    os.environ[INDEX_ENV] = str(index)
    log.info("flashrl: using config %d of %d: fn=%s model=%s profile=%s", index, len(configs), chosen.fn,
             chosen.model, chosen.profile)
    _selected["cfg"] = (index, chosen)
    return _selected["cfg"]


@FEATURE.before("vllm.engine.arg_utils:EngineArgs.create_engine_config", name="flashrl.engine_args",
                dist="vllm", versions=">=0.13,<0.24", order=40, params=("self",),
                reason="serve the W8A8 checkpoint named by this rank's FlashRL config instead of the BF16 "
                       "path the trainer passes, and fail at engine start on a bad config/profile (not "
                       "__post_init__: vLLM loads its general plugins inside __post_init__, so a hook there "
                       "misses the first engine when the plugin entry point is the only activation)",
                replaces="FlashRL patch_vllm_llm (LLM.__init__ model/load_format override)",
                remove_when="verl passes the quantized checkpoint and load format itself")
def _flashrl_engine_args(instance, args, kwargs):
    tp = int(getattr(instance, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(instance, "pipeline_parallel_size", 1) or 1)
    _selected.clear()
    os.environ.pop(INDEX_ENV, None)
    _, cfg = active_config(tp * pp)
    if cfg.is_fp8:
        from .config import ConfigError
        from .fp8_support import fp8_support
        from .profile import FP8_FNS
        ok, why = fp8_support(FP8_FNS[cfg.fn])
        if not ok:
            raise ConfigError(f"{CONFIG.name}={CONFIG.value} selects fn={cfg.fn!r} (FP8 W8A8 rollout), which this "
                              f"platform cannot serve: {why}. Supported here: int8 configs (`ascend-rl flashrl "
                              f"setup -m W8A8 -p PROFILE --fn int8`) and bf16.")
    if cfg.is_int4 or cfg.is_block_fp8:
        _check_low_precision(cfg)
    if cfg.is_quantized:
        stacked = _verl_fp8_rollout(instance)
        if stacked:
            from .config import ConfigError
            raise ConfigError(f"{CONFIG.name}={CONFIG.value} selects fn={cfg.fn!r} (flashrl's quantized rollout with "
                              f"online re-quantization) while {stacked}; the two would quantize the same updates "
                              f"twice. Use one: unset {CONFIG.name}, or drop verl's actor_rollout_ref.rollout."
                              f"quantization=fp8.")
    if cfg.is_quantized and cfg.model and os.path.abspath(str(instance.model)) != os.path.abspath(cfg.model):
        log.info("flashrl: serving %s (W8A8) instead of %s", cfg.model, instance.model)
        if getattr(instance, "tokenizer", None) in (None, ""):
            instance.tokenizer = instance.model
        instance.model = cfg.model
    if cfg.is_quantized and cfg.load_format:
        instance.load_format = cfg.load_format
    return None


def _check_low_precision(cfg) -> None:
    """fn w4a16 / fp8_block: refuse at engine start where the platform cannot serve them."""
    from .config import ConfigError
    from .fp8_support import ALTERNATIVES, block_fp8_support, w4a16_support
    if cfg.is_int4:
        ok, why = w4a16_support()
        if not ok:
            raise ConfigError(f"{CONFIG.name}={CONFIG.value} selects fn='w4a16' (W4A16 rollout), which this platform "
                              f"cannot serve with flashrl's reload: {why}. Supported here instead: {ALTERNATIVES}.")
        return
    ok, why = block_fp8_support()
    if ok:  # vLLM 0.23 CPU with AMX: flashrl writes each update straight into the kernel's storage
        log.info("flashrl: block FP8 served here: %s", why)
        return
    raise ConfigError(f"{CONFIG.name}={CONFIG.value} selects fn='fp8_block' (128x128 block FP8 rollout), which is "
                      f"refused here: {why}. Supported instead: {ALTERNATIVES}, and W4A16 (--fn w4a16) on vLLM 0.23 "
                      f"CPU.")


def _verl_fp8_rollout(instance) -> str | None:
    """Whether verl 0.9.1's own FP8 rollout is on for this engine (what to call it), else None.
    verl's vLLM server sets VERL_VLLM_FP8_QUANT_ENABLED=1 and injects an fp8 quantization_config
    through hf_overrides (``rollout.quantization=fp8``)."""
    if os.environ.get("VERL_VLLM_FP8_QUANT_ENABLED", "0") == "1":
        return "verl's FP8 rollout is on (VERL_VLLM_FP8_QUANT_ENABLED=1: actor_rollout_ref.rollout.quantization=fp8)"
    if str(getattr(instance, "quantization", None) or "") == "fp8":
        return "the engine is asked for vLLM's own online FP8 quantization (quantization='fp8', verl's FP8 rollout)"
    overrides = getattr(instance, "hf_overrides", None)
    qc = overrides.get("quantization_config") if isinstance(overrides, dict) else None
    if isinstance(qc, dict) and qc.get("quant_method") == "fp8":
        return "hf_overrides inject an fp8 quantization_config (verl's FP8 rollout)"
    return None


@FEATURE.wrap("vllm.model_executor.model_loader.utils:process_weights_after_loading",
              name="flashrl.process_weights_after_loading", dist="vllm", versions=">=0.13,<0.24", order=40,
              params=("model", "model_config", "target_device"),
              reason="remember each quantized layer's checkpoint-layout parameters before the quant method "
                     "post-processes them, then wrap model.load_weights so BF16 updates are quantized "
                     "online and reloaded in place (same storage, scales updated)",
              replaces="FlashRL hacked_process_weights_after_loading / BaseModelLoader.load_model",
              remove_when="vLLM's layerwise reload quantizes BF16 updates for INT8 layers by itself",
              upstream="https://github.com/vllm-project/vllm/issues/19020")
def _flashrl_process_weights(wrapped, instance, args, kwargs):
    model = args[0] if args else kwargs.get("model")
    from .reload import state_of
    if state_of(model) is None:
        _, cfg = active_config()
        if cfg.is_block_fp8:  # 128x128 block FP8 on vLLM 0.23's CPU kernel (engine start allowed it)
            from .reload import block_fp8_process_weights
            return block_fp8_process_weights(wrapped, args, kwargs, cfg)
    from .hooks import process_weights_after_loading
    return process_weights_after_loading(wrapped, args, kwargs)


@FEATURE.before("vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead.__init__",
                name="flashrl.lm_head_fp32_init", dist="vllm", versions=">=0.13,<0.24", order=40,
                enabled_by=LMHEAD_FP32,
                params=("self", "num_embeddings", "embedding_dim", "params_dtype", "quant_config"),
                reason="keep lm_head weights in float32 and unquantized (FLASHRL_LMHEAD_FP32)",
                replaces="FlashRL patch_vllm_lmhead_to_fp32 (VocabParallelEmbedding.__init__)",
                remove_when="the stacks' vLLM honours head_dtype for generation models (merged upstream "
                            "after 0.23)", upstream=_LM_HEAD_UPSTREAM)
def _flashrl_lmhead_init(instance, args, kwargs):
    from .hooks import lmhead_fp32_init_args
    return lmhead_fp32_init_args(args, kwargs)


@FEATURE.wrap("vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod.apply",
              name="flashrl.lm_head_fp32_apply", dist="vllm", versions=">=0.13,<0.24", order=40,
              enabled_by=LMHEAD_FP32,
              params=("self", "layer", "x", "bias"),
              reason="feed the float32 lm_head float32 hidden states so logits are computed in float32",
              replaces="FlashRL hacked UnquantizedEmbeddingMethod.apply",
              remove_when="the stacks' vLLM honours head_dtype for generation models (merged upstream "
                          "after 0.23)", upstream=_LM_HEAD_UPSTREAM)
def _flashrl_lmhead_apply(wrapped, instance, args, kwargs):
    from .hooks import lmhead_fp32_apply
    return lmhead_fp32_apply(wrapped, args, kwargs)


@FEATURE.wrap("verl.workers.rollout.vllm_rollout.utils:vLLMColocateWorkerExtension.update_weights_from_ipc",
              name="flashrl.verl_update_weights_session", dist="verl", versions=">=0.9,<0.10", order=40,
              params=("self",),
              reason="verl 0.9 sends each update in buckets (one model.load_weights call per bucket; a fused layer "
                     "can be split between two) and then runs process_weights_after_loading over the whole model; "
                     "one flashrl update session spans the buckets, and that final call finishes the session "
                     "instead of post-processing already processed layers a second time",
              replaces="FlashRL's hook on verl's sharding manager (verl 0.6 calls load_weights once per update)",
              remove_when="verl drives vLLM's layerwise reload and vLLM quantizes BF16 updates for W8A8 layers")
def _flashrl_verl_update_session(wrapped, instance, args, kwargs):
    from .hooks import verl_update_session
    return verl_update_session(wrapped, instance, args, kwargs)


def register_cli(subparsers) -> None:
    """``ascend-rl flashrl {profile,setup,quantize}`` (FlashRL-compatible arguments)."""
    from .cli import register
    register(subparsers)


# -- vLLM-Ascend: refuse the NZ layout the reload cannot reuse, at engine start ---------------

def _ascend_require_plain_layout(scheme: str):
    def check(instance, args, kwargs):
        from .hooks import ascend_check_layout
        ascend_check_layout(scheme, instance)
        return None
    check.__name__ = f"ascend_require_plain_layout_{scheme}"
    return check


_ASCEND_TARGETS = (
    (">=0.13,<0.14", "vllm_ascend.quantization.w8a8:AscendW8A8LinearMethod", "static", "va13_static"),
    (">=0.13,<0.14", "vllm_ascend.quantization.w8a8_dynamic:AscendW8A8DynamicLinearMethod", "dynamic",
     "va13_dynamic"),
    (">=0.13,<0.14", "vllm_ascend.quantization.w8a8_dynamic:AscendW8A8DynamicFusedMoEMethod", "moe_dynamic",
     "va13_moe"),
    (">=0.23,<0.24", "vllm_ascend.quantization.methods.w8a8_static:AscendW8A8LinearMethod", "static",
     "va23_static"),
    (">=0.23,<0.24", "vllm_ascend.quantization.methods.w8a8_dynamic:AscendW8A8DynamicLinearMethod", "dynamic",
     "va23_dynamic"),
    (">=0.23,<0.24", "vllm_ascend.quantization.methods.w8a8_dynamic:AscendW8A8DynamicFusedMoEMethod",
     "moe_dynamic", "va23_moe"),
)
for _versions, _cls, _scheme, _tag in _ASCEND_TARGETS:
    FEATURE.before(f"{_cls}.process_weights_after_loading", _ascend_require_plain_layout(_scheme),
                   name=f"flashrl.ascend_plain_layout_{_tag}", dist="vllm-ascend", versions=_versions, order=40,
                   params=("self", "layer"),
                   reason="the int8 reload copies post-processed weights into the engine's storage; that is "
                          "exact for vLLM-Ascend's transposed ND layout but unverifiable for FRACTAL_NZ, so NZ "
                          "is refused at engine start with the setting that disables it",
                   replaces="FlashRL as_strided raw-storage copy (wrong for NZ weights)",
                   remove_when="the reload is verified on an NPU with NZ weights (copy_ between NZ tensors)")


# -- vLLM-Ascend 0.23: refuse generic block FP8 (its fp8 method keeps power-of-two scales only) ----

@FEATURE.before("vllm_ascend.quantization.fp8_config:AscendFp8Config.from_config",
                name="flashrl.ascend_block_fp8_refusal", dist="vllm-ascend", versions=">=0.23,<0.24", order=40,
                params=("cls", "config"),
                reason="vLLM-Ascend 0.23 serves quant_method 'fp8' through its MXFP8 method, whose post-processing "
                       "keeps only the exponent of each 128x128 block scale; a generic block-FP8 checkpoint (slime's "
                       "FP8 rollout: scale = amax/448) would be served with wrong weights, so with a flashrl "
                       "quantized rollout active it is refused when the engine parses the quantization config, "
                       "naming per-channel FP8 (W8A8FP8_DYNAMIC) and INT8 W8A8 instead",
                remove_when="vLLM-Ascend's fp8 method keeps float32 block scales (or checks scale_fmt itself)")
def _flashrl_ascend_block_fp8(instance, args, kwargs):
    config = args[0] if args else kwargs.get("config")
    from .hooks import ascend_refuse_block_fp8
    ascend_refuse_block_fp8(config)
    return None


def selftest_checks(ctx):
    """``ascend-rl selftest``: every quantizer on the device vs the CPU kernels, bit for bit; speed
    vs the formulas they replace; refusal of non-finite weights (:mod:`.device_checks`)."""
    from .device_checks import run
    return run(ctx)
