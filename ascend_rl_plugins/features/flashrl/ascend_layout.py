"""vLLM-Ascend W8A8 weight layout after post-processing, and whether a reload can reuse it.

vLLM-Ascend's W8A8 methods post-process the int8 weight in place (``param.data = ...``):
transpose to ``[in, out]`` (``.transpose(0, 1).contiguous()``) and, depending on the
version and settings, cast to the FRACTAL_NZ private format with
``torch_npu.npu_format_cast``. The reload (:mod:`.reload`) runs the method's own
post-processing on fresh tensors and copies the result into the engine's storage, which
is exact for the plain transposed layout. For NZ it would rely on a format-preserving
``copy_`` between two NZ tensors that cannot be verified without an NPU, so NZ is
refused with a clear error naming the setting that turns it off.

Rules (read from the sources of vLLM-Ascend 0.13.0 and 0.23.0.post1; the unit test
re-derives them from those sources):

* 0.13 ``quantization/w8a8.py AscendW8A8LinearMethod`` (static): transpose unless the
  device is 310P; ``utils.maybe_trans_nz`` casts int8 to NZ whenever
  ``VLLM_ASCEND_ENABLE_NZ`` (env, default 1) is non-zero.
  ``w8a8_dynamic.py AscendW8A8DynamicLinearMethod``: transpose, same NZ rule;
  ``AscendW8A8DynamicFusedMoEMethod``: transpose(1, 2) and NZ unconditionally.
* 0.23 ``quantization/methods/w8a8_static.py`` / ``w8a8_dynamic.py``: transpose always;
  ``utils._should_trans_nz``: 310P -> NZ; else ``ascend_config.weight_nz_mode``
  (``additional_config["weight_nz_mode"]``, else env ``VLLM_ASCEND_ENABLE_NZ``, default 1)
  non-zero -> NZ for int8. Fused MoE W8A8: NZ unconditionally.
* 0.23 ``methods/w8a8fp8_dynamic.py AscendW8A8FP8DynamicLinearMethod`` (compressed-tensors
  FP8 W8A8, ``W8A8FP8_DYNAMIC``) inherits the dynamic method's post-processing, which casts
  to NZ only ``if self.act_quant_type == torch.int8``; its activations are
  ``float8_e4m3fn``, so its weights stay transposed ND whatever the NZ setting. 0.13 has
  no FP8 W8A8 scheme.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

SCHEMES = ("static", "dynamic", "moe_dynamic", "fp8_dynamic")


@dataclass(frozen=True)
class W8A8Layout:
    transposed: bool  # weight stored [in, out] (MoE: [experts, in, out]) after processing
    nz: bool  # FRACTAL_NZ private format
    reason: str

    @property
    def reloadable(self) -> bool:
        return not self.nz


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"unrecognised vLLM-Ascend version {version!r}") from None


def _env_nz(env: Mapping[str, str]) -> int:
    raw = env.get("VLLM_ASCEND_ENABLE_NZ", "1")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"VLLM_ASCEND_ENABLE_NZ={raw!r} is not an integer (vLLM-Ascend parses it with int())") from None


def w8a8_layout(vllm_ascend_version: str, scheme: str, *, env: Mapping[str, str] | None = None,
                additional_config: Mapping | None = None, is_310p: bool = False) -> W8A8Layout:
    """The int8 weight layout vLLM-Ascend produces for ``scheme`` in this setting."""
    import os
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    env = os.environ if env is None else env
    additional_config = additional_config or {}
    major, minor = _major_minor(vllm_ascend_version)
    if (major, minor) < (0, 13) or (major, minor) >= (0, 24):
        raise ValueError(f"vLLM-Ascend {vllm_ascend_version} is outside the versions whose W8A8 layout is "
                         f"known here (0.13, 0.23)")
    if scheme == "moe_dynamic":
        return W8A8Layout(True, True, "fused-MoE W8A8 weights are always cast to NZ")
    if scheme == "fp8_dynamic":
        if (major, minor) < (0, 23):
            raise ValueError(f"vLLM-Ascend {vllm_ascend_version} has no FP8 W8A8 (W8A8FP8_DYNAMIC) scheme")
        return W8A8Layout(True, False, "FP8 dynamic W8A8 weights are transposed and never cast to NZ "
                                       "(the NZ cast is guarded by int8 activations)")
    if (major, minor) < (0, 23):
        transposed = not (scheme == "static" and is_310p)
        mode = _env_nz(env)
        nz = mode != 0
        why = f"VLLM_ASCEND_ENABLE_NZ={mode}"
    else:
        transposed = True
        if is_310p:
            return W8A8Layout(True, True, "310P always converts int8 weights to NZ")
        if "weight_nz_mode" in additional_config:
            mode = int(additional_config["weight_nz_mode"])
            why = f"additional_config weight_nz_mode={mode}"
        else:
            mode = _env_nz(env)
            why = f"VLLM_ASCEND_ENABLE_NZ={mode} (additional_config weight_nz_mode unset)"
        nz = bool(mode)
    return W8A8Layout(transposed, nz, why)


def require_reloadable(layout: W8A8Layout, vllm_ascend_version: str) -> None:
    """Raise a clear error when FlashRL reload cannot reuse the engine's int8 storage."""
    if layout.reloadable:
        return
    major, minor = _major_minor(vllm_ascend_version)
    fix = ("set VLLM_ASCEND_ENABLE_NZ=0" if (major, minor) < (0, 23)
           else "pass additional_config={'weight_nz_mode': 0} (or set VLLM_ASCEND_ENABLE_NZ=0)")
    from .config import ConfigError
    raise ConfigError(f"ASCEND_RL_FLASHRL int8 reload needs plain (ND) int8 weights on vLLM-Ascend "
                      f"{vllm_ascend_version}, but they would be cast to FRACTAL_NZ ({layout.reason}); {fix}. "
                      f"Fused-MoE W8A8 and 310P always use NZ and are not supported by the reload.")
