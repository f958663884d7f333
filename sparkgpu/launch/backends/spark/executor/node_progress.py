"""What a Spark node says of its ranks while they run: their progress, rank 0's trial reports, their stacks.

Each node reads its own ranks' progress records (:mod:`sparkgpu.rundir.progress`: a few bytes
of shared memory each, no file write and no request per step) and sends them, one compact row
per rank (:func:`~sparkgpu.rundir.progress.to_row`), in the beat it sends node 0 anyway
(:mod:`sparkgpu.launch.backends.spark.executor.hub`), with their latest collectives' arrivals
(:mod:`sparkgpu.launch.rank.arrivals`, a few hundred bytes a rank, rewritten every look) for
straggler detection. Node 0 adds its own ranks' rows and rank 0's
trial reports (the few ``(step, value)`` pairs of :mod:`sparkgpu.sweeps.reports`) and writes them
into the attempt's state for the client, no more often than once a second.

When the client finds the attempt hung it asks for the ranks' stacks (the sealed ``spark/DUMP``
control file, which node 0 reads and hands on in its replies): each node then signals its ranks
(:func:`~sparkgpu.launch.rank.progress.request_stacks`) and copies each rank's stacks file into
the attempt's ``spark/`` folder, which the client reads while the attempt runs.
"""

from __future__ import annotations

import contextlib
import json

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.launch.rank.arrivals import read_ranks_arrivals
from sparkgpu.launch.rank.progress import request_stacks
from sparkgpu.rundir import progress as _progress
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout

__all__ = ["MAX_REPORTS", "ranks_of", "read_progress", "read_node_arrivals", "read_trial_reports", "dump_stacks"]

#: The most trial reports node 0 hands on (the latest); a pruner reads the few latest.
MAX_REPORTS = 200


def ranks_of(node: int, nproc: int) -> range:
    """The global ranks of node ``node`` (``nproc`` ranks per node)."""
    return range(node * nproc, (node + 1) * nproc)


def read_progress(rd: RunDir, attempt: int, ranks: range) -> dict[str, list]:
    """Each of ``ranks``' progress record on this host, as a row, by rank (a rank without one yet is absent)."""
    rows = {}
    for rank in ranks:
        record = _progress.read(rd.file(RunLayout.progress(attempt, rank)))
        if record is not None:
            rows[str(rank)] = _progress.to_row(record)
    return rows


def read_node_arrivals(rd: RunDir, attempt: int, ranks: range) -> dict[str, list]:
    """Each of ``ranks``' latest collectives' arrivals on this host (:mod:`sparkgpu.launch.rank.arrivals`),
    by rank; a rank without any yet is absent."""
    return {str(rank): rows for rank, rows in read_ranks_arrivals(rd, attempt, ranks).items()}


def read_trial_reports(rd: RunDir, attempt: int) -> list[list[float]]:
    """Rank 0's trial reports on this host, ``[[step, value], ...]`` (the latest :data:`MAX_REPORTS`);
    ``[]`` when it made none (or the file is being replaced)."""
    try:
        data = json.loads(rd.file(RunLayout.trial_reports(attempt)).read_text())
        rows = data.get("reports") if isinstance(data, dict) else None
        return [[int(row[0]), float(row[1])] for row in (rows or [])[-MAX_REPORTS:]]
    except (OSError, ValueError, TypeError, IndexError):
        return []


def dump_stacks(rd: RunDir, attempt: int, rows: dict[str, list]) -> int:
    """Asks the ranks of ``rows`` (this node's, from :func:`read_progress`) for their stacks and copies
    each rank's stacks file, and its flight recorder's dump before it, into the attempt's ``spark/``
    folder; returns how many stacks files it copied."""
    pids = {}
    for rank, row in rows.items():
        record = _progress.from_row(row)
        if record is not None:
            pids[int(rank)] = record.pid
    copied = 0
    for asked, text in request_stacks(rd, attempt, pids).items():
        with contextlib.suppress(OSError):  # none came: the client's diagnosis does without it
            dumped = rd.file(RunLayout.flight_record(attempt, asked)).read_bytes()
            atomic_write_bytes(rd.file(RunLayout.spark_flight_record(attempt, asked)), dumped)
        if text is not None:
            atomic_write_bytes(rd.file(RunLayout.spark_stacks(attempt, asked)), text.encode())
            copied += 1
    return copied
