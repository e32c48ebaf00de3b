"""Compiled (fused) quantizers for accelerators: the torch paths' math in one kernel per block.

Why: on an accelerator the blocked torch path runs each elementwise step as its own kernel
over a float32 copy (5-8 passes over the weight), which measured 0.3-0.6x the speed of the
plain formulas it replaces and 13-45x slower than the same math compiled into one kernel
(issue 31, NVIDIA H200). Here each quantizer is the same formula written once more for
``torch.compile`` (inductor: Triton on CUDA/XPU): one read of the weight, one write of the
codes and scales.

Bit identity with the CPU kernels and the eager torch path rests on three rules:

* **Quotients through float64.** Compiled code may evaluate a float32 ``a / b`` with a fast
  approximate division (Triton's default ``div.full.f32`` is within 2 ulp) and replaces a
  division by a constant with a reciprocal multiply. The few divisions that make a scale
  (one per row, group or block) are float64 divisions of float32 values, rounded to float32:
  the correctly rounded float32 quotient (double rounding is innocuous for a division when
  the wide format has at least 2p + 2 bits: 53 >= 2 * 24 + 2), and float64 division has
  only the IEEE-rounded form in PTX. The divisors are tensor inputs
  (``device_math.constant``), never constants, so no reciprocal is substituted. The
  per-element quotient ``x / scale`` of the INT8 / FP8 rows and block FP8 is
  ``float32(float64(x) * r)`` with ``r`` the float64 reciprocal of the scale, computed once per
  row or block (:func:`_times_reciprocal` says why that is the same float32 as the division):
  a multiply per element instead of a float64 division, a multi-instruction sequence on GPUs
  (1.3-1.4x faster on an H200). INT4 keeps the float64 division, which measured faster there.
* **bf16 rounding on the bit pattern** (:func:`_round_bf16`): eager torch rounds a bf16
  quotient to bf16 before the next step; inductor may keep intermediates in float32, so
  that rounding is written out as integer ops it cannot drop.
* **-0.0 made +0.0 by a select**, not by ``+ 0`` (a compiler may fold ``x + 0``).

Nothing is trusted blindly: the first use of each compiled kernel on a device -- one per
quantizer, dtype, width and (INT8 / FP8 rows) SmoothQuant factors given, the same things that
make :func:`compiled` build a separate kernel -- is checked against the eager torch path on
probes of that width with those factors (:func:`verified`): a probe with crafted rounding ties
must give the same bits, and a probe holding a NaN, a +inf and a -inf must make exactly the
scales of their rows, groups or blocks non-finite (the refusal: a compiler whose max reduction
skips NaN would quantize a NaN weight silently). A mismatch or a compile failure logs one
WARNING and that kernel falls back to the eager path for the rest of the process.
``ASCEND_RL_FLASHRL_DEVICE_FUSED`` chooses: ``auto`` (default: compiled where inductor
generates code for the device type -- cuda, xpu -- else eager), ``on`` (require it: a failure
raises), ``off`` (eager only).
NPUs take the eager path under ``auto`` (torch_npu's inductor backend is not verified here).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from .. import flags

# the logger (and so ASCEND_RL_FLASHRL_LOGGING_LEVEL) of the rollout reload, the first user of
# these quantizers: their warnings read as they did before the quantizers had a package
log = logging.getLogger("ascend_rl_plugins.flashrl")

# The switch of the compiled forms. Declared here, below the features, because both features that
# quantize on an accelerator (flashrl's reload, int4_qat's fake quantization) go through this
# module; its name and its place in the documentation (feature "flashrl") are what they were.
DEVICE_FUSED = flags.define(
    "ASCEND_RL_FLASHRL_DEVICE_FUSED", "enum", "auto",
    "Quantizers on an accelerator (FlashRL reload, INT4 QAT fake quantization): 'auto' runs the torch.compile'd "
    "one-kernel form where inductor generates code for the device (cuda, xpu), after checking it once per process "
    "bit for bit against the eager torch path (a mismatch warns and falls back); 'on' requires it (a failure "
    "raises); 'off' always takes the eager torch path. Same bits in every case; NPUs take the eager path under "
    "'auto'. CPUs always use the numba kernels.",
    choices=("auto", "on", "off"), feature="flashrl")

FUSED_DEVICE_TYPES = ("cuda", "xpu")   # where inductor's Triton backend compiles under ``auto``
_LOCK = threading.Lock()


@dataclass
class _State:
    """Per-process memory of this module: compiled functions and the verdict of each probe."""
    compiled: dict      # (kind, variant, static arguments) -> compiled formula
    verdicts: dict      # (kind and kernel, device type, dtype) -> True (use compiled) / False (eager)
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


def _reciprocal(b):
    """float64 ``1 / b`` of a float32 scale (correctly rounded: an IEEE float64 division), made
    once per row, group or block for :func:`_times_reciprocal`."""
    import torch
    return 1.0 / b.to(torch.float64)


def _times_reciprocal(x, r):
    """float32 ``x / b`` for float32 ``x`` and ``r = _reciprocal(b)``: ``float32(float64(x) * r)``.

    Why this is the correctly rounded float32 quotient (the bits of the eager ``x / b``): the
    float64 product is within a relative ``2u + u**2`` (u = 2**-53, two float64 roundings) of the
    exact ``x / b``, under 2**-51.9. A quotient of two float32 numbers (24-bit significands) is
    either a float32 itself, or at a relative distance of at least about 2**-49 from every
    float32 rounding midpoint: a midpoint has an odd 25-bit significand ``M``, and
    ``x / b == M * 2**k`` would need the 24-bit significand of ``x`` to hold the odd factor
    ``M * (odd part of b)`` of at least 25 bits; otherwise their difference is a nonzero
    multiple of the smaller of the two exponent units, which bounds it below. So the product
    and the exact quotient round to the same float32 (``tests/quant/
    test_device_exact.py`` checks it against float64 division on adversarial pairs). The one
    exception is a quotient below the float32 normal range (|x / b| < 2**-126), where midpoints
    are absolute: it can round 1 ulp apart, and every code it feeds (INT8, INT4, FP8 E4M3)
    rounds it to zero either way."""
    import torch
    return (x.to(torch.float64) * r).to(torch.float32)


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
    codes = _times_reciprocal(x, _reciprocal(scale)).round().clamp(-128.0, 127.0).to(torch.int8)
    return codes, scale


def fp8_rows_formula(w, col, gain, fp8_max, eps):
    """``(float8_e4m3fn, float32 scale [rows, 1])``: :func:`.quant.quantize_fp8_rows`'s ``channel`` math."""
    import torch
    x = _scaled_rows(w, col, gain)
    scale = _quotient(x.abs().amax(dim=1, keepdim=True), fp8_max)
    scale = torch.where(scale == 0, eps, scale)
    q = _times_reciprocal(x, _reciprocal(scale)).clamp(-448.0, 448.0)
    q = torch.where(q == 0, torch.zeros_like(q), q)
    return q.to(torch.float8_e4m3fn), scale


