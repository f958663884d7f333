"""What the supervisor watches while an attempt runs: one small monitor per concern, each returning a decision.

At every poll the supervisor builds an :class:`AttemptView` and asks its monitors in this
order (:func:`attempt_monitors`); it applies each decision at once (the view then shows a stop
that was asked) and ends the watch at the first :data:`ENDING` one:

1. :class:`Cancelled`: the job's cancel was asked -> :class:`EndJob` ``CANCELLED``.
2. :class:`Timeout`: the job ran past ``job.policy.timeout`` -> :class:`EndJob` ``TIMED_OUT``.
3. :class:`ElasticShrink`: an elastic attempt's ranks waited ``elastic_wait`` to start -> :class:`Resize`.
4. :class:`UsagePolicyStop`: a callback's ``stop_reason`` -> :class:`AskToStop` (``USAGE_POLICY``).
5. :class:`Preemption`: a critical job asks this one to give way -> :class:`AskToStop` (``PRIORITY``).
6. :class:`Growth`: all GPUs of an elastic job on fewer are free -> :class:`AskToStop` (``RESIZE``).
7. :class:`GraceExpiry`: ranks asked to stop still run after ``checkpoint_grace`` -> :class:`StopNow`.
8. :class:`CapNear`: ``checkpoint_grace`` before the runtime cap, ranks that started late -> :class:`AskToCheckpoint`.
9. :class:`CapReached`: the attempt ran past ``max_runtime`` -> :class:`StopNow` (``CAP``).

10. :class:`~sparkgpu.launch.client.progress_watch.ProgressWatch` (added by the attempt runner):
    no progress for ``progress_timeout`` -> the stacks dumped, :class:`StopNow` (``HANG``).
11. :class:`~sparkgpu.launch.client.stragglers.StragglerWatch` (added by the attempt runner for a
    job of two ranks or more): a rank that slows the job ``SPARKGPU_STRAGGLER_FACTOR`` times over
    a window is named; nothing is stopped (:data:`CONTINUE` always).

3 is asked only while the ranks wait to start, 4-11 only once they started; 4-6 at most once a
second (each may ask a callback or the cluster), 10 twice a second and 11 once a look, both only
while no stop was asked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, Union

from sparkgpu.callbacks import JobCallback
from sparkgpu.errors import JobCancelledError, JobTimeoutError
from sparkgpu.launch.backends.base import Backend
from sparkgpu.launch.backends.capabilities import DeferredStart, Preemptible
from sparkgpu.launch.client.attempt_verdict import StoppedBy
from sparkgpu.launch.scheduling.elastic import ElasticPlan
from sparkgpu.rundir.states import AttemptStatus, JobStatus
from sparkgpu.spec import JobSpec

__all__ = [
    "AttemptView",
    "Continue",
    "CONTINUE",
    "AskToStop",
    "AskToCheckpoint",
    "StopNow",
    "EndJob",
    "Resize",
    "WatchDecision",
    "ENDING",
    "Monitor",
    "attempt_monitors",
]

#: Seconds between two asks of the monitors that ask a callback or the cluster (4-6).
REQUEST_SECONDS = 1.0


@dataclasses.dataclass(frozen=True)
class AttemptView:
    """The running attempt as the monitors see it at one poll (times on the monotonic clock)."""

    attempt: int
    gpus: int  # the attempt's: fewer than the job's for an elastic job short of GPUs
    now: float
    job_seconds: float  # since the supervisor started the job
    waited: float  # wall-clock seconds since the attempt was submitted
    ran: float | None  # seconds since its ranks started; None while they wait for GPUs
    asked: StoppedBy | None = None  # the stop asked of its ranks (POLICY, PRIORITY or RESIZE), if one was
    asked_at: float | None = None


# -- decisions -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Continue:
    """Nothing to do."""


CONTINUE = Continue()


@dataclasses.dataclass(frozen=True)
class AskToStop:
    """Ask the ranks (the stop file) to checkpoint and stop within ``checkpoint_grace``."""

    kind: StoppedBy
    reason: str  # written into the stop file
    said: str  # told to the caller after "... within checkpoint_grace (Ns)"


@dataclasses.dataclass(frozen=True)
class AskToCheckpoint:
    """Ask the ranks to checkpoint (the stop file, unless a stop already wrote it)."""

    why: str


@dataclasses.dataclass(frozen=True)
class StopNow:
    """Stop the ranks (SIGTERM, then SIGKILL after ``shutdown_grace``); the attempt's outcome is read back."""

    kind: StoppedBy
    note: str | None = None  # told to the caller first


