"""Where the preemption hand-back's mark comes from, read in the real upstream sources.

``MigrationKVConnector.build_connector_meta`` marks the requests in the step's
``SchedulerOutput.preempted_req_ids``: present only if the scheduler that runs fills it. vLLM
0.23's own ``Scheduler`` does; vLLM-Ascend 0.23 ships its own schedulers (NPU only, not
runnable here), read statically: every ``SchedulerOutput`` they build is checked for the field.
"""

from __future__ import annotations

import ast
import glob
import os

from tests.support.stacks import source


def _scheduler_outputs(paths) -> dict:
    """file -> for each SchedulerOutput(...) / *SchedulerOutput(...) built there: whether it
    passes preempted_req_ids."""
    found = {}
    for path in paths:
        with open(path) as fh:
            tree = ast.parse(fh.read())
        calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call)
                 and ast.unparse(c.func).endswith("SchedulerOutput")]
        if calls:
            found[os.path.basename(path)] = [any(k.arg == "preempted_req_ids" for k in c.keywords)
                                             for c in calls]
    return found


def test_vllms_scheduler_names_each_steps_preemptions_for_the_connector():
    path = source("current", "vllm", "vllm", "v1", "core", "sched", "scheduler.py")
    assert _scheduler_outputs([path]) == {"scheduler.py": [True]}
    with open(path) as fh:
        text = fh.read()
    # the step's output reaches the connector's build_connector_meta after every preemption
    assert text.index("preempted_req_ids={req.request_id") < text.index("connector.build_connector_meta(")


def test_which_vllm_ascend_schedulers_fill_preempted_req_ids():
    """All but ``SchedulerDynamicBatch`` do: under it (vLLM-Ascend's dynamic-batch scheduling)
    no mark is written and a preempted request waits in its replica's queue as in stock vLLM
    (nothing lost; the feature README says so)."""
    root = source("current", "vllm_ascend", "vllm_ascend")
    paths = sorted(glob.glob(os.path.join(root, "core", "*.py"))
                   + glob.glob(os.path.join(root, "patch", "**", "*.py"), recursive=True))
    found = _scheduler_outputs(paths)
    assert {name: all(flags) for name, flags in found.items()} == {
        "patch_balance_schedule.py": True, "recompute_scheduler.py": True,
        "scheduler_dynamic_batch.py": False, "scheduler_profiling_chunk.py": True}, found
