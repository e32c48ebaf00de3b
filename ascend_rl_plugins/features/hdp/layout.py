"""One rank's share of one micro-batch under an HDP plan (pure Python, no torch import).

A micro-batch plan partitions the ``cp_size`` ranks of a context-parallel group into groups
and gives each sequence (batch row) one group. Every rank is in exactly one group, so for
one micro-batch a rank has one (group size ``g``, position ``p``): it computes every
sequence of its group, each padded to a multiple of ``2 * g * tp`` (``tp`` when ``g == 1``,
as verl pads for ``cp_size == 1``) and cut into ``2 * g`` equal chunks of which it holds
chunks ``p`` and ``2g - 1 - p`` -- Megatron's load-balanced causal split, inside the
group. Everything a rank needs about the others (what each holds, how long each one's
packed output is) follows from the plan, so nothing but outputs has to be exchanged.

The layout is attached to the micro-batch's ``cu_seqlens`` tensors (see :func:`attach`),
which travel inside ``PackedSeqParams`` to attention and RoPE and are saved with it for
activation recompute: a recomputed layer sees the layout of *its* micro-batch, never a
process global that a later micro-batch has overwritten (the seed's bug with PP > 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

ATTRIBUTE = "_ascend_rl_hdp_layout"


def zigzag_ranges(padded_length: int, group_size: int, position: int) -> list[tuple[int, int]]:
    """The token ranges of a padded sequence that ``position`` of a ``group_size`` group holds:
    chunks ``position`` and ``2g - 1 - position`` of ``2g`` equal chunks (the whole sequence
    when ``g == 1``). Mirrors ``split_for_group`` of planner.py, which the tests compare."""
    if group_size == 1:
        return [(0, padded_length)]
    chunk = padded_length // (2 * group_size)
    if chunk * 2 * group_size != padded_length:
        raise ValueError(f"padded length {padded_length} is not a multiple of 2 * {group_size}")
    first, second = position, 2 * group_size - 1 - position
    return [(first * chunk, (first + 1) * chunk), (second * chunk, (second + 1) * chunk)]


def align_for(group_size: int, tp: int) -> int:
    """Per-sequence padding multiple for a group (verl's rule with ``cp_size = group_size``)."""
    return tp * group_size * 2 if group_size > 1 else tp


def padded(length: int, group_size: int, tp: int) -> int:
    align = align_for(group_size, tp)
    return -(-length // align) * align


@dataclass(frozen=True)
class HdpLayout:
    """This rank's view of one micro-batch plan.

    ``lengths``: real lengths of the micro-batch's rows (batch order); ``groups``: partition
    of ``range(cp_size)`` (context-parallel ranks, not global ranks); ``group_of``: per row,
    the index of its group; ``cp_rank``: this rank's context-parallel rank; ``tp``: the
    tensor-parallel size (part of the padding rule)."""

    lengths: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    group_of: tuple[int, ...]
    cp_rank: int
    tp: int = 1
    digest: str = ""  # the plan's digest, for dumps and error messages

    def __post_init__(self):
        if len(self.lengths) != len(self.group_of):
            raise ValueError(f"{len(self.lengths)} lengths but {len(self.group_of)} group assignments")
        members = sorted(r for g in self.groups for r in g)
        if members != list(range(len(members))):
            raise ValueError(f"groups {self.groups} are not a partition of range(cp_size)")

    @classmethod
    def from_plan(cls, micro_batch_plan, lengths, cp_rank: int, tp: int = 1, digest: str = "") -> "HdpLayout":
        """From a planner ``MicroBatchPlan`` (``sequences``: indices into ``lengths``, which are the
        micro-batch's rows in that order; ``groups``; ``group_of`` per row). Groups are kept
        sorted: a rank's position in its group is then its rank in the process group
        ``torch.distributed.new_group`` builds (which sorts)."""
        rows = tuple(int(lengths[i]) for i in micro_batch_plan.sequences)
        return cls(rows, tuple(tuple(sorted(int(r) for r in g)) for g in micro_batch_plan.groups),
                   tuple(int(x) for x in micro_batch_plan.group_of), int(cp_rank), int(tp), digest)

    @property
    def cp_size(self) -> int:
        return sum(len(g) for g in self.groups)

    def group_index_of_rank(self, cp_rank: int) -> int:
        return next(i for i, g in enumerate(self.groups) if cp_rank in g)

    @cached_property
    def group_index(self) -> int:
        return self.group_index_of_rank(self.cp_rank)

    @property
    def group(self) -> tuple[int, ...]:
        return self.groups[self.group_index]

    @property
    def group_size(self) -> int:
        return len(self.group)

    @property
    def position(self) -> int:
        return self.group.index(self.cp_rank)

    @property
    def is_all_cp(self) -> bool:
        return len(self.groups) == 1

    def rows_of_group(self, group_index: int) -> list[int]:
        return [i for i, g in enumerate(self.group_of) if g == group_index]

    @cached_property
    def rows(self) -> list[int]:
        """The batch rows this rank computes, in batch order."""
        return self.rows_of_group(self.group_index)

    def padded_length(self, row: int) -> int:
        return padded(self.lengths[row], len(self.groups[self.group_of[row]]), self.tp)

    def local_tokens(self, cp_rank: int) -> int:
        """How many packed tokens ``cp_rank`` holds (every rank can compute every other's)."""
        gi = self.group_index_of_rank(cp_rank)
        g = len(self.groups[gi])
        return sum(self.padded_length(r) // g for r in self.rows_of_group(gi))

    def ranges(self, row: int, cp_rank: int | None = None) -> list[tuple[int, int]]:
        """Token ranges of ``row`` (padded) held by ``cp_rank`` (default: this rank)."""
        rank = self.cp_rank if cp_rank is None else cp_rank
        group = self.groups[self.group_of[row]]
        return zigzag_ranges(self.padded_length(row), len(group), group.index(rank))

    def cu_seqlens_padded(self) -> list[int]:
        """Cumulative *full* padded lengths of this rank's rows (what Megatron's THD code and
        RoPE expect: each row's local share is its full length / group size)."""
        out = [0]
        for r in self.rows:
            out.append(out[-1] + self.padded_length(r))
        return out

    def positions(self, cp_rank: int | None = None) -> tuple[list[int], list[int]]:
        """(row, position in the row) of every packed token of ``cp_rank``, in packed order."""
        rank = self.cp_rank if cp_rank is None else cp_rank
        gi = self.group_index_of_rank(rank)
        rows, pos = [], []
        for r in self.rows_of_group(gi):
            for start, stop in self.ranges(r, rank):
                rows.extend([r] * (stop - start))
                pos.extend(range(start, stop))
        return rows, pos

    def segments(self, cp_rank: int | None = None) -> list[tuple[int, int, int]]:
        """(row, start, stop) of every token range ``cp_rank`` holds, in packed order."""
        rank = self.cp_rank if cp_rank is None else cp_rank
        gi = self.group_index_of_rank(rank)
        return [(r, a, b) for r in self.rows_of_group(gi) for a, b in self.ranges(r, rank)]

    def token_index(self, cp_rank: int | None = None, device=None):
        """(row, position) of every packed token of ``cp_rank`` as two long tensors, built
        without a per-token Python loop (the packing and unpacking hot path)."""
        import torch

        segs = self.segments(cp_rank)
        if not segs:
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return empty, empty
        rows, starts, stops = (torch.tensor(col, dtype=torch.long, device=device) for col in zip(*segs))
        widths = stops - starts
        seg_of_token = torch.repeat_interleave(torch.arange(len(segs), device=device), widths)
        first_token = torch.cumsum(widths, 0) - widths
        offset = torch.arange(int(widths.sum()), device=device) - first_token[seg_of_token]
        return rows[seg_of_token], starts[seg_of_token] + offset

    def describe(self) -> str:
        return (f"HDP plan {self.digest or '?'}: cp rank {self.cp_rank} in group {self.group} "
                f"(size {self.group_size}, position {self.position}), rows {self.rows}")


def attach(tensors: Sequence, layout: HdpLayout) -> None:
    """Attach ``layout`` to the micro-batch's ``cu_seqlens`` tensors (a Python attribute on
    the tensor objects that ``PackedSeqParams`` carries)."""
    for t in tensors:
        if t is not None:
            setattr(t, ATTRIBUTE, layout)


def layout_of(tensor) -> HdpLayout | None:
    """The layout attached to a ``cu_seqlens`` tensor, or None (stock behaviour)."""
    return getattr(tensor, ATTRIBUTE, None) if tensor is not None else None
