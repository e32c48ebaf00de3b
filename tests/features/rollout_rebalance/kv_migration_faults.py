"""Fault-injecting subclasses of the migration connector, named in a replica's
``kv_transfer_config`` (``kv_connector_module_path`` = this module): vLLM builds them in the
engine core process exactly as it builds the shipped connector."""

from __future__ import annotations

import os

from ascend_rl_plugins.features.rollout_rebalance.kv_migration import (
    MigrationConnectorMetadata,
    MigrationKVConnector,
)

EXIT_CODE = 17


class DyingOnLoadConnector(MigrationKVConnector):
    """The destination dies mid-migration: its engine core process exits the moment a step
    carries a KV load (the request was admitted, blocks allocated, nothing loaded, no output
    sent), as a replica crashing in the middle of a move would."""

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MigrationConnectorMetadata)
        if meta.loads:
            os._exit(EXIT_CODE)
        super().start_load_kv(forward_context, **kwargs)


DIE_MARKER_ENV = "ARP_KV_MIGRATION_DIE_MARKER"
DIE_AFTER_EXPORT_MARKER_ENV = "ARP_KV_MIGRATION_DIE_AFTER_EXPORT_MARKER"


def claim_marker(env: str) -> bool:
    """Whether this process takes the fault armed by the file named by ``$<env>``: it exists
    and this process removed it (of several processes only one unlink succeeds, so the
    fault fires once). No variable or no file: not armed."""
    marker = os.environ.get(env)
    if not marker:
        return False
    try:
        os.unlink(marker)
    except FileNotFoundError:
        return False
    return True


class DyingOnceOnLoadConnector(MigrationKVConnector):
    """Every replica of a verl rollout runs this one (verl gives all servers one engine
    config); the first replica to receive a KV load after the file named by
    ``$ARP_KV_MIGRATION_DIE_MARKER`` appears removes it (only one unlink succeeds) and dies
    there, mid-migration. Without the file it is the shipped connector."""

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MigrationConnectorMetadata)
        if meta.loads and claim_marker(DIE_MARKER_ENV):
            os._exit(EXIT_CODE)
        super().start_load_kv(forward_context, **kwargs)


class DyingAfterExportConnector(MigrationKVConnector):
    """The source dies after its export: once the file named by
    ``$ARP_KV_MIGRATION_DIE_AFTER_EXPORT_MARKER`` exists, the worker's first export (the
    shipped ``_export`` has returned: the export is complete in the store) removes it and
    the engine core exits there, before any destination has loaded it, so the move can only
    go on from the export. Other exports of the same step are never written. Without the
    file it is the shipped connector."""

    def _export(self, job) -> None:
        super()._export(job)
        if claim_marker(DIE_AFTER_EXPORT_MARKER_ENV):
            os._exit(EXIT_CODE)
