"""Train-rollout log-prob mismatch on the same tokens.

``mismatch(trainer, rollout, mask=None, clip=0.2)`` compares the log-probabilities that the
trainer and the rollout engine assign to the *same* tokens and returns plain floats:

* ``abs_delta_mean`` / ``abs_delta_p99`` / ``abs_delta_max``: |trainer - rollout| over the
  tokens of the mask;
* robust companions that one outlier token cannot move much: ``abs_delta_median`` and
  ``abs_delta_trimmed_mean`` (the mean after leaving out the largest ``trim`` share of
  |delta|, at least one token);
* ``k1`` / ``k2`` / ``k3``: the token-level KL estimators of verl's rollout correction
  (verl 0.9.1, ``verl/trainer/ppo/rollout_corr_helper.py``, ``compute_rollout_rejection_mask``):
  with ``log_ratio = trainer - rollout`` clamped to ``[-20, 20]`` (its ``SAFETY_BOUND``),
  ``k1 = -log_ratio``, ``k2 = log_ratio**2 / 2``, ``k3 = exp(log_ratio) - 1 - log_ratio``,
  averaged over the mask tokens. ``k1``'s mean is also verl's ``kl`` metric
  (``compute_offpolicy_metrics``: ``mean(rollout - old)``), ``k3``'s its ``k3_kl``;
* ``chi2_token``: verl's ``mean(exp(log_ratio)**2) - 1``;
* ``share_outside_clip``: the share of tokens whose ratio ``exp(log_ratio)`` leaves
  ``[1 - clip, 1 + clip]`` (what PPO's clip would cut), ``share_ratio_above_2`` and
  ``share_ratio_below_half``.

Inputs: anything ``numpy.asarray`` accepts (torch tensors included), the same shape for
trainer and rollout (and mask, truthy = counted). Positions outside the mask may hold
anything (NaN / -inf padding); a non-finite value inside it is an error. Computed in float64.
"""

from __future__ import annotations

import math

SAFETY_BOUND = 20.0   # verl's clamp of log ratios before exp() (rollout_corr_helper.SAFETY_BOUND)
DEFAULT_CLIP = 0.2
DEFAULT_TRIM = 0.01

KEYS = ("tokens", "abs_delta_mean", "abs_delta_median", "abs_delta_trimmed_mean", "abs_delta_p99",
        "abs_delta_max", "delta_mean", "k1", "k2", "k3", "chi2_token", "share_outside_clip",
        "share_ratio_above_2", "share_ratio_below_half", "clip", "trim")


class MismatchError(ValueError):
    """The inputs cannot be compared (shapes, empty mask, non-finite values)."""


def _array(x, name: str):
    import numpy as np
    if hasattr(x, "detach"):   # torch tensor (bf16 included) without importing torch here
        x = x.detach().cpu().double().numpy()
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise MismatchError(f"{name}: not a numeric array ({exc})") from None


def token_deltas(trainer, rollout, mask=None):
    """``trainer - rollout`` (float64, 1-D) over the tokens of ``mask``."""
    import numpy as np
    t, r = _array(trainer, "trainer"), _array(rollout, "rollout")
    if t.shape != r.shape:
        raise MismatchError(f"trainer {t.shape} and rollout {r.shape} log-probs differ in shape: "
                            "they must be on the same tokens")
    if mask is None:
        m = np.ones(t.shape, dtype=bool)
    else:
        m = _array(mask, "mask") != 0
        if m.shape != t.shape:
            raise MismatchError(f"mask {m.shape} does not match the log-probs {t.shape}")
    delta = (t - r)[m]
    if delta.size == 0:
        raise MismatchError("no token to compare (the mask is empty)")
    bad = ~np.isfinite(delta)
    if bad.any():
        raise MismatchError(f"{int(bad.sum())} of {delta.size} masked tokens have a non-finite "
                            "log-prob; mask them out or fix the producer")
    return delta


def mismatch(trainer, rollout, mask=None, clip: float = DEFAULT_CLIP, trim: float = DEFAULT_TRIM) -> dict:
    """Mismatch statistics of trainer vs rollout log-probs on the same tokens (see the module
    docstring); a dict of floats with the keys of ``KEYS``."""
    import numpy as np
    if not 0.0 < clip < 1.0:
        raise MismatchError(f"clip={clip!r}: expected 0 < clip < 1 (the ratio range is [1-clip, 1+clip])")
    if not 0.0 <= trim < 0.5:
        raise MismatchError(f"trim={trim!r}: expected 0 <= trim < 0.5")
    delta = token_deltas(trainer, rollout, mask)
    n = delta.size
    absd = np.sort(np.abs(delta))
    dropped = max(1, int(math.floor(trim * n))) if n > 1 else 0
    log_ratio = np.clip(delta, -SAFETY_BOUND, SAFETY_BOUND)
    ratio = np.exp(log_ratio)
    return {
        "tokens": int(n),
        "abs_delta_mean": float(absd.mean()),
        "abs_delta_median": float(np.median(absd)),
        "abs_delta_trimmed_mean": float(absd[:n - dropped].mean()),
        "abs_delta_p99": float(np.quantile(absd, 0.99)),
        "abs_delta_max": float(absd[-1]),
        "delta_mean": float(delta.mean()),
        "k1": float((-log_ratio).mean()),
        "k2": float((0.5 * log_ratio ** 2).mean()),
        "k3": float((ratio - 1.0 - log_ratio).mean()),
        "chi2_token": float((ratio ** 2).mean() - 1.0),
        "share_outside_clip": float(((ratio < 1.0 - clip) | (ratio > 1.0 + clip)).mean()),
        "share_ratio_above_2": float((ratio > 2.0).mean()),
        "share_ratio_below_half": float((ratio < 0.5).mean()),
        "clip": float(clip),
        "trim": float(trim),
    }


def format_table(stats: dict) -> str:
    """A two-column text table of ``mismatch``'s result."""
    rows = [(k, stats[k]) for k in KEYS if k in stats]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v:.6g}" if isinstance(v, float) else f"{k:<{width}}  {v}"
                     for k, v in rows)
