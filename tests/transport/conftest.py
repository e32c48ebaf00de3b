"""Mooncake masters for this folder's tests; tests that need Mooncake skip, naming what is
missing, where the mooncake package or libibverbs is absent.

``mooncake_master`` is shared by the session (started once, stopped at the end).
``private_mooncake_master`` is a test's own: for tests that kill a client. The master keeps a
dead client's segment listed until ``--client_ttl`` (10 s) has passed, and places new objects
on it meanwhile (their puts then fail), so a killed client must not be seen by other tests.
"""

from __future__ import annotations

import pytest

from tests.support import mooncake


def _skip_without_mooncake() -> None:
    reason = mooncake.missing()
    if reason is not None:
        pytest.skip(f"Mooncake Store needs {reason}")


@pytest.fixture(scope="session")
def mooncake_master():
    _skip_without_mooncake()
    with mooncake.running_master() as master:
        yield master


@pytest.fixture
def private_mooncake_master():
    _skip_without_mooncake()
    with mooncake.running_master() as master:
        yield master
