"""On ``PYTHONPATH`` (put there by tests/conftest.py): runs in every Python process the suite
starts -- child scenarios, vLLM engine cores, their multiprocess workers -- and installs what
:func:`tests.support.process_hooks.install_in_this_process` lists. Lazy: nothing heavy is
imported here."""

from tests.support import process_hooks

process_hooks.install_in_this_process()
