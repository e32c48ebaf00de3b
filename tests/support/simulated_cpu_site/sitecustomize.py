"""On ``PYTHONPATH`` (put there by tests/conftest.py) only while ``ARP_TEST_CPU_ISA`` is set: every
Python process the suite starts -- child scenarios, vLLM engine cores, their multiprocess
workers -- answers torch's ISA probes as the simulated CPU does. A worker on the real ISA next
to an engine core on the simulated one would load other kernels and share compile caches with
it (a multiprocess engine then crashed in its workers). Lazy: nothing heavy is imported here
(see ``cpu_isa.simulate_avx2_only``)."""

from tests.support import cpu_isa

cpu_isa.apply_from_env()
