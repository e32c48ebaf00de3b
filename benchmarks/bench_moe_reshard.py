"""MoE expert reshard: bytes received and peak extra memory, stock vs the recipe's scheme vs this
planner vs the minimum; plus measured gloo wall time of the executor vs an all-gather path.

Part 1 (model, no communication) -- for each layout, per rank (max) and in total:

* ``stock all-gather`` : verl 0.6.1 ``per_tensor_generator`` (verl/utils/megatron_utils.py),
  walked tensor by tensor: every expert tensor of another pipeline stage arrives by the PP
  broadcast, then each local-expert tensor is all-gathered over EP (and each of those over
  ETP). Peak extra: the broadcast tensor, the EP-gathered list, the ETP-gathered list and the
  merged copy of the largest (fc1) tensor alive together.
* ``recipe 0005`` : the recipe's ``ep_param_reshard_by_alltoallv`` (verl patch 0005): PP broadcast
  of every weight1/weight2 shard, then one list ``all_to_all`` per tensor inside the training EP
  group, rollout rank r receiving its ``E/ep_rollout`` experts from training EP rank
  ``r // (ep_rollout/ep_train)`` (no wire bytes when that is itself). Requires ETP = 1, experts
  divisible by both EPs and vLLM's linear placement; otherwise "n/a". Peak extra: the broadcast
  weight1, its transposed ``.contiguous()`` copy and the received experts.
* ``this planner`` : ``planner.plan`` (bytes counted from the plan, peak = two rounds in flight
  + the largest assembled need).
* ``minimum`` : every needed row a rank does not already hold, once (``planner.minimum_bytes``).

Part 1b (plan once, balanced senders) -- for the recipe layout, one with replicated owners and a
verl 0.9 checkpoint-engine group (trainer ranks sending, disjoint rollout ranks receiving):
plan time cold (plan + validate) and cached (a lookup by the input digest), the re-plan after a
simulated EPLB move, the busiest sender and receiver against their lower bounds, and the earlier
source rule (same-node owner first) as the baseline.

Part 2 (measured): 4 gloo processes on this machine, a small real config (random expert
tensors in Megatron GroupedMLP storage), ``reshard_experts`` vs the stock-style path
(all_gather over EP per local expert, the loader keeping only its hosted experts); both
outputs are compared bit for bit before timing; median of several runs, printed as a ratio.

Run: ``python benchmarks/bench_moe_reshard.py [--bucket-mb 512] [--repeats 5] [--no-measure]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ascend_rl_plugins.features.moe_reshard.layout import MoEShape, RolloutLayout, TrainingLayout  # noqa: E402
from ascend_rl_plugins.features.moe_reshard.planner import PlanCache, PlanError, plan, receiver_lower_bound, \
    sender_lower_bound  # noqa: E402

GB = 1e9
SMALL_BUCKET = 64 << 20


# ---------------------------------------------------------------------------------------------
# models of the other schemes

def stock_allgather(shape: MoEShape, t: TrainingLayout, world: int) -> tuple[list[int], int]:
    """Bytes received per rank and peak extra bytes of verl 0.6.1's per_tensor_generator."""
    t = t.with_world(world)
    e_loc = t.local_experts(shape)
    per_expert = shape.expert_layer_bytes() // t.etp          # one local expert's fc1 + fc2 shard
    fc1 = 2 * shape.ffn_hidden * shape.row_bytes() // t.etp
    recv = []
    for r in range(world):
        stage = t.coords(r)["pp"]
        total = 0
        for layer in shape.expert_layers:
            own = t.stage_of_layer(layer, shape.num_layers) == stage
            bcast = 0 if own else e_loc * per_expert            # PP broadcast of each local-expert tensor
            ep_gather = e_loc * per_expert * (t.ep - 1)         # all_gather over EP
            etp_gather = e_loc * t.ep * per_expert * (t.etp - 1)  # all_gather over ETP of each gathered one
            total += bcast + ep_gather + etp_gather
        recv.append(total)
    peak = fc1 * (1 + t.ep + 2 * t.etp)
    return recv, peak


