"""``ascend-rl hdp calibrate``: measure the cost model's numbers on this machine's device.

Why: the planner decides between HDP and fixed CP from a cost model, and the shipped default
is derived from assumed device numbers (``default_cost_model.json`` says UNCALIBRATED).
This command runs short timings of the kernels the model prices, on the local device and
its process group, fits the model's fields and writes the JSON the planner reads
(``ASCEND_RL_HDP_COST_MODEL``), marked ``"calibrated": true``:

- ``linear_per_token``: forward+backward of one layer's projections and MLP (the rank's
  tensor-parallel shard: ``hidden`` x ``(heads + 2 kv_heads) * head_dim / tp`` and back,
  ``hidden`` x ``2 * ffn_hidden / tp`` and back) on ``T`` tokens for a few ``T``; the slope
  of a least-squares line, times the layers of a stage;
- ``attention_per_token_pair``: causal ``scaled_dot_product_attention`` forward+backward on
  the rank's ``heads / tp`` heads for a few lengths ``L``; the fit ``t = a * L**2 / 2 + b * L``
  gives ``a`` (the report also gives it per head), times the layers;
- ring step latency and bandwidth **per group size**: for every group size ``g`` from 2 to
  the world size, the first ``g`` ranks exchange a buffer around their ring (``isend`` to
  the next, ``irecv`` from the previous, the ring attention's step) for a small and a large
  buffer; latency = the small exchange's time, bandwidth = the extra bytes over the extra
  time. The model's latency is per ring step of forward and backward over a stage's layers
  (``2 * layers`` exchanges, as ``CostModel.from_architecture`` counts);
- ``per_micro_batch_overhead``: the same tokens through the layer as 1 and as 4
  micro-batches, the difference per extra micro-batch, times the layers;
- ``relative_error``: the fitted model against measured packs of mixed lengths (linear work
  plus each sequence's causal attention, on one rank): the largest relative error, which the
  planner then requires a regrouping to gain (its margin).

``kv_bytes_per_token`` is not measured: it follows from the shape (``kv_heads * (qk_head_dim +
v_head_dim) / tp`` elements per token and layer, forward K/V plus backward K/V/dK/dV = 3x).
The kernels are proxies of the real model's layer (same sizes, not its MoE routing or its
fused kernels); on an Atlas A3 run it under the training launch (``torchrun`` with HCCL), on
the training's CP ranks, so the ring numbers are those of the real links. ``--quick`` runs
tiny sizes (CI, on CPU with gloo: the numbers then describe that CPU, nothing else).

Every rank runs the same timings (in lockstep, the ring ones need it); each figure is the
largest over the ranks. Rank 0 writes the file.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from .cost_model import CostModel

# the locally spawned ranks' rendezvous: as long as torch's own default for init_process_group
STORE_TIMEOUT_S = 600


@dataclass(frozen=True)
class Shape:
    """The model's sizes the kernels are run with (one layer of one pipeline stage)."""

    hidden: int = 4096
    ffn_hidden: int = 12288
    heads: int = 64
    kv_heads: int = 4
    qk_head_dim: int = 128
    v_head_dim: int = 128
    layers: int = 24  # layers of one pipeline stage
    tp: int = 4
    bytes_per_element: int = 2

    @classmethod
    def quick(cls) -> "Shape":
        return cls(hidden=64, ffn_hidden=128, heads=4, kv_heads=2, qk_head_dim=16, v_head_dim=16,
                   layers=2, tp=1, bytes_per_element=4)


@dataclass(frozen=True)
class Sizes:
    """What is timed: token counts, sequence lengths, ring buffer bytes, repeats."""

    tokens: tuple[int, ...] = (2048, 4096, 8192)
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    ring_bytes: tuple[int, int] = (4096, 64 * 2 ** 20)
    repeats: int = 5
    packs: tuple[tuple[int, ...], ...] = ((4096, 512, 256), (2048, 2048, 1024, 128),
                                          (8192,), (640,) * 8)

    @classmethod
    def quick(cls) -> "Sizes":
        return cls(tokens=(64, 128, 256), lengths=(64, 128, 256), ring_bytes=(1024, 2 ** 18),
                   repeats=3, packs=((256, 32, 16), (128, 128, 64), (256,), (48,) * 6))


