"""``ascend-rl moe-reshard convert|plan``.

* ``convert --direction hf-to-mcore|mcore-to-hf --expert-impl grouped|sequential|te_grouped
  -i SRC -o DST [--pp P --ep E --etp T --num-layers N]``: HF <-> Megatron-Core expert weights
  through layout.py's mapping (the same one the run-time reshard uses); see convert.py.
* ``plan --layers L --experts E --hidden H --ffn I --tp --pp --ep --etp --rollout-tp
  --rollout-dp [--pp-layers 23,24,24,23] [--no-rollout-ep] [--placement linear|round_robin] --bucket-mb B``: print what the
  reshard planner would move for a layout (bytes per rank, rounds, peak memory), or the one-line
  reason it cannot.

* ``verl09``: the verl 0.9 config overrides (and the flag) that select the checkpoint-engine backend
  ``ascend_rl_alltoallv`` (verl09_backend.py).

Heavy imports (torch, safetensors) happen inside the commands.
"""

from __future__ import annotations

import argparse
import sys


def _fail(msg: str) -> int:
    print(f"ascend-rl moe-reshard: error: {msg}", file=sys.stderr)
    return 2


def _layer_stages(spec: str | None) -> tuple[int, ...] | None:
    """``"23,24,24,23"`` (layers per pipeline stage) -> the stage of every layer."""
    if not spec:
        return None
    try:
        counts = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"--pp-layers wants comma-separated layer counts per stage, got {spec!r}") from None
    return tuple(stage for stage, n in enumerate(counts) for _ in range(n))


def cmd_convert(args: argparse.Namespace) -> int:
    from .convert import ConvertError, hf_to_mcore, mcore_to_hf
    from .layout import LayoutError, TrainingLayout
    try:
        if args.direction == "hf-to-mcore":
            training = TrainingLayout(tp=1, pp=args.pp, ep=args.ep, etp=args.etp, expert_impl=args.expert_impl,
                                      layer_stages=_layer_stages(args.pp_layers))
            meta = hf_to_mcore(args.input, args.output, training, num_layers=args.num_layers)
            print(f"wrote {len(meta['files'])} expert shard(s) ({args.expert_impl}) to {args.output}")
        else:
            written = mcore_to_hf(args.input, args.output)
            print(f"wrote {len(written)} safetensors file(s) to {args.output}")
    except (ConvertError, LayoutError, FileNotFoundError, ValueError) as exc:
        return _fail(str(exc))
    return 0


# plan's sizes that must be >= 1 (a zero or negative one gives an empty plan, which reads as "nothing
# to move" instead of a mistake)
_PLAN_POSITIVE = ("layers", "experts", "hidden", "ffn", "dtype_bytes", "tp", "pp", "vpp", "ep", "etp",
                  "rollout_tp", "rollout_dp", "ranks_per_node")


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def plan_argument_error(args: argparse.Namespace) -> str | None:
    """What is wrong with ``plan``'s arguments, in the options the user typed, or None.

    The planner checks the same layout, but in its own terms (``world``, ``etp*ep*pp``,
    ``layer_stages``): this says it as ``--rollout-tp`` x ``--rollout-dp``, ``--pp-layers`` and so
    on. What only the planner can tell (expert maps, bucket fits) still comes from it."""
    for dest in _PLAN_POSITIVE:
        value = getattr(args, dest)
        if value < 1:
            return f"{_option(dest)} {value} must be >= 1"
    if not args.bucket_mb > 0:
        return f"--bucket-mb {args.bucket_mb:g} must be > 0 (MiB per rank per round)"
    world = args.rollout_tp * args.rollout_dp
    # colocated: the training ranks are the rollout ranks, so the rollout's size is the training world
    colocated = (f"the world, --rollout-tp {args.rollout_tp} x --rollout-dp {args.rollout_dp} = {world} "
                 f"(training and rollout share the ranks),")
    if world % (args.tp * args.pp):
        return (f"{colocated} is not divisible by --tp {args.tp} x --pp {args.pp} = {args.tp * args.pp}; "
                f"make it a multiple of {args.tp * args.pp}")
    expert_grid = args.etp * args.ep * args.pp
    if world % expert_grid:
        return (f"{colocated} is not divisible by --etp {args.etp} x --ep {args.ep} x --pp {args.pp} = "
                f"{expert_grid}; make it a multiple of {expert_grid}")
    if args.experts % args.ep:
        return f"--experts {args.experts} is not divisible by --ep {args.ep}; give a multiple of --ep"
    if args.ffn % args.etp:
        return f"--ffn {args.ffn} is not divisible by --etp {args.etp}; give a multiple of --etp"
    if args.no_rollout_ep and args.ffn % world:
        return (f"--ffn {args.ffn} is not divisible by --rollout-tp {args.rollout_tp} x --rollout-dp "
                f"{args.rollout_dp} = {world} (with --no-rollout-ep every rollout rank holds a slice of "
                f"every expert)")
    if args.pp_layers:
        try:
            counts = [int(x) for x in args.pp_layers.split(",")]
        except ValueError:
            return f"--pp-layers wants comma-separated layer counts per stage, got {args.pp_layers!r}"
        if len(counts) != args.pp or any(n < 0 for n in counts) or sum(counts) != args.layers:
            return (f"--pp-layers {args.pp_layers} must give --pp {args.pp} layer counts (one per pipeline "
                    f"stage, each >= 0) adding up to --layers {args.layers}; it gives {len(counts)} "
                    f"adding up to {sum(counts)}")
    elif args.layers % (args.pp * args.vpp):
        return (f"--layers {args.layers} do not split evenly into --pp {args.pp} x --vpp {args.vpp} = "
                f"{args.pp * args.vpp} chunks; give --pp-layers (layers per stage, e.g. 23,24,24,23) "
                f"for an uneven split")
    return None


