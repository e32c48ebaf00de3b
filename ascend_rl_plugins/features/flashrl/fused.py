"""Compiled (fused) quantizers for accelerators: the torch paths' math in one kernel per block.

Why: on an accelerator the blocked torch path runs each elementwise step as its own kernel
over a float32 copy (5-8 passes over the weight), which measured 0.3-0.6x the speed of the
plain formulas it replaces and 13-45x slower than the same math compiled into one kernel
(issue 31, NVIDIA H200). Here each quantizer is the same formula written once more for
``torch.compile`` (inductor: Triton on CUDA/XPU): one read of the weight, one write of the
codes and scales.

Bit identity with the CPU kernels and the eager torch path rests on three rules:

* **Divisions in float64.** Compiled code may evaluate a float32 ``a / b`` with a fast
  approximate division (Triton's default ``div.full.f32`` is within 2 ulp) and replaces a
  division by a constant with a reciprocal multiply. A float64 division of two float32
  values, rounded to float32, is the correctly rounded float32 quotient (double rounding is
  innocuous for a division when the wide format has at least 2p + 2 bits: 53 >= 2 * 24 + 2),
  and float64 division has only the IEEE-rounded form in PTX. The divisors are tensor
  inputs (``device_math.constant``), never constants, so no reciprocal is substituted.
* **bf16 rounding on the bit pattern** (:func:`_round_bf16`): eager torch rounds a bf16
  quotient to bf16 before the next step; inductor may keep intermediates in float32, so
  that rounding is written out as integer ops it cannot drop.
* **-0.0 made +0.0 by a select**, not by ``+ 0`` (a compiler may fold ``x + 0``).

Nothing is trusted blindly: the first use of each compiled quantizer on a device is checked
bit for bit against the eager torch path on a probe tensor with crafted rounding ties
(:func:`verified`); a mismatch or a compile failure logs one WARNING and that quantizer
falls back to the eager path for the rest of the process. ``ASCEND_RL_FLASHRL_DEVICE_FUSED``
chooses: ``auto`` (default: compiled where inductor generates code for the device type --
cuda, xpu -- else eager), ``on`` (require it: a failure raises), ``off`` (eager only).
NPUs take the eager path under ``auto`` (torch_npu's inductor backend is not verified here).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

log = logging.getLogger("ascend_rl_plugins.flashrl")

FUSED_DEVICE_TYPES = ("cuda", "xpu")   # where inductor's Triton backend compiles under ``auto``
_LOCK = threading.Lock()


@dataclass
class _State:
    """Per-process memory of this module: compiled functions and the verdict of each probe."""
    compiled: dict      # (kind, variant, static arguments) -> compiled formula
    verdicts: dict      # (kind, device type, dtype) -> True (use compiled) / False (eager)
    reasons: dict       # same keys -> why the compiled form is not used
    warned: set
    choices: dict       # a quantizer's compiled variant per (kind, device type, dtype, width, ...)

    def reset(self) -> None:
        self.compiled.clear()
        self.verdicts.clear()
        self.reasons.clear()
        self.warned.clear()
        self.choices.clear()


STATE = _State({}, {}, {}, set(), {})


class FusedUnavailable(RuntimeError):
    """``ASCEND_RL_FLASHRL_DEVICE_FUSED=on`` but the compiled quantizer cannot be used here."""


def mode() -> str:
    from . import DEVICE_FUSED
    return DEVICE_FUSED.value


def wanted(device) -> bool:
    """Whether a quantizer on ``device`` should try its compiled form (before verification)."""
    m = mode()
    if m == "off" or device.type in ("cpu", "meta"):
        return False
    return m == "on" or device.type in FUSED_DEVICE_TYPES


# -- the formulas (compiled by torch.compile; also runnable eagerly for tests) ------------------

def _round_bf16(x):
    """float32 -> nearest bf16 (ties to even), as a float32 value; integer ops on the bits so a
    compiler cannot drop the rounding (finite values)."""
    import torch
    b = x.view(torch.int32)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.view(torch.float32)


def _quotient(a, b):
    """The correctly rounded float32 ``a / b`` of float32 ``a``, ``b`` (see the module docstring)."""
    import torch
    return (a.to(torch.float64) / b.to(torch.float64)).to(torch.float32)


def _scaled_rows(w, col, gain):
    """float32 ``(w * col) * gain`` (smoothing per input column, gain per output row), in the
    eager path's order."""
    import torch
    x = w.to(torch.float32)
    if col is not None:
        x = x * col
    if gain is not None:
        x = x * gain
    return x


def int8_rows_formula(w, col, gain, qmax, min_amax):
    """``(int8 codes, float32 scale [rows, 1])``: :func:`.quant.quantize_int8_rows_torch`'s math."""
    import torch
    x = _scaled_rows(w, col, gain)
    amax = torch.maximum(x.abs().amax(dim=1, keepdim=True), min_amax)
    scale = _quotient(amax, qmax)
    codes = _quotient(x, scale).round().clamp(-128.0, 127.0).to(torch.int8)
    return codes, scale


