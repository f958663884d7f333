"""The Spark backend's seats in its cluster's GPU queue (:mod:`sparkgpu.launch.scheduling.cluster_queue`).

One :class:`ClusterSeats` per backend holds a :class:`~sparkgpu.launch.scheduling.cluster_queue.QueueSeat`
per GPU job, from the job's first wait for GPUs to its end: the supervisor's
``await_capacity`` waits here for the job's turn (outside any attempt: unbilled), the
attempt's start moves the ticket to ``running``, a running best-effort job looks for genuine
requests to give way (every :attr:`ClusterSeats.poll_seconds`, not every poll of the
supervisor: the queue may live on an object store), and the job's end removes its ticket.
CPU jobs do not queue: they take no GPUs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

from sparkgpu._util.report import report
from sparkgpu.config import settings
from sparkgpu.errors import CapacityError
from sparkgpu.launch.scheduling.cluster_queue import (
    ClusterQueue,
    QueueSeat,
    Ticket,
    TicketState,
    Turn,
    cluster_key,
    queue_root,
)
from sparkgpu.spec import JobSpec

__all__ = ["ClusterSeats"]


class ClusterSeats:
    """The queue seats of one backend's jobs.

    Args:
        staging_url: The backend's staging root (the queue lives under it), ``None`` for none.
        out: Where waiting notices go.
    """

    #: Seconds between two looks at the queue, waiting or running.
    poll_seconds = 5.0
    #: Seconds between two "waiting" notices.
    notice_seconds = 30.0

    def __init__(self, staging_url: str | None, out: Callable[[], TextIO]):
        self.staging_url = staging_url
        self._out = out
        self._seats: dict[str, QueueSeat] = {}
        self._totals: dict[str, int] = {}
        self._first_asked: dict[str, float] = {}
        self._next_look: dict[str, float] = {}

    def seat(self, job_id: str) -> QueueSeat | None:
        return self._seats.get(job_id)

    def await_turn(self, job: JobSpec, master: str, total_gpus: int, wait: float) -> None:
        """Waits in the queue of the cluster at ``master`` until ``job`` may submit.

        Args:
            total_gpus: The cluster's GPUs, as the capacity probe saw them when the job first
                asked (a later probe may miss executors whose cores the running jobs hold).
            wait: Seconds to wait.

        Raises:
            CapacityError: Its turn did not come within ``wait`` seconds; names the jobs ahead.
        """
        if job.resources.is_cpu:
            return
        seat = self._seats.get(job.job_id)
        if seat is None:
            queue = ClusterQueue(queue_root(self.staging_url), cluster_key(master))
            order = self._first_asked.setdefault(job.job_id, time.time())  # kept when it gives way
            ticket = Ticket(job.job_id, job.policy.priority, job.resources.gpus, order, user=settings().user)
            seat = self._seats[job.job_id] = QueueSeat(queue, ticket, on_error=self._beat_failed).start()
            self._totals[job.job_id] = total_gpus
        else:
            seat.set_state(TicketState.WAITING)
        total = self._totals[job.job_id]
        started = time.monotonic()
        next_notice = started + 5.0
        try:
            while True:
                try:
                    turn = seat.turn(total)
                except OSError as exc:  # a store that is down: wait on, within ``wait``
                    self._beat_failed(exc)
                    why = f"the cluster's queue could not be read ({exc})"
                else:
                    if turn.go:
                        seat.set_state(TicketState.STARTING)
                        return
                    why = _why_waiting(turn, total)
                now = time.monotonic()
                if now - started > wait:
                    raise CapacityError(
                        f"job {job.job_id} ({job.policy.priority.value}) gave up after waiting {now - started:.0f}s "
                        f"for {job.resources.gpus} GPUs on the Spark cluster: {why}; try again later, ask for "
                        "fewer GPUs, give the job a higher priority=, or raise capacity_wait="
                    )
                if now >= next_notice:
                    report(
                        f"job {job.job_id} ({job.policy.priority.value}) waits for {job.resources.gpus} GPUs "
                        f"({now - started:.0f}s so far): {why}",
                        out=self._out(),
                    )
                    next_notice = now + self.notice_seconds
                time.sleep(min(self.poll_seconds, max(0.0, wait - (now - started)) + 0.01))
        except BaseException:
            if seat.state is TicketState.WAITING and job.job_id in self._seats:
                self.end(job)  # the job ends here: nothing of it stays in line
            raise

    def started(self, job: JobSpec) -> None:
        """The attempt's ranks got their GPUs: the ticket says ``running``."""
        seat = self._seats.get(job.job_id)
        if seat is not None and seat.state is not TicketState.RUNNING:
            try:
                seat.set_state(TicketState.RUNNING)
            except OSError as exc:  # the store is down: the next beat writes it
                self._beat_failed(exc)

    def request(self, job: JobSpec) -> str | None:
        """Why a critical job asks ``job`` to give way, once judged genuine; ``None`` when none does."""
        seat = self._seats.get(job.job_id)
        if seat is None or not job.policy.priority.preemptible:
            return None
        now = time.monotonic()
        if now < self._next_look.get(job.job_id, 0.0):
            return None
        self._next_look[job.job_id] = now + self.poll_seconds
        try:
            found = seat.request()
        except OSError as exc:
            self._beat_failed(exc)
            return None
        if found is None:
            return None
        _, requester = found
        return f"critical job {requester.job_id} needs {requester.gpus} GPU(s) of the Spark cluster"

    def resize(self, job: JobSpec) -> None:
        """The job's next attempt runs on ``job.resources.gpus`` (an elastic job): its ticket says so."""
        seat = self._seats.get(job.job_id)
        if seat is not None:
            try:
                seat.set_gpus(job.resources.gpus)
            except OSError as exc:  # the next beat writes it
                self._beat_failed(exc)

    def held_by_others(self, job: JobSpec) -> int:
        """GPUs of the cluster that other queued jobs hold (0 when ``job`` has no seat)."""
        seat = self._seats.get(job.job_id)
        return 0 if seat is None else seat.held_by_others()

    def give_way(self, job: JobSpec) -> None:
        """The job checkpointed and stopped for a critical one: its GPUs no longer count as held."""
        seat = self._seats.get(job.job_id)
        if seat is not None:
            seat.set_state(TicketState.WAITING)

    def end(self, job: JobSpec) -> None:
        """Removes the job's ticket and requests."""
        seat = self._seats.pop(job.job_id, None)
        self._totals.pop(job.job_id, None)
        self._next_look.pop(job.job_id, None)
        self._first_asked.pop(job.job_id, None)  # a long-lived client keeps nothing of ended jobs
        if seat is not None:
            try:
                seat.stop()
            except OSError as exc:  # its ticket goes stale within a minute
                self._beat_failed(exc)

    def _beat_failed(self, exc: BaseException) -> None:
        report(f"could not update this job's place in the cluster's GPU queue: {exc}", out=self._out())


def _why_waiting(turn: Turn, total: int) -> str:
    """What a job that may not submit yet waits for, in words."""
    if turn.ahead:
        return f"{len(turn.ahead)} job(s) ahead in the queue ({', '.join(map(str, turn.ahead))})"
    why = f"the queued jobs hold {total - turn.free} of the cluster's {total} GPUs"
    if turn.preempt:
        why += f"; asked {', '.join(t.job_id for t in turn.preempt)} (best effort) to give way"
    return why
