"""The migration KV connector's ``kv_transfer_config``, importable without vLLM or torch.

:mod:`.kv_migration` (the connector, which imports both) and the config printers
(``ascend-rl router --migration``, doctor, :mod:`.verl_manager`'s checks) share these
definitions; the connector module re-exports them.
"""

from __future__ import annotations

import os
import tempfile

CONNECTOR_CLASS = "MigrationKVConnector"
CONNECTOR_MODULE = "ascend_rl_plugins.features.rollout_rebalance.kv_migration"
STORE_DIR_KEY = "store_dir"
DEFAULT_STORE_DIR = "/dev/shm/ascend-rl-kv-migration" if os.path.isdir("/dev/shm") else \
    os.path.join(tempfile.gettempdir(), "ascend-rl-kv-migration")


def kv_transfer_config(store_dir: str | None = None, *, connector_class: str = CONNECTOR_CLASS,
                       module: str = CONNECTOR_MODULE) -> dict:
    """The ``kv_transfer_config`` to give every replica (``AsyncEngineArgs(kv_transfer_config=
    ...)``, ``vllm serve --kv-transfer-config '<json>'``, or verl's
    ``rollout.engine_kwargs.vllm.kv_transfer_config``). ``connector_class`` / ``module`` name a
    subclass (tests inject faults that way)."""
    return {"kv_connector": connector_class, "kv_connector_module_path": module,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {STORE_DIR_KEY: store_dir or DEFAULT_STORE_DIR}}
