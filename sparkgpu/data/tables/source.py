"""Where a table dataset's rows come from: its files, row groups and surviving-row counts.

Opening lists the live files (Delta through :mod:`sparkgpu.data.tables.delta`, deletion vectors
included; Parquet through ``pyarrow.dataset``), lets pyarrow prune partitions and row groups
with the filter, and counts each row group's surviving rows: from the footer, minus the rows
its deletion vector removes, and when there is a filter, by evaluating it on the filter's
columns alone.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from sparkgpu.data.loaders.order import check_int
from sparkgpu.data.tables.delta import open_delta, row_group_mask
from sparkgpu.data.tables.filter import KEEP
from sparkgpu.data.tables.paths import arrow_filesystem, open_parquet_dataset
from sparkgpu.data.tables.resolve import ResolvedSource, SourceKind, resolve_source
from sparkgpu.errors import ConfigurationError, DataError

__all__ = [
    "OpenedTable",
    "open_table",
    "open_resolved_table",
    "row_groups",
    "file_cache",
    "keep_mask",
    "count_rows",
    "scan",
    "RowGroup",
]


def file_cache(dataset, units, identity, storage_options, local, cache_limit, download_threads):
    from sparkgpu.config import settings
    from sparkgpu.spec.units import parse_size
    from sparkgpu.data.storage.table_cache import TableFileCache

    url = identity.get("uri") or identity.get("path")
    if isinstance(dataset.filesystem, pa.fs.LocalFileSystem) or "://" not in url or url.startswith("file://"):
        return None  # read in place
    check_int("download_threads", download_threads, 1)
    limit = cache_limit if cache_limit is not None else settings().cache_limit_bytes
    limit = parse_size(limit, "cache_limit") if limit is not None else None
    files = sorted({unit.path for unit in units})
    sizes = [info.size for info in dataset.filesystem.get_file_info(files)]
    _, root = arrow_filesystem(url, storage_options)
    return TableFileCache(
        url,
        root,
        files,
        sizes,
        storage_options,
        local if local is not None else settings().cache_dir,
        limit,
        download_threads,
    )


@dataclasses.dataclass(frozen=True)
class OpenedTable:
    """A Delta table at one version, or Parquet files as they are now: what readers and conversions read.

    Attributes:
        dataset: The live files as a ``pyarrow.dataset``.
        selection: Per file path, the rows its deletion vector keeps (Delta only; empty otherwise).
        identity: What names these exact rows: ``{"type": "delta", "uri", "version", "id"}`` or
            ``{"type": "parquet", "path", "files": [[path, size, mtime_ns], ...]}``.
        description: What was read, for people and for an output's index.
    """

    dataset: pads.Dataset
    selection: dict
    identity: dict
    description: dict


def open_table(source, version=None, timestamp=None, storage_options: dict | None = None) -> OpenedTable:
    """Opens a Delta table (a path, URL or ``deltalake.DeltaTable``; time travel with ``version``
    or ``timestamp``) or Parquet files under a path.

    Raises:
        ConfigurationError: ``version``/``timestamp`` for Parquet files, or a source that is not
            a table's files.
        DataError: The path cannot be read.
    """
    return open_resolved_table(
        resolve_source(source, version=version, timestamp=timestamp, storage_options=storage_options)
    )


def open_resolved_table(resolved: ResolvedSource) -> OpenedTable:
    """Opens a resolved ``DELTA`` or ``PARQUET`` source (:func:`~sparkgpu.data.tables.resolve.resolve_source`).

    Raises:
        ConfigurationError: A source of another kind.
        DataError: The files cannot be read.
    """
    if resolved.kind is SourceKind.DELTA:
        snapshot = open_delta(
            resolved.data,
            version=resolved.version,
            timestamp=resolved.timestamp,
            storage_options=resolved.storage_options,
        )
        identity = {"type": "delta", "uri": snapshot.uri, "version": snapshot.version, "id": snapshot.table_id}
        description: dict = {"type": "delta", "uri": snapshot.uri, "version": snapshot.version}
        timestamp = resolved.timestamp
        if timestamp is not None:
            description["timestamp"] = (
                timestamp.isoformat() if isinstance(timestamp, datetime.datetime) else str(timestamp)
            )
        if snapshot.selection:
            description["deletion_vectors"] = len(snapshot.selection)
        return OpenedTable(snapshot.dataset, snapshot.selection, identity, description)
    if resolved.kind is not SourceKind.PARQUET or resolved.path is None:
        raise ConfigurationError(
            f"a {resolved.kind.value} source is not a table's files; give the path of a Delta table or of Parquet files"
        )
    path = resolved.path
    dataset = open_parquet_dataset(path, resolved.storage_options)
    infos = dataset.filesystem.get_file_info(sorted(dataset.files))
    identity = {"type": "parquet", "path": path, "files": [[i.path, i.size, i.mtime_ns] for i in infos]}
    return OpenedTable(dataset, {}, identity, {"type": "parquet", "path": path, "files": len(dataset.files)})


class RowGroup:
    """One row group of one file: where it is, and how many of its rows survive."""

    __slots__ = ("piece", "path", "start", "rows", "count")

    def __init__(self, piece, path, start, rows, count):
        self.piece, self.path, self.start, self.rows, self.count = piece, path, start, rows, count


def row_groups(dataset, expression, selection, threads) -> list[RowGroup]:
    fragments = list(dataset.get_fragments(filter=expression) if expression is not None else dataset.get_fragments())

    def split(fragment):
        fragment.ensure_complete_metadata()
        metadata = fragment.metadata
        starts = np.cumsum([0] + [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)])
        pieces = (
            fragment.split_by_row_group(filter=expression, schema=dataset.schema)
            if expression is not None
            else fragment.split_by_row_group()
        )
        groups = []
        for piece in pieces:
            group_id = piece.row_groups[0].id
            rows = metadata.row_group(group_id).num_rows
            group = RowGroup(piece, fragment.path, int(starts[group_id]), rows, 0)
            group.count = count_rows(group, dataset.schema, expression, selection)
            groups.append(group)
        return groups

    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="sparkgpu-table-open") as pool:
        split_files = list(pool.map(split, fragments))
    return [group for groups in split_files for group in groups if group.count > 0]


def keep_mask(group: RowGroup, keep: pa.Array | None, selection) -> np.ndarray | None:
    mask = row_group_mask(selection.get(group.path), group.start, group.rows)
    if keep is not None:
        passed = pc.fill_null(keep, False).to_numpy(zero_copy_only=False)
        mask = passed if mask is None else mask & passed
    return mask


def count_rows(group: RowGroup, schema, expression, selection) -> int:
    keep = None
    if expression is not None:
        keep = scan(group.piece, schema, {KEEP: expression}).column(KEEP)
        if len(keep) != group.rows:
            raise DataError(f"{group.path} row group changed while being read; open the dataset again")
    mask = keep_mask(group, keep, selection)
    return group.rows if mask is None else int(mask.sum())


def scan(piece, schema, projection: dict) -> pa.Table:
    return pads.Scanner.from_fragment(piece, schema=schema, columns=projection, use_threads=False).to_table()
