"""Long-tail rollout simulator: makespan with and without rollout rebalance.

Scenario (seed 003's measured setting, scaled by its own numbers): DP ranks step in lockstep
(a synchronous MoE rollout), each step's time set by the largest padded graph batch any rank
runs; response lengths are heavy-tailed (log-normal) and truncated at the max response
length; a rebalance check every ``--interval`` steps costs a gather, and migrations stall
every rank for the time the busiest link needs (KV bytes / bandwidth) plus any recompute
prefill at the receivers. Policies, in one run:

* ``none``      : no rebalance (ranks still drop to smaller graphs as they drain);
* ``seed``      : the seed recipe's planner, re-implemented here from its description;
* ``this``      : ``ascend_rl_plugins.features.rollout_rebalance.planner``;
* ``bound``     : perfect free rebalancing (one global pool, zero migration cost): a lower
                  bound no planner can beat.

Run: ``python benchmarks/bench_rollout_rebalance.py`` (about a minute); ``--quick`` for a
smaller scenario.
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import time
from dataclasses import dataclass

import numpy as np

from ascend_rl_plugins.features.rollout_rebalance.planner import (
    PlannerConfig, RankLoad, bucket, plan)

# ~60 ms at small graph batches rising to ~200 ms at the largest (seed doc, Qwen3-235B, A3)
STEP_MS = {4: 60.0, 8: 70.0, 16: 90.0, 32: 125.0, 64: 200.0}
LADDER = tuple(sorted(STEP_MS))


def step_seconds(graph_batch: int) -> float:
    if graph_batch <= 0:
        return 0.0
    if graph_batch in STEP_MS:
        return STEP_MS[graph_batch] / 1000
    return STEP_MS[LADDER[-1]] * graph_batch / LADDER[-1] / 1000  # beyond the ladder: eager


@dataclass
class Scenario:
    dp: int = 32
    requests_per_rank: int = 256  # 512 prompts x n=16 over DP=32
    max_num_seqs: int = 64
    prompt_tokens: int = 1024
    max_response: int = 32768
    median_response: int = 7000
    sigma: float = 1.0
    block_size: int = 128
    kv_blocks_per_rank: int = 24000  # ~3M tokens: KV never forces preemption here
    kv_bytes_per_token: float = 94 * 2 * 1 * 128 * 2  # Qwen3-235B, TP4: 1 KV head per TP rank
    link_bytes_per_s: float = 20e9
    prefill_tokens_per_s: float = 8000.0
    interval: int = 200  # steps between rebalance checks
    check_seconds: float = 0.002  # gather + plan
    per_request_seconds: float = 0.002  # metadata, scheduler re-admission
    seed: int = 0

    def lengths(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        raw = rng.lognormal(math.log(self.median_response), self.sigma,
                            self.dp * self.requests_per_rank)
        return np.clip(raw.astype(np.int64), 16, self.max_response)


# -- the seed planner, re-implemented from its published description ----------------------

def seed_plan(states, graph_sizes, max_running):
    """Seed 003's rule: target the smallest rung at or above the average load; spread queued
    requests over ranks below the target first (no KV); only when no queue is left, move
    running requests (always with their KV) from ranks above the target, taking the last
    listed ones, to ranks below it whose KV usage is under 80%."""
    sizes = sorted(graph_sizes)
    loads = [s["running"] + s["waiting"] for s in states]
    before = max(bucket(x, sizes) for x in loads)
    avg = sum(loads) / len(loads)
    target = min(before, sizes[-1], max_running)
    for rung in sizes:
        if avg <= rung < target:
            target = rung
            break
    receivers, queued, over = [], [], []
    for s in states:
        if s["waiting"]:
            queued.append([s["rank"], s["waiting"]])
            continue
        usage = s["usage"]
        if usage > 0.8:
            continue
        room = target - s["running"]
        if room > 0:
            cap = room if usage <= 0 else min(room, int(s["running"] * (1 - usage) / usage))
            receivers.append({"rank": s["rank"], "cap": cap, "running": s["running"], "got": 0})
        elif room < 0:
            over.append([s["rank"], -room])
    tasks = []  # (src, dst, count, with_kv)
    if queued and receivers:
        for _ in range(sum(q[1] for q in queued)):
            open_ = [r for r in receivers if r["got"] < r["cap"]]
            if not open_:
                break
            best = min(open_, key=lambda r: r["running"] + r["got"])
            best["got"] += 1
        qi = 0
        for r in receivers:
            n = r["got"]
            while n > 0 and qi < len(queued):
                k = min(n, queued[qi][1])
                if k:
                    tasks.append((queued[qi][0], r["rank"], k, False))
                    n -= k
                    queued[qi][1] -= k
                    r["cap"] -= k
                if queued[qi][1] == 0:
                    qi += 1
    if any(q[1] for q in queued) or target >= before:
        return tasks
    while over and receivers:
        di = 0
        for r in sorted(receivers, key=lambda r: r["cap"], reverse=True):
            d = over[di]
            k = min(d[1], r["cap"])
            if k > 0:
                tasks.append((d[0], r["rank"], k, True))
                d[1] -= k
                r["cap"] -= k
                di = (di + 1) % len(over)
        over = [d for d in over if d[1]]
        receivers = [r for r in receivers if r["cap"]]
    return tasks


# -- the simulator ----------------------------------------------------------------------

class Rollout:
    """Lockstep DP decoding; requests finish at absolute step numbers."""

    def __init__(self, sc: Scenario, lengths: np.ndarray):
        self.sc = sc
        self.length = lengths
        self.running = [dict() for _ in range(sc.dp)]  # rid -> start step
        self.waiting = [list(range(r * sc.requests_per_rank, (r + 1) * sc.requests_per_rank))
                        for r in range(sc.dp)]
        self.finish_heap = []  # (finish step, rid, rank); stale entries skipped
        self.where = {}
        self.step = 0
        self.seconds = 0.0
        self.moved = self.moved_bytes = self.checks = 0
        self.stall = 0.0
        for r in range(sc.dp):
            self._admit(r)

    def _admit(self, r):
        run, wait = self.running[r], self.waiting[r]
        while wait and len(run) < self.sc.max_num_seqs:
            rid = wait.pop(0)
            self._start(rid, r, self.step, self.length[rid])

    def _start(self, rid, r, start, remaining):
        self.running[r][rid] = start
        self.where[rid] = r
        heapq.heappush(self.finish_heap, (self.step + int(remaining), rid, r))

    def graph_batch(self) -> int:
        return max(bucket(len(run), LADDER) for run in self.running)

    def run(self, policy) -> float:
        sc = self.sc
        next_check = sc.interval
        while self.finish_heap:
            finish, rid, r = self.finish_heap[0]
            if self.where.get(rid) != r or rid not in self.running[r]:
                heapq.heappop(self.finish_heap)
                continue
            target = min(finish, next_check) if policy else finish
            if target > self.step:
                self.seconds += (target - self.step) * step_seconds(self.graph_batch())
                self.step = target
            while self.finish_heap and self.finish_heap[0][0] <= self.step:
                f, rid, r = heapq.heappop(self.finish_heap)
                if self.where.get(rid) == r and rid in self.running[r]:
                    del self.running[r][rid]
                    del self.where[rid]
                    self._admit(r)
            if policy and self.step >= next_check:
                next_check = self.step + sc.interval
                self.checks += 1
                self.seconds += sc.check_seconds
                policy(self)
        return self.seconds

    # -- applying a list of (rid, src, dst, with_kv) ----------------------------------------
    def migrate(self, moves):
        sc = self.sc
        if not moves:
            return
        sent = np.zeros(sc.dp)
        recv = np.zeros(sc.dp)
        prefill = np.zeros(sc.dp)
        count = np.zeros(sc.dp)
        block_bytes = sc.block_size * sc.kv_bytes_per_token
        for rid, src, dst, with_kv in moves:
            if rid in self.running[src]:
                start = self.running[src].pop(rid)
                done = self.step - start
                tokens = sc.prompt_tokens + done
                if with_kv:
                    nbytes = (tokens + sc.block_size) // sc.block_size * block_bytes
                    sent[src] += nbytes
                    recv[dst] += nbytes
                    self.moved_bytes += nbytes
                else:
                    prefill[dst] += tokens
                heapq.heappush(self.finish_heap, (self.step + int(self.length[rid]) - done, rid, dst))
                self.running[dst][rid] = start
                self.where[rid] = dst
            else:  # queued: it is prefilled wherever it starts, so moving costs nothing
                self.waiting[src].remove(rid)
                self.waiting[dst].append(rid)
            count[dst] += 1
            self.moved += 1
        for r in range(sc.dp):
            self._admit(r)
        self.stall += (max(sent.max(), recv.max()) / sc.link_bytes_per_s
                       + prefill.max() / sc.prefill_tokens_per_s
                       + count.max() * sc.per_request_seconds)
        self.seconds += (max(sent.max(), recv.max()) / sc.link_bytes_per_s
                         + prefill.max() / sc.prefill_tokens_per_s
                         + count.max() * sc.per_request_seconds)

    def loads(self):
        sc = self.sc
        out = []
        for r in range(sc.dp):
            req = {}
            used = 0
            for rid, start in self.running[r].items():
                tokens = sc.prompt_tokens + self.step - start
                req[str(rid)] = (tokens, False)
                used += (tokens + sc.block_size - 1) // sc.block_size
            for rid in self.waiting[r]:
                req[str(rid)] = (sc.prompt_tokens, True)
            out.append(RankLoad.from_requests(r, req, kv_blocks_used=used,
                                              kv_blocks_total=sc.kv_blocks_per_rank,
                                              block_size=sc.block_size,
                                              max_num_seqs=sc.max_num_seqs))
        return out


def this_policy(config: PlannerConfig, timings: list):
    def policy(sim: Rollout):
        loads = sim.loads()
        t = time.perf_counter()
        result = plan(loads, config)
        timings.append(time.perf_counter() - t)
        sim.migrate([(int(m.request_id), m.src, m.dst, m.with_kv) for m in result.migrations])
    return policy


def seed_policy(sim: Rollout):
    sc = sim.sc
    states = []
    for r in range(sc.dp):
        used = sum((sc.prompt_tokens + sim.step - s + sc.block_size - 1) // sc.block_size
                   for s in sim.running[r].values())
        states.append({"rank": r, "running": len(sim.running[r]), "waiting": len(sim.waiting[r]),
                       "usage": used / sc.kv_blocks_per_rank})
    moves = []
    pools = {}
    for src, dst, k, with_kv in seed_plan(states, LADDER, sc.max_num_seqs):
        # the seed takes the last k of [*running, *waiting]; running ones go with their KV
        pool = pools.setdefault(src, list(sim.running[src]) + list(sim.waiting[src]))
        for _ in range(min(k, len(pool))):
            rid = pool.pop()
            moves.append((rid, src, dst, rid in sim.running[src]))
    sim.migrate(moves)


def lower_bound(sc: Scenario, lengths: np.ndarray) -> float:
    """One global pool of dp*max_num_seqs slots, requests spread evenly every step for free:
    per step the graph batch is the rung holding ceil(active / dp)."""
    slots = sc.dp * sc.max_num_seqs
    queue = list(range(len(lengths)))
    heap = []
    step = 0
    seconds = 0.0
    qi = 0
    while qi < len(queue) and len(heap) < slots:
        heapq.heappush(heap, int(lengths[queue[qi]]))
        qi += 1
    while heap:
        finish = heap[0]
        active = len(heap)
        seconds += (finish - step) * step_seconds(bucket(-(-active // sc.dp), LADDER))
        step = finish
        while heap and heap[0] <= step:
            heapq.heappop(heap)
        while qi < len(queue) and len(heap) < slots:
            heapq.heappush(heap, step + int(lengths[queue[qi]]))
            qi += 1
    return seconds


def planning_time(dp: int, per_rank: int, repeats: int = 200,
                  for_rank: int | None = None) -> tuple[float, float, int]:
    """Median wall and CPU seconds of one plan() for a long-tail snapshot of ``dp`` ranks."""
    rng = np.random.default_rng(1)
    loads = []
    for r in range(dp):
        n = int(rng.integers(0, per_rank))
        req = {f"{r}-{i}": (int(t), False) for i, t in enumerate(rng.integers(1000, 32000, n))}
        used = sum((t + 127) // 128 for t, _ in req.values())
        loads.append(RankLoad.from_requests(r, req, kv_blocks_used=used, kv_blocks_total=used + 8000,
                                            block_size=128, max_num_seqs=64))
    config = PlannerConfig(graph_sizes=LADDER, kv_bytes_per_token=48128)
    if for_rank is not None:  # the busiest donor: the rank with the most to list
        for_rank = max(loads, key=lambda x: len(x.request_ids)).rank
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        result = plan(loads, config, for_rank=for_rank)
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return float(np.median(walls)), float(np.mean(cpus)), len(result.migrations)


def compare(sc: Scenario, lengths: np.ndarray, config: PlannerConfig) -> tuple[list, float, list]:
    rows = []
    sim = Rollout(sc, lengths)
    rows.append(("none", sim.run(None), sim))
    sim = Rollout(sc, lengths)
    rows.append(("seed planner", sim.run(seed_policy), sim))
    timings: list = []
    sim = Rollout(sc, lengths)
    rows.append(("this planner", sim.run(this_policy(config, timings)), sim))
    return rows, lower_bound(sc, lengths), timings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="DP=8, 64 requests per rank")
    ap.add_argument("--intervals", default="200,1000",
                    help="steps between checks to compare (1000 is the seed's default)")
    args = ap.parse_args()
    intervals = [int(x) for x in args.intervals.split(",")]
    base = Scenario(dp=8, requests_per_rank=64) if args.quick else Scenario()
    lengths = base.lengths()
    print(f"scenario: DP={base.dp}, {base.dp * base.requests_per_rank} responses "
          f"(median {int(np.median(lengths))}, mean {int(lengths.mean())}, "
          f"{(lengths >= base.max_response).mean():.1%} truncated at {base.max_response}), "
          f"max_num_seqs={base.max_num_seqs}, ladder={LADDER}, step ms={STEP_MS}, "
          f"KV {base.kv_bytes_per_token / 1024:.0f} KiB/token/rank, link "
          f"{base.link_bytes_per_s / 1e9:.0f} GB/s, recompute {base.prefill_tokens_per_s:.0f} tok/s")
    config = PlannerConfig(graph_sizes=LADDER, kv_bytes_per_token=base.kv_bytes_per_token,
                           link_bytes_per_s=base.link_bytes_per_s,
                           prefill_tokens_per_s=base.prefill_tokens_per_s)
    t = time.perf_counter()
    all_timings = []
    for interval in intervals:
        sc = Scenario(**{**base.__dict__, "interval": interval})
        rows, bound, timings = compare(sc, lengths, config)
        all_timings += timings
        print(f"\ncheck every {interval} steps")
        print(f"{'policy':<16}{'makespan s':>12}{'vs none':>9}{'vs bound':>10}{'moved':>8}"
              f"{'KV GB':>8}{'stall s':>9}")
        for name, seconds, s in rows:
            print(f"{name:<16}{seconds:>12.0f}{rows[0][1] / seconds:>8.2f}x"
                  f"{seconds / bound:>9.3f}x{s.moved:>8}{s.moved_bytes / 1e9:>8.1f}{s.stall:>9.1f}")
        print(f"{'bound (free)':<16}{bound:>12.0f}{rows[0][1] / bound:>8.2f}x{1.0:>9.3f}x")
        this, seed = rows[2][1], rows[1][1]
        print(f"this planner vs lower bound: +{(this / bound - 1):.1%} (target <= +10%); "
              f"vs seed planner: {(1 - this / seed):+.1%} (target >= +15%)")
    elapsed = time.perf_counter() - t
    if all_timings:
        print(f"\nin-simulation plan() time: median {np.median(all_timings) * 1e3:.3f} ms over "
              f"{len(all_timings)} checks (DP={base.dp})")
    for dp, per_rank in ((128, 24), (128, 64)):
        for who, for_rank in (("whole plan", None), ("busiest rank's share", 0)):
            wall, cpu, moves = planning_time(dp, per_rank, for_rank=for_rank)
            print(f"planning time DP={dp}, up to {per_rank} requests/rank, {who}: median wall "
                  f"{wall * 1e3:.3f} ms, mean CPU {cpu * 1e3:.3f} ms ({moves} migrations "
                  f"listed; target < 1 ms)")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"(simulated in {elapsed:.1f} s; load average {load:.1f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
