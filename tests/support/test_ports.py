"""The suite's port leases (tests/support/ports.py): no two processes of the suite (two stacks'
suites and the late shard run at once in CI) are handed the same port, none comes from the
kernel's ephemeral range, and vLLM's own port choice takes its port from the lease."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support import ports
from tests.support.child import run_scenario
from tests.support.ports_scenario import SCENARIO, Rendezvous
from tests.support.stacks import running_stack


def _at_once(n, function, *args, returns=None):
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(run_scenario, SCENARIO, function, *args, timeout=600, returns=returns)
                   for _ in range(n)]
        return [f.result() for f in futures]


@pytest.mark.stack_independent
def test_leases_taken_at_once_by_several_processes_never_overlap_and_avoid_ephemeral_and_ray_ports():
    span = ports.lease_range()
    low, _ = ports.ephemeral_ports()
    block = 4
    taken = _at_once(4, "lease_many", 25, block)
    given = [start + i for process in taken for start in process for i in range(block)]
    assert len(given) == len(set(given)), "a port was leased to two processes"
    assert all(span.first <= p < span.end <= low for p in given)
    if span.first > ports.RAY_WORKER_PORTS[1]:    # not on a machine whose ephemeral range starts that low
        assert not any(ports.RAY_WORKER_PORTS[0] <= p <= ports.RAY_WORKER_PORTS[1] for p in given)


@pytest.mark.stack_independent
def test_free_port_is_leased():
    a, b = ports.free_port(), ports.free_port()
    span = ports.lease_range()
    assert a != b and all(span.first <= p < span.end for p in (a, b))


@pytest.mark.skipif(running_stack() != "current", reason="vLLM 0.23's rendezvous (the stack whose engine "
                    "start died with EADDRINUSE in CI); one stack is enough for a stress of the harness")
def test_vllm_rendezvous_started_at_once_from_two_processes_with_connections_churning_never_collides():
    """Port stress: two processes (as two pytest processes do) each start two at once, each
    running vLLM's own distributed initialization three times while outgoing connections churn the
    ephemeral range: every rendezvous binds (an EADDRINUSE fails its child), and no port is used
    by two of them."""
    parents = _at_once(2, "start_at_once", 2, 3, returns=list[Rendezvous])
    runs = [r for parent in parents for r in parent]
    assert len(runs) == 4 and all(len(r.ports) == 3 for r in runs)
    assert all(r.churned_connections > 0 for r in runs)
    used = [p for r in runs for p in r.ports]
    assert len(set(used)) == len(used), "two rendezvous were given the same port"
