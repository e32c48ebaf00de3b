"""Generation makespan over DP ranks: no rebalance vs the recipe's permutation vs this
project's assignment vs the lower bound, on the long-tail simulator, in one run.

The simulator (ascend_rl_plugins/features/data_rebalance/simulator.py): per-prompt response
lengths heavy-tailed across prompts (lognormal or Pareto), correlated within a prompt's GRPO
group, clipped at the response limit; "history" is an earlier epoch's draw of the same prompts
after the policy drifted; a rank decodes its samples in dispatch order with at most
``running`` at once (0: all), a step costing ``48 + running sequences``. The planner uses
its defaults (step overhead 64: deliberately not the simulator's 48), the scenario's
concurrency limit (what a user sets in ASCEND_RL_DATA_REBALANCE_MAX_SEQS) and the response
limit (learned from the first outputs at run time). Figures are mean makespan / lower bound
over the trials (1.00 = the bound); "seed kept" is how often the planner kept the seed's
order because its own plan did not model at least 1% faster.

    python benchmarks/bench_data_rebalance.py [--trials 40] [--seed 0]

Exits 1 if this project's assignment is worse than the seed's in any scenario.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ascend_rl_plugins.features.data_rebalance import simulator  # noqa: E402
from ascend_rl_plugins.features.data_rebalance.planner import CostModel, plan  # noqa: E402

S = simulator.Scenario
SCENARIOS = [
    S("n=8, DP=8, first epoch (no history)", n=8, ranks=8, history=False),
    S("n=8, DP=8", n=8, ranks=8),
    S("n=8, DP=32 (more ranks than samples)", n=8, ranks=32),
    S("n=5, DP=8 (n and DP coprime)", n=5, ranks=8),
    S("n=16, DP=64, Pareto tail", n=16, ranks=64, tail="pareto"),
    S("n=16, DP=16, 32 running/rank, first epoch", n=16, ranks=16, max_seqs=32, history=False),
    S("n=16, DP=16, 32 running/rank", n=16, ranks=16, max_seqs=32),
    S("n=8, DP=32, 256 prompts, 16 running/rank", prompts=256, n=8, ranks=32, max_seqs=16),
    S("n=8, DP=16, 256 prompts, 32K limit, 32 running/rank", prompts=256, n=8, ranks=16, max_seqs=32,
      max_len=32768, median_len=4000),
    S("DAPO-like n=16, DP=64, 512 prompts, Pareto, 16 running/rank", prompts=512, n=16, ranks=64,
      tail="pareto", max_seqs=16),
]


def planning_ms(s: simulator.Scenario, repeats: int = 5) -> float:
    d = simulator.draw(s, np.random.default_rng(123))
    model = CostModel(max_seqs=s.max_seqs, max_len=s.max_len)
    plan(d.est, d.prompt_len, d.group, s.ranks, model)  # compile / load the numba kernels
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        plan(d.est, d.prompt_len, d.group, s.ranks, model)
        times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, numpy {np.__version__}; {args.trials} trials per scenario, seed {args.seed}")
    print("| scenario | samples | no rebalance | seed's permutation | this project | lower bound | seed kept |"
          " plan ms |")
    print("|---|---|---|---|---|---|---|---|")
    worse = []
    for s in SCENARIOS:
        r = simulator.run(s, trials=args.trials, seed=args.seed)
        ms = planning_ms(s)
        print(f"| {s.name} | {s.prompts * s.n} | {r['none']:.3f} | {r['seed']:.3f} | {r['ours']:.3f} | 1.000 | "
              f"{100 * r['kept_seed']:.0f}% | {ms:.1f} |", flush=True)
        if r["ours"] > r["seed"] + 1e-12:
            worse.append(s.name)
    if worse:
        print(f"\nWORSE than the seed's permutation in: {', '.join(worse)}")
        return 1
    print("\nthis project's assignment is never worse than the seed's permutation in these scenarios")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