@dataclass(frozen=True)
class RingFit:
    group_size: int
    latency_s: float  # one exchange of the small buffer
    bytes_per_s: float


@dataclass(frozen=True)
class Report:
    """Everything measured, and the model fitted from it."""

    device: str
    world_size: int
    shape: Shape
    linear_s_per_token_per_layer: float
    attention_s_per_pair_per_layer: float
    attention_s_per_pair_per_head: float
    overhead_s_per_micro_batch_per_layer: float
    rings: tuple[RingFit, ...]
    pack_errors: tuple[float, ...]
    model: CostModel


def _device():
    import torch
    try:
        import torch_npu  # noqa: F401  (registers the NPU device)
        if torch.npu.is_available():
            return torch.device("npu", int(os.environ.get("LOCAL_RANK", 0)))
    except ImportError:
        pass
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def _timed(fn, device, repeats: int) -> float:
    """Median seconds of ``fn()`` after one warm-up run, the device synchronized around each."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _max_over_ranks(values: list[float], device) -> list[float]:
    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64,
                     device=device if dist.get_backend() != "gloo" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(x) for x in t.tolist()]


def _least_squares(columns: list[list[float]], y: list[float]) -> list[float]:
    import numpy as np
    coef, *_ = np.linalg.lstsq(np.array(columns, dtype=np.float64).T, np.array(y), rcond=None)
    return [float(c) for c in coef]


def _positive_slope(main: list[float], others: list[list[float]], y: list[float]) -> tuple[float, bool]:
    """The coefficient of ``main`` in the least-squares fit of ``y`` on ``main`` and ``others``;
    where noise makes it non-positive (short timings on a busy machine), the proportional fit
    ``y ~ a * main`` instead, which is positive for positive times. A cost of zero is never
    written: it would price the work as free. Returns (coefficient, whether it fell back)."""
    coef = _least_squares([main, *others], y)[0]
    if coef > 0:
        return coef, False
    return sum(m * t for m, t in zip(main, y)) / sum(m * m for m in main), True


class _Layer:
    """One layer's projections and MLP, the rank's tensor-parallel shard (forward+backward)."""

    def __init__(self, shape: Shape, device, dtype):
        import torch
        qkv = (shape.heads * shape.qk_head_dim + shape.kv_heads * (shape.qk_head_dim
                                                                   + shape.v_head_dim)) // shape.tp
        out = shape.heads * shape.v_head_dim // shape.tp
        ffn = 2 * shape.ffn_hidden // shape.tp
        g = torch.Generator(device="cpu").manual_seed(0)

        def weight(rows, cols):
            w = torch.randn(rows, cols, generator=g, dtype=torch.float32) / rows ** 0.5
            return w.to(device=device, dtype=dtype).requires_grad_(True)

        self.weights = [weight(shape.hidden, qkv), weight(out, shape.hidden),
                        weight(shape.hidden, ffn), weight(ffn // 2, shape.hidden)]
        self.out_width = out
        self.shape, self.device, self.dtype = shape, device, dtype

    def run(self, tokens: int) -> None:
        import torch
        w_qkv, w_o, w_up, w_down = self.weights
        x = torch.randn(tokens, self.shape.hidden, device=self.device, dtype=self.dtype,
                        requires_grad=True)
        qkv = x @ w_qkv
        h = x + qkv[:, :self.out_width] @ w_o
        up = h @ w_up
        gate, value = up.chunk(2, dim=-1)
        y = h + (torch.nn.functional.silu(gate) * value) @ w_down
        y.float().square().mean().backward()


def _attention(shape: Shape, device, dtype, lengths) -> None:
    """Causal attention forward+backward of each sequence of ``lengths`` (one rank's heads)."""
    import torch
    heads = max(1, shape.heads // shape.tp)
    for length in lengths:
        q = torch.randn(1, heads, length, shape.qk_head_dim, device=device, dtype=dtype,
                        requires_grad=True)
        k = torch.randn_like(q, requires_grad=True)
        v = torch.randn(1, heads, length, shape.v_head_dim, device=device, dtype=dtype,
                        requires_grad=True)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.float().square().mean().backward()


def _ring_exchange(group_ranks: list[int], group, buffer, receive) -> None:
    import torch.distributed as dist
    me = dist.get_rank()
    i = group_ranks.index(me)
    nxt, prev = group_ranks[(i + 1) % len(group_ranks)], group_ranks[i - 1]
    ops = [dist.P2POp(dist.isend, buffer, nxt, group), dist.P2POp(dist.irecv, receive, prev, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()


def measure(shape: Shape, sizes: Sizes) -> Report:
    """Run every timing on this rank (all ranks of the initialized process group call it
    together) and fit the model."""
    import torch
    import torch.distributed as dist

    device = _device()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    layer = _Layer(shape, device, dtype)
    # linear: seconds per token (slope over token counts)
    linear_t = [_timed(lambda n=n: layer.run(n), device, sizes.repeats) for n in sizes.tokens]
    linear_t = _max_over_ranks(linear_t, device)
    linear, linear_fallback = _positive_slope(list(map(float, sizes.tokens)), [[1.0] * len(sizes.tokens)], linear_t)
    # attention: t = a * L**2 / 2 + b * L
    attn_t = [_timed(lambda n=n: _attention(shape, device, dtype, [n]), device, sizes.repeats)
              for n in sizes.lengths]
    attn_t = _max_over_ranks(attn_t, device)
    pair, pair_fallback = _positive_slope([x * x / 2.0 for x in sizes.lengths], [[float(x) for x in sizes.lengths]],
                                          attn_t)
    # per-micro-batch overhead: the same tokens as 1 and as 4 micro-batches
    total = sizes.tokens[-1]
    one = _timed(lambda: layer.run(total), device, sizes.repeats)
    four = _timed(lambda: [layer.run(total // 4) for _ in range(4)], device, sizes.repeats)
    one, four = _max_over_ranks([one, four], device)
    overhead = max(0.0, (four - one) / 3.0)
    # rings: every group size 2..world, the first g ranks
    rings = []
    world = dist.get_world_size() if dist.is_initialized() else 1
    for g in range(2, world + 1):
        ranks = list(range(g))
        group = dist.new_group(ranks)
        times = []
        for nbytes in sizes.ring_bytes:
            n = max(1, nbytes // 4)
            buf = torch.ones(n, dtype=torch.float32, device=device)
            recv = torch.empty_like(buf)
            if dist.get_rank() in ranks:
                t = _timed(lambda: _ring_exchange(ranks, group, buf, recv), device, sizes.repeats)
            else:
                t = 0.0
            times.append(t)
        small, large = _max_over_ranks(times, device)
        if large > small:  # the extra bytes over the extra time
            bandwidth = (sizes.ring_bytes[1] - sizes.ring_bytes[0]) / (large - small)
        else:  # no measurable difference (latency-bound): the large buffer over its whole time
            bandwidth = sizes.ring_bytes[1] / large
        rings.append(RingFit(g, small, bandwidth))
        dist.barrier()
    heads = max(1, shape.heads // shape.tp)
    kv_bytes = (shape.kv_heads * (shape.qk_head_dim + shape.v_head_dim) / shape.tp
                * shape.bytes_per_element * 3.0 * shape.layers)
    ring_by_size = {str(r.group_size): {"ring_step_latency": 2.0 * shape.layers * r.latency_s,
                                        "link_bytes_per_s": r.bytes_per_s} for r in rings}
    base_latency, base_bw = ((ring_by_size[str(world)]["ring_step_latency"],
                              ring_by_size[str(world)]["link_bytes_per_s"]) if rings else (0.0, 1e12))
    # the model's error on measured packs (one rank: linear work plus each sequence's attention)
    errors = []
    for pack in sizes.packs:
        measured = _timed(lambda p=pack: (layer.run(sum(p)), _attention(shape, device, dtype, p)),
                          device, sizes.repeats)
        measured = _max_over_ranks([measured], device)[0]
        predicted = linear * sum(pack) + pair * sum(x * x for x in pack) / 2.0
        errors.append(abs(predicted - measured) / measured)
    error = min(max(errors), 0.99)
    layers = shape.layers
    model = CostModel(
        linear_per_token=linear * layers, attention_per_token_pair=pair * layers,
        kv_bytes_per_token=kv_bytes, link_bytes_per_s=base_bw, ring_step_latency=base_latency,
        per_micro_batch_overhead=overhead * layers, relative_error=error,
        ring_by_group_size=ring_by_size, calibrated=True,
        comment=(f"CALIBRATED by `ascend-rl hdp calibrate` on {device.type} ({world} ranks, "
                 f"{dist.get_backend() if dist.is_initialized() else 'no process group'}) at "
                 f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; kernels of one layer "
                 f"(hidden {shape.hidden}, ffn {shape.ffn_hidden}, {shape.heads} q / "
                 f"{shape.kv_heads} kv heads, head dims {shape.qk_head_dim}/{shape.v_head_dim}, "
                 f"TP{shape.tp}) times {layers} layers per stage; kv_bytes_per_token from the "
                 f"shape, not measured; largest error on measured packs {max(errors):.3f}"
                 + "".join(f"; {what}: noisy timings, proportional fit" for what, fell in
                           (("linear", linear_fallback), ("attention", pair_fallback)) if fell)))
    return Report(device.type, world, shape, linear, pair, pair / heads, overhead, tuple(rings),
                  tuple(errors), model)


def _init_group(store=None) -> None:
    """The process group: from torchrun's environment, or over ``store`` (a client of the
    launching process's store, for locally spawned ranks)."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    device = _device()
    backend = {"npu": "hccl", "cuda": "nccl"}.get(device.type, "gloo")
    if device.type != "cpu":
        import torch
        getattr(torch, device.type).set_device(device)
    if store is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))


def _worker(rank: int, world: int, port: int, shape: Shape, sizes: Sizes, out: str) -> None:
    """One locally spawned rank (when not launched by torchrun): a client of the store the
    launching process already listens on (:func:`_rendezvous_store`)."""
    import torch.distributed as dist
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    run(shape, sizes, out, store=dist.TCPStore("127.0.0.1", port, world, False,
                                               timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S)))


def _rendezvous_store():
    """The locally spawned ranks' store, listening before any rank starts, on a port the kernel
    picks (``store.port``) and holds until the calibration ends. A port merely found free and
    handed to the ranks (bind port 0, close, pass the number on) can be taken by any other bind
    or outgoing connection on the machine before rank 0 listens on it: EADDRINUSE."""
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
                         wait_for_workers=False)


def run(shape: Shape, sizes: Sizes, out: str, store=None) -> Report:
    """Measure on every rank of the (possibly new) process group; rank 0 writes ``out``.
    ``store``: the locally spawned ranks' rendezvous (None under torchrun)."""
    import torch.distributed as dist
    _init_group(store)
    try:
        report = measure(shape, sizes)
        if dist.get_rank() == 0:
            with open(out, "w", encoding="utf-8") as fh:
                json.dump(report.model.to_dict(), fh, indent=2)
                fh.write("\n")
            with open(out + ".report.json", "w", encoding="utf-8") as fh:
                json.dump(asdict(report), fh, indent=2, default=str)
                fh.write("\n")
        dist.barrier()
        return report
    finally:
        dist.destroy_process_group()


def cmd_calibrate(args) -> int:
    for name in ("nproc", "hidden", "ffn_hidden", "heads", "kv_heads", "qk_head_dim", "v_head_dim",
                 "layers", "tp"):
        if getattr(args, name) < 1:
            print(f"ascend-rl hdp calibrate: --{name.replace('_', '-')}={getattr(args, name)}: expected "
                  f"an integer >= 1", file=sys.stderr)
            return 2
    if args.heads % args.tp or args.kv_heads % args.tp and args.kv_heads >= args.tp:
        print(f"ascend-rl hdp calibrate: --heads={args.heads} / --kv-heads={args.kv_heads} with "
              f"--tp={args.tp}: head counts must divide by the tensor parallel size", file=sys.stderr)
        return 2
    if args.quick:
        shape, sizes = Shape.quick(), Sizes.quick()
    else:
        shape, sizes = Shape(hidden=args.hidden, ffn_hidden=args.ffn_hidden, heads=args.heads,
                             kv_heads=args.kv_heads, qk_head_dim=args.qk_head_dim,
                             v_head_dim=args.v_head_dim, layers=args.layers, tp=args.tp), Sizes()
    out = os.path.abspath(args.out)
    if "WORLD_SIZE" in os.environ:  # launched by torchrun: this process is one rank
        run(shape, sizes, out)
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
    else:
        import torch.multiprocessing as mp
        store = _rendezvous_store()
        mp.start_processes(_worker, args=(args.nproc, store.port, shape, sizes, out),
                           nprocs=args.nproc, start_method="spawn")
        del store
    with open(out + ".report.json", encoding="utf-8") as fh:
        report = json.load(fh)
    model = CostModel.load(out)
    print(f"ascend-rl hdp calibrate: wrote {out} (calibrated on {report['device']}, "
          f"{report['world_size']} ranks; raw figures in {out}.report.json)")
    per_layer = (("linear s/token/layer", report["linear_s_per_token_per_layer"]),
                 ("attention s/pair/head/layer", report["attention_s_per_pair_per_head"]),
                 ("overhead s/micro-batch/layer", report["overhead_s_per_micro_batch_per_layer"]))
    for name, value in per_layer:
        print(f"  {name:<30} {value:.4g}")
    for ring in report["rings"]:
        print(f"  ring g={ring['group_size']:<3} latency {ring['latency_s']:.4g} s, "
              f"{ring['bytes_per_s'] / 1e9:.4g} GB/s")
    print(f"  model error on measured packs: {', '.join(f'{e:.3f}' for e in report['pack_errors'])}"
          f" (relative_error = {model.relative_error:.3f}: the planner's margin)")
    print(f"use it: ASCEND_RL_HDP_COST_MODEL={out}")
    return 0


def register(subparsers) -> None:
    from ...cli import needs
    hdp = subparsers.add_parser("hdp", help="HDP: calibrate the planner's cost model on this device")
    sub = hdp.add_subparsers(dest="hdp_command", required=True)
    c = sub.add_parser("calibrate", help="time the kernels the cost model prices (linear, attention, ring "
                                         "per group size, per-micro-batch overhead) and write its JSON")
    c.add_argument("--out", required=True, help="where to write the cost model JSON")
    c.add_argument("--quick", action="store_true",
                   help="tiny sizes (CI; on CPU with gloo the numbers describe that CPU only)")
    c.add_argument("--nproc", type=int, default=2,
                   help="ranks to spawn locally when not launched by torchrun (default 2)")
    defaults = Shape()
    for name in ("hidden", "ffn_hidden", "heads", "kv_heads", "qk_head_dim", "v_head_dim", "layers", "tp"):
        c.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name),
                       help=f"the model's {name.replace('_', ' ')} (default {getattr(defaults, name)})")
    c.set_defaults(func=cmd_calibrate)
    needs(c, "torch", "numpy")

