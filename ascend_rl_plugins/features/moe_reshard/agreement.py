"""Every fallback is collective: the ranks decide together whether the reshard runs.

Why: the reshard is a collective (uneven all-to-alls over every rank), and the path it replaces
is one too (verl's all-gathers, a checkpoint engine's broadcast). If one rank refused -- its plan
failed validation, the planner refused its inputs, or anything raised while it prepared -- and
kept that to itself, it would take the stock path while the others resharded: a partial sync, or,
once the two paths' collectives meet, a deadlock. So every rank runs each preparation step under
:func:`attempt` (which turns any exception into a one-line reason instead of letting the rank
leave early), then all ranks exchange their :class:`Vote` in one ``all_gather_object`` and act
on the same answer: the first rank's reason, or none.

A vote also carries the plan's input digest (``planner.plan_key``): ranks that would plan from
different inputs (a flag set differently on one rank, a stale expert map) disagree on it, and
that is a reason too -- they would otherwise run two different plans against each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Vote:
    """What one rank says before a collective step: ``reason`` empty when it can take part;
    ``key`` the digest of the inputs it would plan from; ``payload`` what the others need from
    it (its rollout expert map)."""
    reason: str = ""
    key: str = ""
    payload: Any = field(default=None, compare=False)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def attempt(what: str, step: Callable[..., Any], *args, **kwargs) -> tuple[Any, str]:
    """``(step(*args, **kwargs), "")``, or ``(None, "<what>: <why>")`` if it raised anything: a
    rank that cannot prepare must still vote, never leave the others waiting in a collective."""
    from .planner import PlanError
    try:
        return step(*args, **kwargs), ""
    except PlanError as exc:
        return None, f"{what}: {one_line(exc)}"
    except Exception as exc:  # noqa: BLE001 -- any failure is a vote against, shared below
        return None, f"{what}: {type(exc).__name__}: {one_line(exc)}"


@dataclass(frozen=True)
class Outcome:
    """The common answer: ``reason`` empty when every rank can go ahead; ``votes`` by rank."""
    reason: str
    votes: tuple[Vote, ...]


def decide(vote: Vote, group=None, *, gather: Callable[[Any], list] | None = None) -> Outcome:
    """Collective over ``group`` (default WORLD): gather every rank's vote; the answer is the
    lowest refusing rank's reason (with how many others refused), else a disagreement of plan
    digests, else go. Every rank returns the same :class:`Outcome`.

    ``gather`` replaces ``all_gather_object`` over ``group`` (object -> every rank's object, by
    rank): a checkpoint engine's group of trainer and rollout processes is a process group of
    its own, outside ``torch.distributed``'s world."""
    if gather is not None:
        votes = list(gather(vote))
    else:
        import torch.distributed as dist
        votes = [None] * dist.get_world_size(group)
        dist.all_gather_object(votes, vote, group=group)
    refusals = [(r, v.reason) for r, v in enumerate(votes) if v.reason]
    if refusals:
        r, why = refusals[0]
        more = f" (and {len(refusals) - 1} more ranks)" if len(refusals) > 1 else ""
        return Outcome(f"rank {r}: {why}{more}", tuple(votes))
    keys = sorted({v.key for v in votes})
    if len(keys) > 1:
        first = {k: next(r for r, v in enumerate(votes) if v.key == k) for k in keys}
        shown = ", ".join(f"rank {first[k]} has {k[:12] or '-'}" for k in keys)
        return Outcome(f"ranks would plan from different inputs ({len(keys)} plan digests: {shown})", tuple(votes))
    return Outcome("", tuple(votes))
