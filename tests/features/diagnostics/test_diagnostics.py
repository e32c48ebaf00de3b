"""diagnostics: every process that runs engine steps appends one JSON line (pid, who
activated ascend-rl, every patch's state) on its first step, and only then.

Both real engines of the shared scenarios (tests/features/shared_engine.py) run with
``ASCEND_RL_DIAGNOSTICS`` set and read the file after several more steps.
"""

from __future__ import annotations

from tests.features.shared_engine import part

REPORTING = ("diagnostics.report_on_first_step", "diagnostics.report_on_first_step_with_batch_queue")


def _only_record(records, pid_check):
    assert len(records) == 1, records  # once per process, not once per step
    record = records[0]
    assert pid_check(record["pid"]), record["pid"]
    assert record["activated_by"][0] == "vllm.general_plugins"
    states = {p["patch"]: p["state"] for p in record["patches"]}
    for name in REPORTING:
        assert states[name] == "applied", states
    return states


def test_in_process_engine_reports_once_from_its_process(shared_engine):
    records = part(shared_engine, "diagnostics")["records"]
    states = _only_record(records, lambda pid: pid == shared_engine["pid"])
    assert states["gc_off.engine_core_step"] == "applied"  # the other patches are listed too


def test_multiprocess_engine_reports_from_the_engine_core_process_only(multiprocess_engine):
    """The front end runs no engine step, so the one record is the spawned engine core's."""
    records = part(multiprocess_engine, "diagnostics")["records"]
    _only_record(records, lambda pid: pid != multiprocess_engine["pid"])
