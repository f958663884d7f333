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

import concurrent.futures
import hashlib
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkgpu.data.loaders.order import (
    DEFAULT_BLOCK_SIZE,
    EpochPlan,
    check_int,
    epoch_order,
    fragment_order,
    locate,
    restore_position,
)
from sparkgpu.data.loaders.positioned import Positioned
from sparkgpu.data.tables.filter import KEEP, to_expression
from sparkgpu.data.tables.plan import TableRef
from sparkgpu.data.tables.source import file_cache, keep_mask, open_source, row_groups, scan
from sparkgpu.data.loaders.table_tensors import UnitColumns, gather_batch
from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["table_dataset", "TableDataset"]

_STATE_VERSION = 1


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
    from sparkgpu import runtime

    rank = runtime.get_global_rank() if rank is None else rank
    world_size = runtime.get_world_size() if world_size is None else world_size
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
    check_int("world_size", world_size, 1)
    check_int("read_threads", read_threads, 1)
    if shuffle_block_size is not None:
        check_int("shuffle_block_size", shuffle_block_size, 1)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigurationError(f"rank={rank!r} must be an integer in [0, world_size={world_size})")
    dataset, selection, identity = open_source(path_or_url, version, timestamp, storage_options)
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

    # Position (the same rules as MDSLoader).

    def state_dict(self) -> dict:
        """The position after the last batch handed out, as plain JSON (the same on every rank)."""
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "samples_consumed": self._consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_block_size": self.shuffle_block_size,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "num_samples": self.num_samples,
            "dataset": self.fingerprint,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continues from a saved position: the next iteration yields the rest of that epoch.

        Raises:
            ConfigurationError: The state comes from another table version, filter or shuffle.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ConfigurationError(
                f"not a table dataset state (expected a dict from TableDataset.state_dict(), got {state!r:.200})"
            )
        self.epoch, self._consumed = restore_position(
            state,
            self.state_dict(),
            keys=("seed", "shuffle", "shuffle_block_size", "num_samples", "dataset"),
            total=self.num_samples,
            unit=f"dataset of {self.num_samples} rows",
            what="dataset",
            fix="open the same table version with the same columns, filter, seed and shuffle to resume, or start "
            "afresh with set_epoch()",
        )

    def set_epoch(self, epoch: int) -> None:
        """Starts the next iteration at the beginning of ``epoch``."""
        self.epoch, self._consumed = int(epoch), 0

    def __len__(self) -> int:
        """Batches this rank reads in a whole epoch."""
        return self._plan(self.epoch, 0).num_batches

    # Iteration.

    def __iter__(self):
        plan, start = self._begin()
        numbers = self._batch_numbers(plan)
        reader = _Reader(self, plan, numbers)
        try:
            for number in numbers:
                batch = reader.batch(number)
                self._advance(plan, start, number + 1)
                yield batch
        finally:
            reader.close()
        self.epoch, self._consumed = self.epoch + 1, 0

    def _plan(self, epoch: int, start: int) -> EpochPlan:
        if self.shuffle == "fragments":
            window = self.batch_size * self.world_size
            order = fragment_order(self._sizes, seed=self.seed, epoch=epoch, window=window)
        else:
            order = epoch_order(
                self._sizes, shuffle=bool(self.shuffle), seed=self.seed, epoch=epoch, block_size=self.shuffle_block_size
            )
        return EpochPlan.for_rank(
            order,
            start=start,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
        )

    def _read(self, unit: int, needed_at: int) -> pa.Table:
        group = self._units[unit]
        projection = {name: pc.field(name) for name in self.columns}
        if self._expression is not None:
            projection[KEEP] = self._expression
        if self._file_cache is None:
            table = scan(group.piece, self.schema, projection)
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


class _Reader:
    """Reads the row groups of a plan ahead of need and builds its batches."""

    def __init__(self, dataset: TableDataset, plan: EpochPlan, numbers: range):
        self.dataset = dataset
        self.plan = plan
        starts = dataset._starts
        unit_of, self.offset = locate(plan.samples, dataset._sizes)  # row groups play the part of shards
        self.unit_of = unit_of
        # Units in the order the batches first need them, and the last batch needing each.
        batch_of = np.arange(len(plan.samples)) // plan.batch_size
        wanted = (
            (batch_of >= numbers.start) & (batch_of < numbers.stop) & ((batch_of - numbers.start) % numbers.step == 0)
        )
        unit_w, batch_w = unit_of[wanted], batch_of[wanted]
        first = np.full(len(starts), len(unit_w), dtype=np.int64)
        np.minimum.at(first, unit_w, np.arange(len(unit_w)))
        last = np.full(len(starts), -1, dtype=np.int64)
        np.maximum.at(last, unit_w, batch_w)
        units = np.flatnonzero(first < len(unit_w))
        self.queue = units[np.argsort(first[units], kind="stable")].tolist()
        self.numbers = numbers
        # Steps count this process's batches (with DataLoader workers, every W-th batch).
        self.first_step = dict(zip(units.tolist(), ((batch_w[first[units]] - numbers.start) // numbers.step).tolist()))
        self.last_use = dict(zip(units.tolist(), last[units].tolist()))
        self.files = dataset._file_cache
        if self.files is not None:
            file_of = np.array([self.files.position[u.path] for u in dataset._units], dtype=np.int64)
            self.steps = [np.unique(file_of[unit_of[n * plan.batch_size : (n + 1) * plan.batch_size]]) for n in numbers]
            self.files.start(self.steps)
        self.pool = concurrent.futures.ThreadPoolExecutor(
            dataset.read_threads, thread_name_prefix="sparkgpu-table-read"
        )
        self.loaded: dict[int, concurrent.futures.Future] = {}
        self.started: set[int] = set()
        self.ahead = 2 * dataset.read_threads

    def batch(self, number: int) -> dict:
        begin, end = number * self.plan.batch_size, (number + 1) * self.plan.batch_size
        units, offsets = self.unit_of[begin:end], self.offset[begin:end]
        needed = list(dict.fromkeys(units.tolist()))
        if self.files is not None:
            step = (number - self.numbers.start) // self.numbers.step
            self.files.reached(step, self.steps[step])
        self._fill(needed)
        columns = [self.loaded[u].result() for u in needed]
        position = np.full(max(needed) + 1, -1, dtype=np.int32)
        position[needed] = np.arange(len(needed), dtype=np.int32)
        batch = gather_batch(columns, position[units], np.ascontiguousarray(offsets, dtype=np.int64))
        for unit in needed:
            if self.last_use[unit] <= number:
                self.loaded.pop(unit)
        return batch

    def _fill(self, needed: list[int]) -> None:
        for unit in needed:
            self._start(unit)
        while self.queue and (self.queue[0] in self.started or len(self.loaded) < len(needed) + self.ahead):
            self._start(self.queue.pop(0))

    def _start(self, unit: int) -> None:
        if unit not in self.started:
            self.started.add(unit)
            self.loaded[unit] = self.pool.submit(self._columns, unit)

    def _columns(self, unit: int) -> UnitColumns:
        # The copies batches need are made here, in a read thread, rather than when a batch is
        # asked for: in order, writable columns that batches are views of; shuffled, the packed rows
        # batches gather from.
        shuffle = bool(self.dataset.shuffle)
        columns = UnitColumns(
            self.dataset._read(unit, self.first_step.get(unit, 0)), self.dataset.fill_null, own=not shuffle
        )
        if shuffle:
            columns.pack()
        return columns

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.loaded.clear()
        if self.files is not None:
            self.files.close()