def int4_formula(w, divisor, eps, group: int, ct: bool, bf16_weight: bool, qmin: float, output: str):
    """INT4 of a 2-D block (:mod:`.int4`'s torch math). ``output``: ``"packed"`` -> (int32
    words, stored scale), ``"codes"`` -> (int8 codes, stored scale), ``"fake"`` -> (the
    dequantized weight in ``w``'s dtype, a 0-dim bool: every weight of the block is finite --
    the non-finite check's verdict made inside the kernel, so the caller launches nothing for it)."""
    import torch
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group).to(torch.float32)
    s = _quotient(g.abs().amax(dim=-1), divisor)       # amax is exact in any float dtype
    scale_bf16 = bf16_weight or not ct
    if scale_bf16:
        s = _round_bf16(s)
    s = torch.where(s == 0, eps, s)
    # a float64 division here, not the reciprocal multiply of the other quantizers: on an H200 the
    # multiply made this kernel slower (INT4 pack 393216 x 4096: 10.7 vs 6.6 ms; fake quantization
    # equal), where it made INT8 1.3x and block FP8 1.4x faster (benchmarks/bench_device_quantizers.py)
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
        # the verdict from the weight itself, per group (the amax's own reduction loop), not from
        # the scales: a backend whose max reduction skips NaN (inductor's CPU code) gives a finite
        # scale for a group holding a NaN
        return d.reshape(rows, cols).to(w.dtype), torch.isfinite(g).all(dim=-1).all()
    codes = q.reshape(rows, cols)
    if output == "codes":
        return codes.to(torch.int8), stored
    nib = (codes.to(torch.int64) + 8).reshape(rows, cols // 8, 8)
    words = nib[..., 0]
    for i in range(1, 8):                              # unrolled: a pointwise kernel, not a reduction
        words = words | (nib[..., i] << (4 * i))
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32), stored


