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
