"""Hang detection: the monitor that watches the ranks' progress and stops an attempt that hangs.

Every rank keeps a progress record in shared memory (:mod:`sparkgpu.rundir.progress`): a count of
the progress it noted and the longest gap between two notes. :class:`ProgressWatch` reads the
records twice a second and notes, on this process's own clock, when each rank's count last
grew (so other hosts' clocks never matter). Nothing is judged before a rank of the attempt first
made progress: start-up, loading a model and compiling take what they take.

Once one has, a rank hangs when its count has not grown for ``progress_timeout`` (counted
from the attempt's first progress for a rank that never made any): when no rank progresses,
or when some do and others do not. The default timeout (``progress_timeout=None``) is
:func:`default_progress_timeout`: the larger of :data:`DEFAULT_FLOOR` and
:data:`DEFAULT_FACTOR` times the longest gap seen between two notes of any rank, so a slow
step, a checkpoint or an evaluation seen once does not count as a hang later.

Once a rank's function returned (or raised), nothing is judged any more: the attempt is ending,
and a rank that uploads its model at the end while its peers wait is not hung.

The watch reads the records through the attempt's :class:`~sparkgpu.launch.client.progress_source.ProgressSource`,
which the backend gives (:class:`~sparkgpu.launch.backends.capabilities.WatchedProgress`): from
this host's memory where the ranks run here; on Spark, from node 0's state of the attempt, where
the nodes' beats bring them. When an attempt hangs, the watch:

1. asks every rank, through its source, to dump every thread's Python stack
   (:data:`~sparkgpu.launch.rank.progress.DUMP_SIGNAL`, served by :mod:`faulthandler` in the rank)
   and torch's flight recorder (served by a thread of the rank,
   :mod:`~sparkgpu.launch.rank.flight_recorder`), and waits a few seconds for them;
2. names the rank(s) behind and where every rank is (:func:`~sparkgpu.launch.client.hang_diagnosis.diagnose`);
3. writes ``attempts/<k>/hang.json`` and ``hang.txt`` (:class:`~sparkgpu.launch.client.hang_record.HangRecord`);
4. kills the ranks at once where its source can (a hung rank cannot checkpoint, and a save
   needs its peers; on Spark the backend's cancel stops them) and ends the watch with :class:`~sparkgpu.launch.client.monitors.StopNow` ``HANG``: the attempt
   fails as ``hang``, which the default failure policy restarts from the latest checkpoint.
"""

from __future__ import annotations

import dataclasses
import time

from sparkgpu.rundir.progress import RankProgress
from sparkgpu.launch.client.attempt_verdict import StoppedBy
from sparkgpu.launch.client.flight_record import LastCollective
from sparkgpu.launch.client.hang_diagnosis import RankStacks, diagnose
from sparkgpu.launch.client.hang_record import HangRecord
from sparkgpu.launch.client.monitors import CONTINUE, AttemptView, StopNow, WatchDecision
from sparkgpu.launch.client.progress_source import ProgressSource
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout

__all__ = [
    "ProgressWatch",
    "default_progress_timeout",
    "DEFAULT_FLOOR",
    "DEFAULT_FACTOR",
    "LOOK_SECONDS",
]

#: The default progress timeout's least value, in seconds.
DEFAULT_FLOOR = 600.0
#: The default progress timeout, in longest gaps seen between two progress notes.
DEFAULT_FACTOR = 10.0
#: Seconds between two reads of the ranks' progress records.
LOOK_SECONDS = 0.5


def default_progress_timeout(slowest_gap: float) -> float:
    """The progress timeout when none is set: ``max(DEFAULT_FLOOR, DEFAULT_FACTOR * slowest_gap)``."""
    return max(DEFAULT_FLOOR, DEFAULT_FACTOR * slowest_gap)


@dataclasses.dataclass
class _Seen:
    count: int
    since: float  # monotonic, when this process saw the count change


@dataclasses.dataclass
class ProgressWatch:
    """Stops an attempt whose ranks stopped making progress (see the module docstring).

    Args:
        rd: The job's run dir (the hang's record goes into its attempt folder).
        world_size: The attempt's ranks.
        progress_timeout: The policy's: seconds, ``None`` for the default, 0 for off.
        source: Where the ranks' records are read, their stacks asked for, and they are stopped.
    """

    rd: RunDir
    world_size: int
    progress_timeout: float | None
    source: ProgressSource
    _seen: dict[int, _Seen] = dataclasses.field(default_factory=dict)
    _tracking_since: float | None = None
    _next: float = float("-inf")

    def check(self, view: AttemptView) -> WatchDecision:
        if self.progress_timeout == 0 or view.ran is None or view.asked is not None or view.now < self._next:
            return CONTINUE
        self._next = view.now + LOOK_SECONDS
        records = self.source.records(view.attempt, self.world_size)
        for rank, record in records.items():
            seen = self._seen.get(rank)
            if seen is None or record.count != seen.count:
                self._seen[rank] = _Seen(record.count, view.now)
            if record.count and self._tracking_since is None:
                self._tracking_since = view.now
        if self._tracking_since is None or any(r.done for r in records.values()):
            return CONTINUE  # before the first progress; or a rank's function ended: the attempt is ending
        limit = self.progress_timeout or default_progress_timeout(max(r.slowest for r in records.values()))
        stalled = {}
        for rank in range(self.world_size):
            seen = self._seen.get(rank)
            since = seen.since if seen is not None and seen.count else self._tracking_since
            if view.now - since > limit:
                stalled[rank] = view.now - since
        if not stalled:
            return CONTINUE
        return self._hung(view.attempt, records, stalled, limit)

    def _hung(self, attempt: int, records: dict[int, RankProgress], stalled: dict[int, float], limit: float) -> StopNow:
        found_at = time.time()
        stacks = self.source.stacks(attempt, records)
        collectives = self.source.flight_records(attempt, list(range(self.world_size)))
        diagnosis = diagnose(stacks, records, stalled, limit, self.world_size, collectives)
        stacks_path = self.rd.file(RunLayout.hang_stacks(attempt))
        ranks = diagnosis.to_json()["ranks"]
        for rank, progress in records.items():
            ranks[str(rank)]["progress"] = dataclasses.asdict(progress)
        for rank, collective in collectives.items():
            if collective is not None:
                ranks[str(rank)]["last_collective"] = dataclasses.asdict(collective)
        record = HangRecord(found_at, limit, list(diagnosis.behind), diagnosis.summary, str(stacks_path), ranks)
        text = _stacks_text(diagnosis.summary, diagnosis.places, diagnosis.nodes, stacks, collectives)
        record.write(self.rd, attempt, text)
        self.source.stop(records)
        return StopNow(
            StoppedBy.HANG,
            f"attempt {attempt} hung: {diagnosis.summary}. Every rank's stacks: {stacks_path}; stopping its ranks",
        )


def _stacks_text(
    summary: str, places, nodes, stacks: dict[int, RankStacks | None], collectives: dict[int, LastCollective | None]
) -> str:
    parts = [summary, ""]
    for rank in sorted(places):
        dump, collective = stacks.get(rank), collectives.get(rank)
        last = f"; last {collective.words}" if collective is not None else ""
        parts.append(f"=== rank {rank} on node {nodes.get(rank, 0)}: {places[rank].words}{last} ===")
        parts.append(dump.text if dump is not None else "(no stacks came back)")
        parts.append("")
    return "\n".join(parts)
