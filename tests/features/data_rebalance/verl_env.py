"""Import verl modules into the pytest process without verl's plugin loading.

On verl >= 0.9, ``import verl`` loads the ``verl.plugins`` entry point, which activates
ascend-rl and applies its default-on patches in the importing process. The feature tests of
data_rebalance, dataproto_timing_merge and onpolicy_old_logprob import verl once at module
level (so that their ``@pytest.mark.forked`` children inherit it instead of paying the import
each) and must not leave patches behind in the pytest process: the import happens with
``VERL_USE_EXTERNAL_PLUGINS=none`` (and no ``VERL_USE_EXTERNAL_MODULES``), restored right
after. If verl was imported earlier by another test, nothing changes here; each forked test
reverts what it needs pristine itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest

_QUIET = {"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": ""}


def import_verl(*modules: str):
    """``importlib.import_module`` of each name with verl's plugin loading off; skips the
    calling test module when verl is not installed. Returns the modules."""
    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not installed in this interpreter (bash .ci/stack.sh installs it)",
                    allow_module_level=True)
    saved = {k: os.environ.get(k) for k in _QUIET}
    os.environ.update(_QUIET)
    try:
        return [importlib.import_module(m) for m in modules]
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
