"""What kind of source a conversion or a table reader was given, decided once.

:func:`resolve_source` looks at what the caller passed (a Spark DataFrame, a table name, a path
or URL, a ``deltalake.DeltaTable``, Arrow or pandas data) and returns a
:class:`ResolvedSource`: its :class:`SourceKind` and what that kind needs (the path, the Delta
version, the plain file scan a DataFrame is). Everything downstream (``to_mds``, the table
reader, ``spark.gpu.train(data=...)``) takes that object and switches on its kind; nothing
inspects the raw input again. Bad input fails here, with the fix in the message, before any
file is listed or any Spark job starts.

Resolving is cheap: type checks, the client's own Spark plan (no server round trip) and, for
a path, whether it is a Delta table root (one ``_delta_log`` lookup). Files are opened later.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any

from sparkgpu.data.tables.paths import is_delta_table
from sparkgpu.data.tables.plan import TableRef, table_ref_of
from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["SourceKind", "ResolvedSource", "resolve_source", "is_spark_dataframe"]

_SOURCES = (
    "a Spark DataFrame, a path to a Delta table or Parquet files, a deltalake.DeltaTable, "
    "a pyarrow Table / RecordBatchReader or a pandas DataFrame"
)
_SPARK_TIME_TRAVEL = (
    "version= and timestamp= apply to Delta tables read without Spark; for a Spark DataFrame, "
    "time-travel in the read: spark.read.format('delta').option('versionAsOf', 12)"
)


class SourceKind(enum.Enum):
    """The kinds of source, each read its own way."""

    SPARK = "spark"  # a Spark DataFrame whose rows Spark computes (or a catalog table name)
    SPARK_SCAN = "spark-scan"  # a Spark DataFrame that only scans one Parquet or Delta path
    DELTA = "delta"  # a Delta table: its root path or URL, or a deltalake.DeltaTable
    PARQUET = "parquet"  # a Parquet file or a folder of them: path or URL
    ARROW = "arrow"  # a pyarrow Table (or a RecordBatch, resolved as a Table)
    ARROW_STREAM = "arrow-stream"  # a pyarrow RecordBatchReader, read once
    PANDAS = "pandas"  # a pandas DataFrame

    @property
    def is_spark(self) -> bool:
        return self in (SourceKind.SPARK, SourceKind.SPARK_SCAN)

    @property
    def is_table(self) -> bool:
        """Delta or Parquet files, read in place by pyarrow."""
        return self in (SourceKind.DELTA, SourceKind.PARQUET)


@dataclasses.dataclass(frozen=True, eq=False)
class ResolvedSource:
    """A source whose kind is decided.

    Attributes:
        kind: What it is.
        data: The object given: the DataFrame (a table name's ``spark.table``), the
            ``DeltaTable``, the pyarrow Table (a RecordBatch as one), the RecordBatchReader,
            the pandas frame; for a path, the path as a string.
        path: ``DELTA`` / ``PARQUET`` given as a path: that path or URL; else ``None``.
        version: Delta version to read (``DELTA`` only).
        timestamp: Delta timestamp to read (``DELTA`` only).
        storage_options: fsspec / deltalake options for remote paths.
        scan: ``SPARK_SCAN``: the path, columns and filter the DataFrame's plan scans.
        files: ``SPARK_SCAN``: those files resolved (``DELTA`` / ``PARQUET``), or ``None``
            when this process cannot read them (``why`` says why).
        why: ``SPARK``: why it is not a plain file scan; ``SPARK_SCAN`` without ``files``:
            why its files are not read here.
    """

    kind: SourceKind
    data: Any
    path: str | None = None
    version: int | None = None
    timestamp: Any = None
    storage_options: dict | None = None
    scan: TableRef | None = None
    files: ResolvedSource | None = None
    why: str = ""


def resolve_source(
    data, *, version=None, timestamp=None, storage_options: dict | None = None, spark=None
) -> ResolvedSource:
    """Decides what ``data`` is; an already resolved source is returned as it is.

    Args:
        data: A Spark DataFrame (classic or Connect), a path or URL of a Delta table or of
            Parquet files, a ``deltalake.DeltaTable``, a pyarrow Table / RecordBatch /
            RecordBatchReader, a pandas DataFrame, or (with ``spark``) a catalog table name.
        version: Delta version (Delta tables only).
        timestamp: Delta timestamp, ``datetime`` or ISO-8601 string (Delta tables only).
        storage_options: fsspec / deltalake options for remote paths.
        spark: A session to read a catalog table name (``"main.ml.clicks"``) with; without
            one, every string is a path.

    Raises:
        ConfigurationError: A type no reader knows, or ``version`` / ``timestamp`` for a
            source that is not a Delta table.
        DataError: A local path that does not exist.
    """
    if isinstance(data, ResolvedSource):
        if (version is not None and version != data.version) or (timestamp is not None and timestamp != data.timestamp):
            raise ConfigurationError("version= and timestamp= are those the source was resolved with; resolve it again")
        return data
    if is_spark_dataframe(data):
        return _spark(data, version, timestamp, storage_options)
    if isinstance(data, str) and spark is not None and _is_table_name(data):
        if version is not None or timestamp is not None:
            raise ConfigurationError(_SPARK_TIME_TRAVEL)
        frame = spark.table(data)
        why = "it is a catalog table name, whose files the client cannot locate; pass the table's path instead"
        return ResolvedSource(SourceKind.SPARK, frame, storage_options=storage_options, why=why)
    if _is_delta_table_object(data):
        return ResolvedSource(SourceKind.DELTA, data, None, version, timestamp, storage_options)
    if isinstance(data, (str, os.PathLike)):
        return _path(os.fspath(data), version, timestamp, storage_options)
    return _in_memory(data, version, timestamp, storage_options)


def is_spark_dataframe(obj) -> bool:
    """Whether ``obj`` is a Spark DataFrame (classic or Spark Connect), without importing pyspark."""
    module = type(obj).__module__
    return module.startswith("pyspark.sql") and hasattr(obj, "mapInArrow")


def _spark(df, version, timestamp, storage_options) -> ResolvedSource:
    if version is not None or timestamp is not None:
        raise ConfigurationError(_SPARK_TIME_TRAVEL)
    ref, why = table_ref_of(df)
    if ref is None:
        return ResolvedSource(SourceKind.SPARK, df, storage_options=storage_options, why=why)
    files, why, local = None, "", _local_path(ref.path)
    if local is not None and not os.path.exists(local):
        why = f"its files ({ref.path}) are not visible on this machine"
    else:
        try:
            files = _path(ref.path, ref.version, ref.timestamp, storage_options)
        except (ConfigurationError, DataError) as exc:
            why = f"its files cannot be read here ({exc})"
    return ResolvedSource(SourceKind.SPARK_SCAN, df, storage_options=storage_options, scan=ref, files=files, why=why)


def _path(path: str, version, timestamp, storage_options) -> ResolvedSource:
    local = _local_path(path)
    if local is not None and not os.path.exists(local):
        raise DataError(
            f"cannot read {path}: there is no such file or folder; give a Delta table, a folder of Parquet files or one file"
        )
    if is_delta_table(path, storage_options):
        return ResolvedSource(SourceKind.DELTA, path, path, version, timestamp, storage_options)
    if version is not None or timestamp is not None:
        raise ConfigurationError(
            f"version= and timestamp= apply to Delta tables; {path} is not a Delta table (no _delta_log)"
        )
    return ResolvedSource(SourceKind.PARQUET, path, path, storage_options=storage_options)


def _in_memory(data, version, timestamp, storage_options) -> ResolvedSource:
    import pyarrow as pa

    if isinstance(data, pa.RecordBatch):
        kind, data = SourceKind.ARROW, pa.Table.from_batches([data])  # no copy
    elif isinstance(data, pa.Table):
        kind = SourceKind.ARROW
    elif isinstance(data, pa.RecordBatchReader):
        kind = SourceKind.ARROW_STREAM
    elif type(data).__module__.startswith("pandas") and hasattr(data, "to_dict"):
        kind = SourceKind.PANDAS
    else:
        raise ConfigurationError(f"cannot convert a {type(data).__name__}; give {_SOURCES}")
    if version is not None or timestamp is not None:
        raise ConfigurationError("version= and timestamp= apply to Delta tables; only Delta tables have versions")
    return ResolvedSource(kind, data, storage_options=storage_options)


def _local_path(path: str) -> str | None:
    """The local path ``path`` names (a plain path or a ``file://`` URL), or ``None`` for a remote URL."""
    if path.startswith("file://"):
        return os.path.expanduser(path[len("file://") :])
    return None if "://" in path else os.path.expanduser(path)


def _is_table_name(data: str) -> bool:
    """A string that names a catalog table (``main.ml.clicks``) rather than a path or URL."""
    return "://" not in data and os.sep not in data and not os.path.exists(data)


def _is_delta_table_object(data) -> bool:
    """Whether ``data`` is a ``deltalake.DeltaTable`` (False when deltalake is not installed)."""
    try:
        from deltalake import DeltaTable
    except ImportError:
        return False
    return isinstance(data, DeltaTable)
