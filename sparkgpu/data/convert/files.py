"""Sources converted on this machine: Delta tables (deltalake, no Spark), Parquet, Arrow.

Work is split into contiguous groups of Parquet files or row groups, balanced by rows, one
:class:`~sparkgpu.data.mds.writer.ShardWriter` per group in its own sub-folder, all groups in
parallel threads (pyarrow decoding, numpy copies and file writes release the GIL). Groups are
contiguous, so the dataset keeps the source's row order.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterable

import pyarrow as pa
import pyarrow.dataset as pads

from sparkgpu.data.mds.writer import ShardOptions
from sparkgpu.data.tables.delta import row_group_mask
from sparkgpu.data.tables.filter import KEEP, to_expression
from sparkgpu.data.tables.resolve import ResolvedSource, SourceKind, resolve_source
from sparkgpu.data.tables.source import OpenedTable, open_resolved_table, open_table
from sparkgpu.errors import ConfigurationError
from sparkgpu.store import Store

__all__ = ["FileSource", "resolve_file_source", "file_source", "open_files"]

_BATCH_ROWS = 64 * 1024


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode("utf-8")).hexdigest()


class FileSource:
    """A source read with pyarrow on this machine.

    Attributes:
        schema: Arrow schema of the rows.
        description: What was read, recorded in the output's index (type, path, version).
    """

    def __init__(
        self, schema: pa.Schema, description: dict, units: Callable[[int], list], fingerprint: Callable[[], str]
    ):
        self.schema = schema
        self.description = description
        self._units = units
        self._fingerprint = fingerprint

    def fingerprint(self) -> str:
        """Hex digest that changes whenever the rows may have changed."""
        return self._fingerprint()

    def narrowed(self, schema: pa.Schema, description: dict, fingerprint: Callable[[], str]) -> FileSource:
        """The same rows read as ``schema`` (a selection of this source's columns), described anew."""
        return FileSource(schema, description, self._units, fingerprint)

    def write(
        self, volume: Store, options: ShardOptions, *, max_workers: int | None = None, progress=None, transform=None
    ) -> list[dict]:
        """Writes every row as MDS shards under ``volume``; returns the index entries in order.

        Args:
            volume: Output folder (already claimed by :class:`~sparkgpu.data.convert.output.OutputFolder`).
            options: Encodings and shard settings.
            max_workers: Parallel writers; defaults to the number of CPUs.
            progress: Optional object with ``start(total)`` and ``advance(rows)``.
            transform: Optional thread-safe callable turning each record batch of its
                ``input_columns`` into the batch written (``options`` then describes its output).
        """
        workers = max(1, max_workers or os.cpu_count() or 1)
        columns = list(transform.input_columns) if transform is not None else [spec.name for spec in options.specs]
        groups = _balanced_groups(self._units(workers), workers)
        if progress is not None:
            progress.start(sum(unit.rows or 0 for group in groups for unit in group) or None)
        stop = threading.Event()
        single = len(groups) == 1

        def write_group(index: int, group: list) -> list[dict]:
            writer = options.writer(volume, f"part-{index:05d}")
            for unit in group:
                for batch in unit.batches(columns, use_threads=single):
                    if stop.is_set():
                        return []
                    writer.write_batch(transform(batch) if transform is not None else batch)
                    if progress is not None:
                        progress.advance(batch.num_rows)
            return writer.finish()

        if not groups:
            return []
        if single:
            return write_group(0, groups[0])
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="sparkgpu-mds") as pool:
            futures = [pool.submit(write_group, i, group) for i, group in enumerate(groups)]
            try:
                return [shard for future in futures for shard in future.result()]
            finally:
                stop.set()


class _Unit:
    """A piece of the source one writer reads in order: a fragment, row group or slice."""

    def __init__(self, rows: int | None, batches: Callable[[list[str], bool], Iterable[pa.RecordBatch]]):
        self.rows = rows
        self._batches = batches

    def batches(self, columns: list[str], use_threads: bool) -> Iterable[pa.RecordBatch]:
        return self._batches(columns, use_threads)


