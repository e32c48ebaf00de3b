"""A slow step says what it is doing while it runs; a fast one stays silent."""

import logging
import threading

import pytest

from ascend_rl_plugins.patching.progress import slow_step

pytestmark = pytest.mark.forked


def test_a_step_still_running_after_the_threshold_says_so_and_when_it_is_done(caplog):
    spoke = threading.Event()

    class Witness(logging.Handler):
        def emit(self, record):
            spoke.set()

    witness = Witness()
    logging.getLogger("ascend_rl_plugins").addHandler(witness)
    try:
        with caplog.at_level(logging.WARNING, logger="ascend_rl_plugins"):
            with slow_step("compiling the thing", after=0.05):
                assert spoke.wait(30)  # the step is "slow": it waits until the notice came
    finally:
        logging.getLogger("ascend_rl_plugins").removeHandler(witness)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "compiling the thing ..." and messages[1].startswith("compiling the thing: done in ")
    assert all(r.levelno == logging.WARNING for r in caplog.records)


def test_a_step_done_before_the_threshold_is_silent(caplog):
    with caplog.at_level(logging.DEBUG, logger="ascend_rl_plugins"):
        with slow_step("compiling the thing", after=600):
            pass
    assert caplog.records == []
