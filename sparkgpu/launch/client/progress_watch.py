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

The attempt runner watches only where the ranks run on this host
(:class:`~sparkgpu.launch.backends.capabilities.LocalRanks`): their records are then read from
this host's memory. (A Spark node's records are to ride its beats to node 0; not yet.) When an
attempt hangs, the watch:

1. asks every rank to dump every thread's Python stack (:data:`~sparkgpu.launch.rank.progress.DUMP_SIGNAL`,
   served by :mod:`faulthandler` in the rank) and waits up to :data:`DUMP_WAIT` seconds for them;
2. names the rank(s) behind and where every rank is (:func:`~sparkgpu.launch.client.hang_diagnosis.diagnose`);
3. writes ``attempts/<k>/hang.json`` and ``hang.txt`` (:class:`~sparkgpu.launch.client.hang_record.HangRecord`);
4. kills the ranks at once (a hung rank cannot checkpoint, and a save needs its peers) and
   ends the watch with :class:`~sparkgpu.launch.client.monitors.StopNow` ``HANG``: the attempt
   fails as ``hang``, which the default failure policy restarts from the latest checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time

from sparkgpu.rundir import progress as _progress
from sparkgpu.rundir.progress import RankProgress
from sparkgpu.launch.client.attempt_verdict import StoppedBy
from sparkgpu.launch.client.hang_diagnosis import DUMP_MARKER, RankStacks, diagnose, parse_stacks
from sparkgpu.launch.client.hang_record import HangRecord
from sparkgpu.launch.rank.progress import DUMP_SIGNAL
from sparkgpu.launch.client.monitors import CONTINUE, AttemptView, StopNow, WatchDecision
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout

__all__ = [
    "ProgressWatch",
    "default_progress_timeout",
    "dump_stacks",
    "DEFAULT_FLOOR",
    "DEFAULT_FACTOR",
    "LOOK_SECONDS",
    "DUMP_WAIT",
]

_logger = logging.getLogger(__name__)

#: The default progress timeout's least value, in seconds.
DEFAULT_FLOOR = 600.0
#: The default progress timeout, in longest gaps seen between two progress notes.
DEFAULT_FACTOR = 10.0
#: Seconds between two reads of the ranks' progress records.
LOOK_SECONDS = 0.5
#: Most seconds the watch waits for the ranks' stacks once it asked for them.
DUMP_WAIT = 3.0
#: A dump counts as whole once its file stopped growing for this long.
_SETTLED = 0.2


def default_progress_timeout(slowest_gap: float) -> float:
    """The progress timeout when none is set: ``max(DEFAULT_FLOOR, DEFAULT_FACTOR * slowest_gap)``."""
    return max(DEFAULT_FLOOR, DEFAULT_FACTOR * slowest_gap)


@dataclasses.dataclass
class _Seen:
    count: int
    since: float  # monotonic, when this process saw the count change


def dump_stacks(
    rd: RunDir, attempt: int, records: dict[int, RankProgress], wait: float = DUMP_WAIT
) -> dict[int, RankStacks | None]:
    """Asks each rank with a record to dump its stacks; returns each rank's last dump (``None``: none came).

    The ranks must run on this host: they are signalled by their pid.
    """
    paths = {rank: rd.file(RunLayout.stacks(attempt, rank)) for rank in records}
    asked: dict[int, int] = {}
    for rank, record in records.items():
        try:
            with open(paths[rank], "a", encoding="utf-8") as out:
                out.write(f"\n{DUMP_MARKER}\n")
            asked[rank] = paths[rank].stat().st_size
            os.kill(record.pid, DUMP_SIGNAL)
        except (OSError, ProcessLookupError) as exc:
            _logger.warning("rank %d's stacks could not be asked for: %s", rank, exc)
            asked.pop(rank, None)
    deadline = time.monotonic() + wait
    sizes = {rank: (size, time.monotonic()) for rank, size in asked.items()}
    settled: set[int] = set()
    while len(settled) < len(asked) and time.monotonic() < deadline:
        time.sleep(0.05)
        now = time.monotonic()
        for rank, start in asked.items():
            if rank in settled:
                continue
            with contextlib.suppress(OSError):
                size = paths[rank].stat().st_size
                if size != sizes[rank][0]:
                    sizes[rank] = (size, now)
                elif size > start and now - sizes[rank][1] >= _SETTLED:
                    settled.add(rank)
    found: dict[int, RankStacks | None] = {}
    for rank in records:
        try:
            text = paths[rank].read_text(encoding="utf-8", errors="replace")
        except OSError:
            found[rank] = None
            continue
        found[rank] = parse_stacks(text) if rank in settled or DUMP_MARKER in text else None
    return found


@dataclasses.dataclass
class ProgressWatch:
    """Stops an attempt whose ranks stopped making progress (see the module docstring).

    Args:
        rd: The job's run dir (the ranks' records are in its attempt folders).
        world_size: The attempt's ranks.
        progress_timeout: The policy's: seconds, ``None`` for the default, 0 for off.
        local: The ranks run on this host: their stacks can be asked for, and they can be killed.
    """

    rd: RunDir
    world_size: int
    progress_timeout: float | None
    local: bool
    _seen: dict[int, _Seen] = dataclasses.field(default_factory=dict)
    _tracking_since: float | None = None
    _next: float = float("-inf")

    def check(self, view: AttemptView) -> WatchDecision:
        if self.progress_timeout == 0 or view.ran is None or view.asked is not None or view.now < self._next:
            return CONTINUE
        self._next = view.now + LOOK_SECONDS
        records = self._read(view.attempt)
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

    def _read(self, attempt: int) -> dict[int, RankProgress]:
        records = {}
        for rank in range(self.world_size):
            record = _progress.read(self.rd.file(RunLayout.progress(attempt, rank)))
            if record is not None:
                records[rank] = record
        return records

    def _hung(self, attempt: int, records: dict[int, RankProgress], stalled: dict[int, float], limit: float) -> StopNow:
        found_at = time.time()
        stacks = dump_stacks(self.rd, attempt, records) if self.local else {}
        diagnosis = diagnose(stacks, records, stalled, limit, self.world_size)
        stacks_path = self.rd.file(RunLayout.hang_stacks(attempt))
        ranks = diagnosis.to_json()["ranks"]
        for rank, progress in records.items():
            ranks[str(rank)]["progress"] = dataclasses.asdict(progress)
        record = HangRecord(found_at, limit, list(diagnosis.behind), diagnosis.summary, str(stacks_path), ranks)
        record.write(self.rd, attempt, _stacks_text(diagnosis.summary, diagnosis.places, diagnosis.nodes, stacks))
        if self.local:
            _kill(records)
        return StopNow(
            StoppedBy.HANG,
            f"attempt {attempt} hung: {diagnosis.summary}. Every rank's stacks: {stacks_path}; stopping its ranks",
        )


def _stacks_text(summary: str, places, nodes, stacks: dict[int, RankStacks | None]) -> str:
    parts = [summary, ""]
    for rank in sorted(places):
        dump = stacks.get(rank)
        parts.append(f"=== rank {rank} on node {nodes.get(rank, 0)}: {places[rank].words} ===")
        parts.append(dump.text if dump is not None else "(no stacks came back)")
        parts.append("")
    return "\n".join(parts)


def _kill(records: dict[int, RankProgress]) -> None:
    """SIGKILL for every rank, and its process group where it leads one (its loader workers, its
    subprocesses): a hung rank cannot checkpoint, and waiting the shutdown grace helps nobody."""
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