def cmd_plan(args: argparse.Namespace) -> int:
    from .layout import MoEShape, RolloutLayout, TrainingLayout
    from .planner import PlanError, plan
    wrong = plan_argument_error(args)
    if wrong is not None:
        return _fail(f"cannot plan: {wrong}")
    shape = MoEShape(args.layers, args.experts, args.hidden, args.ffn, dtype_bytes=args.dtype_bytes)
    stages = _layer_stages(args.pp_layers)
    training = TrainingLayout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, vpp=args.vpp, layer_stages=stages)
    if args.no_rollout_ep:
        rollout = RolloutLayout(args.rollout_tp, args.rollout_dp)
    elif args.placement == "round_robin":
        rollout = RolloutLayout.round_robin(args.rollout_tp, args.rollout_dp, args.experts)
    else:
        rollout = RolloutLayout.linear(args.rollout_tp, args.rollout_dp, args.experts)
    try:
        p = plan(shape, training, rollout, bucket_bytes=int(args.bucket_mb * 2**20), ranks_per_node=args.ranks_per_node)
    except PlanError as exc:
        return _fail(f"cannot plan: {exc}")
    world = p.world
    recv = [p.bytes_received(r) for r in range(world)]
    peak = [p.peak_extra_bytes(r) for r in range(world)]
    gib = 2**30
    print(f"world {world}, {len(p.rounds)} rounds, bucket {args.bucket_mb} MiB")
    print(f"received per rank: max {max(recv) / gib:.3f} GiB, total {sum(recv) / gib:.3f} GiB "
          f"(minimum {sum(p.minimum_bytes(r) for r in range(world)) / gib:.3f} GiB)")
    print(f"peak extra memory per rank: max {max(peak) / gib:.3f} GiB ({max(peak) / p.bucket_bytes:.2f} buckets)")
    print(f"plan digest {p.digest()[:16]}")
    return 0


def register_cli(subparsers) -> None:
    from ...cli import needs
    m = subparsers.add_parser("moe-reshard", help="MoE expert reshard: HF<->Megatron converter, reshard plans")
    sub = m.add_subparsers(dest="moe_reshard_command", required=True)
    c = sub.add_parser("convert", help="convert expert weights between HF and Megatron-Core layouts")
    c.add_argument("--direction", required=True, choices=("hf-to-mcore", "mcore-to-hf"))
    c.add_argument("--expert-impl", default="grouped", choices=("grouped", "sequential", "te_grouped"),
                   help="Megatron expert module (hf-to-mcore; mcore-to-hf reads it from moe_layout.json)")
    c.add_argument("-i", "--input", required=True, help="source directory")
    c.add_argument("-o", "--output", required=True, help="destination directory")
    c.add_argument("--pp", type=int, default=1, help="pipeline stages (even split of the layers)")
    c.add_argument("--ep", type=int, default=1, help="expert parallel size")
    c.add_argument("--etp", type=int, default=1, help="expert tensor parallel size")
    c.add_argument("--pp-layers", default=None, help="uneven pipeline split: layers per stage, e.g. 23,24,24,23")
    c.add_argument("--num-layers", type=int, default=None,
                   help="decoder layers (default: config.json's num_hidden_layers, else the last MoE layer + 1)")
    c.set_defaults(func=cmd_convert)
    needs(c, "torch", "safetensors")
    p = sub.add_parser("plan", help="what the reshard planner moves for a layout")
    for name, default in (("layers", None), ("experts", None), ("hidden", None), ("ffn", None)):
        p.add_argument(f"--{name}", type=int, required=default is None)
    p.add_argument("--dtype-bytes", type=int, default=2)
    for name in ("tp", "pp", "vpp", "ep", "etp", "rollout-tp", "rollout-dp"):
        p.add_argument(f"--{name}", type=int, default=1)
    p.add_argument("--pp-layers", default=None, help="uneven pipeline split: layers per stage, e.g. 23,24,24,23")
    p.add_argument("--no-rollout-ep", action="store_true", help="rollout without expert parallelism (TP narrow)")
    p.add_argument("--placement", choices=("linear", "round_robin"), default="linear")
    p.add_argument("--bucket-mb", type=float, default=512.0)
    p.add_argument("--ranks-per-node", type=int, default=16)
    p.set_defaults(func=cmd_plan)
    v = sub.add_parser("verl09", help="print the verl 0.9 config overrides that select the reshard's "
                                      "checkpoint-engine backend")
    v.set_defaults(func=cmd_verl09)


def cmd_verl09(args: argparse.Namespace) -> int:
    from . import verl09_config_lines
    print("export ASCEND_RL_MOE_RESHARD=auto   # hands the training engine to the backend (patch "
          "moe_reshard.hand_training_engine)")
    for line in verl09_config_lines():
        print(line)
    print("# colocated rollout (checkpoint_engine.backend=naive): ASCEND_RL_MOE_RESHARD=auto is all it needs "
          "(patch moe_reshard.colocated_export; expert maps from rollout.expert_parallel_size and "
          "rollout.engine_kwargs.vllm.expert_placement_strategy)")
    return 0
