"""The GPU queue of one host, shared by every user: who waits for GPUs, in which order, and who asked whom to give way.

It lives beside the GPU locks (:mod:`sparkgpu.launch.scheduling.gpu_lease`), in the machine-wide lease
folder (``<tmp>/sparkgpu-gpus``, mode 1777), so that two users' jobs on one machine see one
queue::

    queue/<kind>.<job id>.<pid>.json     a waiting job (QueueEntry), flock'ed by its process
    preempt/<target>.<requester>.json    a critical job's request (PreemptionRequest)

**Entries are alive only while flock'ed.** A waiting process creates its entry under a
temporary name, takes an exclusive ``flock`` on it, then renames it into place: a reader that
can take a shared lock on an entry knows its process is gone (however it ended) and ignores it
(:class:`Liveness`). Nobody waits behind a dead job.

**Order.** Live entries sort by class (``critical``, ``normal``, ``best_effort``), then by
``order`` (when the job first asked; a preempted job keeps its place), then job id. Only the
first entry may take GPUs: a job that does not fit keeps the ones behind it waiting, as a
queue does (no job overtakes a more urgent or an older one).

**Preemption is a request, judged by its target.** The first entry, when it is ``critical``,
writes a :class:`PreemptionRequest` for as few ``best_effort`` jobs holding GPUs of its kind as
make up, with the free GPUs, what it needs (:func:`~sparkgpu.launch.scheduling.gpu_lease.to_preempt`). The
target's own supervisor reads it (:func:`pending_request`) and honours it only if the
requester's entry is live, ``critical``, of the same kind of GPUs and first in the queue, and the
target itself is ``best_effort``; then it asks its ranks to checkpoint and stop, as at the
runtime cap, and frees its GPUs. A request cannot stop a ``normal`` or ``critical`` job,
cannot cancel anything, and a stale one (its requester gone) is ignored. Anyone on the
machine may submit a ``critical`` job; the classes are an agreement between the machine's
users, not an access control.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import fcntl
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import ClassVar

from sparkgpu.launch.scheduling.queue_record import QueueRecord
from sparkgpu.spec.priority import Priority

__all__ = [
    "Liveness",
    "QueueEntry",
    "GpuHolder",
    "PreemptionRequest",
    "GpuQueue",
    "pending_request",
]

QUEUE_DIR, PREEMPT_DIR = "queue", "preempt"
_SAFE = re.compile(r"^[A-Za-z0-9_.-]+$")


class Liveness(enum.Enum):
    """Whether a queue entry's process still holds it."""

    LIVE = "live"  # its process holds the flock
    STALE = "stale"  # its process is gone: ignored
    MISSING = "missing"  # no such entry (it got its GPUs, or gave up)


def shared_dir(root: Path, name: str) -> Path:
    """``root/name``, created mode 1777: every user of the machine writes its own files there."""
    folder = root / name
    with contextlib.suppress(FileExistsError):
        folder.mkdir()
        folder.chmod(0o1777)
    return folder


@dataclasses.dataclass(frozen=True)
class QueueEntry(QueueRecord):
    """A job waiting for ``gpus`` GPUs of ``gpu_kind`` (``gpu`` or ``simulated-gpu``) on this host.

    Attributes:
        gpu_kind: Which GPUs of the host: real ones or simulated ones.
        pid: The waiting process (its supervisor).
        host: This host's name.
        uid: The waiting process's user.
    """

    gpu_kind: str
    pid: int = dataclasses.field(default_factory=os.getpid)
    host: str = dataclasses.field(default_factory=socket.gethostname)
    uid: int = dataclasses.field(default_factory=os.getuid)

    json_keys: ClassVar[dict[str, str]] = {"gpu_kind": "pool"}  # what every version writes

    @property
    def file_name(self) -> str:
        return f"{self.gpu_kind}.{self.job_id}.{self.pid}.json"


@dataclasses.dataclass(frozen=True)
class GpuHolder:
    """Who holds a GPU: written into its lock file, read by waiting jobs."""

    job_id: str
    priority: Priority
    pid: int = dataclasses.field(default_factory=os.getpid)
    host: str = dataclasses.field(default_factory=socket.gethostname)
    uid: int = dataclasses.field(default_factory=os.getuid)

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "priority": self.priority.value}) + "\n"

    @classmethod
    def read(cls, path: Path) -> GpuHolder | None:
        """The holder written in ``path``, ``None`` when unreadable or not a holder record."""
        try:
            data = json.loads(path.read_text())
            return cls(
                str(data["job_id"]), Priority.parse(data["priority"]), int(data["pid"]), data["host"], data["uid"]
            )
        except (OSError, ValueError, KeyError, TypeError):  # a half-written or foreign file
            return None

    def __str__(self) -> str:
        return f"{self.job_id} (pid {self.pid} on {self.host}, user {self.uid}, {self.priority.value})"


@dataclasses.dataclass(frozen=True)
class PreemptionRequest:
    """A critical job's request that a best-effort job checkpoint and stop.

    Attributes:
        target_job_id: The best-effort job asked to give way.
        requester_job_id: The critical job that waits for its GPUs.
        requester_entry: The file name of the requester's queue entry, by which the target
            checks that the request is genuine and current.
        asked_at: Unix time of the request.
    """

    target_job_id: str
    requester_job_id: str
    requester_entry: str
    asked_at: float = dataclasses.field(default_factory=time.time)

    @property
    def file_name(self) -> str:
        return f"{self.target_job_id}.{self.requester_job_id}.json"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PreemptionRequest:
        data = json.loads(text)
        return cls(
            str(data["target_job_id"]),
            str(data["requester_job_id"]),
            str(data["requester_entry"]),
            float(data["asked_at"]),
        )