def _block_scale(amax, fp8_max, eps):
    """The stored float32 scale of each block from its float32 amax, and its float64 reciprocal."""
    import torch
    s = _quotient(amax, fp8_max)
    s = torch.where(s == 0, eps, s)
    return s, _reciprocal(s)


def _block_fp8_apply(w, r, bn: int, bk: int):
    """The E4M3 codes of whole blocks given each block's float64 reciprocal scale ``[n/bn, k/bk]``."""
    import torch
    n, k = w.shape
    x = w.to(torch.float32).reshape(n // bn, bn, k // bk, bk)
    q = _times_reciprocal(x, r.reshape(n // bn, 1, k // bk, 1)).clamp(-448.0, 448.0)
    q = torch.where(q == 0, torch.zeros_like(q), q)
    return q.reshape(n, k).to(torch.float8_e4m3fn)


def block_runs_formula(w, bk: int):
    """float32 amax of each contiguous run of ``bk`` along each row ``[n, k/bk]`` (coalesced, like
    the INT4 groups): the first step of a block amax. amax is exact in any float dtype, so the
    order of the reduction does not change a bit."""
    import torch
    n, k = w.shape
    return w.reshape(n, k // bk, bk).abs().amax(dim=-1).to(torch.float32)


def block_amax_formula(w, bn: int, bk: int):
    """float32 amax of each ``bn x bk`` block, in two steps: the row runs
    (:func:`block_runs_formula`), then the ``bn`` runs of a block column (1/bk of the data)."""
    n, k = w.shape
    return block_runs_formula(w, bk).reshape(n // bn, bn, k // bk).amax(dim=1)


# The one-graph forms also return the float64 reciprocal (the caller drops it): a graph output is
# stored once per block, where a value only used inside the graph may be recomputed by inductor
# in the per-element kernel -- a float64 division per element, which is what it replaces.

def block_fp8_formula(w, fp8_max, eps, bn: int, bk: int):
    """``(float8_e4m3fn, float32 scale_inv [n/bn, k/bk], float64 1/scale_inv)`` of a weight made
    of whole blocks, the two-step amax and the quantization in one graph (variant ``one_graph``)."""
    s, r = _block_scale(block_amax_formula(w, bn, bk), fp8_max, eps)
    return _block_fp8_apply(w, r, bn, bk), s, r


def block_fp8_direct_formula(w, fp8_max, eps, bn: int, bk: int):
    """The same, with the block amax as one reduction over both block dimensions of the 4-D view
    (variant ``direct``: the form of the DeepGEMM / slime formula, which inductor fused well on
    an H200 -- see ``features/flashrl/README.md``)."""
    import torch
    n, k = w.shape
    amax = w.reshape(n // bn, bn, k // bk, bk).abs().amax(dim=(1, 3)).to(torch.float32)
    s, r = _block_scale(amax, fp8_max, eps)
    return _block_fp8_apply(w, r, bn, bk), s, r


def block_scale_formula(w, fp8_max, eps, bn: int, bk: int):
    """The first call of variant ``split``: each block's stored scale and float64 reciprocal
    (two small outputs: the second call reads them instead of recomputing them per element)."""
    return _block_scale(block_amax_formula(w, bn, bk), fp8_max, eps)


def block_scale_from_runs_formula(runs, fp8_max, eps, bn: int):
    """The second call of variant ``three_pass``: block amax, scale and reciprocal from the row
    runs ``[n, k/bk]`` (a small reduction over ``bn`` rows of runs)."""
    n, kb = runs.shape
    return _block_scale(runs.reshape(n // bn, bn, kb).amax(dim=1), fp8_max, eps)


def block_fp8_apply_formula(w, r, bn: int, bk: int):
    """The last call of variants ``split`` and ``three_pass``: a pointwise kernel with a broadcast
    reciprocal scale, like the row quantizers'."""
    return _block_fp8_apply(w, r, bn, bk)


_FORMULAS = {"int8_rows": int8_rows_formula, "fp8_rows": fp8_rows_formula, "int4": int4_formula,
             "block_fp8": block_fp8_formula, "block_fp8_direct": block_fp8_direct_formula,
             "block_scale": block_scale_formula, "block_fp8_apply": block_fp8_apply_formula,
             "block_runs": block_runs_formula, "block_scale_from_runs": block_scale_from_runs_formula}


def compiled(kind: str, variant: tuple = (), rows_args: tuple = (0,), **static):
    """The ``torch.compile``'d formula of ``kind`` with its non-tensor arguments ``static`` bound.

    Shapes: the row count (dim 0 of the tensors at ``rows_args``) is dynamic, every other size
    is static -- so one compiled kernel serves every block of a weight and every layer of one
    width, while the index arithmetic inside the kernel divides by constants (a fully dynamic
    kernel divides by runtime values per element and ran 5-20x slower on an H200). ``variant``
    names what else makes a separate kernel: the dtype, optional inputs left out, and the
    column count. Each variant compiles a copy of the formula's code object **under a name of its
    own** (:func:`_code_name`): dynamo counts recompilations, and remembers the sizes it has seen
    for automatic dynamic shapes, per code identity -- (file, first line, *name*), not per code
    object. With one shared name, the first-use probe (1024 columns) followed by a real weight
    (4096) made dynamo recompile the real weight's copy with dynamic columns: block FP8's
    indexing then divided by runtime sizes per element and ran 13x slower than the static
    kernel on an H200 (15.2 vs 2.5 ms at 393216 x 4096)."""
    key = (kind, variant, tuple(sorted(static.items())))
    with _LOCK:
        fn = STATE.compiled.get(key)
        if fn is None:
            import types
            import torch
            base = _FORMULAS[kind]
            name = _code_name(base.__name__, key)
            copy = types.FunctionType(base.__code__.replace(co_name=name, co_qualname=name), base.__globals__, name,
                                      base.__defaults__, base.__closure__)
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


def _code_name(formula: str, key) -> str:
    """A code name unique to one compiled form (``key``), the same in every process."""
    import hashlib
    return f"{formula}__{hashlib.sha1(repr(key).encode()).hexdigest()[:12]}"


def usable(kind: str, weight, check, kernel: str = "") -> bool:
    """Whether a quantizer should run the compiled form ``kind`` on ``weight``: a bf16/float32
    weight on a device where it is wanted (:func:`wanted`), and ``check()`` (compiled == eager
    on the probes) passed there at first use of this ``kernel`` (:func:`verified`)."""
    import torch
    if weight.dtype not in (torch.bfloat16, torch.float32) or not wanted(weight.device):
        return False
    return verified(kind, weight.device, weight.dtype, check, kernel)


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
    ties[:1] = 381.0                                            # amax 381 -> INT8 scale 381 / 127 = 3
    tie_rows = min(rows, 8)
    w[:tie_rows] = ties * (1.0 + torch.arange(tie_rows).reshape(tie_rows, 1) % 2) * 2.0 ** -7
    w[8:9] = 0.0                                                # all-zero row: eps scale
    return w.to(dtype).to(device)


def nonfinite_probe(device, dtype, rows: int = 384, cols: int = 1024):
    """:func:`probe_weight` with a NaN in its first row, a +inf in its middle row and a -inf in
    its last (and columns first, middle, last): three rows, three groups, and -- with at least
    three block rows -- three blocks hold one non-finite weight each, the others none."""
    w = probe_weight("cpu", dtype, rows, cols)
    if rows and cols:
        w[0, 0] = float("nan")
        w[rows // 2, cols // 2] = float("inf")
        w[rows - 1, cols - 1] = float("-inf")
    return w.to(device)


def probe_factors(device, rows: int = 384, cols: int = 1024):
    """float32 SmoothQuant factors for a probe: ``(col_smooth [cols], row_gain [rows])``.

    Why these values: 1.0 on the first half of the columns and a power of two on the tie rows
    (the first nine) scale those weights exactly, so the tie rows keep their .5 ties (and their
    amax at column 0), where a compiled division could round apart from the eager one; random
    values on the other columns and rows make every product inexact there, so a compiled
    kernel that multiplies in another order (``w * (col * gain)``) differs from the eager
    ``(w * col) * gain``."""
    import torch
    gen = torch.Generator().manual_seed(44)
    col = torch.ones(cols)
    col[cols // 2:] = 0.5 + 0.5 * torch.rand(cols - cols // 2, generator=gen)   # < 1: the amax stays at column 0
    gain = 0.5 + 1.5 * torch.rand(rows, generator=gen)
    gain[:9] = 2.0 ** (torch.arange(min(rows, 9)) % 3 - 1.0)
    return col.to(device), gain.to(device)


def nonfinite_where_expected(scale, probe, unit_rows: int, unit_cols: int) -> bool:
    """Whether ``scale`` (one per ``unit_rows x unit_cols`` unit of ``probe``: a row, a group, a
    block) is non-finite exactly for the units that hold a NaN or an infinity -- what the eager
    path gives, and what makes the entry points refuse the weight. At least one must."""
    import torch
    r, c = probe.shape
    bad = (~torch.isfinite(probe)).reshape(r // unit_rows, unit_rows, c // unit_cols, unit_cols)
    bad = bad.any(dim=3).any(dim=1)
    return bool(bad.any()) and bool(torch.equal(~torch.isfinite(scale.reshape(bad.shape)), bad))


def verified(kind: str, device, dtype, check, kernel: str = "") -> bool:
    """Whether the compiled ``kind`` may be used on ``device``: ``check()`` (compiled == eager on
    the probes) is run once per compiled kernel -- (kind, device type, dtype) and ``kernel``, the
    caller's words for whatever else makes a separate kernel (width, inputs given) -- and
    remembered. ``kernel`` goes into the first element of the key (``"kind (kernel)"``), so a
    key stays (kind, device type, dtype)."""
    label = f"{kind} ({kernel})" if kernel else kind
    key = (label, device.type, str(dtype))
    verdict = STATE.verdicts.get(key)
    if verdict is not None:
        return verdict
    reason = None
    try:
        ok = bool(check())
        if not ok:
            reason = ("its result differs from the eager torch path on the probe tensors (the bits of a finite "
                      "weight, or which scales a NaN or an infinity makes non-finite)")
    except Exception as exc:  # noqa: BLE001 - any compile/runtime failure means: do not use it
        ok, reason = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    STATE.verdicts[key] = ok
    if not ok:
        STATE.reasons[key] = reason
        msg = (f"flashrl: the compiled {label} quantizer is not used on {device.type} ({dtype}): {reason}; "
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