def recipe_0005(shape: MoEShape, t: TrainingLayout, rollout: RolloutLayout, world: int):
    """Bytes received per rank and peak extra bytes of the recipe's all-to-all-v, or a reason."""
    t = t.with_world(world)
    ep_r = world
    if t.etp != 1:
        return "n/a (raises for ETP > 1)"
    if not rollout.expert_parallel:
        return "n/a (needs rollout EP)"
    if ep_r % t.ep or shape.num_experts % t.ep or shape.num_experts % ep_r:
        return f"n/a (asserts experts % EP: {shape.num_experts} experts, EP {t.ep} -> {ep_r})"
    if rollout.expert_maps is not None and tuple(rollout.expert_maps) != RolloutLayout.linear(
            rollout.tp, rollout.dp, shape.num_experts).expert_maps:
        return "n/a (hard-codes linear placement)"
    micro = ep_r // t.ep
    e_loc, e_r = shape.num_experts // t.ep, shape.num_experts // ep_r
    s = shape.expert_layer_bytes()
    recv = []
    for r in range(world):
        c = t.coords(r)
        total = 0
        for layer in shape.expert_layers:
            if t.stage_of_layer(layer, shape.num_layers) != c["pp"]:
                total += e_loc * s                                # PP broadcast of weight1 + weight2
            if r // micro != c["ep"]:                             # all_to_all from another EP rank
                total += e_r * s
        recv.append(total)
    fc1 = 2 * shape.ffn_hidden * shape.row_bytes()
    peak = 2 * e_loc * fc1 + e_r * fc1
    return recv, peak


# ---------------------------------------------------------------------------------------------
# part 1

LAYOUTS = [
    ("Qwen3-235B-A22B recipe: train TP4/PP4/EP32/ETP1 (GroupedMLP, stages 23/24/24/23) -> rollout TP4xDP32 EP128 linear",
     MoEShape(94, 128, 4096, 1536), TrainingLayout(tp=4, pp=4, ep=32, etp=1, expert_impl="grouped",
                                                   layer_stages=tuple([0] * 23 + [1] * 24 + [2] * 24 + [3] * 23)),
     RolloutLayout.linear(4, 32, 128)),
    ("Qwen3-30B-A3B, 16 ranks: train TP4/PP2/EP8/ETP1 -> rollout TP2xDP8 EP16 linear",
     MoEShape(48, 128, 2048, 768), TrainingLayout(tp=4, pp=2, ep=8, etp=1, expert_impl="grouped"),
     RolloutLayout.linear(2, 8, 128)),
    ("Qwen3-30B-A3B, 24 ranks: train TP2/PP3/EP4/ETP2 -> rollout TP4xDP6 EP24 linear (128 experts / 24: uneven)",
     MoEShape(48, 128, 2048, 768), TrainingLayout(tp=2, pp=3, ep=4, etp=2, expert_impl="grouped"),
     RolloutLayout.linear(4, 6, 128)),
    ("Qwen3-30B-A3B, 16 ranks: train TP4/PP2/EP8/ETP1 -> rollout TP2xDP8 EP16 round-robin",
     MoEShape(48, 128, 2048, 768), TrainingLayout(tp=4, pp=2, ep=8, etp=1, expert_impl="grouped"),
     RolloutLayout.round_robin(2, 8, 128)),
]


