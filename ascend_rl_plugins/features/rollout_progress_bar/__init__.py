"""Rollout progress bar: vLLM's tqdm bar during verl 0.6's SPMD rollout, on chosen ranks only.

verl 0.6.1's ``vLLMRollout.generate_sequences`` calls ``LLM.generate(..., use_tqdm=False)``,
so a rollout that runs for an hour shows nothing. Two wrappers, both scoped to that call:

* ``vLLMRollout.generate_sequences`` decides once per call whether this rank shows a bar
  (``ASCEND_RL_ROLLOUT_PROGRESS_BAR_RANKS``: global rank 0 only, the first rank of every
  rollout engine, or all ranks) and records it in a context variable for the duration of the
  call;
* ``LLM.generate`` turns ``use_tqdm`` on only while that variable says so, with the rank in
  the bar's description. Every other ``LLM.generate`` call in the process is untouched.

verl 0.9 rolls out through its async server (no ``LLM.generate``): the feature does not apply
there. README.md beside this file: why, flags, verified where.

Remove when: verl's SPMD rollout shows generation progress itself (it never will: verl 0.9
removed the SPMD rollout), i.e. when verl 0.6 is no longer run.
"""

from __future__ import annotations

import contextvars

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_ROLLOUT_PROGRESS_BAR", "bool", False,
    "Show vLLM's progress bar (tqdm, on stderr) while verl 0.6's SPMD rollout generates; "
    "see ASCEND_RL_ROLLOUT_PROGRESS_BAR_RANKS for which ranks print one.",
    feature="rollout_progress_bar")
RANKS = flags.define(
    "ASCEND_RL_ROLLOUT_PROGRESS_BAR_RANKS", "enum", "first",
    "Which rollout ranks print a bar: 'first' (global rank 0 only: one bar for the job), "
    "'engines' (the first rank of every rollout engine, i.e. tensor- and pipeline-parallel "
    "rank 0: one bar per data-parallel engine), 'all' (every rank, as the recipe's patch did).",
    choices=("first", "engines", "all"), feature="rollout_progress_bar")

FEATURE = Feature(
    "rollout_progress_bar", "vLLM's progress bar during verl 0.6's SPMD rollout, on chosen ranks.",
    flag=ENABLE, replaces="the recipe's verl patch 0002-verl-feature-set_use_tqdm_true",
    verified=Verified(cpu_runtime="real verl 0.6.1 vLLMRollout (tiny Qwen3, vLLM 0.13 on CPU): bar printed "
                                  "by generate_sequences, not by other generate calls, not on a rank "
                                  "the flag excludes (rank simulated)"),
    stacks="recipe")

FEATURE.does_not_apply(
    dist="verl", versions=">=0.9",
    why="verl 0.9 rolls out through its async server (AsyncLLM behind vLLMHttpServer); "
        "LLM.generate, where the bar lives, is never called by the rollout")

VERL_RANGE = ">=0.6,<0.9"
REMOVE_WHEN = "verl 0.6 (the SPMD rollout) is no longer run; verl 0.9 has no SPMD rollout"

# Set by the generate_sequences wrapper for the duration of one rollout call: the rank that
# shows a bar, or None when this rank shows none (or outside a rollout call).
_BAR_RANK: contextvars.ContextVar = contextvars.ContextVar("ascend_rl_rollout_bar_rank", default=None)


def shows_bar(mode: str, rank: int, engine_first_rank: bool) -> bool:
    """Does a rank print a bar? ``rank`` is the global rank, ``engine_first_rank`` whether it
    is tensor- and pipeline-parallel rank 0 of its rollout engine."""
    if mode == "all":
        return True
    if mode == "engines":
        return engine_first_rank
    if mode == "first":
        return rank == 0
    raise ValueError(f"ASCEND_RL_ROLLOUT_PROGRESS_BAR_RANKS={mode!r}; accepted: 'first', 'engines', 'all'")


def _global_rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _engine_first_rank(rollout) -> bool:
    """Tensor- and pipeline-parallel rank 0 in verl's rollout device mesh (dims dp, infer_tp,
    infer_pp); a rollout without such a mesh is one engine of its own."""
    mesh = getattr(rollout, "device_mesh", None)
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    return all(mesh[dim].get_local_rank() == 0 for dim in ("infer_tp", "infer_pp") if dim in names)


class RankLabelledBar:
    """A ``use_tqdm`` callable for vLLM: vLLM's own tqdm with the rank in the description."""

    def __init__(self, rank: int):
        self.rank = rank

    def __call__(self, *args, **kwargs):
        from tqdm.auto import tqdm  # what vLLM itself uses
        kwargs["desc"] = f"rollout rank {self.rank}: {kwargs.get('desc') or 'generating'}"
        return tqdm(*args, **kwargs)


@FEATURE.wrap("verl.workers.rollout.vllm_rollout.vllm_rollout_spmd:vLLMRollout.generate_sequences",
              name="rollout_progress_bar.generate_sequences", dist="verl", versions=VERL_RANGE, order=50,
              params=("self", "prompts"),
              reason="verl 0.6's SPMD rollout generates with use_tqdm=False; decide here, once per "
                     "rollout call, whether this rank shows a bar",
              replaces="recipe verl 0002 (use_tqdm=True on every rank)", remove_when=REMOVE_WHEN)
def _decide_bar(wrapped, instance, args, kwargs):
    rank = _global_rank()
    show = shows_bar(RANKS.value, rank, RANKS.value == "engines" and _engine_first_rank(instance))
    token = _BAR_RANK.set(rank if show else None)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _BAR_RANK.reset(token)


@FEATURE.wrap("vllm.entrypoints.llm:LLM.generate", name="rollout_progress_bar.llm_generate", dist="verl",
              versions=VERL_RANGE, order=50, params=("self", "use_tqdm"),
              reason="turn use_tqdm on for the LLM.generate call that verl 0.6's rollout makes, only "
                     "on the ranks chosen above; every other LLM.generate call is untouched",
              replaces="recipe verl 0002", remove_when=REMOVE_WHEN)
def _bar_inside_rollout(wrapped, instance, args, kwargs):
    rank = _BAR_RANK.get()
    if rank is not None:
        kwargs = dict(kwargs, use_tqdm=RankLabelledBar(rank))
    return wrapped(*args, **kwargs)
