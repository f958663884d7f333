"""A rank's progress, noted in memory shared with whoever watches it: :func:`note` and :func:`read`.

What sparkgpu already sees of a rank's work (an optimizer step of a patched Trainer or
Lightning, a ``Checkpointer`` step or save, a batch of a sparkgpu loader, an explicit
``runtime.heartbeat()``) calls :func:`note`. It costs a clock read and three stores into a
64-byte record mapped from a small file in the attempt's folder on the rank's own node
(``attempts/<k>/progress/rank-<r>``): no system call, no store request, no file write per step.
The node's side reads the record (:func:`read`) when it looks, and the supervisor judges it
(:mod:`sparkgpu.launch.client.progress_watch`).

The record is written under a sequence count (odd while a write is under way), so a reader
never takes half of one write for a record. Outside a rank (no :func:`start`), :func:`note`
does nothing. A process forked from the rank (a DataLoader worker) notes nothing: only the
rank's own progress counts.

Standard library only: the loaders, the checkpointer and the framework patches import it.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
import time
from pathlib import Path

__all__ = ["RankProgress", "note", "read", "start", "finish", "stop", "to_row", "from_row", "RECORD_SIZE"]

# seq; pid, node, count, step (-1: none), last note (Unix time), longest gap between two notes, start
# (Unix time), done (1 once the rank's function returned or raised)
_BODY = struct.Struct("<qqqqdddq")
_SEQ = struct.Struct("<Q")
RECORD_SIZE = _SEQ.size + _BODY.size  # 72 bytes
_NO_STEP = -1
_READ_TRIES = 50


@dataclasses.dataclass(frozen=True)
class RankProgress:
    """One rank's progress, as its record held it when read.

    Attributes:
        pid: The rank's process id (on its node).
        node: Its node rank.
        count: Notes so far in this attempt (0: none yet).
        step: The latest step a note named; ``None`` when none did.
        last: Unix time of the latest note (its start, before the first).
        slowest: The longest gap in seconds between two consecutive notes so far (0 before two).
        started: Unix time the rank began recording.
        done: The rank's function returned or raised: it makes no more progress, and is not hung.
    """

    pid: int
    node: int
    count: int
    step: int | None
    last: float
    slowest: float
    started: float
    done: bool = False


class _Record:
    __slots__ = ("map", "seq", "pid", "node", "count", "step", "last", "slowest", "started", "done")

    def __init__(self, path: Path, node: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, RECORD_SIZE)
            self.map = mmap.mmap(fd, RECORD_SIZE)
        finally:
            os.close(fd)
        self.seq = 0
        self.pid, self.node = os.getpid(), node
        self.count, self.step = 0, _NO_STEP
        self.started = self.last = time.time()
        self.slowest = 0.0
        self.done = 0
        self.write()

    def write(self) -> None:
        self.seq += 1  # odd: a write is under way
        _SEQ.pack_into(self.map, 0, self.seq)
        _BODY.pack_into(
            self.map,
            _SEQ.size,
            self.pid,
            self.node,
            self.count,
            self.step,
            self.last,
            self.slowest,
            self.started,
            self.done,
        )
        self.seq += 1
        _SEQ.pack_into(self.map, 0, self.seq)

    def note(self, step: int | None) -> None:
        now = time.time()
        if self.count:
            gap = now - self.last
            if gap > self.slowest:
                self.slowest = gap
        self.count += 1
        self.last = now
        if step is not None:
            self.step = int(step)
        self.write()


_record: _Record | None = None


def start(path: str | os.PathLike, node: int = 0) -> None:
    """Begins recording this process's progress in ``path`` (the rank entrypoint calls it once)."""
    global _record
    _record = _Record(Path(path), node)


def finish() -> None:
    """Marks the rank's function as ended (returned or raised): the rank is not judged any more."""
    record = _record
    if record is not None:
        record.done = 1
        record.write()


def stop() -> None:
    """Stops recording (the record stays as it was)."""
    global _record
    _record = None


def note(step: int | None = None) -> None:
    """Notes that this rank made progress (optionally: it finished ``step``); a no-op outside a rank."""
    record = _record
    if record is not None:
        record.note(step)


def read(path: str | os.PathLike) -> RankProgress | None:
    """The record in ``path``; ``None`` when there is none yet (or it never reads whole)."""
    try:
        with open(path, "rb") as file:
            if os.fstat(file.fileno()).st_size < RECORD_SIZE:
                return None
            view = mmap.mmap(file.fileno(), RECORD_SIZE, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    with view:
        for _ in range(_READ_TRIES):
            (before,) = _SEQ.unpack_from(view, 0)
            body = _BODY.unpack_from(view, _SEQ.size)
            (after,) = _SEQ.unpack_from(view, 0)
            if before == after and before % 2 == 0 and before > 0:
                pid, node, count, step, last, slowest, started, done = body
                return RankProgress(
                    pid, node, count, None if step == _NO_STEP else step, last, slowest, started, bool(done)
                )
    return None


def to_row(record: RankProgress) -> list:
    """``record`` as a compact JSON row (what a Spark node's beat carries to node 0, per rank)."""
    return [
        record.pid,
        record.node,
        record.count,
        record.step,
        round(record.last, 3),
        round(record.slowest, 3),
        round(record.started, 3),
        int(record.done),
    ]


def from_row(row) -> RankProgress | None:
    """The record a :func:`to_row` row holds; ``None`` for anything else."""
    try:
        pid, node, count, step, last, slowest, started, done = row
        return RankProgress(
            int(pid),
            int(node),
            int(count),
            None if step is None else int(step),
            float(last),
            float(slowest),
            float(started),
            bool(done),
        )
    except (TypeError, ValueError):
        return None


def _forget_in_child() -> None:
    stop()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
