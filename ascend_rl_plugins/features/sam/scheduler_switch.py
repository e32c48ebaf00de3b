"""Batch-size switch for speculation, at the scheduler (stable across vLLM 0.13 and 0.23).

Before the scheduler builds a step, if more requests than the threshold will run, the
pending drafts of running requests are dropped, so the step schedules one token per
request (plain decode) and the model runner takes its non-speculative path. Proposers keep
ingesting tokens while speculation is off (the SAM drafter sees every token of every
step), so when the batch drains into the long tail the automata are warm. The proposer
also skips drafting itself above the threshold, which saves its CPU time; this hook covers
the step where the batch grows after drafts were made. The ``SchedulerOutput`` is never
edited (``update_from_output`` relies on the scheduled spec tokens to roll back).
"""

from __future__ import annotations


def expected_batch_size(scheduler) -> int:
    """Requests that can run in the coming step: running + waiting, capped at max_num_seqs."""
    waiting = len(getattr(scheduler, "waiting", ()))
    cap = getattr(scheduler, "max_num_running_reqs", None)
    n = len(scheduler.running) + waiting
    return min(n, cap) if cap else n


def drop_drafts_over_threshold(scheduler, threshold: int) -> int:
    """Clear spec_token_ids of running requests when the batch exceeds ``threshold``.
    Returns how many requests lost their drafts."""
    if threshold <= 0 or expected_batch_size(scheduler) <= threshold:
        return 0
    dropped = 0
    for request in scheduler.running:
        if request.spec_token_ids:
            request.spec_token_ids = []
            dropped += 1
    return dropped
