"""Issue 31 on an accelerator: what the compiled quantizers' time is made of.

Run on a machine with a non-CPU torch device (a GPU stands in for an NPU only as "a non-CPU
torch device")::

    python benchmarks/bench_device_quantizers.py --json out.json --code kernels.txt

``ascend-rl selftest`` reports each quantizer against the formula it replaces; this benchmark
says *why* a figure is what it is, in one run, each baseline measured beside what it is
compared with:

1. **Per-element quotient, A/B** (393216 x 4096 bf16: 128 experts x 3072 x 4096). The
   compiled formulas compute ``x / scale`` per element as a float64 multiply by the scale's
   float64 reciprocal (:func:`~ascend_rl_plugins.quant.fused._times_reciprocal`);
   before, as a float64 division. Both are timed for every compiled quantizer (each block-FP8
   form separately), and their bits compared with each other and with the eager torch path.
2. **QAT fake quantization, 4096 x 4096 bf16, ct g128, against the forward matmul over 8192
   tokens**: the entry point; the compiled call alone; the non-finite check alone; the host
   time of one call (8 rows, so the device has nothing to do); back-to-back calls without a
   synchronization (what a training forward pays when the host runs ahead); and how many
   device-to-host reads (``Tensor.item``) one warm call makes.
3. ``--code``: the Triton source inductor generated for these kernels, for reading.

Prints ratios; ``--json`` writes every number.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import sys
import tempfile
import time

BIG = (393216, 4096)
LAYER = (4096, 4096)
TOKENS = 8192


def _division_form():
    """The per-element quotient as it was before the reciprocal multiply: a float64 division."""
    import torch
    from ascend_rl_plugins.quant import fused
    saved = (fused._reciprocal, fused._times_reciprocal)
    fused._reciprocal = lambda b: b.to(torch.float64)
    fused._times_reciprocal = lambda x, d: (x.to(torch.float64) / d).to(torch.float32)
    return saved


@contextlib.contextmanager
def quotient_form(form: str):
    import torch
    from ascend_rl_plugins.quant import fused
    fused.STATE.reset()
    torch._dynamo.reset()
    saved = _division_form() if form == "division" else None
    try:
        yield
    finally:
        if saved is not None:
            fused._reciprocal, fused._times_reciprocal = saved
        fused.STATE.reset()
        torch._dynamo.reset()


def _quantizers(w):
    from ascend_rl_plugins.quant import block_fp8, int4, quant
    ct = int4.Int4Spec(128, "ct")
    rows = {"INT8 rows": (lambda: quant.quantize_int8_rows(w), lambda: quant.quantize_int8_rows_torch(w)),
            "INT4 pack ct g128": (lambda: int4.quantize_pack(w, ct), lambda: int4.quantize_pack_torch(w, ct)),
            "INT4 fake ct g128": (lambda: int4.fake_quantize(w, ct), lambda: int4.fake_quantize_torch(w, ct))}
    for variant in block_fp8.VARIANTS:
        rows[f"block FP8 {variant}"] = (lambda v=variant: block_fp8._fused(w, 128, 128, None, None, v),
                                        lambda: block_fp8.quantize_torch(w))
    return rows


def _same(a, b) -> bool:
    from ascend_rl_plugins.quant.fused import same_bits
    if isinstance(a, tuple):
        return all(same_bits(x, y) for x, y in zip(a, b))
    return same_bits(a, b)


def quotient_ab(ctx, w) -> dict:
    """Section 1: each compiled quantizer under both quotient forms."""
    import torch
    from ascend_rl_plugins.quant import fused
    out = {}
    results = {}
    for form in ("division", "reciprocal"):
        with quotient_form(form):
            for name, (run, eager) in _quantizers(w).items():
                got = run()
                ms = ctx.seconds(run, warmup=1) * 1e3
                row = out.setdefault(name, {})
                row[f"{form} ms"] = ms
                ref = results.get(name)
                if ref is None:
                    results[name] = tuple(t.clone() for t in got) if isinstance(got, tuple) else got.clone()
                    row["division == eager torch path"] = _same(got, eager())
                else:
                    row["reciprocal == division (bits)"] = _same(got, ref)
                del got
                torch.cuda.empty_cache() if ctx.device.type == "cuda" else None
            # which compiled forms passed their first-use check (a False row was timed eagerly)
            out[f"compiled forms used ({form})"] = {f"{k[0]} {k[2]}": v for k, v in fused.STATE.verdicts.items()}
    for name, row in out.items():
        if "division ms" in row and "reciprocal ms" in row:
            row["speed-up"] = row["division ms"] / row["reciprocal ms"]
    return out


def _item_reads(fn) -> int:
    import torch
    reads = []
    original = torch.Tensor.item

    def counting(self):
        reads.append(1)
        return original(self)
    torch.Tensor.item = counting
    try:
        fn()
    finally:
        torch.Tensor.item = original
    return len(reads)


def fake_quant_breakdown(ctx) -> dict:
    """Section 2."""
    import torch
    from ascend_rl_plugins.quant import int4
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(LAYER, generator=g) * 0.02).to(torch.bfloat16).to(ctx.device)
    x = (torch.randn(TOKENS, LAYER[1], generator=g) * 0.5).to(torch.bfloat16).to(ctx.device)
    spec = int4.Int4Spec(128, "ct")
    entry = lambda: int4.fake_quantize(w, spec)  # noqa: E731
    entry()
    fn, args = int4._compiled_formula(w, spec, "fake")
    call = lambda: fn(w, *args)  # noqa: E731
    fake, all_finite = call()
    check = lambda: bool(all_finite)  # noqa: E731  (the synchronized read of the verdict)
    tiny = w[:8].contiguous()
    fn(tiny, *args)
    out = {
        "matmul ms": ctx.seconds(lambda: torch.nn.functional.linear(x, w)) * 1e3,
        "entry point ms": ctx.seconds(entry) * 1e3,
        "compiled call ms": ctx.seconds(call) * 1e3,
        "verdict read ms": ctx.seconds(check) * 1e3,
        "entry point, host ms per call on 8 rows": ctx.host_seconds(lambda: int4.fake_quantize(tiny, spec), 200) * 1e3,
        "compiled call, host ms per call on 8 rows": ctx.host_seconds(lambda: fn(tiny, *args), 200) * 1e3,
        "compiled call, back to back ms per call": ctx.host_seconds(call, 50) * 1e3,
        "entry point, back to back ms per call": ctx.host_seconds(entry, 50) * 1e3,
        "device reads per warm compiled call": _item_reads(call),
        "device reads per warm entry-point call": _item_reads(entry),
    }
    out["entry / matmul"] = out["entry point ms"] / out["matmul ms"]
    out["compiled call / matmul"] = out["compiled call ms"] / out["matmul ms"]
    out["back to back compiled / matmul"] = out["compiled call, back to back ms per call"] / out["matmul ms"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every number here")
    parser.add_argument("--code", help="write the Triton source inductor generated here")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rows", type=int, default=BIG[0], help="rows of the section-1 weight")
    args = parser.parse_args(argv)
    code_dir = None
    if args.code and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        code_dir = tempfile.mkdtemp(prefix="inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = code_dir
    import torch
    from ascend_rl_plugins import selftest
    device = selftest.pick_device(args.device)
    if device.type == "cpu" and args.device == "auto":
        print("bench_device_quantizers: no accelerator here (the compiled quantizers run on cuda/xpu only; "
              "--device cpu runs the script's mechanics on the CPU paths)")
        return 0
    ctx = selftest.SelftestContext(device=device, quick=False, reps=10)
    report = {"device": selftest.describe(device)}
    print(f"device: {report['device']}")
    g = torch.Generator(device=device).manual_seed(3)
    w = torch.randn((args.rows, BIG[1]), generator=g, device=device).mul_(0.02)
    w[:, ::585] *= 30.0
    w = w.to(torch.bfloat16)
    t0 = time.time()
    report["quotient A/B"] = ab = quotient_ab(ctx, w)
    print(f"\n1. per-element quotient ({args.rows} x {BIG[1]} bf16), {time.time() - t0:.0f} s:")
    for name, row in ab.items():
        if "speed-up" in row:
            print(f"  {name:24s} division {row['division ms']:7.2f} ms  reciprocal {row['reciprocal ms']:7.2f} ms  "
                  f"speed-up {row['speed-up']:.2f}x  same bits: {row.get('reciprocal == division (bits)')}, "
                  f"eager: {row.get('division == eager torch path')}")
        else:
            print(f"  {name}: {row}")
    del w
    torch.cuda.empty_cache() if device.type == "cuda" else None
    report["fake quant"] = fq = fake_quant_breakdown(ctx)
    print(f"\n2. QAT fake quantization {LAYER} bf16 ct g128 vs its matmul ({TOKENS} tokens):")
    for key, value in fq.items():
        print(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    code_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if args.code and code_dir:
        with open(args.code, "w") as out:
            for path in sorted(glob.glob(os.path.join(code_dir, "**", "*.py"), recursive=True)):
                text = open(path).read()
                if "@triton.jit" in text:
                    out.write(f"# ===== {os.path.relpath(path, code_dir)}\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
