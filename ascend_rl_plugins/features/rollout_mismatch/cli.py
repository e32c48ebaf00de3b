"""``ascend-rl mismatch --trainer T --rollout R [--mask M] [--clip 0.2] [--trim 0.01] [--json]``.

Each file holds token log-probs on the same tokens, in one of these forms (chosen by suffix):

* ``.pt``: ``torch.save`` of a tensor (any shape, e.g. ``[batch, seq]``) or of a list of 1-D
  tensors (one per sequence, ragged allowed);
* ``.npy``: a numpy array;
* ``.jsonl``: one JSON list of numbers per line (one sequence per line, ragged allowed;
  ``null`` marks a position without a log-prob, e.g. vLLM's first prompt token, and must be
  masked out -- without ``--mask`` such positions are left out of both sides).

Trainer and rollout must have the same shape (sequence by sequence for ragged inputs); the
mask the same again (non-zero = counted). The output is the table of
``rollout_mismatch.metric.mismatch`` or, with ``--json``, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


class InputError(ValueError):
    pass


def load(path: str, what: str):
    """A numpy array, or a list of 1-D float arrays (ragged sequences)."""
    import numpy as np
    if not os.path.isfile(path):
        raise InputError(f"{what}: {path} does not exist")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".npy":
        array = np.load(path, allow_pickle=False)
        if array.dtype.kind not in "biuf":
            raise InputError(f"{what}: {path} holds {array.dtype} values, not numbers")
        return array
    if suffix == ".jsonl":
        rows = []
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(f"{what}: {path} line {i} is not JSON ({exc.msg})") from None
                if not isinstance(row, list):
                    raise InputError(f"{what}: {path} line {i} is not a JSON list")
                bad = [(j, v) for j, v in enumerate(row)
                       if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))]
                if bad:
                    j, v = bad[0]
                    raise InputError(f"{what}: {path} line {i} position {j}: {v!r} is not a number "
                                     f"(accepted: numbers, or null for a position without a log-prob)")
                rows.append(np.array([np.nan if v is None else float(v) for v in row], dtype=np.float64))
        return rows
    if suffix == ".pt":
        import torch
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if torch.is_tensor(obj):
            return obj.detach().double().numpy()
        if isinstance(obj, (list, tuple)) and all(torch.is_tensor(t) for t in obj):
            return [t.detach().double().reshape(-1).numpy() for t in obj]
        raise InputError(f"{what}: {path} holds {type(obj).__name__}, not a tensor or a list of tensors")
    raise InputError(f"{what}: {path}: unknown format {suffix!r} (expected .pt, .npy or .jsonl)")


def flatten(trainer, rollout, mask):
    """Ragged inputs as flat arrays (checked sequence by sequence); arrays unchanged."""
    import numpy as np
    ragged = [isinstance(x, list) for x in (trainer, rollout) + ((mask,) if mask is not None else ())]
    if not any(ragged):
        return trainer, rollout, mask
    if not all(ragged):
        raise InputError("mix of ragged (.jsonl / list) and array inputs: use one form for all files")
    if len(trainer) != len(rollout) or (mask is not None and len(mask) != len(trainer)):
        raise InputError(f"sequence counts differ: trainer {len(trainer)}, rollout {len(rollout)}"
                         + ("" if mask is None else f", mask {len(mask)}"))
    for i, (t, r) in enumerate(zip(trainer, rollout)):
        if t.shape != r.shape or (mask is not None and mask[i].shape != t.shape):
            raise InputError(f"sequence {i}: lengths differ (trainer {t.size}, rollout {r.size}"
                             + ("" if mask is None else f", mask {mask[i].size}") + ")")
    t, r = np.concatenate(trainer), np.concatenate(rollout)
    m = np.concatenate(mask) if mask is not None else np.isfinite(t) & np.isfinite(r)
    return t, r, m


def cmd_mismatch(args: argparse.Namespace) -> int:
    from .metric import MismatchError, format_table, mismatch
    try:
        trainer = load(args.trainer, "--trainer")
        rollout = load(args.rollout, "--rollout")
        mask = load(args.mask, "--mask") if args.mask else None
        t, r, m = flatten(trainer, rollout, mask)
        stats = mismatch(t, r, m, clip=args.clip, trim=args.trim)
    except (InputError, MismatchError, json.JSONDecodeError) as exc:
        print(f"ascend-rl mismatch: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(stats, sort_keys=True) if args.json else format_table(stats))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "mismatch", help="trainer vs rollout log-prob mismatch on the same tokens (|delta|, verl's "
                         "k1/k2/k3, share outside the clip range)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", required=True, help="trainer log-probs (.pt, .npy or .jsonl)")
    p.add_argument("--rollout", required=True, help="rollout log-probs on the same tokens")
    p.add_argument("--mask", default=None, help="optional mask, same shape (non-zero = counted)")
    p.add_argument("--clip", type=float, default=0.2, help="ratio range [1-clip, 1+clip] (default 0.2)")
    p.add_argument("--trim", type=float, default=0.01,
                   help="share of the largest |delta| left out of the trimmed mean (default 0.01, at least 1 token)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.set_defaults(func=cmd_mismatch)