@dataclasses.dataclass(frozen=True)
class EndJob:
    """Stop the ranks, end the attempt and the job with these statuses, and raise ``error``."""

    attempt_status: AttemptStatus
    job_status: JobStatus
    error: Exception


@dataclasses.dataclass(frozen=True)
class Resize:
    """Withdraw the attempt before its ranks start; the next one runs on ``gpus``."""

    gpus: int
    why: str


WatchDecision = Union[Continue, AskToStop, AskToCheckpoint, StopNow, EndJob, Resize]
#: The decisions that end the watch.
ENDING = (StopNow, EndJob, Resize)


class Monitor(Protocol):
    def check(self, view: AttemptView) -> WatchDecision: ...


# -- monitors ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Cancelled:
    requested: Callable[[], bool]
    job_id: str
    logs: str

    def check(self, view: AttemptView) -> WatchDecision:
        if not self.requested():
            return CONTINUE
        message = f"job {self.job_id} was cancelled; its ranks were stopped. Logs: {self.logs}"
        return EndJob(AttemptStatus.CANCELLED, JobStatus.CANCELLED, JobCancelledError(message))


@dataclasses.dataclass
class Timeout:
    timeout: float | None
    job_id: str
    logs: str

    def check(self, view: AttemptView) -> WatchDecision:
        if self.timeout is None or view.job_seconds <= self.timeout:
            return CONTINUE
        message = (
            f"job {self.job_id} ran longer than its timeout of {self.timeout:g}s and was "
            f"stopped; raise timeout= (or SPARKGPU_TIMEOUT), or checkpoint and set max_runtime= "
            f"so it resumes. Logs: {self.logs}"
        )
        return EndJob(AttemptStatus.TIMED_OUT, JobStatus.TIMED_OUT, JobTimeoutError(message))


@dataclasses.dataclass
class ElasticShrink:
    plan: ElasticPlan | None
    elastic_wait: float

    def check(self, view: AttemptView) -> WatchDecision:
        if self.plan is None or view.ran is not None:
            return CONTINUE
        smaller = self.plan.shrink_to(view.gpus, view.waited, view.now)
        if smaller is None:
            return CONTINUE
        return Resize(
            smaller,
            f"attempt {view.attempt} waited {self.elastic_wait:g}s (elastic_wait) for {view.gpus} GPUs; going "
            f"on from the latest checkpoint with the {smaller} free (min_gpus={self.plan.minimum}), "
            f"growing back to {self.plan.target} at a checkpoint once they are free",
        )


class _Request:
    """A monitor asked once a second, once the ranks started, while no stop was asked."""

    _next = float("-inf")

    def check(self, view: AttemptView) -> WatchDecision:
        if view.ran is None or view.asked is not None or view.now < self._next:
            return CONTINUE
        self._next = view.now + REQUEST_SECONDS
        return self.ask(view, view.ran)

    def ask(self, view: AttemptView, ran: float) -> WatchDecision:
        raise NotImplementedError


@dataclasses.dataclass
class UsagePolicyStop(_Request):
    """Asks the callbacks whether the job (``job``: as this attempt runs it) must stop."""

    callbacks: Sequence[JobCallback]
    job: JobSpec

    def ask(self, view: AttemptView, ran: float) -> WatchDecision:
        for callback in self.callbacks:
            reason = callback.stop_reason(self.job, view.attempt, ran)
            if reason:
                return AskToStop(StoppedBy.USAGE_POLICY, reason, f": {reason}")
        return CONTINUE


