"""The client-side supervisor: a job's attempts as explicit states, the steps between them in one table.

The supervisor is the one writer of the job's status (``state.json``'s, through
:meth:`~sparkgpu.launch.client.job_state.JobBook.set_status`): the attempt runner, the
failure policy and the monitors return what happened or what to do as data, and the
supervisor applies it; the jobs that no supervisor runs end through this module too
(:func:`fail_unsupervisable`, :func:`cancel_abandoned`). Which changes are legal is
:data:`~sparkgpu.rundir.states.JOB_TRANSITIONS`.

How attempt k ended -> the job's next step (:func:`next_step`)::

    SUCCEEDED                        FINISH           the job SUCCEEDED; its results are returned
    any, once a usage policy stopped STOP             the job is STOPPED (PolicyViolationError)
    RESIZED                          RESIZE           attempt k+1 on the GPUs that are free (elastic)
    PREEMPTED, having given way      WAIT_FOR_GPUS    GPUs freed, wait in the queue (unbilled), attempt k+1
    PREEMPTED (cap, growing back)    RESUME           attempt k+1 from the checkpoint
    FAILED, STOPPED                  RESTART_OR_FAIL  the FailurePolicy: attempt k+1 (a restart), or FAILED

Only RESTART_OR_FAIL uses up a restart; the
:class:`~sparkgpu.launch.client.failure_policy.FailurePolicy` fails the job at once where no
restart can help (a failure after the function returned, the same error at the same place again). Each attempt runs in an
:class:`~sparkgpu.launch.client.attempt_runner.AttemptRunner`: while it runs, its monitors
(:mod:`~sparkgpu.launch.client.monitors`) decide what happens to it; they may end the job
``CANCELLED`` or ``TIMED_OUT`` at once (the attempt's ``ended_job``; Ctrl-C ends it
``CANCELLED``, any other error ``FAILED``). An attempt stopped at the runtime cap counts as preempted only when its ranks
stopped for a restart or it committed a new checkpoint; otherwise it failed, so a function
that never checkpoints cannot resume forever.

The backend's capabilities (a queue, preemption, elastic capacity) are used where it has them.
"""

from __future__ import annotations

import enum
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

from sparkgpu._util.process import ProcessRef
from sparkgpu._util.report import console, report
from sparkgpu.callbacks import JobCallback, reads_results
from sparkgpu.errors import (
    CapacityError,
    JobStateError,
    JobTimeoutError,
    PolicyViolationError,
    RankFailure,
)
from sparkgpu.failure_class import Classified, classify
from sparkgpu.launch.backends.base import Backend
from sparkgpu.launch.backends.capabilities import ElasticCapacity, Preemptible, QueuedCapacity
from sparkgpu.launch.client.attempt_verdict import AttemptVerdict, StoppedBy
from sparkgpu.launch.client.attempt_runner import AttemptRunner
from sparkgpu.launch.client.checkpoint_progress import restart_point
from sparkgpu.launch.client.failure_policy import Decision, FailurePolicy
from sparkgpu.launch.client.job_state import JobBook
from sparkgpu.launch.scheduling.elastic import ElasticPlan
from sparkgpu.rundir.states import AttemptStatus, JobState, JobStatus
from sparkgpu.rundir.directory import RunDir
from sparkgpu.launch.client.supervision_lock import SupervisionLock
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.spec import JobSpec

__all__ = [
    "Supervisor",
    "JobStatus",
    "Decision",
    "FailurePolicy",
    "CANCEL_REQUEST_FILE",
    "JobStep",
    "next_step",
    "fail_unsupervisable",
    "cancel_abandoned",
]

#: In the run dir: asks whichever process supervises the job to cancel it (its text says who asked).
CANCEL_REQUEST_FILE = RunLayout.CANCEL_REQUEST


class JobStep(enum.Enum):
    """What the job does once an attempt ended (the module docstring's table)."""

    FINISH = "finish"
    STOP = "stop"
    RESIZE = "resize"
    WAIT_FOR_GPUS = "wait_for_gpus"
    RESUME = "resume"
    RESTART_OR_FAIL = "restart_or_fail"


_NEXT_STEP: dict[AttemptStatus, JobStep] = {
    AttemptStatus.SUCCEEDED: JobStep.FINISH,
    AttemptStatus.RESIZED: JobStep.RESIZE,
    AttemptStatus.PREEMPTED: JobStep.RESUME,
    AttemptStatus.FAILED: JobStep.RESTART_OR_FAIL,
    AttemptStatus.STOPPED: JobStep.RESTART_OR_FAIL,
}