def part1(bucket_bytes: int) -> None:
    print(f"## Bytes received and peak extra memory (bucket {bucket_bytes / 2**20:.0f} MiB, bf16)\n")
    for title, shape, training, rollout in LAYOUTS:
        world = rollout.world_size()
        t0 = time.perf_counter()
        p = plan(shape, training, rollout, bucket_bytes=bucket_bytes)
        planning = time.perf_counter() - t0
        mine = [p.bytes_received(r) for r in range(world)]
        minimum = [p.minimum_bytes(r) for r in range(world)]
        peak = max(p.peak_extra_bytes(r) for r in range(world))
        stock, stock_peak = stock_allgather(shape, training, world)
        seed = recipe_0005(shape, training, rollout, world)
        print(f"### {title}")
        print(f"experts {shape.total_expert_bytes() / GB:.1f} GB in total; plan: {len(p.rounds)} rounds, "
              f"{planning:.2f} s to plan\n")
        print("| scheme | received per rank, max (GB) | received, total (GB) | peak extra per rank (MB) "
              "| vs minimum (max per rank) |")
        print("|---|---|---|---|---|")
        rows = [("stock all-gather (verl 0.6.1)", stock, stock_peak)]
        rows.append(("recipe 0005 all-to-all-v", seed[0], seed[1]) if isinstance(seed, tuple)
                    else ("recipe 0005 all-to-all-v", seed, None))
        rows.append(("this planner", mine, peak))
        small = plan(shape, training, rollout, bucket_bytes=SMALL_BUCKET)
        rows.append((f"this planner, {SMALL_BUCKET >> 20} MiB bucket ({len(small.rounds)} rounds)",
                     [small.bytes_received(r) for r in range(world)],
                     max(small.peak_extra_bytes(r) for r in range(world))))
        rows.append(("minimum", minimum, None))
        for name, recv, pk in rows:
            if isinstance(recv, str):
                print(f"| {name} | {recv} | | | |")
                continue
            bucket = SMALL_BUCKET if "MiB bucket" in name else bucket_bytes
            pk_s = f"{pk / 1e6:.0f}" + (f" ({pk / bucket:.2f} buckets)" if name.startswith("this planner") else "") \
                if pk is not None else "-"
            ratio = max(recv) / max(minimum) if max(minimum) else float("nan")
            print(f"| {name} | {max(recv) / GB:.3f} | {sum(recv) / GB:.1f} | {pk_s} | {ratio:.3f}x |")
        if isinstance(seed, tuple):
            print(f"\nrecipe 0005 / this planner, bytes per rank (max): {max(seed[0]) / max(mine):.2f}x; "
                  f"stock / this planner: {max(stock) / max(mine):.1f}x")
        else:
            print(f"\nstock / this planner, bytes per rank (max): {max(stock) / max(mine):.1f}x")
        print()


# ---------------------------------------------------------------------------------------------
# part 1b: plan once, balanced senders

BALANCE_LAYOUTS = [
    LAYOUTS[0],
    ("Qwen3-30B-A3B, 32 ranks, replicated owners: train TP2/PP1/EP8/ETP1 (4 expert-DP copies of every expert) "
     "-> rollout TP4xDP8 EP32 linear",
     MoEShape(48, 128, 2048, 768), TrainingLayout(tp=2, pp=1, ep=8, etp=1, expert_impl="grouped"),
     RolloutLayout.linear(4, 8, 128)),
    ("Qwen3-30B-A3B, verl 0.9 checkpoint-engine group: 16 trainer ranks TP2/PP1/EP8/ETP1 (2 expert-DP copies) "
     "-> 2 rollout replicas of EP8 linear on 16 more ranks (rollout ranks after the trainer's)",
     MoEShape(48, 128, 2048, 768), TrainingLayout(tp=2, pp=1, ep=8, etp=1, expert_impl="grouped"),
     dataclasses.replace(RolloutLayout.from_expert_maps(
         1, 16, [m for _ in range(2) for m in RolloutLayout.linear(8, 1, 128).expert_maps]), first_rank=16)),
]


def _eplb_move(rollout: RolloutLayout) -> RolloutLayout:
    """The same layout after a (simulated) EPLB step: the first experts of ranks 0 and 1 swap."""
    maps = [list(m) for m in rollout.expert_maps]
    maps[0][0], maps[1][0] = maps[1][0], maps[0][0]
    return dataclasses.replace(RolloutLayout.from_expert_maps(rollout.tp, rollout.dp, maps),
                               first_rank=rollout.first_rank)


