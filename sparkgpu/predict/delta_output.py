"""Committing a scoring run's chunk files to a Delta table, once.

The executors write each chunk's rows as a Parquet file under the table's root
(``sparkgpu-<run id>/p<partition>-c<chunk>.parquet``); nothing reads those files until the
client adds them all in one Delta commit. That commit carries an application transaction
(``txn`` action, app id ``sparkgpu.predict.<run id>``), the mechanism Delta's own streaming
sinks use for idempotent writes: a second commit of the same run finds it in the log and
adds nothing, so a client that died after committing and runs again does not duplicate rows.
"""

from __future__ import annotations

import json
import time
from typing import Sequence

__all__ = ["app_id", "committed_version", "commit_chunks"]


def app_id(run_id: str) -> str:
    """The Delta application id of one scoring run."""
    return f"sparkgpu.predict.{run_id}"


def committed_version(table_uri: str, run_id: str, storage_options: dict | None = None) -> int | None:
    """The table version that committed ``run_id``'s chunks, or ``None`` if none did."""
    from deltalake import DeltaTable

    if not DeltaTable.is_deltatable(table_uri, storage_options=storage_options):
        return None
    table = DeltaTable(table_uri, storage_options=storage_options)
    if table.transaction_version(app_id(run_id)) is None:
        return None
    for entry in table.history():  # the commit's custom metadata holds its run id
        if entry.get("sparkgpu.run_id") == run_id:
            return int(entry["version"])
    return table.version()


def commit_chunks(
    table_uri: str,
    chunks: Sequence[dict],
    schema,
    run_id: str,
    *,
    mode: str = "append",
    metadata: dict | None = None,
    storage_options: dict | None = None,
) -> tuple[int, bool]:
    """Adds every chunk file to the table in one commit, unless ``run_id`` was committed already.

    Args:
        table_uri: The Delta table (created when missing).
        chunks: One dict per chunk: ``path`` (relative to the root), ``bytes``, ``rows``.
        schema: The Arrow schema of the chunk files.
        run_id: The scoring run.
        mode: ``"append"`` or ``"overwrite"`` (removes the table's current files in the same commit).
        metadata: More commit metadata.
        storage_options: deltalake storage options.

    Returns:
        The table version holding the run's rows, and whether this call committed it.
    """
    from deltalake import CommitProperties, DeltaTable, Transaction
    from deltalake.schema import Schema
    from deltalake.transaction import AddAction, RemoveAction, create_table_with_add_actions

    existing = committed_version(table_uri, run_id, storage_options)
    if existing is not None:
        return existing, False
    now = int(time.time() * 1000)
    actions: list[AddAction | RemoveAction] = [
        AddAction(c["path"], int(c["bytes"]), {}, now, True, json.dumps({"numRecords": int(c["rows"])}))
        for c in sorted(chunks, key=lambda c: c["path"])
    ]
    properties = CommitProperties(
        custom_metadata={"sparkgpu.run_id": run_id, **(metadata or {})},
        app_transactions=[Transaction(app_id(run_id), 1)],
    )
    if DeltaTable.is_deltatable(table_uri, storage_options=storage_options):
        table = DeltaTable(table_uri, storage_options=storage_options)
        table.create_write_transaction(actions, mode, schema, commit_properties=properties)
        table.update_incremental()
        return table.version(), True
    create_table_with_add_actions(
        table_uri,
        Schema.from_arrow(schema),
        [a for a in actions if isinstance(a, AddAction)],
        mode="append",
        storage_options=storage_options,
        commit_properties=properties,
    )
    return DeltaTable(table_uri, storage_options=storage_options).version(), True
