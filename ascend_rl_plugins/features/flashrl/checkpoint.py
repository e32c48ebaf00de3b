"""Offline quantizer: a local BF16 HF checkpoint -> a compressed-tensors W8A8 checkpoint.

The output is what llm-compressor's W8A8 recipes write and what vLLM's
``CompressedTensorsConfig`` / vLLM-Ascend's ``AscendCompressedTensorsConfig`` parse:
int8 ``weight`` [out, in], float32 ``weight_scale`` [out, 1] (channel strategy,
symmetric), per-token dynamic activations or a static per-tensor ``input_scale``
(``fn="int8"``); or FP8 E4M3 weights with per-channel ([out, 1]) or per-tensor ([1])
scales and per-token dynamic FP8 activations (``fn="fp8_channel"`` / ``"fp8_tensor"``,
"float-quantized" format);
``lm_head`` is left in high precision. Smoothing factors, when given, are folded into
the norms and weights (see :mod:`.profile`); the tensors go through the same
:class:`~.profile.OnlineQuantizer` the engine uses for weight updates.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from .profile import OnlineQuantizer, Profile, is_quantizable_linear, read_tensors

COPY_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja", ".py")


def quantization_config(scheme: str = "dynamic", fn: str = "int8") -> dict:
    """The ``quantization_config`` block of config.json (compressed-tensors W8A8)."""
    from .profile import weight_format
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"scheme must be 'dynamic' or 'static', got {scheme!r}")
    dtype, strategy = weight_format(fn)
    kind = "float" if dtype == torch.float8_e4m3fn else "int"
    weights = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": False,
               "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
               "observer_kwargs": {}}
    acts = {"num_bits": 8, "type": kind, "symmetric": True, "group_size": None, "block_structure": None,
            "actorder": None, "observer": None if scheme == "dynamic" else "minmax", "observer_kwargs": {},
            "strategy": "token" if scheme == "dynamic" else "tensor", "dynamic": scheme == "dynamic"}
    return {"quant_method": "compressed-tensors", "format": f"{kind}-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def linear_shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in tensors.items() if is_quantizable_linear(n, t.shape)}


def quantize_checkpoint(src_dir: str, dst_dir: str, *, profile: Profile | None = None,
                        scheme: str = "dynamic", fn: str = "int8") -> str:
    """Write the W8A8 version of ``src_dir`` to ``dst_dir`` (returns ``dst_dir``).

    ``profile`` carries smoothing factors (``Profile.from_factors``) and, for the static
    scheme, every linear's ``input_scale``.
    """
    if not os.path.isfile(os.path.join(src_dir, "config.json")):
        raise FileNotFoundError(f"{src_dir} is not a local HF checkpoint (no config.json)")
    tensors = read_tensors(src_dir)
    shapes = linear_shapes(tensors)
    prof = profile or Profile()
    prof.scheme = scheme
    if not prof.linears:
        prof.linears = sorted(shapes)
        prof.shapes = {k: list(v) for k, v in shapes.items()}
    if scheme == "static":
        missing = [n for n in prof.linears if n[: -len(".weight")] not in prof.input_scales]
        if missing:
            raise ValueError(f"static scheme needs an input_scale for every linear; missing e.g. {missing[:3]}")
    out = dict(OnlineQuantizer(prof, fn=fn).transform(tensors.items()))
    os.makedirs(dst_dir, exist_ok=True)
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(dst_dir, "model.safetensors"),
              metadata={"format": "pt"})
    for f in os.listdir(src_dir):
        if f.endswith(COPY_SUFFIXES) and f != "config.json" and not f.endswith(".index.json"):
            shutil.copy(os.path.join(src_dir, f), os.path.join(dst_dir, f))
    with open(os.path.join(src_dir, "config.json")) as fh:
        config = json.load(fh)
    config["quantization_config"] = quantization_config(scheme, fn)
    with open(os.path.join(dst_dir, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    return dst_dir


# -- W4A16 (group-wise INT4) and block FP8 ------------------------------------------------
#
# Both converters read every tensor of the BF16 checkpoint, quantize the selected linears
# with the project's own quantizers (:mod:`ascend_rl_plugins.quant.int4`,
# :mod:`ascend_rl_plugins.quant.block_fp8` -- the functions the online reload and QAT use, so
# the offline checkpoint, the reloaded weights and the QAT forward agree bit for bit) and keep
# everything else as it is.

SCOPES = ("all", "experts")
FP8_BLOCK_FORMATS = ("fp8", "ct")


def is_expert_linear(name: str) -> bool:
    """A routed expert's projection (HF per-expert layout ``...mlp.experts.{e}.*_proj.weight``).
    Shared experts (``shared_expert``/``shared_experts``) are not routed experts."""
    return ".mlp.experts." in name


def _selected(name: str, shape, scope: str) -> bool:
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    if not is_quantizable_linear(name, shape):
        return False
    return scope == "all" or is_expert_linear(name)


def _ignored_modules(tensors: dict, selected: set[str]) -> list[str]:
    """Every linear-looking module (2-D ``.weight`` outside the embeddings) that is left in
    high precision: ``lm_head`` first, then decoder-layer linears not quantized (the MoE
    router ``mlp.gate`` and, for ``--scope experts``, attention and shared/dense MLP)."""
    out = ["lm_head"]
    for name, t in tensors.items():
        if (name.endswith(".weight") and t.dim() == 2 and ".layers." in name and name not in selected):
            out.append(name[: -len(".weight")])
    return out


def _write(dst_dir: str, src_dir: str, out: dict, quant_config: dict) -> str:
    os.makedirs(dst_dir, exist_ok=True)
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(dst_dir, "model.safetensors"),
              metadata={"format": "pt"})
    for f in os.listdir(src_dir):
        if f.endswith(COPY_SUFFIXES) and f != "config.json" and not f.endswith(".index.json"):
            shutil.copy(os.path.join(src_dir, f), os.path.join(dst_dir, f))
    with open(os.path.join(src_dir, "config.json")) as fh:
        config = json.load(fh)
    config["quantization_config"] = quant_config
    with open(os.path.join(dst_dir, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    return dst_dir


def w4a16_quantization_config(group_size: int, ignore: list[str]) -> dict:
    """compressed-tensors W4A16 ``pack-quantized`` (int4, symmetric, group strategy, no
    activation quantization), as vLLM's ``CompressedTensorsWNA16`` reads it, plus the
    top-level ``group_size`` vLLM-Ascend's W4A16 MoE method reads (its default is 32)."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
               "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
               "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": list(ignore), "kv_cache_scheme": None, "group_size": group_size}


