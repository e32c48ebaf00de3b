"""Bodies of the flashrl patches (imported lazily, inside the engine process)."""

from __future__ import annotations

import inspect
import logging

import torch

log = logging.getLogger("ascend_rl_plugins.flashrl")


def _bind(wrapped_params: tuple[str, ...], args, kwargs) -> dict:
    bound = dict(zip(wrapped_params, args))
    bound.update(kwargs)
    return bound


def process_weights_after_loading(wrapped, args, kwargs):
    from . import active_config
    from .profile import Profile
    from .reload import BoundedIntSum, ReloadState, install, state_of

    b = _bind(("model", "model_config", "target_device"), args, kwargs)
    model = b["model"]
    state = state_of(model)
    if state is not None:
        # Called again after the engine is built: verl 0.9 does it once after the last bucket
        # of every update. The reload has already post-processed every layer it changed
        # (running the quant methods again would transpose / prepack processed weights a
        # second time), so this call only finishes an open update session.
        if state.update is not None:
            state.finish_update()
        else:
            log.debug("flashrl: process_weights_after_loading on a reloaded model: nothing left to do")
        return None
    _, cfg = active_config()
    if not cfg.is_quantized:
        return wrapped(*args, **kwargs)
    profile = Profile.load(cfg.profile) if cfg.profile else None
    state = ReloadState(model, b.get("model_config"), b.get("target_device"), profile, cfg.fn)
    before = state.record_before()
    with BoundedIntSum():  # (exact; bounds vLLM's CPU int8 azp_adj reduction at initial load too)
        result = wrapped(*args, **kwargs)
    state.record_after(before)
    quantized = [r for r in state.records.values() if r.quantized]
    from .config import ConfigError
    if cfg.is_int4:
        _ready_int4(state, cfg, quantized)
        install(model, state)
        log.info("flashrl: %d W4A16 layers ready for online-quantized reload (group size %d, preset %s)",
                 len(quantized), state.int4_spec.group_size, state.int4_spec.preset)
        return result
    if not quantized:
        raise ConfigError(f"ASCEND_RL_FLASHRL selects fn={cfg.fn!r} with model {cfg.model!r}, but the engine "
                          f"loaded no quantized W8A8 linear layer (is the checkpoint compressed-tensors W8A8?)")
    w4 = sorted(r.name for r in quantized if r.kind != "w8a8")
    if w4:
        raise ConfigError(f"ASCEND_RL_FLASHRL selects fn={cfg.fn!r} (W8A8) but {cfg.model!r} holds W4A16 "
                          f"(pack-quantized) layers ({len(w4)}, e.g. {w4[0]}); use fn: w4a16")
    want = torch.float8_e4m3fn if cfg.is_fp8 else torch.int8
    wrong = sorted(r.name for r in quantized if r.specs["weight"].dtype != want)
    if wrong:
        raise ConfigError(f"ASCEND_RL_FLASHRL selects fn={cfg.fn!r} ({want}) but {cfg.model!r} holds "
                          f"{quantized[0].specs['weight'].dtype} weights ({len(wrong)} layers, e.g. {wrong[0]})")
    # Static (per-tensor input_scale) activations: reloaded like the dynamic scheme; the
    # engine keeps the checkpoint's input scales (calibration; see reload._CALIBRATION).
    # Refused: asymmetric static activations (an input_zero_point), which this project's
    # quantizer never writes -- vLLM's CPU post-processing rewrites input_scale and
    # input_zero_point from the shards' ranges and adds an azp_adj term, and keeping
    # post-processed values across reloads is not verified for them -- and static FP8
    # activations, which no platform this project runs on serves (stock vLLM on CPU has no
    # FP8 W8A8 scheme, vLLM-Ascend 0.23's W8A8FP8_DYNAMIC is per-token).
    asym = sorted(r.name for r in quantized if "input_zero_point" in r.specs)
    if asym:
        raise ConfigError(
            f"ASCEND_RL_FLASHRL: {cfg.model!r} uses asymmetric static activations (input_zero_point; "
            f"{len(asym)} layers, e.g. {asym[0]}); the online reload supports dynamic per-token and "
            f"symmetric static per-tensor activations. Re-quantize with `ascend-rl flashrl quantize "
            f"--scheme static` (symmetric) or `--scheme dynamic`.")
    static = sorted(r.name for r in quantized if "input_scale" in r.specs)
    if static and cfg.is_fp8:
        raise ConfigError(
            f"ASCEND_RL_FLASHRL: {cfg.model!r} uses static (per-tensor input_scale) FP8 activations "
            f"({len(static)} layers, e.g. {static[0]}); FP8 online reload supports dynamic per-token "
            f"activations only (the static FP8 path is not served by vLLM on CPU nor by vLLM-Ascend's "
            f"W8A8FP8_DYNAMIC, so it is not verified). Re-quantize with `ascend-rl flashrl quantize "
            f"--fn {cfg.fn} --scheme dynamic`.")
    state.check_profile()
    install(model, state)
    log.info("flashrl: %d %s layers ready for online-quantized reload (%d rebuilt through their quant "
             "method, %s activations, profile=%s)", len(quantized), "FP8" if cfg.is_fp8 else "INT8",
             sum(r.rebuild for r in state.records.values()),
             "static per-tensor (input scales kept from the checkpoint)" if static else "dynamic per-token",
             cfg.profile)
    return result


