"""HDP simulator: fixed CP vs the seed's HDP schemes (verl 0010, 0015) vs this planner vs the
lower bound, under one cost model, in one run.

Every scheme is priced by the same independent evaluator (``price``): per micro-batch, every
rank's time is the sum of the per-rank times of the sequences its group computes
(``CostModel.sequence_time``), the micro-batch takes its slowest rank plus the per-micro-batch
overhead; memory overload is the largest per-rank token count (padding share included) over
the cap. The planner's own modelled cost is cross-checked against this evaluator.

Scenarios: three RL length distributions (prompt uniform 256..2048 tokens plus a response of
at most 32768 tokens, 2048 sequences per DP rank) x two models:

- GQA (Qwen3-235B-A22B-like: 94 layers, hidden 4096, 64 q / 4 kv heads, head dim 128,
  22e9 active) at TP4 PP4 CP4, 16384 tokens per rank, K_min 4 (one per pipeline stage);
- MLA-like (DeepSeek-V3-like: 61 layers, 128 heads, K (192) and V (128) materialized per
  head in training, 37e9 active) at TP4 PP8 CP8, 8192 tokens per rank, K_min 8.

Device numbers (assumed Atlas A3 die, uncalibrated): 200 TFLOP/s matmul, 150 TFLOP/s
attention, 50 GB/s per ring step, 5 us per ring step per layer, 20 ms per micro-batch. The
GQA model is the shipped ``default_cost_model.json``.

Length distributions (response part): long-tail = log-normal, median 3K, sigma 1;
bimodal = 70% log-normal (median 1.5K, sigma 0.6), 30% truncated at 32K; uniform 16..32K.

Columns (speedup over fixed CP, micro-batches, memory): fixed CP = stock verl's micro-batches
under the strict cap, every sequence on all ranks; seed 0010 / 0015 = the recipe's schemes
(``hdp_seed_schemes.py``; they exceed the cap: 0015 by design, 18%); this planner (strict
cap, contiguous groups); the lower bound under the cap; HDP mbs = micro-batches that do not
run plain CP; plan ms = median planning time; planner @1.18 cap = the planner given the
memory 0015 takes; planner pow2 = power-of-two groups; seed 0015 @1.00 = 0015 with its
overload knob at 1.0 (within the cap).

Run: ``python benchmarks/bench_hdp.py [--n 2048] [--seed 0] [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hdp_seed_schemes import SchemePlan, scheme_0010, scheme_0015  # noqa: E402

from ascend_rl_plugins.features.hdp.cost_model import CostModel, padded_length  # noqa: E402
from ascend_rl_plugins.features.hdp.planner import HdpPlan, plan  # noqa: E402

A3 = dict(matmul_flops_per_s=200e12, attention_flops_per_s=150e12, link_bytes_per_s=50e9,
          step_latency_per_layer=5e-6, per_micro_batch_overhead=0.02)

MODELS = {
    "GQA CP4": dict(cp=4, tp=4, cap=16384, k_min=4, model=CostModel.from_architecture(
        active_params=22e9, num_layers=94, num_q_heads=64, qk_head_dim=128, v_head_dim=128,
        num_kv_heads=4, tp=4, pp=4, **A3)),
    "MLA CP8": dict(cp=8, tp=4, cap=8192, k_min=8, model=CostModel.from_architecture(
        active_params=37e9, num_layers=61, num_q_heads=128, qk_head_dim=192, v_head_dim=128,
        num_kv_heads=128, tp=4, pp=8, **A3)),
}

MAX_RESPONSE = 32768


def lengths_for(dist: str, n: int, rng: np.random.Generator) -> np.ndarray:
    prompt = rng.integers(256, 2049, n)
    if dist == "long-tail":  # log-normal responses, median 3K, truncated at 32K
        response = rng.lognormal(np.log(3000), 1.0, n)
    elif dist == "bimodal":  # 70% short answers, 30% truncated at the maximum
        response = np.where(rng.random(n) < 0.7, rng.lognormal(np.log(1500), 0.6, n),
                            MAX_RESPONSE)
    elif dist == "uniform":
        response = rng.integers(16, MAX_RESPONSE + 1, n)
    else:
        raise ValueError(dist)
    return (prompt + np.clip(response, 16, MAX_RESPONSE)).astype(np.int64)


def price(micro_batches, rank_groups, lengths, model: CostModel, cp: int, tp: int, cap: int,
          ring: str = "pack"):
    """(seconds, max rank tokens / cap, micro-batch count) of a scheme: per micro-batch the
    slowest rank plus overhead. ``rank_groups[b]``: rank list per sequence or None (CP).
    The sequences that share a rank list are one pack on that group
    (``CostModel.group_time``; ``ring="pack"``: one K/V exchange per ring step for the pack,
    as the runtime runs it; ``"sequence"``: each sequence priced alone and summed)."""
    total, overload = 0.0, 0.0
    for seqs, groups in zip(micro_batches, rank_groups):
        if groups is None:
            groups = [list(range(cp))] * len(seqs)
        packs: dict[tuple[int, ...], list[int]] = {}
        for seq, ranks in zip(seqs, groups):
            packs.setdefault(tuple(ranks), []).append(int(lengths[seq]))
        rank_time = np.zeros(cp)
        rank_tokens = np.zeros(cp)
        for ranks, pack in packs.items():
            g = len(ranks)
            t = model.group_time(pack, g, tp=tp, ring=ring)
            tok = float(sum(int(padded_length(x, g, tp)) for x in pack)) / g
            for r in ranks:
                rank_time[r] += t
                rank_tokens[r] += tok
        total += rank_time.max() + model.per_micro_batch_overhead
        overload = max(overload, rank_tokens.max() / cap)
    return total, overload, len(micro_batches)


def plan_groups(p: HdpPlan):
    mbs = [list(m.sequences) for m in p.micro_batches]
    groups = [None if m.fixed_cp else [list(m.groups[g]) for g in m.group_of]
              for m in p.micro_batches]
    return mbs, groups


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"HDP simulator: {args.n} sequences per scenario, seed {args.seed}; speedup = fixed "
          f"CP seconds / scheme seconds (modelled); mb = micro-batches; mem = max rank "
          f"tokens / cap")
    header = (f"{'scenario':<20} {'fixed CP':>14} {'seed 0010':>20} {'seed 0015':>20} "
              f"{'this planner':>20} {'lower bound':>11} {'HDP mbs':>8} {'plan ms':>8} "
              f"{'planner @1.18 cap':>20} {'planner pow2':>20} {'seed 0015 @1.00':>20}")
    print(header)
    print("-" * len(header))
    results = []
    for model_name, cfg in MODELS.items():
        cp, tp, cap, k_min, model = cfg["cp"], cfg["tp"], cfg["cap"], cfg["k_min"], cfg["model"]
        for dist in ("long-tail", "bimodal", "uniform"):
            rng = np.random.default_rng(args.seed)
            lengths = lengths_for(dist, args.n, rng)
            lens = lengths.tolist()
            kw = dict(cp_size=cp, max_tokens_per_rank=cap, min_micro_batches=k_min)
            plan(lengths, **kw, cost_model=model, tp=tp)  # warm-up (JIT/cache load)
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                ours = plan(lengths, **kw, cost_model=model, tp=tp)
                times.append(time.perf_counter() - t0)
            plan_ms = statistics.median(times) * 1e3
            cp_plan = plan(lengths, **kw, cost_model=model, tp=tp, allow_hdp=False)
            t_cp, mem_cp, k_cp = price(*plan_groups(cp_plan), lengths, model, cp, tp, cap)
            s10: SchemePlan = scheme_0010(lens, **kw)
            s15: SchemePlan = scheme_0015(lens, **kw)
            t10, mem10, k10 = price(s10.micro_batches, s10.rank_groups, lengths, model, cp, tp,
                                    cap)
            t15, mem15, k15 = price(s15.micro_batches, s15.rank_groups, lengths, model, cp, tp,
                                    cap)
            s15s: SchemePlan = scheme_0015(lens, **kw, overload=1.0)  # its knob at no overload
            t15s, mem15s, k15s = price(s15s.micro_batches, s15s.rank_groups, lengths, model,
                                       cp, tp, cap)
            t_ours, mem_ours, k_ours = price(*plan_groups(ours), lengths, model, cp, tp, cap)
            hdp_mbs = sum(not m.fixed_cp for m in ours.micro_batches)
            pow2 = plan(lengths, **kw, cost_model=model, tp=tp, group_policy="pow2")
            t_pow2, mem_pow2, k_pow2 = price(*plan_groups(pow2), lengths, model, cp, tp, cap)
            # the same planner given the memory the seed's 0015 takes (cap x 1.18)
            loose = plan(lengths, **{**kw, "max_tokens_per_rank": int(cap * 1.18)},
                         cost_model=model, tp=tp)
            t_loose, mem_loose, k_loose = price(*plan_groups(loose), lengths, model, cp, tp,
                                                cap)
            row = dict(name=f"{model_name} {dist}", t_cp=t_cp, t10=t10, t15=t15, t_ours=t_ours,
                       lb=ours.lower_bound, plan_ms=plan_ms, inv10=s10.invalid,
                       model_err=abs(t_ours - ours.cost) / ours.cost,
                       cp_err=abs(t_cp - ours.fixed_cp_cost) / ours.fixed_cp_cost,
                       mem_ours=mem_ours, t_loose=t_loose, t15s=t15s, t_pow2=t_pow2,
                       mem_pow2=mem_pow2)
            results.append(row)

            def cell(t, k, mem):
                return f"{t_cp / t:5.3f}x {k:4d}mb {mem:4.2f}m"

            print(f"{row['name']:<20} {t_cp:7.1f}s {k_cp:3d}mb {cell(t10, k10, mem10):>20} "
                  f"{cell(t15, k15, mem15):>20} {cell(t_ours, k_ours, mem_ours):>20} "
                  f"{t_cp / ours.lower_bound:10.3f}x {hdp_mbs:4d}/{k_ours:<3d} {plan_ms:8.1f} "
                  f"{cell(t_loose, k_loose, mem_loose):>20} {cell(t_pow2, k_pow2, mem_pow2):>20} "
                  f"{cell(t15s, k15s, mem15s):>20}")
            if s10.invalid:
                print(f"{'':<20} (seed 0010: {s10.invalid} micro-batches with inconsistent "
                      f"rank groups, which its runtime rejects; priced as CP)")
    print()
    checks = [
        ("never below fixed CP (speedup >= 1 on every scenario)",
         all(r["t_ours"] <= r["t_cp"] * (1 + 1e-12) for r in results),
         min(r["t_cp"] / r["t_ours"] for r in results)),
        ("at least the seed's best scheme on every scenario (planner at the strict cap, the "
         "seed over it)",
         all(r["t_ours"] <= min(r["t10"], r["t15"]) * (1 + 1e-12) for r in results),
         min(min(r["t10"], r["t15"]) / r["t_ours"] for r in results)),
        ("at least the seed's 0015 run at the strict cap (its overload knob at 1.00)",
         all(r["t_ours"] <= r["t15s"] * (1 + 1e-12) for r in results),
         min(r["t15s"] / r["t_ours"] for r in results)),
        ("at least the seed's best scheme on every scenario at equal memory (planner given "
         "the seed 0015's 1.18x cap)",
         all(r["t_loose"] <= min(r["t10"], r["t15"]) * (1 + 1e-12) for r in results),
         min(min(r["t10"], r["t15"]) / r["t_loose"] for r in results)),
        ("within 12% of the lower bound (cost / bound <= 1.12)",
         all(r["t_ours"] <= 1.12 * r["lb"] for r in results),
         max(r["t_ours"] / r["lb"] for r in results)),
        (f"planning <= 100 ms for {args.n} sequences (median of {args.repeat}, worst scenario)",
         max(r["plan_ms"] for r in results) <= 100.0,
         max(r["plan_ms"] for r in results)),
        ("cap never exceeded by this planner (mem <= 1.00), contiguous and pow2",
         all(max(r["mem_ours"], r["mem_pow2"]) <= 1.0 for r in results),
         max(max(r["mem_ours"], r["mem_pow2"]) for r in results)),
        ("pow2 groups never below fixed CP either",
         all(r["t_pow2"] <= r["t_cp"] * (1 + 1e-12) for r in results),
         min(r["t_cp"] / r["t_pow2"] for r in results)),
        ("planner's modelled costs match the independent evaluator (rel. err < 1e-9)",
         all(r["model_err"] < 1e-9 and r["cp_err"] < 1e-9 for r in results),
         max(max(r["model_err"], r["cp_err"]) for r in results)),
    ]
    for text, ok, value in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {text}  [{value:.4g}]")
    for r in results:  # where a seed scheme beats even the bound, it did so over the cap
        seed_best = min(r["t10"], r["t15"])
        if seed_best < r["lb"]:
            print(f"note  {r['name']}: the seed's best ({r['t_cp'] / seed_best:.3f}x) is above "
                  f"the lower bound ({r['t_cp'] / r['lb']:.3f}x), so no plan within the cap "
                  f"can reach it: it runs over the cap (see its mem column)")
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
