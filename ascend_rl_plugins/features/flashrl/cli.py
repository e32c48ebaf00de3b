"""``ascend-rl flashrl profile|setup|quantize`` (arguments compatible with FlashRL's ``flashrl``).

* ``profile -m BF16 -q INT8 -o PROFILE --fn int8``: derive the smoothing factors that
  turn the BF16 checkpoint into the W8A8 one (written as a safetensors profile).
* ``setup -m INT8 -p PROFILE --fn int8 -o CONFIG`` / ``setup -a --fn bf16 -o CONFIG``:
  write (or append to) the FlashRL config; rank r uses config r mod n.
* ``quantize -m BF16 -o INT8 [--profile P] [--scheme dynamic] [--fn int8|fp8_channel|fp8_tensor]``:
  this project's offline W8A8 quantizer (FlashRL has none; it expects an llm-compressor
  checkpoint).
* ``quantize -m BF16 -o W4A16 --fn w4a16 [--group-size 128] [--scope all|experts] [--preset ct|slime]``:
  compressed-tensors W4A16 ``pack-quantized`` (group-wise symmetric INT4) for vLLM, with
  the top-level ``group_size`` vLLM-Ascend reads; ``--scope experts`` quantizes routed
  experts only (slime). ``--group-size`` is the quantization group size (not GPTQ's
  column block size).
* ``quantize -m BF16 -o FP8 --fn fp8-block [--fp8-format fp8|ct] [--scope all|experts]``:
  128x128 block FP8 (``quant_method: fp8`` + ``weight_block_size`` + ``weight_scale_inv``,
  or compressed-tensors ``FP8_BLOCK``).

Only local paths are read; nothing is downloaded and ``usercustomize.py`` is never
edited (activation is the vLLM plugin entry point plus ``ASCEND_RL_FLASHRL``).
"""

from __future__ import annotations

import argparse
import os
import sys

SETUP_FNS = ("fp8", "fp8_fast", "fp8_vllm", "fp8_vllm_fast", "fp8_channel", "fp8_tensor", "int8", "int8_fast",
             "int8_wo_prune", "int8_prune", "w4a16", "fp8_block", "bf16")
NO_MODEL_FNS = ("bf16", "fp8_vllm", "fp8", "fp8_fast", "fp8_vllm_fast")


def _fail(msg: str) -> int:
    print(f"ascend-rl flashrl: error: {msg}", file=sys.stderr)
    return 2


def cmd_profile(args: argparse.Namespace) -> int:
    from .config import ConfigError, require_local_dir
    from .profile import ProfileError, derive_profile
    if not args.model:
        return _fail(f"-m/--model (the BF16 checkpoint) is required for --fn {args.fn}")
    try:
        require_local_dir(args.model, "-m/--model")
        require_local_dir(args.quantized, "-q/--quantized")
        prof = derive_profile(args.model, args.quantized, fn=args.fn)
    except (ConfigError, ProfileError, FileNotFoundError) as exc:
        return _fail(str(exc))
    prof.save(args.output)
    print(f"flashrl profile written to {args.output}: {len(prof.linears)} linears, scheme={prof.scheme}, "
          f"reproduces {100 * (prof.exact_fraction or 0):.4f}% of the checkpoint's quantized weights")
    return 0


def cmd_setup(args: argparse.Namespace) -> int:
    import ast

    from .config import ConfigError, RolloutConfig, write_config
    output = args.config_output or os.path.expanduser("~/.flashrl_config.yaml")
    if args.model is None and args.fn not in NO_MODEL_FNS:
        return _fail(f"-m/--model (the quantized checkpoint) is required for --fn {args.fn}")
    entry = RolloutConfig(fn=args.fn, model=args.model, profile=args.profile,
                          load_format="dummy" if args.fn == "bf16" else "auto")
    for column in args.columns:
        key, sep, value = column.partition("=")
        if not sep:
            return _fail(f"extra argument {column!r} must look like key=value")
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed = value
        if key in ("fn", "model", "profile", "load_format", "distributed_executor_backend"):
            setattr(entry, key, parsed)
        else:
            entry.extra[key] = parsed
    try:
        entry.validate("flashrl setup")
    except ConfigError as exc:
        return _fail(str(exc))
    configs = write_config(output, entry, append=args.append)
    print(f"flashrl config written to {output} ({len(configs)} config(s); rank r uses config r mod "
          f"{len(configs)}). Enable it with ASCEND_RL_FLASHRL={output}")
    return 0


LOW_PRECISION_FNS = ("w4a16", "fp8-block")


