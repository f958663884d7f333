"""Spark DataFrames that only scan files, converted from those files past Spark's row pipeline.

When a DataFrame's plan is a read of one Parquet or Delta path under column selections and
filters (decided by :func:`sparkgpu.data.tables.resolve.resolve_source`, the same test that lets
``spark.gpu.train(data_format="table")`` read a table in place), its rows are exactly the
files' rows that pass the filters, in the selected columns. Those are read here with pyarrow
(Delta through :mod:`sparkgpu.data.tables.delta`, deletion vectors applied), the filter pushed down
to partitions and row groups, and written by the same parallel writers as a Parquet path:
no row goes through a Spark Python worker.
"""

from __future__ import annotations

import hashlib
import json
import logging

import pyarrow as pa

from sparkgpu.data.convert.files import FileSource, file_source
from sparkgpu.data.convert.spark_schema import arrow_schema
from sparkgpu.data.tables.resolve import ResolvedSource, SourceKind, resolve_source
from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["plain_scan_source", "scan_source"]

_logger = logging.getLogger(__name__)


def plain_scan_source(df, storage_options: dict | None = None) -> tuple[FileSource | None, str]:
    """The DataFrame's rows read from its files, or ``(None, why not)``.

    Args:
        df: A Spark Connect DataFrame.
        storage_options: fsspec / deltalake options for remote files.

    Returns:
        ``(source, "")`` when the plan is a plain scan of files this process can read with
        the same columns and types as Spark gives, else ``(None, reason)``.
    """
    return scan_source(resolve_source(df, storage_options=storage_options))


def scan_source(resolved: ResolvedSource) -> tuple[FileSource | None, str]:
    """:func:`plain_scan_source` of a resolved DataFrame: ``SPARK_SCAN`` with files this
    process can read is read from them; any other gets ``(None, why not)``."""
    ref, table = resolved.scan, resolved.files
    if ref is None or table is None:
        return None, resolved.why
    df = resolved.data
    try:
        files = file_source(table, row_filter=ref.filter)
    except (ConfigurationError, DataError) as exc:
        return None, f"its files cannot be read here ({exc})"
    spark_schema = _spark_schema(df)
    if spark_schema is None and table.kind is not SourceKind.DELTA:
        return None, "Spark cannot analyse its plan"
    names = (
        list(ref.columns)
        if ref.columns is not None
        else (spark_schema.names if spark_schema is not None else files.schema.names)
    )
    missing = [name for name in names if files.schema.get_field_index(name) < 0]
    if missing:
        return None, f"columns {missing} are not spelled as in the files"
    schema = pa.schema([files.schema.field(name) for name in names])
    if spark_schema is not None:
        if spark_schema.names != names:
            return None, f"Spark names its columns {spark_schema.names}, the files {names}"
        for theirs in spark_schema:
            if not _same_type(schema.field(theirs.name).type, theirs.type):
                return (
                    None,
                    f"column {theirs.name!r} is {schema.field(theirs.name).type} in the files, {theirs.type} in Spark",
                )

    def fingerprint() -> str:
        parts = {
            "type": "spark-scan",
            "path": ref.path,
            "columns": names,
            "filter": ref.filter,
            "files": files.fingerprint(),
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()

    description = {"type": "spark", "via": "files", "files": files.description, "columns": len(names)}
    if ref.filter:
        description["filter"] = ref.filter
    _logger.info("sparkgpu: to_mds reads the DataFrame's files directly: %s", description)
    return files.narrowed(schema, description, fingerprint), ""


def _spark_schema(df) -> pa.Schema | None:
    """Spark's schema of ``df`` as Arrow, or ``None`` when the server cannot read the source
    (a Delta table on a server without Delta Lake: this package reads it all the same)."""
    from pyspark.errors import PySparkException

    try:
        spark_schema = df.schema
    except PySparkException as exc:  # Connect reports a missing data source as UnknownException
        _logger.info(
            "sparkgpu: Spark cannot analyse the DataFrame (%s); its Delta files are read all the same",
            str(exc).splitlines()[0],
        )
        return None
    return arrow_schema(spark_schema)


def _same_type(ours: pa.DataType, theirs: pa.DataType) -> bool:
    """Equal types, list element names aside (Parquet says "element", Spark's Arrow "item")."""
    if (
        pa.types.is_list(ours)
        and pa.types.is_list(theirs)
        or pa.types.is_large_list(ours)
        and pa.types.is_large_list(theirs)
    ):
        return _same_type(ours.value_type, theirs.value_type)
    return ours == theirs
