"""EPLB warm start vs reset-per-rollout, on simulated drifting expert-load traces.

For every trace (same seed for both modes) the simulator runs vLLM-Ascend-style dynamic
EPLB (gather loads for a window, install a balanced placement after a delay) over a
sequence of rollouts. Reset starts every rollout from the initial placement (the seed's
behaviour); warm start keeps the last learned placement. Reported: max/mean expert load
per device ("imbalance", 1.0 = perfect) during the first iterations of each rollout
(before its first rebalance is live), and over whole rollouts, for several drift speeds.

    python benchmarks/bench_eplb_warm_start.py [--rollouts 12] [--iterations 120] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ascend_rl_plugins.features.eplb.placement import (  # noqa: E402
    TraceConfig, expert_load_trace, first_window, simulate)


def main() -> None:
    with open("/proc/cpuinfo", encoding="utf-8") as fh:  # the machine, as lscpu names it
        cpu_model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "?")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=12)
    ap.add_argument("--iterations", type=int, default=120)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--drifts", default="0.02,0.1,0.3,1.0,3.0", help="log-popularity drift per RL step")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    print(f"# EPLB warm-start simulation, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"python {sys.version.split()[0]}, numpy {np.__version__}, {cpu_model}")
    print("# command: python " + " ".join(sys.argv))
    base = TraceConfig(num_experts=args.experts, num_devices=args.devices,
                       slots_per_device=args.experts // args.devices + 1, num_layers=args.layers,
                       rollouts=args.rollouts, iterations=args.iterations, seed=args.seed)
    print(f"# {base.num_experts} experts on {base.num_devices} devices x {base.slots_per_device} slots, "
          f"{base.num_layers} MoE layers, {base.rollouts} rollouts x {base.iterations} iterations, "
          f"EPLB window {base.collect_iterations} + {base.wait_iterations} iterations, skew {base.skew}\n")
    head = ("drift/step", "mode", "first-window mean", "first-window p95", "first-window max",
            "whole-rollout mean", "first-window ratio warm/reset")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    window = first_window(base)
    for drift in (float(x) for x in args.drifts.split(",")):
        cfg = TraceConfig(**{**base.__dict__, "drift": drift})
        trace = expert_load_trace(cfg)
        results = {}
        for warm in (False, True):
            imb = simulate(trace, cfg, warm_start=warm)
            # rollout 0 starts from the initial placement in both modes: compare from rollout 1
            first = imb[1:, :window].ravel()
            results[warm] = (first.mean(), np.percentile(first, 95), first.max(), imb[1:].mean())
        for warm in (False, True):
            m, p95, mx, whole = results[warm]
            ratio = f"{results[True][0] / results[False][0]:.3f}" if warm else ""
            print(f"| {drift:g} | {'warm start' if warm else 'reset'} | {m:.3f} | {p95:.3f} | {mx:.3f} | "
                  f"{whole:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