def _ready_int4(state, cfg, quantized) -> None:
    """fn w4a16: check what the engine loaded and fix the online quantizer's Int4Spec (the
    served group size; the preset flag). Raises ConfigError naming the flag/setting to change."""
    from . import INT4_GROUP_SIZE, INT4_PRESET
    from .config import ConfigError
    from ...quant.int4 import GROUP_SIZES, Int4Spec
    from .reload import _scheme_of, wna16_direct_layout
    if not quantized:
        raise ConfigError(f"ASCEND_RL_FLASHRL selects fn='w4a16' with model {cfg.model!r}, but the engine loaded no "
                          f"W4A16 linear layer (is the checkpoint compressed-tensors pack-quantized W4A16?)")
    other = sorted(r.name for r in quantized if r.kind != "w4a16")
    if other:
        raise ConfigError(f"ASCEND_RL_FLASHRL selects fn='w4a16' but {cfg.model!r} holds W8A8 layers "
                          f"({len(other)}, e.g. {other[0]}); use fn: int8 / fp8_channel for them")
    groups = {}
    for r in quantized:
        scheme = _scheme_of(r.module)
        g = getattr(scheme, "group_size", None)
        if getattr(scheme, "pack_factor", None) != 8 or not getattr(scheme, "symmetric", False) \
                or getattr(scheme, "has_g_idx", False) or g not in GROUP_SIZES:
            raise ConfigError(f"ASCEND_RL_FLASHRL fn='w4a16': {r.name} is not symmetric group-wise INT4 with a group "
                              f"size in {GROUP_SIZES} and no activation reordering ({type(scheme).__name__}, "
                              f"group_size={g}); write the checkpoint with `ascend-rl flashrl quantize --fn w4a16`")
        why = wna16_direct_layout(r.module)
        if why is not None:
            raise ConfigError(f"ASCEND_RL_FLASHRL fn='w4a16': {r.name}: {why}; the online reload is provided for "
                              f"vLLM's CPUWNA16 W4A16 mode (set VLLM_CPU_INT4_W4A8=0)")
        groups.setdefault(g, r.name)
    if len(groups) != 1:
        raise ConfigError(f"ASCEND_RL_FLASHRL fn='w4a16': the checkpoint mixes group sizes {sorted(groups)}")
    (group,) = groups
    want = INT4_GROUP_SIZE.value
    if want != "auto" and int(want) != group:
        raise ConfigError(f"{INT4_GROUP_SIZE.name}={want} (the trainer's INT4 group size) but {cfg.model!r} is "
                          f"quantized with group size {group}: re-quantize it with `ascend-rl flashrl quantize --fn "
                          f"w4a16 --group-size {want}` or set {INT4_GROUP_SIZE.name}={group}")
    state.int4_spec = Int4Spec(group_size=group, preset=INT4_PRESET.value)


def verl_update_session(wrapped, instance, args, kwargs):
    """verl 0.9 ``vLLMColocateWorkerExtension.update_weights_from_ipc``: one flashrl update
    session around the whole bucketed transfer (see :func:`.reload.update_session`)."""
    from .reload import update_session
    models = []
    try:
        models = list(instance._iter_all_models())
    except Exception:  # noqa: BLE001  (older layouts: the runner's model only)
        model = getattr(getattr(instance, "model_runner", None), "model", None)
        models = [model] if model is not None else []
    with update_session(*models):
        return wrapped(*args, **kwargs)


