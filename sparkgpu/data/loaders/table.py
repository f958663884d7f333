"""``sparkgpu.data.table_dataset``: batches straight from a Delta table or Parquet files.

```python
from sparkgpu import data
rows = data.table_dataset("/lake/clicks", columns=["f0", "f1", "label"], filter="day >= '2026-11-01'",
                          version=42, batch_size=4096, shuffle=True, seed=0)
for batch in rows:              # {"f0": tensor, "f1": tensor, "label": tensor}
    ...
state = rows.state_dict()       # resume exactly with rows.load_state_dict(state)
```

Row groups are the unit of everything. Opening the dataset lists the table's live files
(Delta: at the pinned version, deletion vectors applied, see :mod:`sparkgpu.data.tables.delta`),
prunes partitions and row groups with the filter, and counts each remaining row group's
surviving rows (from the footers; a filter is evaluated on its columns alone). Those counts
play the part of shard sizes in :mod:`sparkgpu.data.loaders.order`: the same seeded shuffle (row
groups in a random layout, rows mixed within a window of ``shuffle_block_size`` rows), the
same split (row ``p`` of the epoch's order goes to rank ``p % world_size``) and the same
remainder rule (the last ``remaining % world_size`` rows of an epoch are left out of it, so
every rank reads the same number of rows and batches, none twice). Row groups are read ahead
of need on a thread pool in the order the plan first needs them, and dropped after their last
use in the epoch.

Inside torch DataLoader workers worker ``w`` of ``W`` builds batches ``w, w + W, ...`` of its
rank's plan, which the DataLoader hands out in order: the same batches as without workers.
``rows.loader(num_workers=2)`` is such a DataLoader that also keeps the position exact
(:mod:`sparkgpu.data.loaders.positioned`).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import hashlib
import json
import os
import weakref

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkgpu.data.loaders._base import StateLayout, job_rank
from sparkgpu.data.loaders.order import DEFAULT_BLOCK_SIZE, EpochOrders, EpochPlan, check_int, locate, shard_spans
from sparkgpu.data.loaders.positioned import Positioned
from sparkgpu.data.loaders.lazy_orders import BandedOrder, FragmentOrder, LazyOrder
from sparkgpu.data.tables.filter import KEEP, to_expression
from sparkgpu.data.tables.plan import TableRef
from sparkgpu.data.tables.source import file_cache, keep_mask, open_table, row_groups, scan
from sparkgpu.data.loaders.table_tensors import UnitColumns, gather_batch, gather_runs
from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["table_dataset", "TableDataset"]

# Iterations not run to their end. One still open when the interpreter exits is closed here,
# while the modules its read threads' shutdown needs still exist; otherwise the interpreter's
# teardown would close it later and print "Exception ignored in ... __iter__".
_open_iterations: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_iterations() -> None:
    for batches in list(_open_iterations):
        batches.close()


def table_dataset(
    path_or_url,
    *,
    batch_size: int,
    columns: list[str] | None = None,
    filter=None,
    version: int | None = None,
    timestamp=None,
    shuffle: bool = False,
    seed: int = 0,
    shuffle_block_size: int | None = None,
    drop_last: bool = False,
    fill_null=None,
    read_threads: int = 4,
    local: str | os.PathLike | None = None,
    cache_limit: int | str | None = None,
    download_threads: int = 8,
    rank: int | None = None,
    world_size: int | None = None,
    storage_options: dict | None = None,
) -> "TableDataset":
    """Opens a Delta table or Parquet files for training, without converting them.

    Args:
        path_or_url: A Delta table root (a folder with ``_delta_log``), a folder of Parquet
            files (hive partitions allowed) or one file; local or an fsspec URL; an open
            ``deltalake.DeltaTable``; or the :class:`~sparkgpu.data.tables.plan.TableRef` that
            ``spark.gpu.train(..., data_format="table")`` hands the ranks (its columns, filter
            and version apply; a ``filter=`` given here narrows it further).
        batch_size: Rows per batch on each rank.
        columns: Columns to read (default: all).
        filter: Rows to keep: a SQL predicate string (``"day >= '2026-11-01' AND label = 1"``)
            or a ``pyarrow.compute`` expression. Prunes partitions and row groups before reading.
        version: Delta table version (default: the latest).
        timestamp: Delta table as of this time (``datetime`` or ISO-8601 string).
        shuffle: ``True``: shuffle rows, differently each epoch, the same for the same seed
            (row groups in a random layout, rows mixed across neighbouring row groups within
            ``shuffle_block_size``). ``"fragments"``: the cheap shuffle ``pyarrow.dataset``
            users write by hand: row groups in a random order, each read whole, rows shuffled
            only within each step's batches (batch size x world size rows). ``False``: in order.
        seed: Seed of the shuffle; every rank must use the same one.
        shuffle_block_size: Rows of neighbouring row groups mix within windows of this many
            rows (default 262144); it is also about the most rows held in memory at once.
        drop_last: Leave out each rank's short last batch of the epoch.
        fill_null: Value for nulls: one for every column, or ``{column: value}``. Without it,
            a null is an error naming its column.
        read_threads: Row groups read in parallel, ahead of need.
        local: Cache root for a remote table's files (default ``SPARKGPU_CACHE_DIR``); local
            tables are read in place.
        cache_limit: Most bytes of a remote table's files kept in the cache (int or ``"200GB"``;
            default ``SPARKGPU_CACHE_LIMIT`` or no limit). Files needed furthest ahead go first.
        download_threads: Parallel file downloads of a remote table.
        rank: This process's rank (default: from the job).
        world_size: Number of ranks (default: from the job).
        storage_options: deltalake / fsspec options for remote tables (credentials, endpoint).

    Returns:
        A :class:`TableDataset`.

    Raises:
        ConfigurationError: An argument is invalid (the message says what to pass instead).
        DataError: The table cannot be read.
    """
    if isinstance(path_or_url, TableRef):
        ref, path_or_url = path_or_url, path_or_url.path
        columns = list(ref.columns) if columns is None and ref.columns is not None else columns
        if version is None and timestamp is None:
            version, timestamp = ref.version, ref.timestamp
        if ref.filter is not None:
            filter = ref.filter if filter is None else ("both", ref.filter, filter)
    check_int("batch_size", batch_size, 1)
    check_int("seed", seed, 0)
    if shuffle not in (True, False, "fragments"):
        raise ConfigurationError(
            f"shuffle={shuffle!r} is not a table shuffle; pass True (rows mixed across row groups), "
            "'fragments' (row groups in a random order, rows mixed within each batch) or False"
        )
    rank, world_size = job_rank(rank, world_size)
    check_int("read_threads", read_threads, 1)
    if shuffle_block_size is not None:
        check_int("shuffle_block_size", shuffle_block_size, 1)
    opened = open_table(path_or_url, version, timestamp, storage_options)
    dataset, selection, identity = opened.dataset, opened.selection, opened.identity
    schema = dataset.schema
    if columns is None:
        columns = list(schema.names)
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise ConfigurationError(f"columns={missing} are not in the table; it has {schema.names}")
    if isinstance(fill_null, dict) and set(fill_null) - set(columns):
        raise ConfigurationError(
            f"fill_null names columns {sorted(set(fill_null) - set(columns))} that are not read; columns are {columns}"
        )
    if isinstance(filter, tuple) and filter[:1] == ("both",):
        table_filter, given_filter = to_expression(filter[1], schema), to_expression(filter[2], schema)
        assert table_filter is not None and given_filter is not None  # neither filter of the pair is None
        expression = table_filter & given_filter
    else:
        expression = to_expression(filter, schema)
    units = row_groups(dataset, expression, selection, read_threads)
    cached_files = file_cache(dataset, units, identity, storage_options, local, cache_limit, download_threads)
    identity = dict(identity, columns=columns, filter=str(expression) if expression is not None else None)
    return TableDataset(
        units=units,
        schema=schema,
        columns=columns,
        expression=expression,
        selection=selection,
        identity=identity,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        shuffle_block_size=shuffle_block_size or DEFAULT_BLOCK_SIZE,
        drop_last=drop_last,
        fill_null=fill_null,
        read_threads=read_threads,
        rank=rank,
        world_size=world_size,
        file_cache=cached_files,
    )


class TableDataset(Positioned):
    """An epoch-by-epoch iterable of batches of a table's rows, with an exact, JSON-able position.

    Built by :func:`table_dataset`. Iterating yields the rest of the current epoch, then moves
    to the next. ``state_dict()`` and ``load_state_dict()`` work as in
    :class:`sparkgpu.data.loaders.mds_loader.MDSLoader` (the position counts rows of the whole job).

    Attributes:
        num_samples: Rows the dataset reads per epoch (after filter and deletions).
        epoch: The epoch the next iteration reads.
    """

    def __init__(
        self,
        *,
        units,
        schema,
        columns,
        expression,
        selection,
        identity,
        batch_size,
        shuffle,
        seed,
        shuffle_block_size,
        drop_last,
        fill_null,
        read_threads,
        rank,
        world_size,
        file_cache=None,
    ):
        self._units = units
        self._sizes = np.array([u.count for u in units], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self._sizes)]).astype(np.int64)
        self.schema = schema
        self.columns = columns
        self._expression = expression
        self._selection = selection
        self.identity = identity
        self.fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.shuffle_block_size = shuffle_block_size
        self.drop_last = drop_last
        self.fill_null = fill_null
        self.read_threads = read_threads
        self._file_cache = file_cache
        self.rank = rank
        self.world_size = world_size
        self.num_samples = int(self._sizes.sum())
        self.epoch = 0
        self._consumed = 0
        self._orders = EpochOrders(self._order_of, per_epoch=bool(shuffle), finish=_work_out_the_rest)

    # Position (the same rules as MDSLoader).

    def state_dict(self) -> dict:
        """The position after the last batch handed out, as plain JSON (the same on every rank)."""
        return self._saved_state()

    def load_state_dict(self, state: dict) -> None:
        """Continues from a saved position: the next iteration yields the rest of that epoch.

        Raises:
            ConfigurationError: The state comes from another table version, filter or shuffle.
        """
        self.epoch, self._consumed = self._restored_position(state)

    _layout = StateLayout(
        fields=("seed", "shuffle", "shuffle_block_size", "world_size", "batch_size", "num_samples"),
        checked=("seed", "shuffle", "shuffle_block_size", "num_samples", "dataset"),
        fix="open the same table version with the same columns, filter, seed and shuffle to resume, or start "
        "afresh with set_epoch()",
        name="a table dataset",
        what="dataset",
    )

    def _state_identity(self) -> dict:
        return {"dataset": self.fingerprint}

    def _state_extent(self, state: dict) -> tuple[int, str]:
        return self.num_samples, f"dataset of {self.num_samples} rows"

    # Iteration.

    def __iter__(self):
        batches = self._batches()
        _open_iterations.add(batches)
        return batches

    def _batches(self):
        plan, start = self._begin_epoch(), self._consumed
        numbers = self._batch_numbers(plan)
        _, spans, lazy = self._orders.get(self.epoch)
        reader = _Reader(self, plan, numbers, spans, lazy)
        try:
            for number in numbers:
                batch = reader.batch(number)
                self._advance(plan, start, number + 1)
                yield batch
        finally:
            reader.close()
        self.epoch, self._consumed = self.epoch + 1, 0

    def _plan(self, epoch: int, start: int) -> EpochPlan:
        return self._rank_plan(self._orders.get(epoch)[0], start)

    def _order_of(self, epoch: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray], LazyOrder | None]:
        # The epoch's order, where each row group's rows lie in it (what the reader plans by), and,
        # shuffled, what works the order out as far as batches need it: a first batch waits for its own.
        lazy: LazyOrder
        if self.shuffle == "fragments":
            lazy = FragmentOrder(self._sizes, seed=self.seed, epoch=epoch, window=self.batch_size * self.world_size)
        elif self.shuffle:
            lazy = BandedOrder(self._sizes, seed=self.seed, epoch=epoch, block_size=self.shuffle_block_size)
        else:
            return np.arange(self.num_samples, dtype=np.int64), shard_spans(None, self._sizes), None
        return lazy.order, lazy.spans(), lazy

    def _read(self, unit: int, needed_at: int, by_range: bool = False) -> pa.Table:
        group = self._units[unit]
        projection = {name: pc.field(name) for name in self.columns}
        if self._expression is not None:
            projection[KEEP] = self._expression
        if self._file_cache is None:
            table = scan(group.piece, self.schema, projection)
        elif by_range:
            table = scan(self._file_cache.remote_piece(group.piece), self.schema, projection)
        else:
            try:
                table = scan(self._file_cache.local_piece(group.piece, needed_at), self.schema, projection)
            except FileNotFoundError:  # evicted by another process between the check and the read
                table = scan(self._file_cache.local_piece(group.piece, needed_at), self.schema, projection)
        keep = table.column(KEEP) if self._expression is not None else None
        mask = keep_mask(group, keep, self._selection)
        table = table.select(self.columns)
        if mask is not None:
            table = table.filter(pa.array(mask))
        if table.num_rows != group.count:
            raise DataError(
                f"{group.path} changed since the dataset was opened ({table.num_rows} rows pass, "
                f"{group.count} did); open the dataset again (pin a Delta version to avoid this)"
            )
        return table


def _work_out_the_rest(result: tuple[np.ndarray, tuple[np.ndarray, np.ndarray], LazyOrder | None]) -> None:
    if result[2] is not None:
        result[2].complete()


class _Reader:
    """Reads the row groups of a plan ahead of need and builds its batches.

    Which row groups to read, in what order and until when, comes from where each one's rows
    lie in the epoch's order (``spans``, from :func:`~sparkgpu.data.loaders.order.shard_spans`):
    no pass over every row of the plan before the first batch. In order, and with the fragment
    shuffle, a row group is needed by every batch between its first and its last; with the
    windowed shuffle by most of them, and one read ahead of a batch that ends up not using it
    is dropped after its last possible use. Which row group and row each batch row comes from
    is worked out a stretch of this process's batches at a time.
    """

    _STRETCH = 32  # batches located at once

    def __init__(
        self,
        dataset: TableDataset,
        plan: EpochPlan,
        numbers: range,
        spans: tuple[np.ndarray, np.ndarray],
        lazy: LazyOrder | None = None,
    ):
        self.dataset = dataset
        self.plan = plan
        self.lazy = lazy  # the plan's samples are final only as far as it has been worked out
        self.numbers = numbers
        first_batch, last_batch = plan.batches_between(*spans)
        # The first and last of this process's batches (with DataLoader workers, every W-th) in each span.
        begin, step = numbers.start, numbers.step
        first = begin - ((begin - np.maximum(first_batch, begin)) // step) * step
        last = begin + ((np.minimum(last_batch, numbers.stop - 1) - begin) // step) * step
        units = np.flatnonzero((first <= last) & (first_batch <= last_batch))
        units = units[np.lexsort((spans[0][units], first[units]))]
        self.queue = collections.deque(units.tolist())
        self.first_step = dict(zip(units.tolist(), ((first[units] - begin) // step).tolist()))
        self.last_use = dict(zip(units.tolist(), last[units].tolist()))
        self.pool = concurrent.futures.ThreadPoolExecutor(
            dataset.read_threads, thread_name_prefix="sparkgpu-table-read"
        )
        self.loaded: dict[int, concurrent.futures.Future] = {}
        self.started: set[int] = set()
        self.ahead = 2 * dataset.read_threads
        self._first = True
        # Read in order by one rank, a batch is consecutive rows: it is cut from its row groups by
        # their boundaries, with no row located one by one.
        self._consecutive = not dataset.shuffle and plan.stride == 1
        self._stretch = -1
        self._located: tuple[np.ndarray, np.ndarray] = (np.empty(0, np.int32), np.empty(0, np.int64))
        self._located_at: list[int] = []
        self.files = dataset._file_cache
        self.early: list[int] = []  # the first batch's row groups, read by byte range (see table_cache)
        if self.files is not None:
            file_of = np.array([self.files.position[u.path] for u in dataset._units], dtype=np.int64)
            self.steps = _files_by_step(
                file_of[units], (first[units] - begin) // step, (last[units] - begin) // step, len(numbers)
            )
            if len(numbers):
                first_units = (
                    self._runs(numbers.start)[0]
                    if self._consecutive
                    else np.unique(self._locate(numbers.start)[0]).tolist()
                )
                self.early = [u for u in first_units if not self.files.is_local(dataset._units[u].path)]
            for unit in self.early:
                self.started.add(unit)
                self.loaded[unit] = self.pool.submit(self._columns, unit, True)
            if not self.early:
                self.files.start(self.steps)

    def batch(self, number: int) -> dict:
        if self._consecutive:
            needed, runs = self._runs(number)
        else:
            units, offsets = self._locate(number)
            present = np.zeros(len(self.dataset._units), dtype=bool)
            present[units] = True
            needed = np.flatnonzero(present).tolist()
        if self.files is not None:
            step = (number - self.numbers.start) // self.numbers.step
            if self.early:  # the whole-file downloads start once the first batch's row groups are in
                concurrent.futures.wait([self.loaded[u] for u in self.early])
                self.early = []
                self.files.start(self.steps)
            else:
                self.files.reached(step, self.steps[step])
        self._fill(needed)
        columns = [self.loaded[u].result() for u in needed]
        if self._consecutive:
            batch = gather_runs([(columns[i], begin, end) for i, begin, end in runs])
        else:
            position = (np.cumsum(present, dtype=np.int32) - 1)[units]  # each row's place in `needed`
            batch = gather_batch(columns, position, np.ascontiguousarray(offsets, dtype=np.int64))
        for unit in [u for u in self.loaded if self.last_use[u] <= number]:
            self.loaded.pop(unit)
        return batch

    def _runs(self, number: int) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Batch ``number`` of consecutive rows: its row groups, and ``(which, first row, end row)`` of each."""
        size, starts = self.plan.batch_size, self.dataset._starts
        samples = self.plan.samples[number * size : (number + 1) * size]
        begin, end = int(samples[0]), int(samples[-1]) + 1
        first = int(np.searchsorted(starts, begin, side="right")) - 1
        last = int(np.searchsorted(starts, end - 1, side="right")) - 1
        needed = list(range(first, last + 1))
        runs = [
            (i, max(begin, int(starts[u])) - int(starts[u]), min(end, int(starts[u + 1])) - int(starts[u]))
            for i, u in enumerate(needed)
        ]
        return needed, runs

    def _locate(self, number: int) -> tuple[np.ndarray, np.ndarray]:
        """The row group and row of each row of batch ``number``."""
        step = (number - self.numbers.start) // self.numbers.step
        stretch = step // self._STRETCH
        if stretch != self._stretch:
            size = self.plan.batch_size
            numbers = self.numbers[stretch * self._STRETCH : (stretch + 1) * self._STRETCH]
            if self.lazy is not None and len(numbers):
                last = min(len(self.plan.samples), (numbers[-1] + 1) * size) - 1
                self.lazy.ensure(self.plan.first_position + last * self.plan.stride + 1)
            if numbers.step == 1:
                samples = self.plan.samples[numbers.start * size : numbers.stop * size]
            else:
                samples = np.concatenate([self.plan.samples[n * size : (n + 1) * size] for n in numbers])
            self._located = locate(samples, self.dataset._sizes)
            lengths = [len(self.plan.samples[n * size : (n + 1) * size]) for n in numbers]
            self._located_at = np.concatenate([[0], np.cumsum(lengths)]).tolist()
            self._stretch = stretch
        at = step - stretch * self._STRETCH
        begin, end = self._located_at[at], self._located_at[at + 1]
        return self._located[0][begin:end], self._located[1][begin:end]

    def _fill(self, needed: list[int]) -> None:
        for unit in needed:
            self._start(unit)
        if self._first:  # the first batch's row groups get the cores to themselves: nothing is ahead yet
            self._first = False
            concurrent.futures.wait([self.loaded[u] for u in needed])
        while self.queue and (self.queue[0] in self.started or len(self.loaded) < len(needed) + self.ahead):
            self._start(self.queue.popleft())

    def _start(self, unit: int) -> None:
        if unit not in self.started:
            self.started.add(unit)
            self.loaded[unit] = self.pool.submit(self._columns, unit)

    def _columns(self, unit: int, by_range: bool = False) -> UnitColumns:
        # What batches need is made here, in a read thread, rather than when a batch is asked for:
        # read in order by one rank, writable columns that batches are views of; shuffled or split
        # over ranks (every world_size-th row), the packed rows batches gather from.
        columns = UnitColumns(
            self.dataset._read(unit, self.first_step.get(unit, 0), by_range),
            self.dataset.fill_null,
            own=self._consecutive,
        )
        if not self._consecutive:
            columns.pack()
        return columns

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.loaded.clear()
        if self.files is not None:
            self.files.close()


def _files_by_step(files: np.ndarray, first: np.ndarray, last: np.ndarray, steps: int) -> list[np.ndarray]:
    """The files each step reads, when row group ``i`` (in file ``files[i]``) is read by steps ``first[i]..last[i]``."""
    counts = last - first + 1
    total = int(counts.sum())
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    step_of = np.repeat(first, counts) + (np.arange(total, dtype=np.int64) - offsets)
    width = int(files.max()) + 1 if len(files) else 1
    pairs = np.unique(step_of * width + np.repeat(files, counts))  # by step, then file, each once
    bounds = np.searchsorted(pairs // width, np.arange(steps + 1))
    return [pairs[bounds[i] : bounds[i + 1]] % width for i in range(steps)]
