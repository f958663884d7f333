"""Where the hang watch reads an attempt's ranks' progress, asks for their stacks and stops them.

:class:`~sparkgpu.launch.client.progress_watch.ProgressWatch` judges; a :class:`ProgressSource`
is what it judges from, given by the backend for each attempt
(:class:`~sparkgpu.launch.backends.capabilities.WatchedProgress`):

* :class:`LocalProgress`: the ranks run on this host. Their records are read from this host's
  memory (:mod:`sparkgpu.rundir.progress`), their stacks asked for by signal, and a hung
  attempt's ranks killed at once by pid.
* On Spark (:class:`~sparkgpu.launch.backends.spark.progress.SparkProgress`), the records ride
  the nodes' beats to node 0, which writes them into the attempt's state; the stacks are
  asked of the nodes through a control file; the backend's cancel stops the ranks.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Protocol

from sparkgpu.launch.client.flight_record import LastCollective, last_collective, read_record
from sparkgpu.launch.client.hang_diagnosis import RankStacks, parse_stacks
from sparkgpu.launch.rank.arrivals import read_ranks_arrivals
from sparkgpu.launch.rank.progress import DUMP_WAIT, request_stacks
from sparkgpu.rundir import progress as _progress
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.rundir.progress import RankProgress

__all__ = ["ProgressSource", "LocalProgress"]

_logger = logging.getLogger(__name__)


class ProgressSource(Protocol):
    """An attempt's ranks as the hang watch sees them."""

    def records(self, attempt: int, world_size: int) -> dict[int, RankProgress]:
        """Each rank's progress record as last known, by rank (a rank without one yet is absent)."""
        ...

    def stacks(self, attempt: int, records: dict[int, RankProgress]) -> dict[int, RankStacks | None]:
        """Asks the ranks of ``records`` for their stacks and returns each one's last dump
        (``None``: none came); bounded, a few seconds."""
        ...

    def flight_records(self, attempt: int, ranks: list[int]) -> dict[int, LastCollective | None]:
        """Each rank's last collective from the flight recorder it dumped with its stacks (``None``:
        none came, or it holds none); read after :meth:`stacks`, nothing asked."""
        ...

    def arrivals(self, attempt: int, world_size: int) -> dict[int, list[list[float]]]:
        """Each rank's latest collectives and when it reached them, ``[[seq, unix time], ...]``, as
        last known (:mod:`sparkgpu.launch.rank.arrivals`; a rank without any yet is absent)."""
        ...

    def stop(self, records: dict[int, RankProgress]) -> None:
        """Stops a hung attempt's ranks at once, where this source can (else the backend's cancel does)."""
        ...


class LocalProgress:
    """The ranks run on this host: records from its memory, stacks by signal, a kill by pid.

    Args:
        rd: The job's run dir (the ranks' records are in its attempt folders).
        signals: Whether the ranks may be signalled (their stacks asked for, a hung attempt's
            ranks killed); ``False`` reads their records only.
        wait: Most seconds to wait for the stacks once asked for.
    """

    def __init__(self, rd: RunDir, signals: bool = True, wait: float = DUMP_WAIT):
        self.rd, self.signals, self.wait = rd, signals, wait

    def records(self, attempt: int, world_size: int) -> dict[int, RankProgress]:
        found = {}
        for rank in range(world_size):
            record = _progress.read(self.rd.file(RunLayout.progress(attempt, rank)))
            if record is not None:
                found[rank] = record
        return found

    def stacks(self, attempt: int, records: dict[int, RankProgress]) -> dict[int, RankStacks | None]:
        if not self.signals:
            return {}
        texts = request_stacks(self.rd, attempt, {rank: r.pid for rank, r in records.items()}, self.wait)
        return {rank: parse_stacks(text) if text is not None else None for rank, text in texts.items()}

    def flight_records(self, attempt: int, ranks: list[int]) -> dict[int, LastCollective | None]:
        return {r: last_collective(read_record(self.rd.file(RunLayout.flight_record(attempt, r)))) for r in ranks}

    def arrivals(self, attempt: int, world_size: int) -> dict[int, list[list[float]]]:
        return read_ranks_arrivals(self.rd, attempt, range(world_size))

    def stop(self, records: dict[int, RankProgress]) -> None:
        """SIGKILL for every rank, and its process group where it leads one (its loader workers, its
        subprocesses): a hung rank cannot checkpoint, and waiting the shutdown grace helps nobody."""
        if not self.signals:
            return
        for rank, record in records.items():
            try:
                if os.getpgid(record.pid) == record.pid:
                    os.killpg(record.pid, signal.SIGKILL)
                else:
                    os.kill(record.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # it ended meanwhile
            except OSError as exc:
                _logger.warning("rank %d (pid %d) could not be killed: %s", rank, record.pid, exc)