def quantize_checkpoint_w4a16(src_dir: str, dst_dir: str, *, group_size: int = 128, scope: str = "all",
                              preset: str = "ct") -> str:
    """Write the W4A16 (group-wise INT4) version of ``src_dir`` to ``dst_dir``.

    Per quantized linear: ``weight_packed`` int32 ``[out, in/8]``, ``weight_scale``
    ``[out, in/G]`` (model dtype for ``preset="ct"``, bf16 for ``"slime"``), ``weight_shape``
    int64 ``[2]``. ``scope="experts"`` quantizes only routed experts (slime's choice);
    ``"all"`` every decoder-layer projection. ``lm_head`` stays in high precision.
    """
    from ...quant.int4 import Int4Spec, quantize_pack
    spec = Int4Spec(group_size=group_size, preset=preset)
    if not os.path.isfile(os.path.join(src_dir, "config.json")):
        raise FileNotFoundError(f"{src_dir} is not a local HF checkpoint (no config.json)")
    tensors = read_tensors(src_dir)
    selected = {n for n, t in tensors.items() if _selected(n, t.shape, scope)}
    if not selected:
        raise ValueError(f"no linear matches scope={scope!r} in {src_dir}")
    bad = sorted(n for n in selected if tensors[n].shape[1] % group_size)
    if bad:
        raise ValueError(f"input dimension of {bad[0]} ({tensors[bad[0]].shape[1]}) is not a multiple of "
                         f"group_size={group_size}")
    if preset == "slime" and any(tensors[n].dtype != torch.bfloat16 for n in selected):
        # vLLM casts weight_scale into the model dtype on load: bf16 scales in an fp16/fp32
        # model would no longer be the scales the codes were computed from
        raise ValueError("preset 'slime' stores bf16 scales and needs a bf16 checkpoint; use preset 'ct'")
    out = {}
    for name, t in tensors.items():
        if name in selected:
            base = name[: -len(".weight")]
            packed, scale = quantize_pack(t, spec, name=name)
            out[base + ".weight_packed"] = packed
            out[base + ".weight_scale"] = scale
            out[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
        else:
            out[name] = t
    return _write(dst_dir, src_dir, out, w4a16_quantization_config(group_size, _ignored_modules(tensors, selected)))


def fp8_block_quantization_config(fmt: str, ignore: list[str], block=(128, 128)) -> dict:
    """``fmt="fp8"``: the native FP8 config (DeepSeek-V3 / slime): ``quant_method: fp8``,
    dynamic activations, ``weight_block_size``; tensors ``weight`` + ``weight_scale_inv``.
    ``fmt="ct"``: compressed-tensors ``FP8_BLOCK`` (block weights, dynamic per-token-group
    128 activations); tensors ``weight`` + ``weight_scale``."""
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block), "ignored_layers": list(ignore),
                "modules_to_not_convert": list(ignore)}
    if fmt != "ct":
        raise ValueError(f"fp8-block format must be one of {FP8_BLOCK_FORMATS}, got {fmt!r}")
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "dynamic": False,
               "group_size": None, "block_structure": list(block), "actorder": None, "observer": "minmax",
               "observer_kwargs": {}}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": block[1],
            "dynamic": True, "block_structure": None, "actorder": None, "observer": None, "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None}},
            "ignore": list(ignore), "kv_cache_scheme": None}


def quantize_checkpoint_fp8_block(src_dir: str, dst_dir: str, *, fmt: str = "fp8", scope: str = "all") -> str:
    """Write the 128x128 block-FP8 version of ``src_dir`` to ``dst_dir`` (see
    :func:`fp8_block_quantization_config` for the two layouts)."""
    from ...quant import block_fp8
    if fmt not in FP8_BLOCK_FORMATS:
        raise ValueError(f"fp8-block format must be one of {FP8_BLOCK_FORMATS}, got {fmt!r}")
    if not os.path.isfile(os.path.join(src_dir, "config.json")):
        raise FileNotFoundError(f"{src_dir} is not a local HF checkpoint (no config.json)")
    tensors = read_tensors(src_dir)
    selected = {n for n, t in tensors.items() if _selected(n, t.shape, scope)}
    if not selected:
        raise ValueError(f"no linear matches scope={scope!r} in {src_dir}")
    scale_name = ".weight_scale_inv" if fmt == "fp8" else ".weight_scale"
    out = {}
    for name, t in tensors.items():
        if name in selected:
            q, s = block_fp8.quantize(t, block_fp8.BLOCK, name=name)
            out[name] = q
            out[name[: -len(".weight")] + scale_name] = s
        else:
            out[name] = t
    return _write(dst_dir, src_dir, out,
                  fp8_block_quantization_config(fmt, _ignored_modules(tensors, selected), block_fp8.BLOCK))
