"""The client-side supervisor: a job's attempts as explicit states, their transitions in one table.

The job's status (``state.json``, written only by :class:`~sparkgpu.launch.client.job_state.JobBook`,
whose table says which changes are legal)::

    PENDING --GPUs granted (the queue)--> RUNNING (attempt k) --next_step--> RUNNING (attempt k+1)
                                                                         \\-> SUCCEEDED | STOPPED | FAILED | TIMED_OUT

How attempt k ended -> the job's next step (:func:`next_step`)::

    SUCCEEDED                        FINISH           the job SUCCEEDED; its results are returned
    any, once a usage policy stopped STOP             the job is STOPPED (PolicyViolationError)
    RESIZED                          RESIZE           attempt k+1 on the GPUs that are free (elastic)
    PREEMPTED, having given way      WAIT_FOR_GPUS    GPUs freed, wait in the queue (unbilled), attempt k+1
    PREEMPTED (cap, growing back)    RESUME           attempt k+1 from the checkpoint
    FAILED, STOPPED                  RESTART_OR_FAIL  the FailurePolicy: attempt k+1 (a restart), or FAILED

Only RESTART_OR_FAIL uses up a restart. While an attempt runs, its monitors
(:mod:`~sparkgpu.launch.client.monitors`) decide what happens to it; they may end the job
``CANCELLED`` or ``TIMED_OUT`` at once (Ctrl-C ends it ``CANCELLED``, any other error
``FAILED``). An attempt stopped at the runtime cap counts as preempted only when its ranks
stopped for a restart or it committed a new checkpoint; otherwise it failed, so a function
that never checkpoints cannot resume forever.

An attempt's runtime cap and billed time start when its ranks start: a
:class:`~sparkgpu.launch.backends.capabilities.DeferredStart` backend says when
(``ranks_started_at``), and its ranks learn of the cap from the stop file. The backend's other
capabilities (a queue, preemption, elastic capacity) are used where it has them.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

from sparkgpu import runtime
from sparkgpu._process import ProcessRef
from sparkgpu._report import console, report
from sparkgpu.callbacks import AttemptOutcome, JobCallback
from sparkgpu.errors import (
    CapacityError,
    EnvironmentMismatchError,
    JobStateError,
    JobTimeoutError,
    PayloadSignatureError,
    PolicyViolationError,
)
from sparkgpu.launch.backends.base import Backend
from sparkgpu.launch.backends.capabilities import DeferredStart, ElasticCapacity, Preemptible, QueuedCapacity
from sparkgpu.launch.client.attempt_result import AttemptResult, StoppedBy, read_attempt
from sparkgpu.launch.client.checkpoint_progress import latest_checkpoint, restart_point
from sparkgpu.launch.client.job_state import JobBook
from sparkgpu.launch.client.monitors import (
    CONTINUE,
    ENDING,
    AskToCheckpoint,
    AskToStop,
    AttemptView,
    EndJob,
    Resize,
    StopNow,
    attempt_monitors,
)
from sparkgpu.launch.scheduling.elastic import ElasticPlan
from sparkgpu.launch.client.logs import LogStreamer
from sparkgpu.protocol import AttemptRecord, AttemptStatus, JobState, JobStatus
from sparkgpu.launch.rundir.directory import RunDir
from sparkgpu.launch.client.supervision_lock import SupervisionLock
from sparkgpu.launch.rundir.layout import RunLayout
from sparkgpu.spec import JobSpec

__all__ = ["Supervisor", "JobStatus", "Decision", "FailurePolicy", "CANCEL_REQUEST_FILE", "JobStep", "next_step"]

_POLL_SECONDS = 0.1

#: In the run dir: asks whichever process supervises the job to cancel it (its text says who asked).
CANCEL_REQUEST_FILE = RunLayout.CANCEL_REQUEST


class Decision(enum.Enum):
    RESTART = "restart"
    RAISE = "raise"


class FailurePolicy:
    """Restart a failed attempt while restarts are left, then raise.

    Failures that the same payload on the same workers meets again — a payload whose
    signature does not match, a worker environment that does not fit the client's — are
    raised at once: restarting them only spends GPU time.
    """

    PERMANENT = (PayloadSignatureError, EnvironmentMismatchError)

    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts

    def decide(self, restarts_used: int, exceptions: dict[int, BaseException]) -> Decision:
        """Restart or raise, given the ranks' exceptions (those that unpickled here) by rank."""
        if any(isinstance(exc, self.PERMANENT) for exc in exceptions.values()):
            return Decision.RAISE
        return Decision.RESTART if restarts_used < self.max_restarts else Decision.RAISE


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


