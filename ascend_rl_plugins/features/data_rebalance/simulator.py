"""A long-tail generation simulator for the data rebalance (used by the benchmark and tests).

One scenario: ``prompts`` prompts with ``n`` samples each, generated on ``ranks`` DP ranks.

- Prompt difficulty is heavy-tailed across prompts: a prompt's typical response length ``mu``
  is lognormal (``tail="lognormal"``, log-sd ``sigma_between``) or Pareto (``tail="pareto"``,
  shape ``pareto_alpha``) around ``median_len``.
- Response lengths are correlated within a prompt's group: ``mu * exp(N(0, sigma_within))``,
  clipped to ``[1, max_len]`` (truncation at the response limit, as in RL rollouts).
- History: what an earlier epoch saw of the same prompt, a different draw of its ``n`` lengths
  from a ``mu`` that has since drifted by ``exp(N(0, drift))`` (the policy changed).
- Prompt lengths: lognormal around ``prompt_median``, clipped to ``[8, prompt_max]``.
- A rank decodes its samples in dispatch order with at most ``max_seqs`` running at once (0:
  all at once); a decode step costs ``step_overhead + running sequences`` (time unit: one
  sequence's share of a step), a prompt token's prefill ``prefill_per_token``. A rank's time is
  therefore ``step_overhead * steps + sum(lengths) + prefill_per_token * sum(prompt_len)``,
  ``steps`` being when its last sample finishes (list scheduling on ``max_seqs`` slots); the
  makespan is the slowest rank's.
- Lower bound on the makespan of *any* assignment with equal per-rank counts and any order:
  the larger of the time of the rank that holds the longest sample (at least that sample and
  the ``N/ranks - 1`` shortest others) and the mean rank time (the ranks' decode steps add up to
  at least the sum of the ``(k*N/ranks+1)``-th longest lengths, ``k = 0..ranks-1``, and to at
  least ``sum(lengths) / max_seqs``).

numpy + numba only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .planner import CostModel, decode_steps, plan, seed_order


@dataclass(frozen=True)
class Scenario:
    name: str
    prompts: int = 128
    n: int = 8
    ranks: int = 16
    median_len: float = 2000.0
    tail: str = "lognormal"  # or "pareto"
    sigma_between: float = 0.8
    pareto_alpha: float = 1.5
    sigma_within: float = 0.35
    max_len: int = 16384
    drift: float = 0.3
    history: bool = True
    prompt_median: float = 300.0
    prompt_max: int = 2048
    step_overhead: float = 48.0
    max_seqs: int = 0
    prefill_per_token: float = 0.01

    def __post_init__(self):
        if self.tail not in ("lognormal", "pareto"):
            raise ValueError(f"tail must be 'lognormal' or 'pareto', got {self.tail!r}")
        if (self.prompts * self.n) % self.ranks:
            raise ValueError(f"{self.prompts} x {self.n} samples do not split over {self.ranks} ranks")


@dataclass(frozen=True)
class Draw:
    """One realization, flattened in the interleaved GRPO layout (sample ``j`` of prompt ``i``
    at ``i*n+j``)."""

    lengths: np.ndarray  # realized response lengths
    prompt_len: np.ndarray
    group: np.ndarray
    est: np.ndarray  # what the planner knows: past mean per prompt, or one common value


def draw(s: Scenario, rng: np.random.Generator) -> Draw:
    if s.tail == "lognormal":
        mu = s.median_len * np.exp(rng.normal(0.0, s.sigma_between, s.prompts))
    else:  # Pareto with its median at median_len
        mu = s.median_len / 2 ** (1 / s.pareto_alpha) * (1.0 + rng.pareto(s.pareto_alpha, s.prompts))

    def lengths(centre):
        raw = centre[:, None] * np.exp(rng.normal(0.0, s.sigma_within, (s.prompts, s.n)))
        return np.clip(np.rint(raw), 1, s.max_len)

    now = mu * np.exp(rng.normal(0.0, s.drift, s.prompts))
    realized = lengths(now).reshape(-1)
    if s.history:
        est = np.repeat(lengths(mu).mean(axis=1), s.n)
    else:
        est = np.full(s.prompts * s.n, s.median_len)
    prompt = np.clip(np.rint(s.prompt_median * np.exp(rng.normal(0.0, 0.5, s.prompts))), 8, s.prompt_max)
    return Draw(realized, np.repeat(prompt, s.n), np.repeat(np.arange(s.prompts), s.n), est)


def rank_times(order: np.ndarray, d: Draw, s: Scenario) -> np.ndarray:
    per_rank = len(order) // s.ranks
    lengths = d.lengths[order].reshape(s.ranks, per_rank)
    prompts = d.prompt_len[order].reshape(s.ranks, per_rank)
    steps = np.array([decode_steps(np.ascontiguousarray(row), s.max_seqs) for row in lengths])
    return s.step_overhead * steps + lengths.sum(axis=1) + s.prefill_per_token * prompts.sum(axis=1)


def lower_bound(d: Draw, s: Scenario) -> float:
    per_rank = len(d.lengths) // s.ranks
    desc = np.sort(d.lengths)[::-1]
    total = desc.sum()
    # the rank holding the longest sample: at least it and the per_rank - 1 shortest others
    holder = (s.step_overhead * desc[0] + desc[0] + desc[len(desc) - per_rank + 1:].sum()
              + s.prefill_per_token * np.sort(d.prompt_len)[:per_rank].sum())
    steps = desc[::per_rank][: s.ranks].sum()
    if s.max_seqs > 0:
        steps = max(steps, total / s.max_seqs)
    average = (s.step_overhead * steps + total + s.prefill_per_token * d.prompt_len.sum()) / s.ranks
    return float(max(holder, average))


def orders(d: Draw, s: Scenario, model: CostModel) -> dict:
    """The dispatch orders compared: no rebalance, the seed's permutation, this project's."""
    n_samples = len(d.lengths)
    ours = plan(d.est, d.prompt_len, d.group, s.ranks, model)
    return {"none": np.arange(n_samples), "seed": seed_order(n_samples, s.n), "ours": ours.order,
            "_plan": ours}


def run(s: Scenario, trials: int = 20, seed: int = 0, model: CostModel | None = None) -> dict:
    """Mean makespan / lower bound of each order over ``trials`` draws, and how often the
    planner kept the seed's order."""
    model = model or CostModel(max_seqs=s.max_seqs, max_len=s.max_len)
    rng = np.random.default_rng(seed)
    ratios = {"none": [], "seed": [], "ours": []}
    kept_seed = 0
    for _ in range(trials):
        d = draw(s, rng)
        bound = lower_bound(d, s)
        candidates = orders(d, s, model)
        kept_seed += candidates.pop("_plan").chosen != "balanced"
        for name, order in candidates.items():
            ratios[name].append(rank_times(order, d, s).max() / bound)
    out = {name: float(np.mean(v)) for name, v in ratios.items()}
    out["lower_bound"] = 1.0
    out["kept_seed"] = kept_seed / trials
    return out

