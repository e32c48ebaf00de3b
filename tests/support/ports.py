"""Test-harness port leases: every listening port the suite's processes choose comes from one
machine-wide counter, below the kernel's ephemeral range. Not part of the product.

Why: CI runs two or three pytest processes at once (the two stacks' suites and the late shard,
``.ci/test``), each starting vLLM engines, gloo groups, TCPStores and Ray. vLLM picks the port of
its ``init_process_group`` rendezvous by binding port 0, closing the socket and handing the
number on (``vllm.utils.network_utils.get_open_port`` without ``VLLM_PORT``); until the store
binds it again, any outgoing connection on the machine (gloo opens many, Ray more) may be given
the same port as its local end, and any other process's port-0 bind may be handed it too: the
store then dies with ``EADDRINUSE`` (seen in CI: ``test_fp8_reload.py``'s two engines, while the
other stack's suite ran). Ports below the ephemeral range are only ever taken by explicit binds,
and a counter shared by every process on the machine (a file under a lock) never hands the same
port to two of them within a cycle of the range.

Two users:
- :func:`free_port`, the port of a scenario's gloo group or TCPStore (``tests/support/child.py``);
- :func:`install_vllm_port_lease`, run in every process the suite starts (through
  ``tests/support/process_hooks.py``): when the process imports vLLM's port helpers, their
  port-0 pick (``_get_open_port``, behind ``get_open_port`` and ``get_open_ports_list``) is
  answered from the lease instead. Not through ``VLLM_PORT``, vLLM's own switch: with it set,
  vLLM hands the same port to every caller of a process until one binds it, and vLLM 0.13's
  ``get_open_ports_list(5)`` (data parallel > 1) then loops for ever. A ``VLLM_PORT`` set by hand is kept: vLLM then
  picks as the user asked (``ARP_TEST_VLLM_PORT_LEASE=0`` turns the lease off too).

Ray is left alone: the local clusters of Ray 2.60 (both stacks) let the process that listens
bind port 0 itself (GCS, object manager, workers), which cannot race. The lease range starts
above 19999 all the same, the worker ports of a ``ray start`` cluster (10002-19999 by default)."""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from dataclasses import dataclass

ENV = "ARP_TEST_VLLM_PORT_LEASE"
HOOKED_MODULE = "vllm.utils.network_utils"   # vLLM 0.13 and 0.23
RAY_WORKER_PORTS = (10002, 19999)     # Ray's default min_worker_port / max_worker_port
COUNTER_FILE = os.path.join(tempfile.gettempdir(), "ascend-rl-test-port-lease")


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux; else its default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


@dataclass(frozen=True)
class LeaseRange:
    """Ports the leases cycle through: [first, end)."""

    first: int
    end: int


def lease_range() -> LeaseRange:
    """Above Ray's worker ports and below the ephemeral range; where the kernel's range starts too
    low for that (a tuned machine), the 4096 ports below it."""
    low, _high = ephemeral_ports()
    first = RAY_WORKER_PORTS[1] + 1
    if low - first < 1024:
        first = max(1024, low - 4096)
    return LeaseRange(first, low)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def lease(count: int = 1) -> int:
    """The first of ``count`` consecutive ports, each free now and not leased to any other
    process on this machine since the counter last wrapped round the range."""
    span = lease_range()
    if count < 1 or count > span.end - span.first:
        raise ValueError(f"lease(count={count}): count must be 1 .. {span.end - span.first}")
    with open(COUNTER_FILE, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        try:
            start = int(f.read().strip() or span.first)
        except ValueError:   # a torn or foreign file: start the cycle again
            start = span.first
        tries = (span.end - span.first) // count
        for _ in range(tries):
            if not span.first <= start <= span.end - count:
                start = span.first
            block = range(start, start + count)
            start += count
            if all(_bindable(p) for p in block):
                f.seek(0)
                f.truncate()
                f.write(str(start))
                f.flush()
                return block[0]
    raise RuntimeError(f"no {count} consecutive free ports in {span.first}-{span.end - 1}")


def free_port() -> int:
    """A TCP port for a scenario's rendezvous (MASTER_PORT, a TCPStore): leased, so no other
    process of the suite is given it, and below the ephemeral range, so no outgoing connection
    takes it while the test starts the process that listens on it (up to minutes later)."""
    return lease(1)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def _lease_vllm_port_picks(module) -> None:
    stock = module._get_open_port

    def leased_open_port(start_port=None, **scan) -> int:
        """The suite's lease in place of vLLM's port-0 pick (tests/support/ports.py); a scan from
        an explicit start port (vLLM 0.23's ``start_port``, only with ``VLLM_PORT``) stays vLLM's."""
        return lease(1) if start_port is None else stock(start_port, **scan)

    module._get_open_port = leased_open_port


def install_vllm_port_lease() -> bool:
    """Answer vLLM's port picks from the lease once this process imports vLLM's port helpers (a
    post-import hook: a process that never imports vLLM leases nothing). Returns whether the
    hook was registered: not where the lease is off, where ``VLLM_PORT`` is set, or without
    wrapt."""
    global _hook_registered
    if not enabled() or os.environ.get("VLLM_PORT"):
        return False
    try:
        import wrapt
    except ImportError:
        return False
    if not _hook_registered:   # once per process: conftest and a sitecustomize may both ask
        wrapt.register_post_import_hook(_lease_vllm_port_picks, HOOKED_MODULE)
        _hook_registered = True
    return True


_hook_registered = False