def _liveness(path: Path) -> Liveness:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return Liveness.MISSING
    except OSError:
        return Liveness.STALE  # unreadable: it cannot be judged, so it cannot hold anyone up
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return Liveness.LIVE
    finally:
        os.close(fd)  # releases the shared lock, if it was taken
    return Liveness.STALE


class GpuQueue:
    """The queue in ``root`` (the lease folder); one instance per waiting job, or a reader."""

    def __init__(self, root: Path):
        self.root = root
        self.queue_dir = shared_dir(root, QUEUE_DIR)
        self.preempt_dir = shared_dir(root, PREEMPT_DIR)
        self._fd: int | None = None
        self.entry: QueueEntry | None = None
        self._asked: set[str] = set()

    # -- a waiting job -------------------------------------------------------------------
    def enter(self, entry: QueueEntry) -> None:
        """Puts ``entry`` in the queue, live for as long as this process holds it (:meth:`leave`)."""
        final = self.queue_dir / entry.file_name
        temporary = self.queue_dir / f".{entry.file_name}.tmp"
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.fchmod(fd, 0o644)  # readable by every user: they order themselves by it
        fcntl.flock(fd, fcntl.LOCK_EX)  # a fresh file of our own: never contended
        os.write(fd, entry.to_json().encode())
        os.replace(temporary, final)  # readers only ever see it locked
        self._fd, self.entry = fd, entry

    def leave(self) -> None:
        """Removes this job's entry and the preemption requests it wrote."""
        if self.entry is None:
            return
        with contextlib.suppress(FileNotFoundError):
            (self.queue_dir / self.entry.file_name).unlink()
        for name in self._asked:
            with contextlib.suppress(FileNotFoundError):
                (self.preempt_dir / name).unlink()
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self.entry, self._asked = None, None, set()

    def ahead(self) -> list[QueueEntry]:
        """The live entries of this job's kind of GPUs that go before it."""
        assert self.entry is not None, "enter() the queue first"
        mine = self.entry.sort_key()
        return [e for e in self.live_entries(self.entry.gpu_kind) if e.sort_key() < mine]

    def ask_to_give_way(self, holder: GpuHolder) -> bool:
        """Writes a request that best-effort ``holder`` checkpoint and stop; True when newly asked."""
        assert self.entry is not None, "enter() the queue first"
        request = PreemptionRequest(holder.job_id, self.entry.job_id, self.entry.file_name)
        if request.file_name in self._asked:
            return False
        path = self.preempt_dir / request.file_name
        temporary = self.preempt_dir / f".{request.file_name}.tmp"
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.fchmod(fd, 0o644)
            os.write(fd, request.to_json().encode())
        finally:
            os.close(fd)
        os.replace(temporary, path)
        self._asked.add(request.file_name)
        return True

    # -- readers -------------------------------------------------------------------------
    def live_entries(self, gpu_kind: str | None = None) -> list[QueueEntry]:
        """Live entries (of GPU kind ``gpu_kind``, or all), in queue order; stale ones are ignored, and removed when ours."""
        entries = []
        for path in self.queue_dir.glob("*.json"):
            liveness = _liveness(path)
            if liveness is Liveness.STALE:
                with contextlib.suppress(OSError):  # another user's: only its owner may remove it
                    if path.stat().st_uid == os.getuid():
                        path.unlink()
                continue
            if liveness is Liveness.MISSING:
                continue
            try:
                entry = QueueEntry.from_json(path.read_text())
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if entry.file_name != path.name or (gpu_kind is not None and entry.gpu_kind != gpu_kind):
                continue  # a file that does not say what its name says is not an entry
            entries.append(entry)
        return sorted(entries, key=QueueEntry.sort_key)

    def positions(self) -> dict[str, tuple[QueueEntry, int]]:
        """Job id -> (its entry, its 1-based place among its kind of GPUs' entries)."""
        places: dict[str, tuple[QueueEntry, int]] = {}
        counts: dict[str, int] = {}
        for entry in self.live_entries():
            counts[entry.gpu_kind] = counts.get(entry.gpu_kind, 0) + 1
            places[entry.job_id] = (entry, counts[entry.gpu_kind])
        return places


def pending_request(
    root: Path, job_id: str, priority: Priority, gpu_kind: str
) -> tuple[PreemptionRequest, QueueEntry] | None:
    """The genuine request that ``job_id`` give way, if any: see the module's rules.

    Args:
        root: The lease folder.
        job_id: The running job that may be asked.
        priority: Its class: only a preemptible one is ever asked.
        gpu_kind: The kind of GPUs it holds (real or simulated).
    """
    if not priority.preemptible:
        return None
    queue = GpuQueue(root)
    for path in sorted(queue.preempt_dir.glob(f"{job_id}.*.json")):
        try:
            request = PreemptionRequest.from_json(path.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if request.target_job_id != job_id or not _SAFE.match(request.requester_entry):
            continue
        entry_path = queue.queue_dir / request.requester_entry
        if _liveness(entry_path) is not Liveness.LIVE:
            continue  # its requester got its GPUs, gave up or died
        try:
            entry = QueueEntry.from_json(entry_path.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if (
            entry.job_id != request.requester_job_id
            or entry.priority is not Priority.CRITICAL
            or entry.gpu_kind != gpu_kind
        ):
            continue
        live = queue.live_entries(gpu_kind)
        if not live or live[0].file_name != entry.file_name:
            continue  # only the first in the queue may ask: the others would not get the GPUs
        return request, entry
    return None