def next_step(status: AttemptStatus, asked: StoppedBy | None, usage_stopped: bool) -> JobStep:
    """The job's next step after an attempt ended ``status``, ``asked`` to stop that way (or not).

    A usage policy's stop (``usage_stopped``) ends the job however the attempt ended: a restart
    would keep spending what the usage policy said is spent.
    """
    step = _NEXT_STEP[status]
    if step is not JobStep.FINISH and usage_stopped:
        return JobStep.STOP
    if step is JobStep.RESUME and asked is StoppedBy.PRIORITY:
        return JobStep.WAIT_FOR_GPUS
    return step


class Supervisor:
    """Drives one job's attempts on a backend until it succeeds or gives up.

    Args:
        job: The validated job, with devices resolved by the backend.
        run_dir: Its staged run directory.
        backend: Where attempts run.
        key: The job's signing key; travels to the workers in their environment only.
        callbacks: Tracking, metering, ... hooks.
        out: Where the ranks' live output goes (``sys.stdout`` by default).
        placement: The backend's placement of the ranks from ``resolve``, passed to every
            ``submit``; ``None`` for a job continued from its run dir (placed anew).
    """

    failure_policy_cls = FailurePolicy

    def __init__(
        self,
        job: JobSpec,
        run_dir: RunDir,
        backend: Backend,
        key: bytes,
        callbacks: Sequence[JobCallback] = (),
        out=None,
        placement=None,
    ):
        self.job = job
        self.run_dir = run_dir
        self.backend = backend
        self.placement = placement
        self.key = key
        self.run_dir.key = key  # the backends hand it to the job's processes (sparkgpu.rundir.key_handover)
        self.callbacks = list(callbacks)
        self.out = out if out is not None else console()
        #: Whether a failed attempt is restarted: the failure policy (``job.policy`` is the job's
        #: RunPolicy; a usage policy's stop is the book's ``stop_reason``).
        self.failure_policy = self.failure_policy_cls(job.policy.max_restarts, job.policy.restart_on)
        #: Set (from any thread) to cancel the job; a CANCEL_REQUEST_FILE does the same from another process.
        self.cancel_event = threading.Event()
        #: When and how an elastic job changes size (``min_gpus=``); ``None`` for a fixed one, and
        #: on a backend that cannot tell what is free (the job then waits for all its GPUs).
        self.elastic = (
            ElasticPlan(job, backend.available_gpus)
            if job.resources.elastic and isinstance(backend, ElasticCapacity)
            else None
        )
        #: The job's supervision lock, when the caller took it (``attach``, ``resume``); else
        #: :meth:`run` takes its own for as long as it runs.
        self.lock: SupervisionLock | None = None
        #: The job's ``state.json``: every change to it goes through the book.
        self.book = JobBook.new(run_dir.state_file, job.job_id, backend.name)

    # -- state -------------------------------------------------------------------------
    @property
    def state(self) -> JobState:
        """The job's state, live (the supervising thread changes it): read it, never change it."""
        return self.book.state

    def state_dict(self) -> JobState:
        return json.loads(json.dumps(self.book.state))

    def load_state_dict(self, state: JobState) -> None:
        self.book.state = json.loads(json.dumps(state))

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> list[Any]:
        """Runs attempts until the job ends; returns one result per rank, ordered by rank.

        Raises:
            JobStateError: another process supervises the job (its supervision lock is held).
            WorkerFailedError: ranks failed and no restart is left; derived from their exception
                type too when they all raised the same one (:func:`~sparkgpu.errors.worker_failed_error`).
            JobTimeoutError: the job ran past ``job.policy.timeout``.
            KeyboardInterrupt: the caller pressed Ctrl-C; every rank was stopped first.
            Exception: whatever the backend raised while the attempt ran (e.g. ``CapacityError``
                when Spark's GPUs stayed busy); the attempt was stopped and ended as failed first.
        """
        results = self._locked(return_results=True)
        assert results is not None  # a job that succeeded has every rank's result
        return results

    def run_detached(self) -> None:
        """:meth:`run`, for a supervisor whose results nobody here receives (a detached job's:
        whoever asks reads them from the run dir). The results are then unpickled only where a
        callback reads them (:func:`~sparkgpu.callbacks.reads_results`), so a returned model's
        libraries (torch, transformers) are not imported just to end the job."""
        self._locked(return_results=False)

    def _locked(self, return_results: bool) -> list[Any] | None:
        lock = self.lock or SupervisionLock(self.run_dir)
        if not lock.acquire():
            raise JobStateError(
                f"job {self.job.job_id} is already supervised by {lock.holder()}; follow it with "
                f"sparkgpu.attach({self.job.job_id!r})"
            )
        try:
            return self._run_supervised(return_results)
        finally:
            lock.release()
            self.lock = None

    def _run_supervised(self, return_results: bool) -> list[Any] | None:
        book = self.book
        job_started = time.monotonic()
        attempts = self._attempt_runner()
        # Who drives the job: `sparkgpu jobs` shows a job whose client died as lost.
        # Its start time tells a recycled pid from the client itself.
        book.set_client(ProcessRef.current().record())
        # Waiting for GPUs (in the host's or the cluster's queue, by priority) is no attempt's time:
        # nobody is billed. A job that gives up there ends failed, with nothing of it left in line.
        try:
            if isinstance(self.backend, QueuedCapacity):
                self.backend.await_capacity(self.job, None)
        except BaseException as exc:
            book.set_status(JobStatus.CANCELLED if isinstance(exc, KeyboardInterrupt) else JobStatus.FAILED)
            self.backend.end_job(self.job)
            raise
        # The first attempt's agent starts beside the callbacks (an MLflow run, a usage row);
        # its ranks wait for their variables, so no user code runs untracked.
        early = attempts.prestart() if self.callbacks else None
        try:
            for callback in self.callbacks:
                callback.before_job(self.job, str(self.run_dir.path))
        except BaseException:
            if early is not None:
                early.discard()
            raise
        results: list[Any] | None = None
        error: BaseException | None = None
        gpus = self.job.resources.gpus
        # The ranks' failures of the latest attempt that failed and was restarted: the same
        # error at the same place again is not restarted a second time, also after a supervisor
        # took the job over (kept in its state).
        failed_before = [RankFailure(**f) for f in book.state.get("failed_before", ())]
        try:
            while True:
                attempt = attempts.begin(len(book.state["attempts"]), gpus)
                book.set_status(JobStatus.RUNNING)
                attempt = attempts.run(attempt, job_started, early)
                early, gpus = None, self.job.resources.gpus
                if attempt.ended_job is not None:  # a monitor ended the job: cancelled, timed out
                    book.set_status(attempt.ended_job.job_status)
                    error = attempt.ended_job.error
                    raise error
                verdict = attempt.verdict
                assert verdict is not None  # set by AttemptRunner.run whenever it returns
                step = next_step(verdict.status, attempt.asked, usage_stopped=bool(book.stop_reason))
                if step is JobStep.FINISH:
                    book.set_status(JobStatus.SUCCEEDED)
                    if return_results or any(reads_results(callback) for callback in self.callbacks):
                        results = verdict.results()
                    return results
                if step is JobStep.STOP:
                    book.set_status(JobStatus.STOPPED)
                    error = PolicyViolationError(self._stop_message(verdict))
                    raise error from verdict.root_exception
                if step is JobStep.RESIZE:
                    assert attempt.resize_to is not None
                    gpus = attempt.resize_to
                elif step in (JobStep.RESUME, JobStep.WAIT_FOR_GPUS):
                    book.count_preemption()
                    if step is JobStep.WAIT_FOR_GPUS:
                        self._wait_after_giving_way(attempt.why, job_started)
                elif (
                    self.failure_policy.decide(
                        book.state["restarts"], verdict.exceptions, verdict.failures, failed_before, verdict.lost
                    )
                    is Decision.RESTART
                ):
                    failed_before = verdict.failures
                    book.state["failed_before"] = [_failure_record(f) for f in failed_before]
                    restarts = book.count_restart()
                    report(
                        f"attempt {attempt.index} failed ({self._classify(attempt)}); restarting "
                        f"{restart_point(attempts.latest_checkpoint())} (restart {restarts} of {self.job.policy.max_restarts})",
                        self.out,
                    )
                else:
                    self._classify(attempt)
                    permanent = self.failure_policy.unrestartable(
                        verdict.exceptions, verdict.failures, failed_before, verdict.lost
                    )
                    if permanent is not None and book.state["restarts"] < self.job.policy.max_restarts:
                        report(f"attempt {attempt.index} failed {permanent}; a restart cannot fix that", self.out)
                    book.set_status(JobStatus.FAILED)
                    logs = self.run_dir.logs_dir(attempt.index)
                    error = verdict.error(self.job.job_id, str(logs))
                    raise error from verdict.root_exception
        except BaseException as exc:
            error = error or exc
            if not book.status.is_terminal:
                book.set_status(JobStatus.CANCELLED if isinstance(exc, KeyboardInterrupt) else JobStatus.FAILED)
            raise
        finally:
            try:
                self.backend.end_job(self.job)
            finally:
                try:
                    for callback in self.callbacks:
                        callback.after_job(self.job, results, error)
                finally:
                    if book.status.is_terminal:
                        book.finish()  # observers in other processes now read the end as final

    def _classify(self, attempt) -> Classified:
        """The failed attempt's class, recorded in its ``state.json`` record (``failure_class``, ``failure_detail``)."""
        verdict = attempt.verdict
        found = classify(verdict.failures, verdict.exceptions, lost=verdict.lost)
        attempt.record["failure_class"] = found.cls.value
        attempt.record["failure_detail"] = found.detail
        self.book.save()
        return found

    def _attempt_runner(self) -> AttemptRunner:
        """Runs this job's attempts with the supervisor's collaborators as they are now."""
        return AttemptRunner(
            job=self.job,
            run_dir=self.run_dir,
            backend=self.backend,
            key=self.key,
            book=self.book,
            callbacks=self.callbacks,
            out=self.out,
            placement=self.placement,
            elastic=self.elastic,
            cancel_requested=self._cancel_requested,
        )

    def _wait_after_giving_way(self, reason: str, job_started: float) -> None:
        """Frees the job's GPUs for the critical job that asked, then waits in the queue for GPUs
        again; no attempt runs meanwhile, so the wait is neither billed nor a restart."""
        backend = self.backend
        assert isinstance(backend, Preemptible), "only a preemptible backend asks its jobs to give way"
        backend.give_way(self.job)
        self.book.start_waiting(reason)
        report(f"job {self.job.job_id} checkpointed and gave way ({reason}); it resumes once GPUs come free", self.out)
        timeout = self.job.policy.timeout
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - job_started))
        try:
            backend.await_capacity(self.job, left if left is not None else float("inf"))
        except CapacityError as exc:
            self.book.set_status(JobStatus.TIMED_OUT)
            raise JobTimeoutError(
                f"job {self.job.job_id} gave way to a critical job and its timeout of {timeout:g}s ran out while "
                f"it waited for GPUs; continue it with `sparkgpu resume {self.job.job_id}`, or raise timeout="
            ) from exc
        self.book.stop_waiting()

    def _stop_message(self, verdict: AttemptVerdict) -> str:
        job_id, reason = self.job.job_id, self.book.stop_reason
        logs = self.run_dir.logs_dir(len(self.book.state["attempts"]) - 1)
        if verdict.status is AttemptStatus.PREEMPTED:
            what = "checkpointed and stopped"
        elif verdict.status is AttemptStatus.FAILED:
            what = f"stopped after its ranks failed (see {logs})"
        else:
            what = (
                f"stopped (its ranks did not checkpoint when asked; work since the latest checkpoint "
                f"is lost, see {logs})"
            )
        return f"job {job_id} {what}: {reason}; continue it with `sparkgpu resume {job_id}` once the policy allows"

    def _cancel_requested(self) -> bool:
        return self.cancel_event.is_set() or self.run_dir.read_control(self.run_dir.cancel_request_file) is not None


def fail_unsupervisable(book: JobBook, cause: str) -> None:
    """Ends ``FAILED``, with ``cause``, a job that no supervisor can take over (unless it ended)."""
    if not book.status.is_terminal:
        book.state["cause"] = cause
        book.set_status(JobStatus.FAILED)
        book.finish()


def cancel_abandoned(book: JobBook) -> None:
    """Ends ``CANCELLED`` a job whose client died and whose cancel was asked for, without running it again."""
    book.cancel_running_attempts()
    book.set_status(JobStatus.CANCELLED)
    book.finish()


def _failure_record(failure: RankFailure) -> dict:
    """What the failure policy compares of a restarted attempt's failure, for the job's state."""
    return {
        "rank": failure.rank,
        "exc_type": failure.exc_type,
        "message": failure.message[:2000],
        "traceback": failure.traceback[-20000:],
        "exitcode": failure.exitcode,
    }
