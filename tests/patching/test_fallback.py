"""Falling back with a reason: a WARNING (visible at the default log level), once per
(feature, cause) per process, in one format for every feature."""

import logging

import pytest

from ascend_rl_plugins.patching import fallback

pytestmark = pytest.mark.forked


def test_a_fallback_is_one_warning_per_cause_per_process(caplog):
    fallback.forget()
    with caplog.at_level(logging.WARNING, logger="ascend_rl_plugins"):
        assert fallback.fall_back("feat", "the stock path", "reason A")
        assert not fallback.fall_back("feat", "the stock path", "reason A")
        assert fallback.fall_back("feat", "the stock path", "reason B")
        assert fallback.fall_back("other", "the stock path", "reason A")  # causes are per feature
        assert fallback.fall_back("feat", "x", "planner wanted 3 micro-batches", cause="planner")
        assert not fallback.fall_back("feat", "x", "planner wanted 4 micro-batches", cause="planner")
    records = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert records == [(logging.WARNING, "ascend-rl feat: falling back to the stock path: reason A"),
                       (logging.WARNING, "ascend-rl feat: falling back to the stock path: reason B"),
                       (logging.WARNING, "ascend-rl other: falling back to the stock path: reason A"),
                       (logging.WARNING, "ascend-rl feat: falling back to x: planner wanted 3 micro-batches")]


def test_no_feature_falls_back_at_info_or_with_its_own_logger_call():
    """Every 'falls back with a reason' goes through fallback.fall_back: no feature module
    logs one at INFO (invisible at the default level) or formats its own line."""
    import os
    import re

    import ascend_rl_plugins.features as features
    own = re.compile(r"log(?:ger)?\.(?:info|warning|debug)\([^)]*(?:fall(?:ing|s)? back|fixed CP|stock weight sync|kept:)",
                     re.IGNORECASE | re.DOTALL)
    offenders = []
    for root, _, files in os.walk(os.path.dirname(features.__file__)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    if own.search(f.read()):
                        offenders.append(os.path.relpath(path, os.path.dirname(features.__file__)))
    assert offenders == []