def next_step(status: AttemptStatus, asked: StoppedBy | None, policy_stopped: bool) -> JobStep:
    """The job's next step after an attempt ended ``status``, ``asked`` to stop that way (or not).

    A policy stop ends the job however the attempt ended: a restart would keep spending what
    the policy said is spent.
    """
    step = _NEXT_STEP[status]
    if step is not JobStep.FINISH and policy_stopped:
        return JobStep.STOP
    if step is JobStep.RESUME and asked is StoppedBy.PRIORITY:
        return JobStep.WAIT_FOR_GPUS
    return step


@dataclasses.dataclass
class _Attempt:
    """One attempt as the supervisor drives it."""

    job: JobSpec  # as this attempt runs it: resized, for an elastic job short of GPUs
    record: AttemptRecord
    handle: Any = None
    streamer: LogStreamer | None = None
    #: The stop asked of its ranks (policy, giving way, growing back), why, and when (monotonic).
    asked: StoppedBy | None = None
    why: str = ""
    asked_at: float | None = None
    #: How it ended: read back from the run dir, or RESIZED with the GPUs of the next attempt.
    outcome: AttemptResult | None = None
    resize_to: int | None = None

    @property
    def index(self) -> int:
        return self.record["attempt"]


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
        self.run_dir.key = key  # the backends hand it to the job's processes (sparkgpu.launch.rundir.keys)
        self.callbacks = list(callbacks)
        self.out = out if out is not None else console()
        self.policy = self.failure_policy_cls(job.policy.max_restarts)
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
            JobTimeoutError: the job ran past ``policy.timeout``.
            KeyboardInterrupt: the caller pressed Ctrl-C; every rank was stopped first.
            Exception: whatever the backend raised while the attempt ran (e.g. ``CapacityError``
                when Spark's GPUs stayed busy); the attempt was stopped and ended as failed first.
        """
        lock = self.lock or SupervisionLock(self.run_dir)
        if not lock.acquire():
            raise JobStateError(
                f"job {self.job.job_id} is already supervised by {lock.holder()}; follow it with "
                f"sparkgpu.attach({self.job.job_id!r})"
            )
        try:
            return self._run_supervised()
        finally:
            lock.release()
            self.lock = None

    def _run_supervised(self) -> list[Any]:
        book = self.book
        job_started = time.monotonic()
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
        early = self._prestart() if self.callbacks else None
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
        try:
            while True:
                attempt = self._run_attempt(len(book.state["attempts"]), gpus, job_started, early)
                early, gpus = None, self.job.resources.gpus
                outcome = attempt.outcome
                assert outcome is not None  # set by _run_attempt whenever it returns
                step = next_step(outcome.status, attempt.asked, policy_stopped=bool(book.stop_reason))
                if step is JobStep.FINISH:
                    book.set_status(JobStatus.SUCCEEDED)
                    results = outcome.results
                    assert results is not None  # a succeeded attempt has every rank's result
                    return results
                if step is JobStep.STOP:
                    book.set_status(JobStatus.STOPPED)
                    error = PolicyViolationError(self._stop_message(outcome))
                    raise error from outcome.root_exception
                if step is JobStep.RESIZE:
                    assert attempt.resize_to is not None
                    gpus = attempt.resize_to
                elif step in (JobStep.RESUME, JobStep.WAIT_FOR_GPUS):
                    book.count_preemption()
                    if step is JobStep.WAIT_FOR_GPUS:
                        self._wait_after_giving_way(attempt.why, job_started)
                elif self.policy.decide(book.state["restarts"], outcome.exceptions) is Decision.RESTART:
                    restarts = book.count_restart()
                    why = f": {outcome.lost}" if outcome.lost else ""
                    report(
                        f"attempt {attempt.index} failed{why}; restarting {restart_point(self._latest_checkpoint())} "
                        f"(restart {restarts} of {self.job.policy.max_restarts})",
                        self.out,
                    )
                else:
                    book.set_status(JobStatus.FAILED)
                    logs = self.run_dir.logs_dir(attempt.index)
                    error = outcome.error(self.job.job_id, str(logs))
                    raise error from outcome.root_exception
        except BaseException as exc:
            error = error or exc
            if not book.status.is_terminal:
                book.set_status(JobStatus.CANCELLED if isinstance(exc, KeyboardInterrupt) else JobStatus.FAILED)
            raise
        finally:
            try:
                self.backend.end_job(self.job)
            finally:
                for callback in self.callbacks:
                    callback.after_job(self.job, results, error)

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

    def _stop_message(self, outcome: AttemptResult) -> str:
        job_id, reason = self.job.job_id, self.book.stop_reason
        logs = self.run_dir.logs_dir(len(self.book.state["attempts"]) - 1)
        if outcome.status is AttemptStatus.PREEMPTED:
            what = "checkpointed and stopped"
        elif outcome.status is AttemptStatus.FAILED:
            what = f"stopped after its ranks failed (see {logs})"
        else:
            what = (
                f"stopped (its ranks did not checkpoint when asked; work since the latest checkpoint "
                f"is lost, see {logs})"
            )
        return f"job {job_id} {what}: {reason}; continue it with `sparkgpu resume {job_id}` once the policy allows"

    def _prestart(self):
        """The next attempt's agent, started ahead of its environment, or ``None`` where the backend cannot."""
        attempt = len(self.book.state["attempts"])
        return self.backend.prestart(self.job, self.run_dir, attempt, self._base_env(attempt, time.time()))

    def _base_env(self, attempt: int, submitted: float) -> dict[str, str]:
        """The ranks' environment that needs no callback."""
        env = {
            runtime.ENV_JOB_ID: self.job.job_id,
            runtime.ENV_ATTEMPT: str(attempt),
            runtime.ENV_RUN_DIR: str(self.run_dir.path),
            runtime.ENV_CHECKPOINT_DIR: self.backend.checkpoint_dir(self.run_dir),
        }
        if self.job.policy.max_runtime is not None and not isinstance(self.backend, DeferredStart):
            # Ranks start at submit here; elsewhere the supervisor writes the stop file in time.
            deadline = submitted + self.job.policy.max_runtime - self.job.policy.checkpoint_grace
            env[runtime.ENV_DEADLINE] = repr(deadline)
        return env

    def _attempt_env(self, job: JobSpec, attempt: int, submitted: float) -> dict[str, str]:
        env = self._base_env(attempt, submitted)
        for callback in self.callbacks:
            env.update(callback.before_attempt(job, attempt))
        return env

    # -- one attempt ---------------------------------------------------------------------
    def _run_attempt(self, index: int, gpus: int, job_started: float, early=None) -> _Attempt:
        """Runs attempt ``index`` on ``gpus`` GPUs until it ends; its ``outcome`` says how."""
        # An elastic job's attempt may run on fewer GPUs than the job asks for: everything about
        # this attempt (its ranks, results, bill) is about this one.
        job = self.job.resized(gpus)
        if job is not self.job:
            early = None  # the agent started ahead was the full job's (it is never started for a resized one)
        submitted = time.time()
        attempt = _Attempt(job, self.book.begin_attempt(index, submitted, job.resources.gpus))
        try:
            checkpoint_before = self._latest_checkpoint()
            try:
                env = self._attempt_env(job, index, submitted)
            except BaseException:
                if early is not None:
                    early.discard()
                raise
            if early is not None:
                attempt.handle = early.start(env)
            else:
                placement = self.placement if job is self.job else None  # a resized attempt is placed anew
                attempt.handle = self.backend.submit(job, self.run_dir, index, env, placement=placement)
            attempt.streamer = LogStreamer(self.run_dir, index, job.world_size, job.log_ranks, self.out)
            end = self._watch(attempt, job_started)
            stopped_by = None
            if isinstance(end, EndJob):
                self._abandon(attempt, end.attempt_status, None)
                self.book.set_status(end.job_status)
                raise end.error
            if isinstance(end, Resize):
                self._abandon(attempt, AttemptStatus.RESIZED, None, cause=[end.why])
                attempt.resize_to = end.gpus
                report(end.why, self.out)
                attempt.outcome = AttemptResult(AttemptStatus.RESIZED)
                return attempt
            if isinstance(end, StopNow):
                if end.note:
                    report(end.note, self.out)
                self.backend.cancel(attempt.handle, job.policy.shutdown_grace)
                code, stopped_by = None, end.kind
            else:
                code = end
            attempt.streamer.finish()
            outcome = attempt.outcome = read_attempt(
                self.run_dir,
                index,
                job.world_size,
                job.policy,
                stopped_by=stopped_by,
                saved_checkpoint=lambda: self._latest_checkpoint() != checkpoint_before,
            )
            self._end_attempt(attempt, outcome.status, code, outcome)
            return attempt
        except KeyboardInterrupt:
            if attempt.record["ended_at"] is None:
                self._abandon(attempt, AttemptStatus.CANCELLED, None)
                self.book.set_status(JobStatus.CANCELLED)
            raise
        except BaseException as exc:
            # The backend (e.g. Spark giving up on busy GPUs), a callback, the run dir: whatever
            # broke, the ranks are stopped and the attempt is ended, so callbacks close their
            # books (the usage journal) instead of leaving it "running" forever.
            if attempt.record["ended_at"] is None:
                self._abandon(attempt, AttemptStatus.FAILED, exc)
            raise

    def _watch(self, attempt: _Attempt, job_started: float) -> int | StopNow | EndJob | Resize:
        """Polls the attempt, asking its monitors at every poll, until it ends or a decision ends the watch.

        Returns:
            The ranks' exit code when they ended by themselves; else the monitor's decision that
            ends the watch (applied by the caller).
        """
        job, handle, streamer = attempt.job, attempt.handle, attempt.streamer
        assert streamer is not None
        monitors = attempt_monitors(
            job,
            self.job,
            self.backend,
            self.callbacks,
            self.elastic,
            self._cancel_requested,
            str(self.run_dir.logs_dir(attempt.index)),
        )
        ranks_started: float | None = None  # monotonic
        next_start_check = time.monotonic()
        while (code := self.backend.poll(handle)) is None:
            streamer.pump()
            now = time.monotonic()
            if ranks_started is None and now >= next_start_check:
                next_start_check = now + 1.0
                ranks_started = self._ranks_started(attempt)
            view = AttemptView(
                attempt=attempt.index,
                gpus=job.resources.gpus,
                now=now,
                job_seconds=now - job_started,
                waited=time.time() - attempt.record["submitted_at"],
                ran=None if ranks_started is None else now - ranks_started,
                asked=attempt.asked,
                asked_at=attempt.asked_at,
            )
            for monitor in monitors:
                decision = monitor.check(view)
                if decision is CONTINUE:
                    continue
                if isinstance(decision, Resize) and self._ranks_started(attempt) is not None:
                    continue  # they started after all, since the view was taken: nothing to withdraw
                if isinstance(decision, ENDING):
                    return decision
                if isinstance(decision, AskToStop):
                    self._ask_to_stop(attempt, decision, now)
                    view = dataclasses.replace(view, asked=attempt.asked, asked_at=attempt.asked_at)
                elif isinstance(decision, AskToCheckpoint):
                    self._ask_to_checkpoint(attempt.index, decision.why)
            time.sleep(_POLL_SECONDS)
        if ranks_started is None:
            self._ranks_started(attempt)  # they may have started and ended between two checks
        return code

    def _cancel_requested(self) -> bool:
        return self.cancel_event.is_set() or self.run_dir.read_control(self.run_dir.cancel_request_file) is not None

    def _ranks_started(self, attempt: _Attempt) -> float | None:
        """Records when the attempt's ranks started, once known; returns it on the monotonic clock."""
        record = attempt.record
        started_at = record["started_at"]
        if started_at is None:
            backend = self.backend
            started = (
                backend.ranks_started_at(attempt.handle)
                if isinstance(backend, DeferredStart)
                else record["submitted_at"]
            )
            if started is None:
                return None
            started_at = min(started, time.time())
            self.book.ranks_started(record, started_at)
            for callback in self.callbacks:
                callback.on_ranks_started(attempt.job, attempt.index, started_at)
        return time.monotonic() - (time.time() - started_at)

    def _ask_to_checkpoint(self, attempt: int, why: str) -> None:
        stop_file = self.run_dir.file(RunLayout.stop(attempt))
        if self.run_dir.read_control(stop_file) is None:  # a policy's reason, already there, says more
            self.run_dir.write_control(stop_file, f"{why}\n".encode())

    def _ask_to_stop(self, attempt: _Attempt, ask: AskToStop, now: float) -> None:
        """Writes the reason into the attempt's stop file (ranks then checkpoint and stop) and tells the caller."""
        if ask.kind is StoppedBy.POLICY:
            self.book.set_stop_reason(ask.reason)
        attempt.asked, attempt.why, attempt.asked_at = ask.kind, ask.reason, now
        self.run_dir.write_control(self.run_dir.file(RunLayout.stop(attempt.index)), (ask.reason + "\n").encode())
        report(
            f"asking every rank to checkpoint and stop within checkpoint_grace "
            f"({self.job.policy.checkpoint_grace:g}s){ask.said}",
            self.out,
        )

    def _abandon(
        self, attempt: _Attempt, status: AttemptStatus, exc: BaseException | None, cause: list[str] | None = None
    ) -> None:
        """Stops and ends an attempt that an exception or a monitor interrupted, recording the
        exception (else ``cause``) as its cause."""
        cause = [f"{type(exc).__name__}: {exc}"] if exc is not None else list(cause or [])
        if attempt.handle is not None:
            try:
                self.backend.cancel(attempt.handle, self.job.policy.shutdown_grace)
            except Exception as cancel_exc:  # the original error is what the caller must see
                cause.append(f"stopping the ranks failed too: {type(cancel_exc).__name__}: {cancel_exc}")
                report(
                    f"could not stop attempt {attempt.index}'s ranks ({cancel_exc}); they may still be running",
                    self.out,
                )
            try:
                self._ranks_started(attempt)  # bill what ran before the error, if anything did
            except Exception as start_exc:
                cause.append(f"when its ranks started is unknown: {type(start_exc).__name__}: {start_exc}")
        if attempt.streamer is not None:
            try:
                attempt.streamer.finish()
            except OSError as log_exc:
                cause.append(f"reading the ranks' logs failed: {log_exc}")
        self._end_attempt(attempt, status, None, cause=cause, error=exc)

    def _end_attempt(
        self,
        attempt: _Attempt,
        status: AttemptStatus,
        code: int | None,
        outcome: AttemptResult | None = None,
        cause: Sequence[str] = (),
        error: BaseException | None = None,
    ) -> None:
        causes = list(cause)
        report_ = outcome.report if outcome is not None else None
        lost = report_.lost if report_ is not None and outcome is not None and outcome.lost else []
        if lost:
            assert outcome is not None
            causes.append(outcome.lost)
        if outcome is not None and outcome.failures:
            causes += [f"rank {f.rank}: {f.exc_type or 'exit'}: {f.message}" for f in outcome.failures]
        started_at, ended_at = self.book.end_attempt(
            attempt.record, status, code, causes, lost_at=report_.lost_at if report_ else None, lost=lost
        )
        if error is None and outcome is not None:
            error = outcome.root_exception
        job = attempt.job
        for callback in self.callbacks:
            callback.after_attempt(
                job,
                AttemptOutcome(
                    attempt=attempt.index,
                    status=status,
                    started_at=started_at,
                    ended_at=ended_at,
                    gpus=job.resources.gpus,
                    gpu_type=self.job.resources.gpu_type or "",
                    error=error,
                    cause=outcome.lost if outcome is not None else "",
                ),
            )

    def _latest_checkpoint(self) -> tuple[int, float] | None:
        return latest_checkpoint(self.backend.checkpoint_dir(self.run_dir), self.key, self.job.job_id, self.out)
