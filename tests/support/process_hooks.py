"""What every Python process of the test suite installs at start-up, through the sitecustomize in
:data:`SITE_DIR` (tests/conftest.py puts it on ``PYTHONPATH`` and installs the same in the pytest
process; the multiprocess-engine fixture's own sitecustomize calls this too).

- ``ARP_TEST_CPU_ISA``: answer torch's ISA probes as the simulated CPU does
  (:mod:`tests.support.cpu_isa`). A worker on the real ISA next to an engine core on the
  simulated one would load other kernels and share compile caches with it.
- TorchInductor's vector-ISA build checks remembered across processes, a test-harness speed
  cache (:mod:`tests.support.isa_probe_cache`; ``ARP_TEST_ISA_PROBE_CACHE=0`` turns it off).
- ``VLLM_PORT`` leased per process when it imports vLLM, below the ephemeral range and never
  the same as another process's (:mod:`tests.support.ports`; ``ARP_TEST_VLLM_PORT_LEASE=0`` turns
  it off): the suites that CI runs at once otherwise race for vLLM's port-0 picks.

All three are wrapt post-import hooks: nothing heavy is imported until the process imports torch."""

from __future__ import annotations

import os

from tests.support import cpu_isa, isa_probe_cache, ports

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "suite_site")


def install_in_this_process() -> None:
    cpu_isa.apply_from_env()
    isa_probe_cache.install_from_env()
    ports.install_vllm_port_lease()