def fp8_rows_formula(w, col, gain, fp8_max, eps):
    """``(float8_e4m3fn, float32 scale [rows, 1])``: :func:`.quant.quantize_fp8_rows`'s ``channel`` math."""
    import torch
    x = _scaled_rows(w, col, gain)
    scale = _quotient(x.abs().amax(dim=1, keepdim=True), fp8_max)
    scale = torch.where(scale == 0, eps, scale)
    q = _quotient(x, scale).clamp(-448.0, 448.0)
    q = torch.where(q == 0, torch.zeros_like(q), q)
    return q.to(torch.float8_e4m3fn), scale


def int4_formula(w, divisor, eps, group: int, ct: bool, bf16_weight: bool, qmin: float, output: str):
    """INT4 of a 2-D block (:mod:`.int4`'s torch math). ``output``: ``"packed"`` -> (int32
    words, stored scale), ``"codes"`` -> (int8 codes, stored scale), ``"fake"`` -> (the
    dequantized weight in ``w``'s dtype, float32 scales for the non-finite check)."""
    import torch
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group).to(torch.float32)
    s = _quotient(g.abs().amax(dim=-1), divisor)       # amax is exact in any float dtype
    scale_bf16 = bf16_weight or not ct
    if scale_bf16:
        s = _round_bf16(s)
    s = torch.where(s == 0, eps, s)
    q = _quotient(g, s.unsqueeze(-1))
    if ct and bf16_weight:
        q = _round_bf16(q)
    q = q.round().clamp(qmin, 7.0)
    q = torch.where(q == 0, torch.zeros_like(q), q)     # an integer code has no -0 (eager casts to int8)
    stored = s.to(torch.bfloat16) if scale_bf16 else s.to(w.dtype)
    if output == "fake":
        d = q * s.unsqueeze(-1)                         # float32 product, rounded as eager rounds it
        if scale_bf16:
            d = _round_bf16(d)
        return d.reshape(rows, cols).to(w.dtype), s
    codes = q.reshape(rows, cols)
    if output == "codes":
        return codes.to(torch.int8), stored
    nib = (codes.to(torch.int64) + 8).reshape(rows, cols // 8, 8)
    words = nib[..., 0]
    for i in range(1, 8):                              # unrolled: a pointwise kernel, not a reduction
        words = words | (nib[..., i] << (4 * i))
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32), stored


