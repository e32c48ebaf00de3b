"""Put on PYTHONPATH by the ``multiprocess_engine`` fixture: runs in every process of that
scenario (front end, spawned engine core) and installs the test probes listed in
``tests.features.shared_engine.IN_EVERY_PROCESS``."""

from tests.features import shared_engine

shared_engine.in_every_process()
