"""Marks one feature leaves on a vLLM request for another feature to read.

Why a module below the features: rollout rebalance (``features/rollout_rebalance``) moves a
request to another engine together with its KV blocks, after its planner has checked the room
they need; the KV admission reserve (``features/kv_admission_reserve``) must then admit it
without holding back its reserve (the moved blocks would be evicted while it waits). The
writer and the reader both import this module, so neither imports the other feature.
"""

from __future__ import annotations

# attribute set on the request object; the reserve removes it once the request got its blocks
EXEMPT_FROM_RESERVE = "_ascend_rl_admit_without_reserve"


def admit_without_reserve(request) -> None:
    """Let ``request`` skip the reserve at its next admission only (rollout rebalance marks
    requests that arrive with their KV: its planner already checked the room they need)."""
    request.__dict__[EXEMPT_FROM_RESERVE] = True