def _block_fp8_from_amax(w, amax, fp8_max, eps, bn: int, bk: int):
    """The quantization of whole blocks given each block's float32 amax ``[n/bn, k/bk]``."""
    import torch
    n, k = w.shape
    s = _quotient(amax, fp8_max)
    s = torch.where(s == 0, eps, s)
    x = w.to(torch.float32).reshape(n // bn, bn, k // bk, bk)
    q = _quotient(x, s.reshape(n // bn, 1, k // bk, 1)).clamp(-448.0, 448.0)
    q = torch.where(q == 0, torch.zeros_like(q), q)
    return q.reshape(n, k).to(torch.float8_e4m3fn), s


def block_amax_formula(w, bn: int, bk: int):
    """float32 amax of each ``bn x bk`` block, in two steps: contiguous runs of ``bk`` along each
    row (coalesced, like the INT4 groups), then the ``bn`` runs of a block column (1/bk of the
    data). amax is exact in any float dtype, so the order does not change a bit."""
    import torch
    n, k = w.shape
    runs = w.reshape(n, k // bk, bk).abs().amax(dim=-1).to(torch.float32)
    return runs.reshape(n // bn, bn, k // bk).amax(dim=1)


def block_fp8_formula(w, fp8_max, eps, bn: int, bk: int):
    """``(float8_e4m3fn, float32 scale_inv [n/bn, k/bk])`` of a weight made of whole blocks, the
    two-step amax and the quantization in one graph (variant ``one_graph``)."""
    return _block_fp8_from_amax(w, block_amax_formula(w, bn, bk), fp8_max, eps, bn, bk)


def block_fp8_direct_formula(w, fp8_max, eps, bn: int, bk: int):
    """The same, with the block amax as one reduction over both block dimensions of the 4-D view
    (variant ``direct``: the form of the DeepGEMM / slime formula, which inductor fused well on
    an H200 -- see ``flashrl/README.md``)."""
    import torch
    n, k = w.shape
    amax = w.reshape(n // bn, bn, k // bk, bk).abs().amax(dim=(1, 3)).to(torch.float32)
    return _block_fp8_from_amax(w, amax, fp8_max, eps, bn, bk)


def block_fp8_from_amax_formula(w, amax, fp8_max, eps, bn: int, bk: int):
    """The second call of variant ``split`` (the first is :func:`block_amax_formula`): a
    pointwise kernel with a broadcast scale, like the row quantizers'."""
    return _block_fp8_from_amax(w, amax, fp8_max, eps, bn, bk)


_FORMULAS = {"int8_rows": int8_rows_formula, "fp8_rows": fp8_rows_formula, "int4": int4_formula,
             "block_fp8": block_fp8_formula, "block_fp8_direct": block_fp8_direct_formula,
             "block_amax": block_amax_formula, "block_fp8_from_amax": block_fp8_from_amax_formula}


def compiled(kind: str, variant: tuple = (), rows_args: tuple = (0,), **static):
    """The ``torch.compile``'d formula of ``kind`` with its non-tensor arguments ``static`` bound.

    Shapes: the row count (dim 0 of the tensors at ``rows_args``) is dynamic, every other size
    is static -- so one compiled kernel serves every block of a weight and every layer of one
    width, while the index arithmetic inside the kernel divides by constants (a fully dynamic
    kernel divides by runtime values per element and ran 5-20x slower on an H200). ``variant``
    names what else makes a separate kernel: the dtype, optional inputs left out, and the
    column count. Each variant compiles a fresh copy of the formula's code object: dynamo
    counts recompilations per code object, and the variants would otherwise exhaust its limit
    (and automatic dynamic shapes would make the columns dynamic again)."""
    key = (kind, variant, tuple(sorted(static.items())))
    with _LOCK:
        fn = STATE.compiled.get(key)
        if fn is None:
            import types
            import torch
            base = _FORMULAS[kind]
            copy = types.FunctionType(base.__code__.replace(), base.__globals__, base.__name__, base.__defaults__,
                                      base.__closure__)
            compiled_copy = torch.compile(copy, fullgraph=True)

            def fn(*tensors, _compiled=compiled_copy, _static=dict(static)):
                tensors = list(tensors)
                for i in rows_args:
                    t = tensors[i]
                    if t is not None and t.dim() and t.shape[0] >= 2:
                        t = t.view(t.shape)          # an alias: never mark the caller's tensor itself
                        torch._dynamo.mark_dynamic(t, 0)
                        tensors[i] = t
                return _compiled(*tensors, **_static)
            STATE.compiled[key] = fn
        return fn


def usable(kind: str, weight, check) -> bool:
    """Whether a quantizer should run the compiled form ``kind`` on ``weight``: a bf16/float32
    weight on a device where it is wanted (:func:`wanted`), and ``check()`` (compiled == eager
    on a probe, bit for bit) passed there at first use (:func:`verified`)."""
    import torch
    if weight.dtype not in (torch.bfloat16, torch.float32) or not wanted(weight.device):
        return False
    return verified(kind, weight.device, weight.dtype, check)


# -- verification ---------------------------------------------------------------------------------

def probe_weight(device, dtype, rows: int = 384, cols: int = 1024):
    """A probe tensor for the first-use check: random rows plus rows built to land on rounding
    ties (row scale exactly 3 for INT8, values (j + 0.5) * 3), where a reciprocal multiply or an
    approximate division rounds the other way."""
    import torch
    gen = torch.Generator().manual_seed(31)
    w = torch.randn(rows, cols, generator=gen) * 0.02
    w[rows // 2:, : cols // 4] *= 40.0                         # rows with outliers
    ties = (torch.arange(cols, dtype=torch.float32) % 120 + 0.5) * 3.0
    ties[0] = 381.0                                             # amax 381 -> INT8 scale 381 / 127 = 3
    w[:8] = ties * (1.0 + torch.arange(8).reshape(8, 1) % 2) * 2.0 ** -7
    w[8] = 0.0                                                  # all-zero row: eps scale
    return w.to(dtype).to(device)


def verified(kind: str, device, dtype, check) -> bool:
    """Whether the compiled ``kind`` may be used on ``device``: ``check()`` (compiled == eager on
    the probe, bit for bit) is run once per (kind, device type, dtype) and remembered."""
    key = (kind, device.type, str(dtype))
    verdict = STATE.verdicts.get(key)
    if verdict is not None:
        return verdict
    reason = None
    try:
        ok = bool(check())
        if not ok:
            reason = "its result differs from the eager torch path on the probe tensor"
    except Exception as exc:  # noqa: BLE001 - any compile/runtime failure means: do not use it
        ok, reason = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    STATE.verdicts[key] = ok
    if not ok:
        STATE.reasons[key] = reason
        msg = (f"flashrl: the compiled {kind} quantizer is not used on {device.type} ({dtype}): {reason}; "
               f"the eager torch path (same bits, slower) is used instead")
        if mode() == "on":
            raise FusedUnavailable(msg + " -- ASCEND_RL_FLASHRL_DEVICE_FUSED=on requires it")
        if key not in STATE.warned:
            STATE.warned.add(key)
            log.warning(msg)
    return ok


def same_bits(a, b) -> bool:
    """Tensors equal bit for bit (dtype, shape and every byte; NaNs compare by bits)."""
    import torch
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous(), b.contiguous()
    if a.element_size() == 1:
        return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.view(width), b.view(width)))
