"""The usage ledger: one row per attempt in a Delta table, readable by Spark, pandas or polars.

Each attempt's row is committed as its own Delta transaction the moment the attempt ends,
so a client that crashes later never loses it. Writers on several machines append to the
same table at once: deltalake commits with optimistic concurrency (a commit file that
already exists makes the loser re-read the log and retry), and blind appends never
conflict logically.

Columns (see :func:`ledger_schema`): ``job_id``, ``job_name``, ``attempt``, ``user``,
``tags`` (a map: ``tags['team']`` in Spark SQL), ``backend``, ``gpu_type``, ``gpus``,
``simulated``, ``status``, ``started_at``, ``ended_at`` (UTC), ``duration_s`` (exact
running time), ``gpu_seconds`` (billed: ``gpus`` x whole seconds, rounded up),
``rate_usd_per_gpu_hour``, ``cost_usd``, ``host``, ``recorded_at``.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from sparkgpu.usage.rates import RateCard, billed_seconds

if TYPE_CHECKING:
    import pyarrow

__all__ = ["UsageRecord", "UsageLedger", "ledger_schema", "clip_to_window"]

_COMMIT_RETRIES = 8

_logger = logging.getLogger(__name__)


def ledger_schema():
    """The pyarrow schema of the ledger (built on demand: pyarrow costs the CLI time to import)."""
    import pyarrow as pa

    ts = pa.timestamp("us", tz="UTC")
    return pa.schema(
        [
            ("job_id", pa.string()),
            ("job_name", pa.string()),
            ("attempt", pa.int32()),
            ("user", pa.string()),
            ("tags", pa.map_(pa.string(), pa.string())),
            ("backend", pa.string()),
            ("gpu_type", pa.string()),
            ("gpus", pa.int32()),
            ("simulated", pa.bool_()),
            ("status", pa.string()),
            ("started_at", ts),
            ("ended_at", ts),
            ("duration_s", pa.float64()),
            ("gpu_seconds", pa.float64()),
            ("rate_usd_per_gpu_hour", pa.float64()),
            ("cost_usd", pa.float64()),
            ("host", pa.string()),
            ("recorded_at", ts),
        ]
    )


@dataclasses.dataclass(frozen=True)
class UsageRecord:
    """What one attempt used, priced. Times are unix seconds."""

    job_id: str
    job_name: str
    attempt: int
    user: str
    tags: Mapping[str, str]
    backend: str
    gpu_type: str
    gpus: int
    simulated: bool
    status: str
    started_at: float
    ended_at: float
    duration_s: float
    gpu_seconds: float
    rate_usd_per_gpu_hour: float
    cost_usd: float
    host: str

    @classmethod
    def priced(
        cls,
        *,
        job_id: str,
        job_name: str,
        attempt: int,
        user: str,
        tags: Mapping[str, str],
        backend: str,
        gpu_type: str,
        gpus: int,
        simulated: bool,
        status: str,
        started_at: float,
        ended_at: float,
        rates: RateCard,
        host: str | None = None,
    ) -> "UsageRecord":
        """Builds the row of one attempt, billing ``gpus`` x its running seconds (rounded up)."""
        ended_at = max(ended_at, started_at)
        gpu_seconds = float(gpus * billed_seconds(started_at, ended_at))
        return cls(
            job_id=job_id,
            job_name=job_name,
            attempt=int(attempt),
            user=user,
            tags={str(k): str(v) for k, v in tags.items()},
            backend=backend,
            gpu_type=gpu_type,
            gpus=int(gpus),
            simulated=bool(simulated),
            status=status,
            started_at=started_at,
            ended_at=ended_at,
            duration_s=round(ended_at - started_at, 6),
            gpu_seconds=gpu_seconds,
            rate_usd_per_gpu_hour=rates.rate(gpu_type),
            cost_usd=rates.cost(gpu_type, gpu_seconds),
            host=host or socket.gethostname(),
        )

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600.0

    def to_row(self, recorded_at: float) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        row["tags"] = sorted(self.tags.items())
        for key in ("started_at", "ended_at"):
            row[key] = int(row[key] * 1_000_000)
        row["recorded_at"] = int(recorded_at * 1_000_000)
        return row


class UsageLedger:
    """The Delta table of usage rows at ``uri`` (a path or any URL deltalake reads).

    Args:
        uri: Table location; created on the first append.
        storage_options: Credentials and options for object stores, passed to deltalake.
        compact_every: Compact the table after every this many commits (0: never). One row
            per commit means one small file per attempt, and reading N small files costs
            milliseconds each (budget checks read the ledger); compaction keeps reads flat.
        checkpoint_every: Write a log checkpoint after every this many commits (0: only when
            compacting). Each append opens the table, which replays every commit since the
            last checkpoint; deltalake reads those files concurrently on blocking threads of
            its tokio runtime, and the threads stay while jobs keep coming. At deltalake's
            interval of 100, a client running job after job came to hold ~100 idle
            ``tokio-rt-worker`` threads and their memory; every 10 (Spark's interval) keeps
            both small and flat.
    """

    def __init__(
        self,
        uri: str,
        storage_options: dict[str, str] | None = None,
        compact_every: int = 100,
        checkpoint_every: int = 10,
    ):
        self.uri = str(uri)
        self.storage_options = storage_options
        self.compact_every = compact_every
        self.checkpoint_every = checkpoint_every

    def __repr__(self) -> str:
        return f"UsageLedger({self.uri!r})"

    def _table(self):
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        try:
            return DeltaTable(self.uri, storage_options=self.storage_options)
        except TableNotFoundError:
            return None

    def append(self, records: Sequence[UsageRecord]) -> None:
        """Commits ``records`` as one transaction (creating the table if needed).

        Raises:
            deltalake.exceptions.DeltaError: the store refused the write after retries.
        """
        if not records:
            return
        import pyarrow as pa
        from deltalake import write_deltalake
        from deltalake.exceptions import CommitFailedError, DeltaError

        now = time.time()
        data = pa.Table.from_pylist([r.to_row(now) for r in records], schema=ledger_schema())
        for attempt in range(_COMMIT_RETRIES):
            table = self._table()
            try:
                if table is None:
                    write_deltalake(
                        self.uri,
                        data,
                        mode="append",
                        storage_options=self.storage_options,
                        name="sparkgpu_usage",
                        description="GPU usage per job attempt (sparkgpu)",
                    )
                else:
                    write_deltalake(table, data, mode="append")
                break
            except (CommitFailedError, DeltaError) as exc:
                # A lost commit race (two writers creating the table at the same moment race
                # for version 0 and the loser reads "metadata changed") is retried: the loser
                # sees the table on its next try and appends. Other errors re-raise.
                if attempt == _COMMIT_RETRIES - 1 or not (isinstance(exc, CommitFailedError) or _is_retryable(exc)):
                    raise
                time.sleep(0.05 * (attempt + 1))
        if table is not None:
            self._maintain(table)

    def _maintain(self, table) -> None:
        """Compacts or checkpoints ``table`` (just written) when its version is due."""
        version = table.version()
        if self.compact_every and version % self.compact_every == 0:
            self._compact_quietly()
        elif self.checkpoint_every and version % self.checkpoint_every == 0:
            self._checkpoint_quietly(table)

    def _compact_quietly(self) -> bool:
        from deltalake.exceptions import CommitFailedError

        try:
            self.compact()
            return True
        except CommitFailedError:
            return False  # another writer committed meanwhile; compaction runs again at the next multiple

    @staticmethod
    def _checkpoint_quietly(table) -> bool:
        from deltalake.exceptions import DeltaError

        try:
            table.create_checkpoint()
            return True
        except (DeltaError, OSError) as exc:  # a checkpoint only speeds reads up; the row is committed
            _logger.debug("usage ledger: no checkpoint at version %s: %s", table.version(), exc)
            return False

    def read(self, since: float | None = None, until: float | None = None) -> pyarrow.Table:
        """Rows of attempts that overlap ``[since, until]`` (unix seconds; ``None`` for open ends).

        An absent table reads as empty, so reports and budgets work before the first job.

        The rows are read by deltalake's own query engine, not through ``to_pyarrow_dataset``:
        a pyarrow scan over deltalake's Python file handler finishes releasing its buffers on
        Arrow's I/O threads after ``to_table`` returns, and a process that exits right after
        reading (the CLI printing a job's GPU-hours) then aborts in interpreter shutdown
        ("terminate called without an active exception", apache/arrow#34314).
        """
        import pyarrow as pa
        from deltalake import QueryBuilder

        table = self._table()
        if table is None:
            return ledger_schema().empty_table()
        conditions = []
        if since is not None:
            conditions.append(f"ended_at >= {_sql_timestamp(since)}")
        if until is not None:
            conditions.append(f"started_at <= {_sql_timestamp(until)}")
        where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
        reader = QueryBuilder().register("ledger", table).execute(f"SELECT * FROM ledger{where}")
        rows = pa.table(reader.read_all())
        return rows.select(ledger_schema().names).cast(ledger_schema())

    def version(self) -> int | None:
        """The table's current version, ``None`` before the first row."""
        table = self._table()
        return None if table is None else table.version()

    def compact(self) -> dict:
        """Merges the many one-row files into few (readers get faster); returns deltalake's metrics.

        Compaction rewrites data without changing it, so it is safe beside running writers.
        """
        table = self._table()
        if table is None:
            return {}
        metrics = table.optimize.compact()
        table.create_checkpoint()
        return metrics


def _sql_timestamp(seconds: float) -> str:
    """A UTC microsecond timestamp literal for deltalake's SQL (the ledger's column type)."""
    return f"arrow_cast({int(seconds * 1_000_000)}, 'Timestamp(Microsecond, Some(\"UTC\"))')"


def _is_retryable(exc: Exception) -> bool:
    text = str(exc).lower()
    return any(word in text for word in ("already exists", "conflict", "version", "concurrent"))


def clip_to_window(rows, since: float | None, until: float | None):
    """Scales each row's ``gpu_seconds``, ``cost_usd`` and ``duration_s`` to its part inside the window.

    An attempt that ran across the window's edge counts only for the share of its running
    time inside the window, so a budget "per 30d" and a report ``--since 30d`` agree with
    a sum over days.

    Args:
        rows: A pyarrow table with the ledger's columns.
        since: Window start (unix seconds) or ``None``.
        until: Window end or ``None``.

    Returns:
        A pyarrow table with the same columns.
    """
    import numpy as np
    import pyarrow as pa

    if rows.num_rows == 0 or (since is None and until is None):
        return rows
    start = rows["started_at"].cast(pa.int64()).to_numpy() / 1e6
    end = rows["ended_at"].cast(pa.int64()).to_numpy() / 1e6
    lo = np.maximum(start, since) if since is not None else start
    hi = np.minimum(end, until) if until is not None else end
    span = end - start
    inside = np.clip(hi - lo, 0.0, None)
    # A zero-length attempt is billed whole when it lies inside the window (it has no share to split).
    fraction = np.where(span > 0, inside / np.where(span > 0, span, 1.0), (hi >= lo).astype(float))
    for name in ("gpu_seconds", "cost_usd", "duration_s"):
        index = rows.schema.get_field_index(name)
        scaled = rows[name].to_numpy(zero_copy_only=False) * fraction
        rows = rows.set_column(index, name, pa.array(scaled, pa.float64()))
    return rows
