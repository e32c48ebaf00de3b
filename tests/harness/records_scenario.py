"""A scenario that returns nested dataclass records, for ``test_child_records``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Leaf:
    name: str
    value: float | None


@dataclass
class Branch:
    leaves: list[Leaf]
    by_name: dict[str, Leaf | None]
    counts: list[list[int]] = field(default_factory=list)


@dataclass
class Tree(Branch):
    """A subclass: inherited fields are rebuilt too."""

    spare: Leaf | None = None


def grow(value: float) -> Tree:
    leaf = Leaf("a", value)
    return Tree(leaves=[leaf, Leaf("b", None)], by_name={"a": leaf, "gone": None},
                counts=[[1, 2], []], spare=Leaf("c", -value))