def part1b(bucket_bytes: int, lookups: int = 200) -> None:
    print(f"## Plan once, balanced senders (bucket {bucket_bytes / 2**20:.0f} MiB, bf16)\n")
    print("Cold = plan + validate on an empty cache (what every rank did at every sync before); "
          f"cached = median of {lookups} lookups of the same inputs (digest of the layouts and maps + "
          "dictionary hit); after an EPLB move = the first sync after two experts swapped ranks (a new "
          "digest: planned afresh). Busiest sender / receiver: the most wire bytes one rank sends / "
          "receives in the whole sync; lower bounds from the layouts alone (planner.sender_lower_bound, "
          "receiver_lower_bound). Baseline: the earlier source rule (same-node owner first, "
          "`plan(balance=False)`), same run.\n")
    print("| layout | plan cold (s) | cached lookup (ms) | after an EPLB move (s) | busiest sender (GB) "
          "| sender lower bound (GB) | ratio | earlier rule: busiest sender (GB), ratio | busiest receiver (GB) "
          "| receiver lower bound (GB) | total = minimum |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    broadcast = []
    for title, shape, training, rollout in BALANCE_LAYOUTS:
        world = rollout.group_world()
        cache = PlanCache()
        t0 = time.perf_counter()
        planned = cache.get(shape, training, rollout, bucket_bytes=bucket_bytes)
        cold = time.perf_counter() - t0
        p = planned.checked()
        hits = []
        for _ in range(lookups):
            t0 = time.perf_counter()
            again = cache.get(shape, training, rollout, bucket_bytes=bucket_bytes)
            hits.append(time.perf_counter() - t0)
            assert again.cached and again.plan is p
        moved = _eplb_move(rollout)
        t0 = time.perf_counter()
        replanned = cache.get(shape, training, moved, bucket_bytes=bucket_bytes)
        eplb = time.perf_counter() - t0
        assert not replanned.cached and replanned.key != planned.key
        base = plan(shape, training, rollout, bucket_bytes=bucket_bytes, balance=False)
        s_lb, r_lb = sender_lower_bound(shape, training, rollout), receiver_lower_bound(shape, training, rollout)
        minimum = sum(p.minimum_bytes(r) for r in range(world))
        assert p.total_bytes == base.total_bytes == minimum
        print(f"| {title} | {cold:.2f} | {1e3 * statistics.median(hits):.3f} | {eplb:.2f} | {p.busiest_sender / GB:.3f} "
              f"| {s_lb / GB:.3f} | {p.busiest_sender / s_lb:.3f}x | {base.busiest_sender / GB:.3f}, "
              f"{base.busiest_sender / s_lb:.3f}x | {p.busiest_receiver / GB:.3f} | {r_lb / GB:.3f} "
              f"| {p.total_bytes / GB:.2f} GB = {minimum / GB:.2f} GB |")
        if rollout.first_rank:
            broadcast.append((title, shape, p, rollout))
    print()
    for title, shape, p, rollout in broadcast:
        every = shape.total_expert_bytes()
        print(f"{title}: a broadcast backend (verl's nccl / hccl) delivers every expert to every rollout rank, "
              f"{every / GB:.3f} GB each; the reshard's busiest rollout rank receives {p.busiest_receiver / GB:.3f} GB "
              f"({every / p.busiest_receiver:.2f}x less), the trainer ranks receive "
              f"{sum(p.bytes_received(r) for r in range(rollout.first_rank))} bytes.\n")


# ---------------------------------------------------------------------------------------------
# part 2: measured on gloo

MEASURE_SHAPE = MoEShape(num_layers=4, num_experts=16, hidden=256, ffn_hidden=128, dtype_bytes=4)
MEASURE_TRAINING = TrainingLayout(tp=2, ep=2, etp=1, expert_impl="grouped")
MEASURE_ROLLOUT = RolloutLayout.round_robin(1, 4, 16)


def _local_params(rank: int, world: int):
    import torch

    from ascend_rl_plugins.features.moe_reshard.layout import hf_expert_name, hf_to_megatron
    shape, t = MEASURE_SHAPE, MEASURE_TRAINING.with_world(world)
    g = torch.Generator().manual_seed(0)
    hf = {}
    for layer in shape.expert_layers:
        for e in range(shape.num_experts):
            for p in ("gate_proj", "up_proj", "down_proj"):
                size = (shape.hidden, shape.ffn_hidden) if p == "down_proj" else (shape.ffn_hidden, shape.hidden)
                hf[hf_expert_name(layer, e, p)] = torch.randn(size, generator=g)
    return hf, hf_to_megatron(hf, shape, t, rank)


def _stock_path(local, shape, t, rollout, rank, groups):
    """verl 0.6.1's shape of the work: per layer and local expert index, all_gather the expert's
    fc1 / fc2 over EP (list form), split fc1 into gate/up, keep only the hosted experts."""
    import torch
    import torch.distributed as dist

    from ascend_rl_plugins.features.moe_reshard.layout import expert_views, hf_expert_name
    c = t.coords(rank)
    group = groups[(c["pp"], c["etp"], c["edp"])]
    e_loc = t.local_experts(shape)
    hosted = set(rollout.hosted(shape, rank))
    out = []
    for layer in shape.expert_layers:
        p = f"decoder.layers.{layer}.mlp.experts."
        fc1 = {i: torch.cat([g, u], 0) for (i, _, g), (_, _, u) in
               zip(*[iter(expert_views(p + "weight1", local[p + "weight1"], shape, t))] * 2)}
        fc2 = {i: d.contiguous() for i, _, d in expert_views(p + "weight2", local[p + "weight2"], shape, t)}
        for i in range(e_loc):
            for which, tensor in (("fc1", fc1[i]), ("fc2", fc2[i])):
                gathered = [torch.empty_like(tensor) for _ in range(t.ep)]
                dist.all_gather(gathered, tensor, group=group)
                for k, full in enumerate(gathered):
                    e = k * e_loc + i
                    if e not in hosted:
                        continue
                    if which == "fc1":
                        gate, up = full.chunk(2, 0)
                        out += [(hf_expert_name(layer, e, "gate_proj"), gate), (hf_expert_name(layer, e, "up_proj"), up)]
                    else:
                        out.append((hf_expert_name(layer, e, "down_proj"), full))
    return out


def _measure_worker(rank: int, world: int, port: int, repeats: int, bucket_bytes: int, queue) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ascend_rl_plugins.features.moe_reshard.executor import reshard_experts
    shape, t, rollout = MEASURE_SHAPE, MEASURE_TRAINING.with_world(world), MEASURE_ROLLOUT
    hf, local = _local_params(rank, world)
    # EP groups: ranks sharing (pp, etp, edp); every rank creates every group in the same order
    members: dict = {}
    for r in range(world):
        c = t.coords(r)
        members.setdefault((c["pp"], c["etp"], c["edp"]), []).append(r)
    groups = {k: dist.new_group(v) for k, v in sorted(members.items())}

    def ours():
        got = []
        for name, tensor in reshard_experts(local, shape=shape, training=t, rollout=rollout, bucket_bytes=bucket_bytes):
            got.append((name, tensor.clone()))       # the loader's copy
        return got

    def stock():
        return [(n, x.clone()) for n, x in _stock_path(local, shape, t, rollout, rank, groups)]

    a, b = dict(ours()), dict(stock())
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) and torch.equal(a[k], hf[k]) for k in a)
    times = {"ours": [], "stock": []}
    for _ in range(repeats):
        for name, fn in (("stock", stock), ("ours", ours)):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    if rank == 0:
        queue.put(times)
    dist.barrier()
    dist.destroy_process_group()


