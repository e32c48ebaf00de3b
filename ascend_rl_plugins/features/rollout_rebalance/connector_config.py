"""The migration KV connector's ``kv_transfer_config``, importable without vLLM or torch.

:mod:`.kv_migration` (the connector, which imports both) and the config printers
(``ascend-rl router --migration``, doctor, :mod:`.verl_manager`'s checks) share these
definitions; the connector module re-exports them.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

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

# The transport of the exports: "directory" (STORE_DIR_KEY, one host: every replica reads and
# writes one directory, by default on /dev/shm) or "mooncake" (Mooncake Store, across hosts:
# MOONCAKE_KEY holds ascend_rl_plugins.transport.mooncake_store.MooncakeSettings' fields but
# local_hostname, which each process derives for itself, see .mooncake_export_store; objects
# named under MOONCAKE_NAMESPACE_KEY).
TRANSPORT_KEY = "transport"
TRANSPORTS = ("directory", "mooncake")
MOONCAKE_KEY = "mooncake"
MOONCAKE_NAMESPACE_KEY = "mooncake_namespace"
DEFAULT_MOONCAKE_NAMESPACE = "ascend-rl-kv-migration"

EXTRA_CONFIG_KEYS = {STORE_DIR_KEY: "a directory",
                     STALE_MAX_AGE_KEY: f"seconds, {STALE_MAX_AGE_RANGE_S[0]} to "
                                        f"{STALE_MAX_AGE_RANGE_S[1]}",
                     TRANSPORT_KEY: " or ".join(map(repr, TRANSPORTS)),
                     MOONCAKE_KEY: "Mooncake settings (master_address, metadata_server, admin_url, ...)",
                     MOONCAKE_NAMESPACE_KEY: "a name of letters, digits, '-', '_', '.'"}


@dataclass(frozen=True)
class StoreChoice:
    """Which export store a ``kv_connector_extra_config`` names, validated: what the connector
    and the clients build (``.mooncake_export_store.export_store``)."""

    transport: str = "directory"
    store_dir: str = DEFAULT_STORE_DIR
    mooncake: tuple = ()          # the Mooncake settings' items (sorted; no local_hostname port)
    namespace: str = DEFAULT_MOONCAKE_NAMESPACE

    @property
    def mooncake_settings(self) -> dict:
        return dict(self.mooncake)


def valid_name(text, max_length: int = 200) -> bool:
    """An export key or a Mooncake namespace: letters, digits, '-', '_', '.', not starting
    with '.' (a file name in the directory store, an object-name part in Mooncake's)."""
    return isinstance(text, str) and 0 < len(text) <= max_length and \
        all(c.isalnum() or c in "-_." for c in text) and not text.startswith(".")


def _bad(key: str, value, accepted: str) -> ValueError:
    return ValueError(f"kv_connector_extra_config[{key!r}]={value!r}: accepted {accepted}")


def store_choice(extra: dict | None) -> StoreChoice:
    """The export store of a ``kv_connector_extra_config``; ValueError naming the key and the
    accepted values for an unknown key or a bad value (the Mooncake settings are checked by
    ``MooncakeSettings``, whose errors name the setting)."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
    if unknown:
        accepted = ", ".join(f"{k!r} ({what})" for k, what in EXTRA_CONFIG_KEYS.items())
        raise ValueError(f"unknown kv_connector_extra_config key(s) {unknown}; accepted: {accepted}")
    transport = extra.get(TRANSPORT_KEY, "directory")
    if transport not in TRANSPORTS:
        raise _bad(TRANSPORT_KEY, transport, " or ".join(map(repr, TRANSPORTS)))
    store_dir = extra.get(STORE_DIR_KEY, DEFAULT_STORE_DIR)
    if not isinstance(store_dir, str) or not store_dir:
        raise _bad(STORE_DIR_KEY, store_dir, "a directory path")
    namespace = extra.get(MOONCAKE_NAMESPACE_KEY, DEFAULT_MOONCAKE_NAMESPACE)
    if not valid_name(namespace, max_length=100):
        raise _bad(MOONCAKE_NAMESPACE_KEY, namespace, EXTRA_CONFIG_KEYS[MOONCAKE_NAMESPACE_KEY])
    raw = extra.get(MOONCAKE_KEY)
    if transport == "directory":
        if raw is not None:
            raise _bad(MOONCAKE_KEY, raw, f"nothing with {TRANSPORT_KEY}='directory' (set "
                                          f"{TRANSPORT_KEY}='mooncake' to use these settings)")
        return StoreChoice("directory", store_dir)
    if not isinstance(raw, dict):
        raise _bad(MOONCAKE_KEY, raw, "a mapping of Mooncake settings (master_address, "
                                      "metadata_server, admin_url, segment_size, holder_segment, "
                                      f"...) with {TRANSPORT_KEY}='mooncake'")
    from ascend_rl_plugins.transport.mooncake_store import MooncakeSettings
    host = raw.get("local_hostname")
    if host is not None and (not isinstance(host, str) or ":" in host or not host):
        raise _bad(f"{MOONCAKE_KEY}.local_hostname", host,
                   "a host (an address of this host, no port) or nothing (derived): every process "
                   "(each engine's scheduler and workers, each client) is a Mooncake client and "
                   "needs a name of its own, so each derives its port")
    try:
        # validated with a placeholder name: the process derives its own (see above)
        MooncakeSettings.from_dict({**raw, "local_hostname": (host or "127.0.0.1") + ":1"})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"kv_connector_extra_config[{MOONCAKE_KEY!r}]: {exc}") from exc
    if raw.get("admin_url") is None:
        raise _bad(f"{MOONCAKE_KEY}.admin_url", None,
                   "'http://<master host>:<mooncake_master --metrics_port>': the exports are "
                   "listed (keys, preemption marks, the stale-export sweep) by the master's admin "
                   "server")
    return StoreChoice("mooncake", store_dir, tuple(sorted(raw.items())), namespace)


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
                       stale_export_max_age_s: float | None = None,
                       mooncake: dict | None = None, mooncake_namespace: str | None = None) -> dict:
    """The ``kv_transfer_config`` to give every replica (``AsyncEngineArgs(kv_transfer_config=
    ...)``, ``vllm serve --kv-transfer-config '<json>'``, or verl's
    ``rollout.engine_kwargs.vllm.kv_transfer_config``). ``connector_class`` / ``module`` name a
    subclass (tests inject faults that way); ``stale_export_max_age_s`` sets the store sweep's
    max age (left out: the connector's default, :data:`DEFAULT_STALE_MAX_AGE_S`); ``mooncake``
    (Mooncake settings, without ``local_hostname``'s port) selects the Mooncake transport
    (replicas on several hosts), ``mooncake_namespace`` names its objects' prefix."""
    extra = {STORE_DIR_KEY: store_dir or DEFAULT_STORE_DIR}
    if stale_export_max_age_s is not None:
        extra[STALE_MAX_AGE_KEY] = stale_export_max_age_s
        stale_max_age_s(extra)
    if mooncake is not None:
        extra[TRANSPORT_KEY] = "mooncake"
        extra[MOONCAKE_KEY] = dict(mooncake)
    if mooncake_namespace is not None:
        extra[MOONCAKE_NAMESPACE_KEY] = mooncake_namespace
    store_choice(extra)
    return {"kv_connector": connector_class, "kv_connector_module_path": module,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}