def _quantize_low_precision(args: argparse.Namespace) -> int:
    from .checkpoint import quantize_checkpoint_fp8_block, quantize_checkpoint_w4a16
    from .config import ConfigError, require_local_dir
    if args.profile:
        return _fail(f"--fn {args.fn} takes no smoothing profile (-p/--profile)")
    try:
        require_local_dir(args.model, "-m/--model")
        if args.fn == "w4a16":
            quantize_checkpoint_w4a16(args.model, args.output, group_size=args.group_size, scope=args.scope,
                                      preset=args.preset)
            what = f"W4A16 (int4 group {args.group_size}, preset {args.preset}, scope {args.scope})"
        else:
            quantize_checkpoint_fp8_block(args.model, args.output, fmt=args.fp8_format, scope=args.scope)
            what = f"block FP8 (128x128, format {args.fp8_format}, scope {args.scope})"
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        return _fail(str(exc))
    print(f"{what} checkpoint written to {args.output}")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from .checkpoint import quantize_checkpoint
    from .config import ConfigError, require_local_dir
    from .profile import Profile, ProfileError
    if args.fn in LOW_PRECISION_FNS:
        return _quantize_low_precision(args)
    if args.scope != "all":
        return _fail(f"--scope {args.scope} applies to --fn w4a16 / fp8-block only")
    try:
        require_local_dir(args.model, "-m/--model")
        prof = Profile.load(args.profile) if args.profile else None
        quantize_checkpoint(args.model, args.output, profile=prof, scheme=args.scheme, fn=args.fn)
    except (ConfigError, ProfileError, FileNotFoundError, ValueError) as exc:
        return _fail(str(exc))
    print(f"W8A8 {args.fn} ({args.scheme}) checkpoint written to {args.output}")
    return 0


def register(subparsers) -> None:
    from ...cli import needs
    fl = subparsers.add_parser("flashrl", help="FlashRL INT8/FP8 rollout: profile, setup, quantize",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = fl.add_subparsers(dest="flashrl_command", required=True)

    p = sub.add_parser("profile", help="derive the online-quantization profile from a BF16/W8A8 pair")
    p.add_argument("-m", "--model", default=None, help="local BF16 checkpoint directory")
    p.add_argument("-q", "--quantized", required=True, help="local W8A8 checkpoint directory made from it")
    p.add_argument("-o", "--output", required=True, help="profile file to write")
    p.add_argument("--fn", choices=["fp8", "int8", "fp8_channel", "fp8_tensor"], default="int8",
                   help="format of the quantized checkpoint (fp8 = fp8_channel)")
    p.set_defaults(func=cmd_profile)
    needs(p, "torch", "safetensors")

    s = sub.add_parser("setup", help="write or append a FlashRL rollout config")
    s.add_argument("-m", "--model", default=None, help="local W8A8 checkpoint directory")
    s.add_argument("-p", "--profile", default=None, help="profile file from `ascend-rl flashrl profile`")
    s.add_argument("--fn", choices=SETUP_FNS, default="int8", help="quantization function")
    s.add_argument("-o", "--config-output", default=None, help="config file (default ~/.flashrl_config.yaml)")
    s.add_argument("-a", "--append", action="store_true", help="append to the existing config file")
    s.add_argument("columns", nargs=argparse.REMAINDER, help="extra key=value entries for the config")
    s.set_defaults(func=cmd_setup)

    q = sub.add_parser("quantize", help="write a compressed-tensors W8A8 checkpoint from a BF16 one")
    q.add_argument("-m", "--model", required=True, help="local BF16 checkpoint directory")
    q.add_argument("-o", "--output", required=True, help="output directory")
    q.add_argument("-p", "--profile", default=None, help="smoothing factors (a profile file)")
    q.add_argument("--scheme", choices=["dynamic", "static"], default="dynamic")
    q.add_argument("--fn", choices=["int8", "int8_prune", "fp8_channel", "fp8_tensor", *LOW_PRECISION_FNS],
                   default="int8",
                   help="int8 W8A8; FP8 E4M3 W8A8 with per-channel / per-tensor weight scales; w4a16 "
                        "(group-wise INT4 weights); fp8-block (128x128 block FP8 weights)")
    q.add_argument("--group-size", type=int, choices=[32, 64, 128], default=128,
                   help="w4a16: input columns per INT4 scale (the quantization group size)")
    q.add_argument("--scope", choices=["all", "experts"], default="all",
                   help="w4a16 / fp8-block: quantize every decoder linear, or routed MoE experts only")
    q.add_argument("--preset", choices=["ct", "slime"], default="ct",
                   help="w4a16: ct = compressed-tensors' W4A16 formula (amax/7.5, [-8, 7]); "
                        "slime = amax/7, [-7, 7], bf16 scales")
    q.add_argument("--fp8-format", choices=["fp8", "ct"], default="fp8",
                   help="fp8-block: quant_method fp8 with weight_scale_inv, or compressed-tensors FP8_BLOCK")
    q.set_defaults(func=cmd_quantize)
    needs(q, "torch", "safetensors")
