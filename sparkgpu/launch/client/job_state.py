"""The one owner of a job's ``state.json``: every change to it goes through :class:`JobBook`.

The job's status changes only along :data:`~sparkgpu.rundir.states.JOB_TRANSITIONS` (an attempt's
along :data:`~sparkgpu.rundir.states.ATTEMPT_TRANSITIONS`), the run dir states' one drawing of them; any
other change is a bug in sparkgpu and raises :class:`IllegalTransition` before anything is
written. Only the supervisor (:mod:`~sparkgpu.launch.client.supervisor`) moves the job's status
(:meth:`JobBook.set_status`); the book's other methods never do. The file stays a plain JSON
dict, rewritten atomically.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.rundir.states import (
    ATTEMPT_TRANSITIONS,
    JOB_TRANSITIONS,
    AttemptRecord,
    AttemptStatus,
    JobState,
    JobStatus,
)

__all__ = ["JobBook", "IllegalTransition"]


class IllegalTransition(RuntimeError):
    """A change of status that the transition tables do not allow: a bug in sparkgpu, never the user's."""


def _check_attempt(record: AttemptRecord, status: AttemptStatus) -> None:
    now = AttemptStatus(record["status"])
    if status not in ATTEMPT_TRANSITIONS[now]:
        raise IllegalTransition(f"attempt {record.get('attempt')} cannot go from {now} to {status}")


class JobBook:
    """A job's ``state.json``, in memory (:attr:`state`, the live dict) and on disk.

    Args:
        path: The run dir's ``state.json``.
        state: What it holds (read back, or :meth:`new`).
    """

    def __init__(self, path: Path, state: JobState):
        self.path = path
        self.state = state

    @classmethod
    def new(cls, path: Path, job_id: str, backend: str) -> JobBook:
        """The book of a job that has run no attempt yet (``PENDING``); nothing is written yet."""
        state: JobState = {
            "job_id": job_id,
            "status": JobStatus.PENDING.value,
            "backend": backend,
            "attempts": [],
            "restarts": 0,
            "preemptions": 0,
            "created_at": time.time(),
        }
        return cls(path, state)

    @classmethod
    def read(cls, path: Path) -> JobBook | None:
        """The book in ``path``; ``None`` when there is none (a staged job whose client never started it)."""
        try:
            return cls(path, json.loads(path.read_text()))
        except FileNotFoundError:
            return None

    # -- the job ---------------------------------------------------------------------------
    @property
    def status(self) -> JobStatus:
        return JobStatus(self.state["status"])

    def save(self) -> None:
        atomic_write_bytes(self.path, json.dumps(self.state, indent=2).encode())

    def set_status(self, status: JobStatus) -> None:
        """Moves the job to ``status`` and writes it: the supervisor's, and the only writer of the status.

        Raises:
            IllegalTransition: :data:`~sparkgpu.rundir.states.JOB_TRANSITIONS` does not allow it.
        """
        if status not in JOB_TRANSITIONS[self.status]:
            raise IllegalTransition(f"job {self.state['job_id']} cannot go from {self.status} to {status}")
        self.state["status"] = status.value
        self.save()

    def finish(self) -> None:
        """Records that the job's supervisor is done with it: its status is final and its
        callbacks (the MLflow run's end, a model's registration) have run."""
        self.state["finished_at"] = time.time()
        self.save()

    @property
    def finished(self) -> bool:
        """Whether the supervisor that ended the job is done with it (:meth:`finish`)."""
        return self.status.is_terminal and self.state.get("finished_at") is not None

    def set_client(self, client: dict[str, Any]) -> None:
        """Records the process that drives the job (written with the next change)."""
        self.state["client"] = client  # type: ignore[typeddict-item]

    def count_restart(self) -> int:
        self.state["restarts"] += 1
        self.save()
        return self.state["restarts"]

    def count_preemption(self) -> None:
        self.state["preemptions"] += 1
        self.save()

    @property
    def stop_reason(self) -> str | None:
        """Why a usage policy stopped the job, once one did."""
        return self.state.get("stop_reason")

    def set_stop_reason(self, reason: str) -> None:
        self.state["stop_reason"] = reason
        self.save()

    def start_waiting(self, reason: str) -> None:
        """The job gave way to ``reason``'s job and waits for GPUs, between two attempts."""
        self.state["waiting"] = {"since": time.time(), "reason": reason}
        self.save()

    def stop_waiting(self) -> None:
        self.state.pop("waiting", None)
        self.save()

    # -- its attempts ----------------------------------------------------------------------
    def begin_attempt(self, attempt: int, submitted: float, gpus: int) -> AttemptRecord:
        """Adds a ``RUNNING`` attempt submitted at ``submitted`` on ``gpus`` GPUs, in memory: it is
        written with the job's ``RUNNING``, which the supervisor sets next."""
        # started_at: when the ranks started, the start of the billed time and of the cap.
        record: AttemptRecord = {
            "attempt": attempt,
            "submitted_at": submitted,
            "started_at": None,
            "ended_at": None,
            "status": AttemptStatus.RUNNING.value,
            "gpus": gpus,
        }
        self.state["attempts"].append(record)
        return record

    def ranks_started(self, record: AttemptRecord, started_at: float) -> None:
        record["started_at"] = started_at
        self.save()

    def end_attempt(
        self,
        record: AttemptRecord,
        status: AttemptStatus,
        code: int | None,
        cause: Sequence[str] = (),
        lost_at: float | None = None,
        lost: Sequence[Any] = (),
    ) -> tuple[float, float]:
        """Ends ``record`` with ``status``; returns its billed ``(started_at, ended_at)``.

        Args:
            cause: Sentences on why it ended (at most 8 are kept).
            lost_at: When the backend last saw a lost node alive: the bill stops there.
            lost: The lost nodes (dataclasses), when it lost any.
        """
        _check_attempt(record, status)
        ended_at = record["ended_at"] = time.time()
        record["status"] = status.value
        record["exit_code"] = code
        started_at = record["started_at"]
        if started_at is None:
            started_at = record["started_at"] = ended_at  # its ranks never started: nothing ran, nothing is billed
        if lost:
            # Billed up to when the node was last seen alive, not to when the client noticed.
            ended_at = record["ended_at"] = max(started_at, min(ended_at, lost_at or ended_at))
            record["lost"] = [dataclasses.asdict(n) for n in lost]
        if cause:
            record["cause"] = list(cause)[:8]
        self.save()
        return started_at, ended_at

    def mark_lost_attempts(self) -> list[int]:
        """Marks ``LOST`` the attempts that a client which died left ``RUNNING``, and drops the old
        policy stop: a job taken over is a new decision. In memory: written with the next change.

        Returns:
            The lost attempts' indexes.
        """
        lost = []
        for record in self.state["attempts"]:
            if record["status"] == AttemptStatus.RUNNING:
                _check_attempt(record, AttemptStatus.LOST)
                record["status"] = AttemptStatus.LOST.value
                lost.append(record["attempt"])
        self.state.pop("stop_reason", None)
        return lost

    def cancel_running_attempts(self) -> None:
        """Ends ``CANCELLED`` the attempts that a client which died left ``RUNNING``, in memory: the
        supervisor's end of the abandoned job (``CANCELLED``) writes them."""
        now = time.time()
        for record in self.state.get("attempts") or ():
            if record.get("status") == AttemptStatus.RUNNING:
                _check_attempt(record, AttemptStatus.CANCELLED)
                record["status"], record["ended_at"] = AttemptStatus.CANCELLED.value, now
                if record.get("started_at") is None:
                    record["started_at"] = now
