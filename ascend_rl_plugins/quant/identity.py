"""Bit-identity rows: a quantizer's entry point and its eager torch path, both on a device,
each compared byte for byte with an independent CPU reference on a CPU copy of the same input.

Why here, below the features: FlashRL's device checks (``features/flashrl/device_checks.py``)
and INT4 QAT's (``features/int4_qat/device_check.py``) build their ``ascend-rl selftest`` rows
from the same pieces -- :class:`IdentityCase` (which refuses a row that would compare a
function with itself), :func:`identity_row`, and the CPU references that are not a kernel's
plain entry point (block FP8 and FP8 rows through the numba block kernel, fp16 INT4 codes in
numpy).
"""

from __future__ import annotations

import functools
import inspect
import itertools
from dataclasses import dataclass
from typing import Callable


def _called_function(role: str, fn: Callable, case: str):
    """The function ``fn`` runs: ``functools.partial`` and decorators (``functools.wraps``)
    unwrapped. A lambda is refused: it hides which function it calls, so the check that a
    row compares different implementations could not see through it."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = inspect.unwrap(fn)
    if getattr(fn, "__name__", "") == "<lambda>":
        raise TypeError(f"identity case {case!r}: {role} is a lambda; pass the function itself or "
                        f"functools.partial(function, ...) so the row can tell which function it compares")
    return fn


def _function_name(fn: Callable) -> str:
    fn = _called_function("reference", fn, "")
    return f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__qualname__}"


@dataclass(frozen=True)
class IdentityCase:
    """One bit-identity row: ``ours(w)`` (the public entry point) and ``eager(w)`` (the eager
    torch path), both on the device, each against ``reference(w.cpu())`` (an independent CPU
    implementation: a numba kernel the package ships, or a numpy formula where no kernel takes
    the dtype).

    Why three different functions: on a CPU the entry point dispatches to the numba kernel or
    to the torch path, so a row whose reference is the entry point again (or whose two sides
    are one function) passes whatever that function computes. Construction raises
    ``ValueError`` when two of the three resolve to the same function, ``TypeError`` for a
    lambda (see :func:`_called_function`)."""
    name: str
    ours: Callable
    eager: Callable
    reference: Callable

    def __post_init__(self):
        called = {role: _called_function(role, getattr(self, role), self.name)
                  for role in ("ours", "eager", "reference")}
        for (role_a, fn_a), (role_b, fn_b) in itertools.combinations(called.items(), 2):
            if fn_a is fn_b:
                raise ValueError(f"identity case {self.name!r}: {role_a} and {role_b} are the same function "
                                 f"({_function_name(fn_a)}); a bit-identity row must compare different "
                                 f"implementations")


def block_fp8_kernel(w, block=(128, 128)):
    """The CPU reference of block FP8: the numba kernel ``_int4_kernels.block_fp8_cpu`` called
    directly (not through ``block_fp8.quantize``, the entry point under test)."""
    import torch
    from . import _int4_kernels
    n, k = w.shape
    bn, bk = block
    out = torch.empty((n, k), dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty((-(-n // bn), -(-k // bk)), dtype=torch.float32)
    return _int4_kernels.block_fp8_cpu(w, bn, bk, out, scale_inv)


def fp8_rows_by_block_kernel(w, strategy: str):
    """The CPU reference of FP8 rows (no col_smooth / row_gain): per-row ("channel") FP8 is
    block FP8 with ``1 x in`` blocks, per-tensor FP8 is one ``out x in`` block -- the same
    float32 ``amax / 448`` scale (zero -> float32 eps), quotient, clamp and ``+ 0`` -- so the
    block kernel (numba, its own E4M3 rounding) checks the torch path that FP8 rows take on
    every device. Scales come back in FP8 rows' shapes (``[out, 1]`` / ``[1]``)."""
    n, k = w.shape
    if strategy == "channel":
        return block_fp8_kernel(w, (1, k))
    if strategy == "tensor":
        out, scale = block_fp8_kernel(w, (n, k))
        return out, scale.reshape(1)
    raise ValueError(f"strategy must be 'channel' or 'tensor', got {strategy!r}")


def int4_ct_codes_numpy(w, spec):
    """The CPU reference of ``int4.quantize`` for fp16 weights, where no numba kernel applies
    (they take bf16 and float32): the ct formula of ``int4``'s docstring evaluated in numpy --
    amax in fp16 (exact), ``scale = fp16(float32(amax) / 7.5)``, zero -> fp16 eps, ``code =
    clamp(rint(fp16(float32(w) / float32(scale))), -8, 7)``. Returns ``(codes int8, scale fp16)``."""
    import numpy as np
    import torch
    if spec.preset != "ct":
        raise ValueError(f"int4_ct_codes_numpy implements the 'ct' preset only, got spec.preset={spec.preset!r}")
    if w.dtype != torch.float16:
        raise ValueError(f"int4_ct_codes_numpy takes fp16 weights (bf16/float32 have the numba kernels), got {w.dtype}")
    rows, cols = w.numel() // w.shape[-1], w.shape[-1]
    groups = w.reshape(rows, cols // spec.group_size, spec.group_size).numpy()
    amax = np.abs(groups).max(axis=-1)
    scale = (amax.astype(np.float32) / np.float32(spec.divisor)).astype(np.float16)
    scale[scale == 0] = np.finfo(np.float16).eps
    quotient = (groups.astype(np.float32) / scale.astype(np.float32)[..., None]).astype(np.float16)
    codes = np.clip(np.rint(quotient.astype(np.float32)), spec.qmin, spec.qmax).astype(np.int8)
    return (torch.from_numpy(codes.reshape(w.shape)),
            torch.from_numpy(scale.reshape(tuple(w.shape[:-1]) + (cols // spec.group_size,))))


def _cpu(result):
    return tuple(t.cpu() for t in result) if isinstance(result, tuple) else result.cpu()


def _same(a, b) -> bool:
    from .fused import same_bits
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same_bits(x.reshape(-1), y.reshape(-1)) for x, y in zip(a, b))
    return same_bits(a.reshape(-1), b.reshape(-1))


def identity_row(feature: str, case: IdentityCase, w):
    """One bit-identity row of ``feature``: ``case.ours`` and ``case.eager`` on ``w`` (on its
    device), each byte for byte against ``case.reference`` on a CPU copy of ``w``."""
    from ..selftest import CheckResult
    ref = case.reference(w.cpu())
    got = _cpu(case.ours(w))
    got_eager = _cpu(case.eager(w))
    ok_ours, ok_eager = _same(got, ref), _same(got_eager, ref)
    reference = f"{_function_name(case.reference)} on the CPU"
    detail = f"vs {reference}" if ok_ours and ok_eager else (
        f"entry point {'==' if ok_ours else '!='} {reference}, eager torch path "
        f"{'==' if ok_eager else '!='} {reference}")
    return CheckResult(feature, f"bit identity: {case.name} {tuple(w.shape)} {str(w.dtype).replace('torch.', '')}",
                       ok_ours and ok_eager, detail)
