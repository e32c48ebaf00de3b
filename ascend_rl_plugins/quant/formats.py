"""What the formats are, apart from how they are computed: the INT8 row constants and the INT4
group format (presets, group sizes, packing, the weight and output checks).

Why a module of its own: the entry points (:mod:`.quant`, :mod:`.int4`) and their numba
kernels (:mod:`._cpu_kernels`, :mod:`._int4_kernels`) both need them, and the entry points
import the kernels; with the definitions here each side imports this module and neither
imports the other back. Nothing here imports torch at module level.
"""

from __future__ import annotations

from dataclasses import dataclass

# INT8 rows (W8A8): codes -127..127 around a float32 scale amax / QMAX per output row
QMAX = 127.0
# Scales below this are clamped (an all-zero row would otherwise divide by zero); the
# value is irrelevant for such a row (its int8 weights are 0 either way).
MIN_SCALE = 1e-10

# INT4 groups (W4A16), see :mod:`.int4`
PRESETS = ("ct", "slime")
GROUP_SIZES = (32, 64, 128)
PACK_FACTOR = 8  # int4 codes per int32
NUM_BITS = 4


@dataclass(frozen=True)
class Int4Spec:
    """How to quantize: ``group_size`` input columns share one scale; ``preset`` picks the
    formula (see the module docstring)."""

    group_size: int = 128
    preset: str = "ct"

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"Int4Spec.preset must be one of {PRESETS}, got {self.preset!r}")
        if isinstance(self.group_size, bool) or self.group_size not in GROUP_SIZES:
            raise ValueError(f"Int4Spec.group_size must be one of {GROUP_SIZES}, got {self.group_size!r}")

    @property
    def qmin(self) -> int:
        return -8 if self.preset == "ct" else -7

    @property
    def qmax(self) -> int:
        return 7

    @property
    def divisor(self) -> float:
        """amax / divisor = scale: compressed-tensors uses half the int4 range (7.5), slime 7."""
        return 7.5 if self.preset == "ct" else 7.0

    def scale_dtype(self, weight_dtype):
        """dtype of the stored scale: the model dtype for ``ct`` (compressed-tensors keeps the
        scale in the weight's dtype), bf16 for ``slime`` (what slime's rollout stores)."""
        import torch
        return weight_dtype if self.preset == "ct" else torch.bfloat16


@dataclass(frozen=True)
class _Shape:
    lead: tuple
    rows: int
    cols: int
    groups: int


def _check(weight, spec: Int4Spec) -> _Shape:
    if not isinstance(spec, Int4Spec):
        raise TypeError(f"spec must be an Int4Spec, got {type(spec).__name__}")
    if weight.dim() < 2:
        raise ValueError(f"INT4 quantization expects a [..., out, in] weight, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"INT4 quantization expects a floating-point weight, got {weight.dtype}")
    cols = weight.shape[-1]
    if cols % spec.group_size:
        raise ValueError(f"the input dimension ({cols}) must be a multiple of group_size={spec.group_size}")
    rows = weight.numel() // cols if cols else 0
    return _Shape(tuple(weight.shape[:-1]), rows, cols, cols // spec.group_size)


def _prepare_out(out, shape, dtype, name):
    if out is None:
        return None
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} {tuple(shape)}, got {out.dtype} {tuple(out.shape)}")
    return out
