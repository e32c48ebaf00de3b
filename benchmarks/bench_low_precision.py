"""Low-precision rollout (issue 21): INT4 W4A16 and block-FP8 quantization vs slime's formulas.

Run: ``python benchmarks/bench_low_precision.py [--size 4096] [--reps 5]`` with a stack's
interpreter. Everything is measured in one run, side by side, on the same bf16 weight:

1. INT4 quantize + pack (GB/s of bf16 input), group 128 and 32: this project's fused
   kernel (:func:`~ascend_rl_plugins.quant.int4.quantize_pack`, numba on CPU,
   presets ``ct`` and ``slime``) and its torch path, vs slime's formulas written plainly in
   torch (float32 copy, ``amax / 7`` per group, divide, round, clamp to +-7, int8, then
   pack 8 nibbles per int32). Target: fused >= 8x slime.
2. Block FP8 (128x128) quantization: :func:`~...block_fp8.quantize` (numba) and its torch
   path vs slime's / DeepGEMM's block formula (zero-padded float32 copy, ``amax`` clamped at
   1e-4, ``x * (1 / (amax / 448))``, cast). Target: >= 2x.
3. Fake-quant forward cost (the QAT forward weight, group 128):
   :func:`~...int4.fake_quantize` vs slime's straight-through fake quantization (float32
   ``amax / 7``, divide, round, clamp, multiply back, ``w + (q - w).detach()``).
Wall-clock and process-CPU times are both reported (best of interleaved rounds: the
machine is shared, and CPU time is less sensitive to other processes' load); the targets
are checked on wall clock.

4. Peak extra memory of each operation above (torch CPU allocator, profiler memory events:
   every tensor allocated inside the call, outputs included), in MiB and relative to the
   bf16 input.

Section hook: ``SECTIONS`` maps a name to a function ``(args) -> list[str]`` (lines to
print); the engine benchmark of the W4A16 reload (vLLM's ``reload_weights`` vs flashrl's
reload) can register itself there (``SECTIONS["reload"] = fn``) or be run by name with
``--sections``.

The slime baselines are this project's own re-implementation of the formulas as the issue
describes them (no slime code), in ``ascend_rl_plugins.quant.baselines`` so the
device self-test (``ascend-rl selftest``) measures against the same code.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ascend_rl_plugins.quant import baselines, block_fp8, int4  # noqa: E402

INT4_TARGET = 8.0
FP8_TARGET = 2.0


# -- the baselines: slime's formulas (shared with `ascend-rl selftest`) ---------------------

slime_int4_quantize_pack = baselines.slime_int4_quantize_pack
slime_fake_quant = baselines.slime_fake_quant
slime_block_fp8 = baselines.slime_block_fp8


# -- measurement ---------------------------------------------------------------------------

def measure(impls: dict, reps: int) -> dict:
    """Best wall and best process-CPU seconds of each implementation over ``reps`` rounds;
    every round runs every implementation once, in rotating order, so a burst of load from
    other processes on this shared machine hits baseline and contenders alike."""
    names = list(impls)
    for fn in impls.values():
        fn()  # warm-up (numba compile, allocator)
    wall = {n: float("inf") for n in names}
    cpu = {n: float("inf") for n in names}
    for r in range(reps):
        for n in names[r % len(names):] + names[: r % len(names)]:
            t0, c0 = time.perf_counter(), time.process_time()
            impls[n]()
            wall[n] = min(wall[n], time.perf_counter() - t0)
            cpu[n] = min(cpu[n], time.process_time() - c0)
    return {n: (wall[n], cpu[n]) for n in names}


def torch_peak_bytes(fn) -> int:
    """Peak of live bytes the torch CPU allocator handed out during ``fn()`` (allocation
    events are positive, frees negative; the running sum's maximum)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for ev in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        nbytes = ev.nbytes() if hasattr(ev, "nbytes") else 0
        if nbytes:
            live += nbytes
            peak = max(peak, live)
    return peak


def table(title: str, impls: dict, args, nbytes: int) -> tuple[list[str], dict]:
    """Markdown table of ``impls`` (the first is the baseline); returns the lines and each
    implementation's wall-clock speed-up over the baseline."""
    times = measure(impls, args.reps)
    base_wall, base_cpu = next(iter(times.values()))
    lines = [f"\n## {title}",
             "| implementation | ms wall (best) | GB/s of bf16 input | vs slime, wall | ms CPU (best) | vs slime, CPU "
             "| peak extra MiB | / input |",
             "|---|---|---|---|---|---|---|---|"]
    ratios = {}
    for name, fn in impls.items():
        wall, cpu = times[name]
        peak = torch_peak_bytes(fn)
        ratios[name] = base_wall / wall
        lines.append(f"| {name} | {wall * 1e3:.1f} | {nbytes / wall / 1e9:.2f} | {base_wall / wall:.2f}x | "
                     f"{cpu * 1e3:.1f} | {base_cpu / cpu:.2f}x | {peak / 2 ** 20:.1f} | {peak / nbytes:.2f} |")
    return lines, ratios


def _weight(args, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(args.size, args.size, generator=g) * 0.02).to(torch.bfloat16)


def section_int4(args):
    w = _weight(args, 0)
    nbytes = w.numel() * w.element_size()
    lines, checks = [], []
    for group in (128, 32):
        impls = {
            "slime formulas (torch, fp32 amax/7, divide, pack)": lambda: slime_int4_quantize_pack(w, group),
            "ours fused kernel, preset ct": lambda: int4.quantize_pack(w, int4.Int4Spec(group, "ct")),
            "ours fused kernel, preset slime": lambda: int4.quantize_pack(w, int4.Int4Spec(group, "slime")),
            "ours torch path, preset ct": lambda: int4.quantize_pack_torch(w, int4.Int4Spec(group, "ct")),
        }
        out, ratios = table(f"1. INT4 quantize + pack, {args.size}x{args.size} bf16, group {group}", impls, args,
                            nbytes)
        lines += out
        for name, ratio in ratios.items():
            if name.startswith("ours fused"):
                checks.append((f"INT4 quantize+pack group {group}, preset {name.rsplit(' ', 1)[-1]}", ratio,
                               INT4_TARGET))
    return lines, checks


def section_fp8(args):
    w = _weight(args, 1)
    impls = {"slime / DeepGEMM block formula (torch)": lambda: slime_block_fp8(w),
             "ours kernel": lambda: block_fp8.quantize(w),
             "ours torch path": lambda: block_fp8.quantize_torch(w)}
    lines, ratios = table(f"2. block FP8 (128x128) quantization, {args.size}x{args.size} bf16", impls, args,
                          w.numel() * w.element_size())
    return lines, [("block FP8", ratios["ours kernel"], FP8_TARGET)]


def section_fake_quant(args):
    w = _weight(args, 2)
    impls = {"slime STE fake-quant (torch)": lambda: slime_fake_quant(w, 128),
             "ours fake_quantize, preset slime": lambda: int4.fake_quantize(w, int4.Int4Spec(128, "slime")),
             "ours fake_quantize, preset ct": lambda: int4.fake_quantize(w, int4.Int4Spec(128, "ct"))}
    lines, _ = table(f"3. fake-quant forward weight (QAT), {args.size}x{args.size} bf16, group 128", impls, args,
                     w.numel() * w.element_size())
    return lines, []


SECTIONS = {"int4": section_int4, "fp8": section_fp8, "fake_quant": section_fake_quant}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096, help="square bf16 weight size")
    ap.add_argument("--reps", type=int, default=7, help="timed rounds (the best of each is reported)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {list(SECTIONS)}")
    args = ap.parse_args(argv)
    import numba
    print(f"# bench_low_precision: torch {torch.__version__}, numba {numba.__version__}, "
          f"torch threads {torch.get_num_threads()}, numba threads {numba.get_num_threads()}, "
          f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    checks = []
    for name in args.sections.split(","):
        lines, c = SECTIONS[name.strip()](args)
        print("\n".join(lines), flush=True)
        checks += c
    if checks:
        print("\n## targets")
        for name, ratio, target in checks:
            print(f"- {name}: {ratio:.2f}x vs slime, wall clock (target >= {target:g}x): "
                  f"{'PASS' if ratio >= target else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