def _balanced_groups(units: list[_Unit], workers: int) -> list[list[_Unit]]:
    """Cuts ``units`` into at most ``workers`` contiguous groups of similar row counts."""
    if not units:
        return []
    count = min(workers, len(units))
    weights = [max(1, unit.rows or 1) for unit in units]
    total = sum(weights)
    groups: list[list[_Unit]] = [[] for _ in range(count)]
    before = 0
    for unit, weight in zip(units, weights):
        groups[min(count - 1, before * count // total)].append(unit)
        before += weight
    return [group for group in groups if group]


# --------------------------------------------------------------------------------------------
# Parquet and Delta: pyarrow datasets
# --------------------------------------------------------------------------------------------


def _dataset_units(dataset: pads.Dataset, workers: int, expression=None) -> list[_Unit]:
    schema = dataset.schema
    fragments = list(dataset.get_fragments(filter=expression) if expression is not None else dataset.get_fragments())
    split = len(fragments) < 4 * workers and all(isinstance(f, pads.ParquetFileFragment) for f in fragments)
    if split:
        # Few files: split them by row group so every worker gets a share. Only then are
        # footers read up front (many remote files would make that slow).
        # The filter prunes row groups by their statistics here.
        fragments = [
            piece for fragment in fragments for piece in fragment.split_by_row_group(filter=expression, schema=schema)
        ]

    def unit(fragment) -> _Unit:
        # With a filter the count is an upper bound: good enough to balance the writers.
        rows = sum(group.num_rows for group in fragment.row_groups) if split else None

        def batches(columns, use_threads):
            return fragment.to_batches(
                schema=schema, columns=columns, filter=expression, batch_size=_BATCH_ROWS, use_threads=use_threads
            )

        return _Unit(rows, batches)

    return [unit(fragment) for fragment in fragments]


def _opened_source(opened: OpenedTable, row_filter=None) -> FileSource:
    """The rows of an opened Delta table or Parquet files that pass ``row_filter``."""
    dataset = opened.dataset
    expression = _expression(row_filter, dataset.schema)
    fingerprint = _digest({**opened.identity, "schema": dataset.schema.to_string()})

    def units(workers: int) -> list[_Unit]:
        if not opened.selection:
            return _dataset_units(dataset, workers, expression)
        fragments = dataset.get_fragments(filter=expression) if expression is not None else dataset.get_fragments()
        return [_deleted_rows_unit(fragment, opened, expression) for fragment in fragments]

    return FileSource(dataset.schema, opened.description, units, lambda: fingerprint)


def _deleted_rows_unit(fragment, opened: OpenedTable, expression=None) -> _Unit:
    """A whole file, its deleted rows (its deletion vector) and the rows ``expression`` rejects left out."""
    import pyarrow.compute as pc

    selection = opened.selection.get(fragment.path)
    schema = opened.dataset.schema

    def batches(columns, use_threads):
        # The filter cannot go to the scanner: rows it drops would shift the positions the
        # deletion vector counts. It is evaluated beside the columns instead.
        projection = {name: pc.field(name) for name in columns}
        if expression is not None:
            projection[KEEP] = expression
        scanner = pads.Scanner.from_fragment(
            fragment, schema=schema, columns=projection, batch_size=_BATCH_ROWS, use_threads=False
        )
        start = 0
        # use_threads=False keeps the batches in file order, which the row positions rely on.
        for batch in scanner.to_batches():
            mask = row_group_mask(selection, start, batch.num_rows)
            start += batch.num_rows
            if expression is not None:
                passed = pc.fill_null(batch.column(KEEP), False).to_numpy(zero_copy_only=False)
                mask = passed if mask is None else mask & passed
                batch = batch.drop_columns([KEEP])
            yield batch if mask is None else batch.filter(pa.array(mask))

    return _Unit(None, batches)


# --------------------------------------------------------------------------------------------
# Arrow tables, streams and pandas frames in memory
# --------------------------------------------------------------------------------------------


def _table_source(table: pa.Table) -> FileSource:
    def units(workers: int) -> list[_Unit]:
        rows = table.num_rows
        step = max(1, -(-rows // workers))

        def slice_batches(start: int) -> Callable[[list[str], bool], Iterable[pa.RecordBatch]]:
            return lambda columns, _threads: table.slice(start, step).select(columns).to_batches(_BATCH_ROWS)

        return [_Unit(min(step, rows - start), slice_batches(start)) for start in range(0, rows, step)]

    def fingerprint() -> str:
        digest = hashlib.sha256()
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as stream:
            stream.write_table(table)
        digest.update(memoryview(sink.getvalue()))
        return digest.hexdigest()

    return FileSource(table.schema, {"type": "arrow", "rows": table.num_rows}, units, fingerprint)


def _stream_source(reader: pa.RecordBatchReader) -> FileSource:
    def units(_workers: int) -> list[_Unit]:
        def batches(columns, _threads):
            for batch in reader:
                yield batch.select(columns)

        return [_Unit(None, batches)]

    def fingerprint() -> str:
        raise ConfigurationError(
            "a stream of record batches cannot be fingerprinted without consuming it; pass a "
            "pyarrow.Table, a DataFrame or a path instead"
        )

    return FileSource(reader.schema, {"type": "arrow-stream"}, units, fingerprint)


def _expression(row_filter, schema: pa.Schema):
    if row_filter is None:
        return None
    return to_expression(row_filter, schema)


def open_files(
    path: str, *, row_filter=None, version=None, timestamp=None, storage_options: dict | None = None
) -> FileSource:
    """The rows of a Delta table or of Parquet files under ``path`` that pass ``row_filter``.

    Args:
        path: Delta table root, Parquet file or folder: local path or URL.
        row_filter: ``None``, a SQL predicate string or a pyarrow expression (as the table
            dataset's ``filter=``); it prunes partitions and row groups before they are read.
        version, timestamp: Delta time travel.
        storage_options: fsspec / deltalake options for remote paths.

    Raises:
        ConfigurationError: A filter this reader cannot evaluate, or time travel on Parquet.
        DataError: The path cannot be read.
    """
    return _opened_source(open_table(path, version, timestamp, storage_options), row_filter)


def resolve_file_source(source, *, version=None, timestamp=None, storage_options: dict | None = None) -> FileSource:
    """Turns a path, Delta table, Arrow table/stream or pandas frame into a :class:`FileSource`.

    Raises:
        ConfigurationError: ``version``/``timestamp`` given for something that is not Delta, or
            a source type this function does not know.
        DataError: The path cannot be read.
    """
    return file_source(resolve_source(source, version=version, timestamp=timestamp, storage_options=storage_options))


def file_source(resolved: ResolvedSource, row_filter=None) -> FileSource:
    """The :class:`FileSource` of a resolved source read on this machine (any kind but Spark's);
    ``row_filter`` (Delta and Parquet only) as for :func:`open_files`.

    Raises:
        ConfigurationError: A Spark DataFrame (converted by :mod:`~sparkgpu.data.convert.spark`).
        DataError: The files cannot be read.
    """
    kind = resolved.kind
    if kind.is_table:
        return _opened_source(open_resolved_table(resolved), row_filter)
    if kind is SourceKind.ARROW:
        return _table_source(resolved.data)
    if kind is SourceKind.ARROW_STREAM:
        return _stream_source(resolved.data)
    if kind is SourceKind.PANDAS:
        return _table_source(pa.Table.from_pandas(resolved.data, preserve_index=False))
    raise ConfigurationError(
        f"a {kind.value} source is converted by Spark, not read here; pass it to sparkgpu.data.to_mds"
    )