def part2(repeats: int, bucket_bytes: int) -> None:
    import torch.multiprocessing as mp
    world = 4
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_measure_worker, args=(r, world, port, repeats, bucket_bytes, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    times = queue.get(timeout=900)
    for p in procs:
        p.join(timeout=300)
    shape = MEASURE_SHAPE
    p = plan(shape, MEASURE_TRAINING, MEASURE_ROLLOUT, bucket_bytes=bucket_bytes)
    stock, _ = stock_allgather(shape, MEASURE_TRAINING, world)
    print(f"## Measured on gloo: {world} processes, {len(shape.expert_layers)} layers x {shape.num_experts} experts, "
          f"hidden {shape.hidden}, moe ffn {shape.ffn_hidden}, fp32 ({shape.total_expert_bytes() / 2**20:.1f} MiB of "
          f"experts); train TP2/EP2/ETP1 GroupedMLP -> rollout DP4 EP4 round-robin; bucket "
          f"{bucket_bytes / 2**20:.2f} MiB ({len(p.rounds)} rounds); median of {repeats}\n")
    print("| path | wall (ms, median) | received per rank, max (MiB) | ratio vs all-gather |")
    print("|---|---|---|---|")
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    print(f"| all-gather over EP (stock shape) | {ms['stock']:.1f} | {max(stock) / 2**20:.2f} | 1.00x |")
    mine = max(p.bytes_received(r) for r in range(world))
    print(f"| reshard_experts | {ms['ours']:.1f} | {mine / 2**20:.2f} | {ms['stock'] / ms['ours']:.2f}x faster |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument("--measure-bucket-mb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-measure", action="store_true")
    args = ap.parse_args()
    try:
        part1(int(args.bucket_mb * 2**20))
        part1b(int(args.bucket_mb * 2**20))
    except PlanError as exc:
        print(f"plan error: {exc}")
        raise
    if not args.no_measure:
        part2(args.repeats, int(args.measure_bucket_mb * 2**20))


if __name__ == "__main__":
    main()
