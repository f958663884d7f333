"""Delta tables read file by file, deletion vectors included, as a pyarrow dataset.

deltalake's ``DeltaTable.to_pyarrow_dataset`` refuses tables with the ``deletionVectors``
reader feature (on by default for new tables on Databricks). The table's snapshot still
lists its data files and ``DeltaTable.deletion_vectors`` gives each file's selection vector,
so this module builds the pyarrow dataset itself: the snapshot's Parquet files, each with its
partition values as a partition expression (so pyarrow prunes partitions before reading and
row groups by their statistics), and beside it the keep-mask of every file that has deleted
rows. Readers apply a file's mask to the rows they read from it (:func:`row_group_mask`).
"""

from __future__ import annotations

import dataclasses
import datetime
import urllib.parse

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from sparkgpu.data.tables.paths import arrow_filesystem
from sparkgpu.errors import ConfigurationError, DataError, MissingDependencyError

__all__ = ["DeltaSnapshot", "open_delta", "row_group_mask"]


@dataclasses.dataclass
class DeltaSnapshot:
    """One version of a Delta table, ready to read with pyarrow.

    Attributes:
        uri: The table's URI.
        version: The pinned version.
        table_id: The table's metadata id (changes when the table is replaced).
        dataset: The live data files as a pyarrow dataset with partition expressions.
        selection: ``{file path in dataset: bool keep-mask}`` for files with deleted rows
            (a mask shorter than the file keeps the rows past its end).
        partition_columns: The table's partition columns.
    """

    uri: str
    version: int
    table_id: str
    dataset: pads.FileSystemDataset
    selection: dict
    partition_columns: list


def open_delta(table, *, version=None, timestamp=None, storage_options: dict | None = None) -> DeltaSnapshot:
    """Opens a Delta table (a path/URL or a ``deltalake.DeltaTable``) at a pinned version.

    Args:
        table: Table root path or URL, or an open ``deltalake.DeltaTable``.
        version: Table version (default: the latest).
        timestamp: Read the table as of this time (``datetime`` or ISO-8601 string).
        storage_options: deltalake / fsspec options for remote tables.

    Raises:
        ConfigurationError: Both ``version`` and ``timestamp`` given.
        DataError: The table cannot be opened at that version.
        MissingDependencyError: ``deltalake`` is not installed.
    """
    try:
        from deltalake import DeltaTable
    except ImportError:
        raise MissingDependencyError("Reading Delta tables", "pip install deltalake") from None
    if version is not None and timestamp is not None:
        raise ConfigurationError("give either version= or timestamp= for a Delta table, not both")
    try:
        if isinstance(table, DeltaTable):
            if version is not None or timestamp is not None:
                table.load_as_version(version if version is not None else timestamp)
        else:
            table = DeltaTable(str(table), version=version, storage_options=storage_options)
            if timestamp is not None:
                table.load_as_version(timestamp)
    except Exception as exc:  # deltalake raises its own TableNotFoundError, DeltaError, ...
        at = f" at version {version}" if version is not None else f" as of {timestamp}" if timestamp is not None else ""
        raise DataError(
            f"cannot open Delta table {table}{at}: {exc}; check the path and that the version exists"
        ) from None
    mapping = table.metadata().configuration.get("delta.columnMapping.mode", "none")
    if mapping != "none":
        # Its Parquet files name columns by physical ids, not by the schema's names: read as
        # they are, every column would come back missing (all null).
        raise DataError(
            f"Delta table {table.table_uri} uses column mapping (delta.columnMapping.mode={mapping}), "
            "which this reader does not resolve; read it through Spark, or rewrite it without column mapping"
        )
    schema = pa.schema(table.schema().to_arrow())
    partition_columns = list(table.metadata().partition_columns)
    adds = pa.table(table.get_add_actions(flatten=True))
    filesystem, root = arrow_filesystem(table.table_uri, storage_options)
    if filesystem is None:
        filesystem = pa.fs.LocalFileSystem()
    root = root.rstrip("/")
    paths, partitions = [], []
    for row in adds.to_pylist():
        paths.append(f"{root}/{urllib.parse.unquote(row['path'])}")
        partitions.append(_partition_expression(schema, {c: row.get(f"partition.{c}") for c in partition_columns}))
    data_schema = schema
    dataset = pads.FileSystemDataset.from_paths(
        paths, schema=data_schema, format=pads.ParquetFileFormat(), filesystem=filesystem, partitions=partitions
    )
    selection = {}
    for batch in pa.table(table.deletion_vectors()).to_pylist():
        name = urllib.parse.unquote(urllib.parse.urlparse(batch["filepath"]).path).rstrip("/")
        match = next((p for p in paths if p == name or name.endswith("/" + p.rsplit("/", 1)[-1])), None)
        if match is None:
            raise DataError(
                f"Delta table {table.table_uri} has a deletion vector for {batch['filepath']}, which is not one of its files"
            )
        selection[match] = np.asarray(batch["selection_vector"], dtype=bool)
    return DeltaSnapshot(table.table_uri, table.version(), table.metadata().id, dataset, selection, partition_columns)


def _partition_expression(schema: pa.Schema, values: dict) -> pc.Expression:
    expression = pc.scalar(True)
    for column, value in values.items():
        field = pc.field(column)
        if value is None:
            expression = expression & field.is_null()
        else:
            typed = (
                pa.scalar(value).cast(schema.field(column).type)
                if not isinstance(value, datetime.datetime)
                else pa.scalar(value)
            )
            expression = expression & (field == typed)
    return expression


def row_group_mask(selection: np.ndarray | None, start: int, rows: int) -> np.ndarray | None:
    """The keep-mask of rows ``[start, start + rows)`` of a file, or ``None`` when all are kept."""
    if selection is None:
        return None
    mask = np.ones(rows, dtype=bool)
    piece = selection[start : start + rows]
    mask[: len(piece)] = piece
    return None if mask.all() else mask
