"""Rollout mismatch: how far the trainer's log-probs are from the rollout engine's, on the same tokens.

A library function (``rollout_mismatch.metric.mismatch``) and the ``ascend-rl mismatch``
subcommand: mean / median / trimmed mean / p99 / max |delta log-prob|, the token-level KL
estimators k1/k2/k3 as verl's rollout correction defines them, and the share of tokens whose
importance ratio leaves a clip range. It patches nothing; it is how a quantized rollout
(FlashRL INT8, W4A16 with INT4 QAT) is checked against its trainer.

README.md beside this file: why, usage, measured figures. Remove when: never (it is a tool).
"""

from __future__ import annotations

from ...patching import Feature, Verified

FEATURE = Feature(
    "rollout_mismatch", "Trainer vs rollout log-prob mismatch on the same tokens (library + `ascend-rl mismatch`).",
    flag=None,
    verified=Verified(cpu_runtime="tiny Qwen3: HF transformers trainer (BF16 and INT4 fake-quant) vs a real "
                                  "vLLM 0.23 CPU engine serving BF16 and W4A16 (current stack); the metric "
                                  "itself on both stacks"),
    stacks="recipe, current")


def register_cli(subparsers) -> None:
    """``ascend-rl mismatch --trainer T --rollout R [--mask M] [--clip C] [--json]``."""
    from .cli import register
    register(subparsers)
