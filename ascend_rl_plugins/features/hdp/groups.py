"""Sub-groups of the context-parallel group, one process group per rank tuple.

An HDP plan regroups the CP ranks per micro-batch; RoPE (on Megatron-Core 0.16, which takes
a ``cp_group``) and the ring attention of a group need a process group holding exactly the
group's ranks. ``torch.distributed.new_group`` is collective over its members, so groups
are created lazily with ``use_local_synchronization=True``: only the members call it, which
they all do at the same point of the same micro-batch (every CP rank holds the same plan),
and ranks of other CP groups (other data-parallel replicas with other plans) are never
involved. Each tuple is created once per process and cached; a group name derived from
the rank tuple (torch's hashed name for local synchronization) keeps two creations of
different tuples apart.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_cache: dict[tuple[int, ...], object] = {}


def global_ranks(group: tuple[int, ...], cp_global_ranks) -> tuple[int, ...]:
    """Global ranks of a plan group given in CP ranks."""
    return tuple(int(cp_global_ranks[r]) for r in group)


def sub_group(ranks: tuple[int, ...]):
    """The process group of exactly ``ranks`` (global ranks, in order); this rank must be one
    of them. Created on first use by the members only, then cached."""
    import torch.distributed as dist

    ranks = tuple(int(r) for r in ranks)
    if dist.get_rank() not in ranks:
        raise ValueError(f"rank {dist.get_rank()} asked for the sub-group {ranks} it is not in")
    with _lock:
        group = _cache.get(ranks)
        if group is None:
            if len(ranks) == dist.get_world_size() and list(ranks) == sorted(ranks):
                group = dist.group.WORLD
            else:
                group = dist.new_group(list(ranks), use_local_synchronization=True)
            _cache[ranks] = group
        return group


def clear() -> None:
    """Forget the cached groups (after ``destroy_process_group``)."""
    with _lock:
        _cache.clear()
