"""Put on PYTHONPATH by the ``multiprocess_engine`` fixture: runs in every process of that
scenario (front end, spawned engine core) and installs the test probes listed in
``tests.features.shared_engine.IN_EVERY_PROCESS``."""

from tests.features import shared_engine
from tests.support import cpu_isa

cpu_isa.apply_from_env()  # ARP_TEST_CPU_ISA reaches the spawned engine core too
shared_engine.in_every_process()
