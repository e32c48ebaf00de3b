"""Scenarios of tests/support/test_ports.py, each in a fresh interpreter of the suite (its
sitecustomize installed the port lease)."""

from __future__ import annotations

import dataclasses
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tests.support.child import run_scenario

SCENARIO = "tests.support.ports_scenario"


def lease_many(blocks: int, count: int) -> list[int]:
    """``blocks`` leases of ``count`` ports each, as one process of the suite takes them."""
    from tests.support import ports
    return [ports.lease(count) for _ in range(blocks)]


class _ConnectionChurn:
    """Outgoing TCP connections opened and closed in a loop while the rendezvous runs: each takes
    an ephemeral local port, as gloo's and Ray's connections do on a busy CI machine."""

    def __init__(self):
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(512)
        self._stop = threading.Event()
        self.opened = 0
        self._threads = [threading.Thread(target=self._accept, daemon=True),
                         threading.Thread(target=self._connect, daemon=True)]
        for t in self._threads:
            t.start()

    def _accept(self):
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
                conn.close()
            except OSError:
                pass

    def _connect(self):
        address = self._listener.getsockname()
        while not self._stop.is_set():
            with socket.socket() as s:
                try:
                    s.connect(address)
                    self.opened += 1
                except OSError:
                    pass
            self._stop.wait(0.001)   # paced: a busy machine's rate, not a core of its own

    def stop(self) -> int:
        self._stop.set()
        for t in self._threads:
            t.join()
        self._listener.close()
        return self.opened


@dataclass
class Rendezvous:
    """One process's rounds of vLLM's own distributed initialization (the engine start's step
    that died with EADDRINUSE in CI), and the ports vLLM's port helpers gave it."""

    ports: list[int] = field(default_factory=list)
    data_parallel_ports: list[int] = field(default_factory=list)  # get_open_ports_list(5), DP > 1's ask
    ephemeral_low: int = 0
    churned_connections: int = 0


def vllm_rendezvous(rounds: int) -> Rendezvous:
    """``rounds`` times: vLLM's port choice, then vLLM's ``init_distributed_environment`` on it
    (a one-rank gloo world, as a CPU engine's executor starts it) and its teardown, with
    outgoing connections churning ephemeral ports meanwhile."""
    from vllm.distributed import parallel_state as ps
    from vllm.utils.network_utils import (get_distributed_init_method, get_ip, get_open_port,
                                          get_open_ports_list)

    from tests.support import ports
    out = Rendezvous(data_parallel_ports=get_open_ports_list(5), ephemeral_low=ports.ephemeral_ports()[0])
    churn = _ConnectionChurn()
    try:
        for _ in range(rounds):
            port = get_open_port()
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                            distributed_init_method=get_distributed_init_method(get_ip(), port))
            out.ports.append(port)
            ps.destroy_distributed_environment()
    finally:
        out.churned_connections = churn.stop()
    return out


def start_at_once(processes: int, rounds: int) -> list[dict]:
    """``processes`` children started together, each running :func:`vllm_rendezvous`: what one
    pytest process does when a test starts several engines at once."""
    env = {"VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    with ThreadPoolExecutor(processes) as pool:
        futures = [pool.submit(run_scenario, SCENARIO, "vllm_rendezvous", rounds, env=env, timeout=600,
                               returns=Rendezvous) for _ in range(processes)]
        return [dataclasses.asdict(f.result()) for f in futures]