@dataclasses.dataclass
class Preemption(_Request):
    """A genuine request of a critical job (the backend judges it) asks this best-effort job to give way."""

    backend: Backend
    job: JobSpec

    def ask(self, view: AttemptView, ran: float) -> WatchDecision:
        if not isinstance(self.backend, Preemptible):
            return CONTINUE
        reason = self.backend.preemption_request(self.job)
        if reason is None:
            return CONTINUE
        return AskToStop(
            StoppedBy.PRIORITY, reason, f" to give way: {reason}; the job resumes by itself, using no restart"
        )


@dataclasses.dataclass
class Growth(_Request):
    """An elastic attempt on fewer GPUs than the job's stops at a checkpoint once all of them are free."""

    plan: ElasticPlan | None

    def ask(self, view: AttemptView, ran: float) -> WatchDecision:
        if self.plan is None or not self.plan.grows(view.gpus, view.now):
            return CONTINUE
        target = self.plan.target
        why = f"all {target} GPUs of the job are free again; growing back from {view.gpus}"
        return AskToStop(
            StoppedBy.RESIZE, why, f": {why}; the job resumes on {target} GPUs by itself, using no restart"
        )


@dataclasses.dataclass
class GraceExpiry:
    """Ranks that never call ``should_checkpoint()`` would otherwise run on until the cap (7 days
    remotely); SIGTERM first: a Checkpointer takes it as a save request."""

    checkpoint_grace: float
    shutdown_grace: float

    def check(self, view: AttemptView) -> WatchDecision:
        if view.asked is None or view.asked_at is None or view.now - view.asked_at <= self.checkpoint_grace:
            return CONTINUE
        return StopNow(
            view.asked,
            f"the ranks did not stop within checkpoint_grace ({self.checkpoint_grace:g}s) "
            f"of the request; stopping them (SIGTERM, SIGKILL after {self.shutdown_grace:g}s)",
        )


@dataclasses.dataclass
class CapNear:
    """Ranks of a backend whose ranks start late learn of the cap from the stop file (the others
    got their deadline in their environment at submit)."""

    max_runtime: float | None
    checkpoint_grace: float
    deferred: bool
    signalled: bool = False

    def check(self, view: AttemptView) -> WatchDecision:
        if (
            self.signalled
            or not self.deferred
            or self.max_runtime is None
            or view.ran is None
            or view.ran < self.max_runtime - self.checkpoint_grace
        ):
            return CONTINUE
        self.signalled = True
        return AskToCheckpoint(f"the runtime cap of {self.max_runtime:g}s is {self.checkpoint_grace:g}s away")


@dataclasses.dataclass
class CapReached:
    """Ranks had ``checkpoint_grace`` to checkpoint and stop; the cap is hard."""

    max_runtime: float | None

    def check(self, view: AttemptView) -> WatchDecision:
        if self.max_runtime is None or view.ran is None or view.ran <= self.max_runtime:
            return CONTINUE
        return StopNow(StoppedBy.CAP)


def attempt_monitors(
    job: JobSpec,
    full_job: JobSpec,
    backend: Backend,
    callbacks: Sequence[JobCallback],
    elastic: ElasticPlan | None,
    cancel_requested: Callable[[], bool],
    logs: str,
) -> list[Monitor]:
    """The monitors of one attempt of ``full_job``, run as ``job`` (resized for an elastic one), in order."""
    run_policy = job.policy
    job_id = full_job.job_id
    return [
        Cancelled(cancel_requested, job_id, logs),
        Timeout(run_policy.timeout, job_id, logs),
        ElasticShrink(elastic, full_job.elastic_wait),
        UsagePolicyStop(callbacks, job),
        Preemption(backend, full_job),
        Growth(elastic),
        GraceExpiry(run_policy.checkpoint_grace, run_policy.shutdown_grace),
        CapNear(run_policy.max_runtime, run_policy.checkpoint_grace, isinstance(backend, DeferredStart)),
        CapReached(run_policy.max_runtime),
    ]
