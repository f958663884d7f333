"""Straggler detection: the ranks that make the others wait, named with their node and by how much.

A synchronous job runs at the pace of its slowest rank: the others reach each collective early
and wait in it. So a slow rank shows not in the step times, which are the same on every rank,
but in *when each rank reaches a collective*. Every rank's flight recorder stamps each
collective with the time the rank issued it, and every rank writes its latest stamps where the
supervisor reads them (:mod:`sparkgpu.launch.rank.arrivals`; on Spark the nodes' beats carry them).

:class:`StragglerWatch` lines the ranks' stamps up by sequence number over the straggler window
(``SPARKGPU_STRAGGLER_WINDOW``, 60 s by default). A rank's *lateness* at a collective is how long
after the first rank it arrived; its lateness over the window is the median. With ``P`` the
job's step time (from the ranks' progress: the steps they note, else their notes, else the
collectives' own pace), the steps would take ``P - lateness`` were the rank as quick as the
quickest, so the rank slows the job ``P / (P - lateness)`` times. A rank whose factor is at least
``SPARKGPU_STRAGGLER_FACTOR`` (1.5 by default) over a whole window is named, once per attempt:

* a line to the caller (``rank 3 on node 1 is a straggler: ...``),
* ``attempts/<k>/stragglers.json``,
* the callbacks' :meth:`~sparkgpu.callbacks.JobCallback.on_straggler` (the job's MLflow run gets a
  tag ``sparkgpu.straggler.rank-<r>`` and the metric ``sparkgpu/straggler_factor``).

Nothing is stopped: a slow node costs time, not correctness; the figures say whether to exclude it.

The lateness is measured against wall clocks of different hosts: a clock skew between two nodes
adds to or takes from it. With the clocks kept by NTP (a few milliseconds apart), that matters
only for steps of a few tens of milliseconds. A job with several collectives a step (DDP's
buckets) shows a lateness below its slow rank's whole lag, so the factor errs low, never high.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu._util.report import report
from sparkgpu.launch.client.monitors import CONTINUE, AttemptView, WatchDecision
from sparkgpu.launch.client.progress_source import ProgressSource
from sparkgpu.launch.rank.arrivals import look_seconds
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.rundir.progress import RankProgress

__all__ = ["Straggler", "StragglerWatch", "find_stragglers", "MIN_SAMPLES"]

#: Collectives every rank must have reached, within the window, before any rank is judged.
MIN_SAMPLES = 8

_logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Straggler:
    """A rank that makes its peers wait, as judged over one window.

    Attributes:
        rank: The rank.
        node: Its node.
        factor: How many times slower the job's steps are than they would be were it as quick as
            the quickest rank (``step / (step - lateness)``).
        lateness: Its median lateness at the window's collectives, in seconds.
        step: The job's step time over the window, in seconds.
        collectives: How many collectives the judgement rests on.
    """

    rank: int
    node: int
    factor: float
    lateness: float
    step: float
    collectives: int

    @property
    def words(self) -> str:
        factor = f"{self.factor:.1f}x" if self.factor < 100 else "more than 100x"
        return (
            f"rank {self.rank} on node {self.node} is a straggler: it reaches the job's collectives "
            f"{self.lateness:.3f}s after the quickest rank (median of {self.collectives}), while a step takes "
            f"{self.step:.3f}s, so it slows the job about {factor}"
        )


def find_stragglers(
    arrivals: Mapping[int, Sequence[Sequence[float]]],
    step: float,
    factor: float,
    nodes: Mapping[int, int] | None = None,
    min_samples: int = MIN_SAMPLES,
) -> list[Straggler]:
    """The ranks of ``arrivals`` (rank -> ``[[seq, unix time], ...]``) that slow a job whose steps
    take ``step`` seconds by ``factor`` or more; ``[]`` with fewer than ``min_samples`` collectives
    that every rank reached, or fewer than two ranks."""
    if len(arrivals) < 2 or not step > 0:
        return []
    times = {rank: {int(seq): float(at) for seq, at in rows} for rank, rows in arrivals.items()}
    common = set.intersection(*(set(found) for found in times.values()))
    if len(common) < min_samples:
        return []
    late: dict[int, list[float]] = {rank: [] for rank in times}
    for seq in common:
        first = min(found[seq] for found in times.values())
        for rank, found in times.items():
            late[rank].append(found[seq] - first)
    named = []
    for rank in sorted(late):
        lateness = statistics.median(late[rank])
        slows = step / (step - lateness) if lateness < step else float("inf")
        if slows >= factor:
            named.append(Straggler(rank, (nodes or {}).get(rank, 0), min(slows, 1000.0), lateness, step, len(common)))
    return named


def step_time(
    before: Mapping[int, RankProgress],
    now: Mapping[int, RankProgress],
    arrivals: Mapping[int, Sequence[Sequence[float]]],
) -> float | None:
    """The job's step time between two reads of its ranks' progress: from the steps the ranks noted,
    else from their notes, else from the pace of their collectives; the median over the ranks."""
    for per in ("step", "count"):
        paces = []
        for rank, record in now.items():
            old = before.get(rank)
            if old is None or record.last <= old.last:
                continue
            done = (record.step or 0) - (old.step or 0) if per == "step" else record.count - old.count
            if done >= 2:
                paces.append((record.last - old.last) / done)
        if paces:
            return statistics.median(paces)
    paces = []
    for rows in arrivals.values():
        if len(rows) >= 2 and rows[-1][0] > rows[0][0]:
            paces.append((rows[-1][1] - rows[0][1]) / (rows[-1][0] - rows[0][0]))
    return statistics.median(paces) if paces else None


@dataclasses.dataclass
class StragglerWatch:
    """Names an attempt's stragglers (see the module docstring); never stops it.

    Args:
        rd: The job's run dir (``stragglers.json`` goes into the attempt's folder).
        job: The attempt's job (handed to the callbacks).
        world_size: The attempt's ranks.
        factor: ``SPARKGPU_STRAGGLER_FACTOR``.
        window: ``SPARKGPU_STRAGGLER_WINDOW``, in seconds; the watch reads the ranks' arrivals as
            often as they rewrite them (:func:`~sparkgpu.launch.rank.arrivals.look_seconds`).
        source: Where the ranks' progress and arrivals are read
            (:class:`~sparkgpu.launch.client.progress_source.ProgressSource`).
        callbacks: The job's callbacks (:meth:`~sparkgpu.callbacks.JobCallback.on_straggler`).
        out: Where the caller's lines go.
    """

    rd: RunDir
    job: object
    world_size: int
    factor: float
    window: float
    source: ProgressSource
    callbacks: Sequence = ()
    out: TextIO | None = None
    _samples: dict[int, dict[int, float]] = dataclasses.field(default_factory=dict)  # rank -> seq -> time
    _progress: list[tuple[float, dict[int, RankProgress]]] = dataclasses.field(default_factory=list)
    _named: dict[int, Straggler] = dataclasses.field(default_factory=dict)
    _first: float | None = None
    _next: float = float("-inf")

    def check(self, view: AttemptView) -> WatchDecision:
        if view.ran is None or view.asked is not None or view.now < self._next:
            return CONTINUE
        self._next = view.now + look_seconds(self.window)
        found = self.source.arrivals(view.attempt, self.world_size)
        records = self.source.records(view.attempt, self.world_size)
        if len(found) < self.world_size or any(r.done for r in records.values()):
            return CONTINUE  # a rank without arrivals yet, or the attempt is ending
        wall = time.time()
        if self._first is None:
            self._first = view.now
        for rank, rows in found.items():
            self._samples.setdefault(rank, {}).update({int(seq): float(at) for seq, at in rows})
        self._progress.append((wall, records))
        latest = max(at for kept in self._samples.values() for at in kept.values())
        for rank, kept in self._samples.items():
            self._samples[rank] = {seq: at for seq, at in kept.items() if at >= latest - self.window}
        while len(self._progress) > 1 and self._progress[1][0] <= wall - self.window:
            self._progress.pop(0)
        if view.now - self._first < self.window:
            return CONTINUE
        window = {rank: sorted(kept.items()) for rank, kept in self._samples.items()}
        step = step_time(self._progress[0][1], records, window)
        if step is None:
            return CONTINUE
        nodes = {rank: record.node for rank, record in records.items()}
        for straggler in find_stragglers(window, step, self.factor, nodes):
            if straggler.rank not in self._named:
                self._name(view.attempt, straggler)
        return CONTINUE

    def _name(self, attempt: int, straggler: Straggler) -> None:
        self._named[straggler.rank] = straggler
        report(f"attempt {attempt}: {straggler.words} (factor {self.factor:g} over {self.window:g}s)", self.out)
        rows = [dataclasses.asdict(found) for found in self._named.values()]
        atomic_write_bytes(
            self.rd.file(RunLayout.stragglers(attempt)),
            json.dumps({"factor": self.factor, "window": self.window, "stragglers": rows}, indent=1).encode(),
        )
        for callback in self.callbacks:
            try:
                callback.on_straggler(self.job, attempt, straggler)
            except Exception as exc:  # a callback's failure must not end the watch of a running job
                _logger.warning(
                    "a callback failed on a straggler (%s): %s: %s", straggler.words, type(exc).__name__, exc
                )