_LMHEAD_PARAMS = None


def lmhead_fp32_init_args(args, kwargs):
    """ParallelLMHead(num_embeddings, embedding_dim, bias, params_dtype, org_num_embeddings,
    padding_size, quant_config, prefix): force params_dtype=float32, quant_config=None."""
    global _LMHEAD_PARAMS
    if _LMHEAD_PARAMS is None:
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        from ...patching import REGISTRY
        target = "vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead.__init__"
        original = next(p.original for p in REGISTRY.patches.values() if p.target == target and p.original)
        _LMHEAD_PARAMS = list(inspect.signature(original).parameters)[1:]  # without self
        del ParallelLMHead
    args = list(args)
    for name, value in (("params_dtype", torch.float32), ("quant_config", None)):
        pos = _LMHEAD_PARAMS.index(name)
        if pos < len(args):
            args[pos] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def lmhead_fp32_apply(wrapped, args, kwargs):
    """UnquantizedEmbeddingMethod.apply(layer, x, bias): with a float32 lm_head, compute the
    logits from float32 hidden states (they stay float32; the sampler works in float32)."""
    b = _bind(("layer", "x", "bias"), args, kwargs)
    w = getattr(b.get("layer"), "weight", None)
    x = b.get("x")
    if w is not None and x is not None and w.dtype == torch.float32 and x.dtype != torch.float32:
        if len(args) >= 2:
            args = (args[0], x.float()) + tuple(args[2:])
        else:
            kwargs = dict(kwargs, x=x.float())
    return wrapped(*args, **kwargs)


def ascend_check_layout(scheme: str, instance=None) -> None:
    """On vLLM-Ascend with a W8A8 FlashRL config: refuse layouts the reload cannot reuse.
    (The FP8 dynamic method inherits the int8 dynamic method's post-processing; it is told
    apart by its activation dtype.)"""
    from . import active_config
    from .ascend_layout import require_reloadable, w8a8_layout
    _, cfg = active_config()
    if not cfg.is_quantized:
        return
    if scheme == "dynamic" and getattr(instance, "act_quant_type", torch.int8) == torch.float8_e4m3fn:
        scheme = "fp8_dynamic"
    from importlib.metadata import version
    va_version = version("vllm-ascend")
    additional: dict = {}
    is_310p = False
    try:  # 0.23: the decision reads ascend_config.weight_nz_mode and utils.is_310p()
        from vllm_ascend.ascend_config import get_ascend_config
        mode = getattr(get_ascend_config(), "weight_nz_mode", None)
        if mode is not None:
            additional["weight_nz_mode"] = mode
    except Exception:  # noqa: BLE001  (0.13 has no weight_nz_mode; the env decides)
        pass
    try:
        from vllm_ascend import utils as va_utils
        if hasattr(va_utils, "is_310p"):
            is_310p = bool(va_utils.is_310p())
        elif hasattr(va_utils, "get_ascend_device_type"):
            is_310p = va_utils.get_ascend_device_type() == va_utils.AscendDeviceType._310P
    except Exception:  # noqa: BLE001
        pass
    require_reloadable(w8a8_layout(va_version, scheme, additional_config=additional, is_310p=is_310p), va_version)


def ascend_refuse_block_fp8(config) -> None:
    """vLLM-Ascend 0.23 ``AscendFp8Config.from_config(config)`` with a flashrl quantized rollout:
    a block-FP8 quantization_config (``weight_block_size``) whose scales are not declared
    power-of-two (``scale_fmt: ue8m0``) cannot be served exactly (see fp8_support)."""
    from . import CONFIG, active_config
    from .config import ConfigError
    from .fp8_support import ALTERNATIVES
    if not CONFIG.value.strip():
        return
    _, cfg = active_config()
    if not cfg.is_quantized or not isinstance(config, dict):
        return
    block = config.get("weight_block_size")
    if not block or str(config.get("scale_fmt", "")).lower() == "ue8m0":
        return
    raise ConfigError(f"{CONFIG.name}={CONFIG.value}: the served checkpoint is block FP8 (weight_block_size={block}, "
                      f"scale_fmt={config.get('scale_fmt')!r}); vLLM-Ascend's fp8 method (MXFP8) keeps only the "
                      f"exponent of each block scale, so these weights would be served wrong. Use instead: "
                      f"{ALTERNATIVES}.")
