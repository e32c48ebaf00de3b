"""Put on PYTHONPATH by the ``multiprocess_engine`` fixture: runs in every process of that
scenario (front end, spawned engine core) and installs, besides what every process of the suite
installs (it shadows the suite's sitecustomize), the test probes listed in
``tests.features.shared_engine.IN_EVERY_PROCESS``."""

from tests.features import shared_engine
from tests.support import process_hooks

process_hooks.install_in_this_process()  # ARP_TEST_CPU_ISA and the ISA-probe cache: in the engine core too
shared_engine.in_every_process()
