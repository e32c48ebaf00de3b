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

# Exports (and their temporary files and preemption marks) older than this are swept when a
# connector opens the store. An export lives from its hop's abort until the destination's hop
# ends (seconds to minutes; a hop is at most one request's whole decode on one replica), and
# every replica sharing the directory sweeps at its start, also while the others run: the
# default sits far above any such lifetime (6 hours); what it sweeps are the leftovers of a
# crashed or killed run.
STALE_MAX_AGE_KEY = "stale_export_max_age_s"
DEFAULT_STALE_MAX_AGE_S = 6 * 3600
STALE_MAX_AGE_RANGE_S = (60, 30 * 24 * 3600)

EXTRA_CONFIG_KEYS = {STORE_DIR_KEY: "a directory",
                     STALE_MAX_AGE_KEY: f"seconds, {STALE_MAX_AGE_RANGE_S[0]} to "
                                        f"{STALE_MAX_AGE_RANGE_S[1]}"}


def stale_max_age_s(extra: dict | None) -> float:
    """The sweep's max age from a ``kv_connector_extra_config`` (the default where it is not
    given); ValueError naming the key and the accepted range for a bad value."""
    value = (extra or {}).get(STALE_MAX_AGE_KEY, DEFAULT_STALE_MAX_AGE_S)
    low, high = STALE_MAX_AGE_RANGE_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"kv_connector_extra_config[{STALE_MAX_AGE_KEY!r}] must be a number of "
                         f"seconds from {low} to {high} (default {DEFAULT_STALE_MAX_AGE_S}), "
                         f"got {value!r}")
    return float(value)


def kv_transfer_config(store_dir: str | None = None, *, connector_class: str = CONNECTOR_CLASS,
                       module: str = CONNECTOR_MODULE,
                       stale_export_max_age_s: float | None = None) -> dict:
    """The ``kv_transfer_config`` to give every replica (``AsyncEngineArgs(kv_transfer_config=
    ...)``, ``vllm serve --kv-transfer-config '<json>'``, or verl's
    ``rollout.engine_kwargs.vllm.kv_transfer_config``). ``connector_class`` / ``module`` name a
    subclass (tests inject faults that way); ``stale_export_max_age_s`` sets the store sweep's
    max age (left out: the connector's default, :data:`DEFAULT_STALE_MAX_AGE_S`)."""
    extra = {STORE_DIR_KEY: store_dir or DEFAULT_STORE_DIR}
    if stale_export_max_age_s is not None:
        extra[STALE_MAX_AGE_KEY] = stale_export_max_age_s
        stale_max_age_s(extra)
    return {"kv_connector": connector_class, "kv_connector_module_path": module,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}
