"""A scenario's dataclass result crosses the process boundary and comes back as the same
records (``run_scenario(..., returns=...)``), so tests read fields rather than keys."""

from tests.harness.records_scenario import Leaf, Tree, grow
from tests.support.child import rebuild, run_scenario


def test_nested_dataclasses_come_back_from_the_child_as_records():
    got = run_scenario("tests.harness.records_scenario", "grow", 0.25, returns=Tree)
    assert got == grow(0.25), got
    assert isinstance(got.leaves[0], Leaf) and isinstance(got.by_name["a"], Leaf) and got.by_name["gone"] is None
    assert isinstance(got.spare, Leaf), got


def test_without_returns_the_result_stays_plain_json():
    got = run_scenario("tests.harness.records_scenario", "grow", 1.0)
    assert got["spare"] == {"name": "c", "value": -1.0}, got


def test_rebuild_leaves_plain_values_and_none_alone():
    assert rebuild(Tree, None) is None
    assert rebuild(list[int], [1, 2]) == [1, 2]
    assert rebuild(dict[str, float], {"x": 1.5}) == {"x": 1.5}
