"""INT4 QAT's device-side check for ``ascend-rl selftest``: what the fake quantization costs.

Every forward of a layer under QAT first makes the fake-quantized weight
(``quant.int4.fake_quantize``, the same quantizer the rollout's W4A16 weights come from),
then multiplies by it. On an accelerator the fake quantization must stay well below the
matmul it precedes (target: <= 0.3x the forward matmul of a 4096 x 4096 layer over 8192
tokens), and it must be bit-identical to the CPU kernel (else the trained policy is not the
rolled-out one).

What is measured as the cost: the time :data:`LAYERS` layer forwards take with the fake
quantization (``fake_quant.linear_fake_quant``, as the QAT patches call it, non-finite verdicts
read once at the end as before an optimizer step) minus the time of the same forwards without
it, per layer, over the matmul -- the host queues kernels ahead of the device, as in training.
The latency of one synchronized call (the verdict read at once) is reported beside it.
"""

from __future__ import annotations

TARGET = 0.3
MICRO_BATCHES = 4   # for the amortized figure of the step cache: micro-batches per optimizer step
LAYERS = 16         # layer forwards per timed sequence


def run(ctx) -> list:
    import torch
    from ...selftest import CheckResult
    from ...quant import int4
    from ...quant.identity import identity_row
    rows = cols = 1024 if (ctx.quick and ctx.device.type == "cpu") else 4096
    tokens = 2048 if (ctx.quick and ctx.device.type == "cpu") else 8192
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16).to(ctx.device)
    results = [identity_row("int4_qat", fake_quant_identity_case(preset), w) for preset in ("ct", "slime")]
    x = (torch.randn(tokens, cols, generator=g) * 0.5).to(torch.bfloat16).to(ctx.device)
    spec = int4.Int4Spec(128, "ct")
    one_call = ctx.seconds(lambda: int4.fake_quantize(w, spec))
    fq, mm = _forward_cost(ctx, w, x, spec)
    ratio = fq / mm
    metrics = {"fake-quant ms per layer forward": fq * 1e3, "matmul ms": mm * 1e3, "ratio": ratio,
               "one synchronized call ms": one_call * 1e3}
    if int4._fused_usable(w, spec):  # where the time goes: the compiled kernel alone, no finiteness sync
        fn, args = int4._compiled_formula(w, spec, "fake")
        metrics["compiled kernel alone ms"] = ctx.seconds(lambda: fn(w, *args)) * 1e3
        # the same call on 8 rows, timed on the host: what one call costs when the device has
        # nearly nothing to do (guards, launch) -- tells a host-bound cost from a slow kernel
        tiny = w[:8].contiguous()
        fn(tiny, *args)
        metrics["compiled call on 8 rows, host ms"] = ctx.host_seconds(lambda: fn(tiny, *args)) * 1e3
    results.append(CheckResult(
        "int4_qat", f"cost: fake-quant ({rows}, {cols}) vs its forward matmul ({tokens} tokens)", True, "",
        metrics,
        f"<= {TARGET}x the matmul" if ctx.device.type != "cpu" else "",
        ratio <= TARGET if ctx.device.type != "cpu" else None))
    results.append(_step_cache(ctx, w, spec, fq, mm))
    return results


def fake_quant_identity_case(preset: str):
    """The fake quantization QAT's forward runs (``int4.fake_quantize``, g128) and its eager torch
    path, on the device, each against the numba kernel called directly on a CPU copy -- never
    ``fake_quantize`` against itself: on a CPU that is the kernel twice and proves nothing."""
    import functools
    from ...quant import _int4_kernels, int4
    from ...quant.identity import IdentityCase
    spec = int4.Int4Spec(128, preset)
    return IdentityCase(f"fake-quant {preset} g128", functools.partial(int4.fake_quantize, spec=spec),
                        functools.partial(int4.fake_quantize_torch, spec=spec),
                        functools.partial(_int4_kernels.fake_quantize_cpu, spec=spec))


def _forward_cost(ctx, w, x, spec):
    """``(fake quantization s per layer forward, matmul s)``: :data:`LAYERS` forwards with and
    without it, timed as sequences (see the module docstring)."""
    import torch
    from .fake_quant import linear_fake_quant
    from .finite_checks import CHECKS

    layers = 2 if ctx.quick and ctx.device.type == "cpu" else LAYERS

    def plain():
        for _ in range(layers):
            torch.nn.functional.linear(x, w)

    def quantized():
        for _ in range(layers):
            torch.nn.functional.linear(x, linear_fake_quant(w, spec, "selftest layer"))
        CHECKS.verify()
    reps = max(3, ctx.reps // 2)
    with_fq = ctx.seconds(quantized, reps=reps)
    without = ctx.seconds(plain, reps=reps)
    return max(0.0, with_fq - without) / layers, without / layers


def _step_cache(ctx, w, spec, fake_quant_s: float, matmul_s: float):
    """``ASCEND_RL_INT4_QAT_FAKE_WEIGHT_CACHE=step``: the first training forward of a step
    fake-quantizes, the later ones reuse that tensor (no device work: the host time of the lookup
    is what a later micro-batch pays). Checked: the reused tensor is the fake-quantized weight."""
    import os
    import torch
    from ...selftest import CheckResult
    from ...quant import _int4_kernels, int4
    from ...quant.fused import same_bits
    from . import FAKE_WEIGHT_CACHE
    from . import fake_weight_cache
    from .fake_quant import straight_through
    previous = os.environ.get(FAKE_WEIGHT_CACHE.name)
    param = torch.nn.Parameter(w.clone())
    try:
        _set_cache_flag("step")
        fake_weight_cache.reset()

        def forward():
            return straight_through(param, lambda t: int4.fake_quantize(t, spec), ("selftest", spec))
        first = forward()
        ok = same_bits(first.detach().cpu(), _int4_kernels.fake_quantize_cpu(w.cpu(), spec))
        reps = 200
        hit_s = ctx.host_seconds(forward, reps)
        ok = ok and fake_weight_cache.CACHE.stats.hits == reps and fake_weight_cache.CACHE.stats.misses == 1
    finally:
        fake_weight_cache.reset()
        _set_cache_flag(previous)
    per_step = (fake_quant_s + (MICRO_BATCHES - 1) * hit_s) / MICRO_BATCHES
    amortized = per_step / matmul_s
    return CheckResult(
        "int4_qat", f"cost with the step cache (ASCEND_RL_INT4_QAT_FAKE_WEIGHT_CACHE=step), {MICRO_BATCHES} "
                    f"micro-batches per optimizer step", ok, "" if ok else "the reused tensor is not the fake weight",
        {"later micro-batch host us": hit_s * 1e6, "ratio per micro-batch, amortized": amortized},
        f"<= {TARGET}x the matmul" if ctx.device.type != "cpu" else "",
        amortized <= TARGET if ctx.device.type != "cpu" else None)


def _set_cache_flag(value) -> None:
    import os
    from ... import flags
    from . import FAKE_WEIGHT_CACHE
    if value is None:
        os.environ.pop(FAKE_WEIGHT_CACHE.name, None)
    else:
        os.environ[FAKE_WEIGHT_CACHE.name] = value
    flags.reset_cache()
