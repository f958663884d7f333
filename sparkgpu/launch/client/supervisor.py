"""The client-side supervisor: an explicit state machine over attempts.

``PENDING -> RUNNING(attempt k) -> SUCCEEDED``; from ``RUNNING`` an attempt can also end
``PREEMPTED`` (ranks checkpointed at the runtime cap, or to give way to a critical job: a new
attempt resumes, no restart is used up; a job that gave way first waits for GPUs in the host's
queue, between two attempts, so the wait is not billed) or ``FAILED`` (the :class:`FailurePolicy` decides between a restart and raising).
An attempt stopped at the cap counts as preempted only when its ranks stopped for a restart
or it committed a new checkpoint; otherwise it failed, so a function that never checkpoints
cannot resume forever. ``TIMED_OUT``, ``CANCELLED`` and ``STOPPED`` (a usage policy's stop:
ranks get ``checkpoint_grace`` to checkpoint, then are stopped) are terminal. The state is
a small JSON file in the run dir (``state.json``), rewritten atomically after every
transition; its job and attempt states are :mod:`sparkgpu.protocol`'s.

An attempt's runtime cap and billed time start when its ranks start. A backend whose ranks
may start long after ``submit`` (Spark waiting for busy GPUs: a
:class:`~sparkgpu.launch.backends.capabilities.DeferredStart` one) says when through
``ranks_started_at(handle)``; its ranks then learn of the cap from the stop file. The backend's
other capabilities (a queue, preemption, elastic capacity) are used where it has them.
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
from sparkgpu._files import atomic_write_bytes
from sparkgpu._process import ProcessRef
from sparkgpu._report import console, report
from sparkgpu.callbacks import AttemptOutcome, JobCallback
from sparkgpu.errors import (
    CapacityError,
    EnvironmentMismatchError,
    JobCancelledError,
    JobStateError,
    JobTimeoutError,
    PayloadSignatureError,
    PolicyViolationError,
)
from sparkgpu.launch.backends.base import Backend
from sparkgpu.launch.backends.capabilities import DeferredStart, ElasticCapacity, Preemptible, QueuedCapacity
from sparkgpu.launch.client.attempt_result import AttemptResult, StoppedBy, read_attempt
from sparkgpu.launch.scheduling.elastic import ElasticPlan
from sparkgpu.launch.client.logs import LogStreamer
from sparkgpu.protocol import AttemptRecord, AttemptStatus, JobState, JobStatus
from sparkgpu._keyring import derive_key
from sparkgpu.launch.rundir.directory import RunDir
from sparkgpu.launch.client.supervision_lock import SupervisionLock
from sparkgpu.launch.rundir.layout import RunLayout
from sparkgpu.spec import JobSpec
from sparkgpu.store import Store
from sparkgpu.train import sealed_files
from sparkgpu.train.checkpoint_directory import CheckpointDirectory, SigningKey

__all__ = ["Supervisor", "JobStatus", "Decision", "FailurePolicy", "CANCEL_REQUEST_FILE"]

_POLL_SECONDS = 0.1

#: In the run dir: asks whichever process supervises the job to cancel it (its text says who asked).
CANCEL_REQUEST_FILE = RunLayout.CANCEL_REQUEST


class _Resized(Exception):
    """An elastic job's attempt waited ``elastic_wait`` for its GPUs: it goes on with ``gpus``."""

    def __init__(self, gpus: int, why: str):
        super().__init__(why)
        self.gpus = gpus


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
        #: Why the current attempt was asked to give way to a more urgent job, if it was.
        self._giving_way: str | None = None
        #: When and how an elastic job changes size (``min_gpus=``); ``None`` for a fixed one, and
        #: on a backend that cannot tell what is free (the job then waits for all its GPUs).
        self.elastic = (
            ElasticPlan(job, backend.available_gpus)
            if job.resources.elastic and isinstance(backend, ElasticCapacity)
            else None
        )
        #: GPUs of the next attempt: all the job's, unless an elastic attempt was withdrawn to go on with fewer.
        self._next_gpus = job.resources.gpus
        #: Why the current attempt was asked to stop to grow back to all its GPUs, if it was.
        self._growing: str | None = None
        #: The job as the current attempt runs it (resized, for an elastic job short of GPUs).
        self._attempt_job = job
        #: The job's supervision lock, when the caller took it (``attach``, ``resume``); else
        #: :meth:`run` takes its own for as long as it runs.
        self.lock: SupervisionLock | None = None
        self.state: JobState = {
            "job_id": job.job_id,
            "status": JobStatus.PENDING.value,
            "backend": backend.name,
            "attempts": [],
            "restarts": 0,
            "preemptions": 0,
            "created_at": time.time(),
        }

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> JobState:
        return json.loads(json.dumps(self.state))

    def load_state_dict(self, state: JobState) -> None:
        self.state = json.loads(json.dumps(state))

    def _save(self) -> None:
        atomic_write_bytes(self.run_dir.state_file, json.dumps(self.state, indent=2).encode())

    def _set_status(self, status: JobStatus) -> None:
        self.state["status"] = status.value
        self._save()

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
        job_started = time.monotonic()
        # Who drives the job: `sparkgpu jobs` shows a job whose client died as lost.
        # Its start time tells a recycled pid from the client itself.
        self.state["client"] = ProcessRef.current().record()  # type: ignore[typeddict-item]
        # Waiting for GPUs (in the host's or the cluster's queue, by priority) is no attempt's time:
        # nobody is billed. A job that gives up there ends failed, with nothing of it left in line.
        try:
            if isinstance(self.backend, QueuedCapacity):
                self.backend.await_capacity(self.job, None)
        except BaseException as exc:
            self._set_status(JobStatus.CANCELLED if isinstance(exc, KeyboardInterrupt) else JobStatus.FAILED)
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
        try:
            while True:
                attempt = len(self.state["attempts"])
                outcome = self._run_attempt(attempt, job_started, early)
                early = None
                if outcome.status is AttemptStatus.SUCCEEDED:
                    self._set_status(JobStatus.SUCCEEDED)
                    results = outcome.results
                    assert results is not None  # a succeeded attempt has every rank's result
                    return results
                if self.state.get("stop_reason"):
                    # A policy stop ends the job however the attempt ended: a restart would
                    # keep spending what the policy said is spent.
                    self._set_status(JobStatus.STOPPED)
                    error = PolicyViolationError(self._stop_message(outcome))
                    raise error from outcome.root_exception
                if outcome.status is AttemptStatus.RESIZED:
                    continue  # withdrawn before its ranks started: the next attempt runs on fewer GPUs
                if outcome.status is AttemptStatus.PREEMPTED:
                    self.state["preemptions"] += 1
                    if self._giving_way is not None:
                        self._wait_after_giving_way(self._giving_way, job_started)
                    continue
                decision = self.policy.decide(self.state["restarts"], outcome.exceptions)
                if decision is Decision.RESTART:
                    self.state["restarts"] += 1
                    self._save()
                    why = f": {outcome.lost}" if outcome.lost else ""
                    report(
                        f"attempt {attempt} failed{why}; restarting {self._restart_point()} "
                        f"(restart {self.state['restarts']} of {self.job.policy.max_restarts})",
                        self.out,
                    )
                    continue
                self._set_status(JobStatus.FAILED)
                logs = self.run_dir.logs_dir(attempt)
                error = outcome.error(self.job.job_id, str(logs))
                raise error from outcome.root_exception
        except BaseException as exc:
            error = error or exc
            if not JobStatus(self.state["status"]).is_terminal:
                self._set_status(JobStatus.CANCELLED if isinstance(exc, KeyboardInterrupt) else JobStatus.FAILED)
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
        self.state["waiting"] = {"since": time.time(), "reason": reason}
        self._save()
        report(f"job {self.job.job_id} checkpointed and gave way ({reason}); it resumes once GPUs come free", self.out)
        timeout = self.job.policy.timeout
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - job_started))
        try:
            backend.await_capacity(self.job, left if left is not None else float("inf"))
        except CapacityError as exc:
            self._set_status(JobStatus.TIMED_OUT)
            raise JobTimeoutError(
                f"job {self.job.job_id} gave way to a critical job and its timeout of {timeout:g}s ran out while "
                f"it waited for GPUs; continue it with `sparkgpu resume {self.job.job_id}`, or raise timeout="
            ) from exc
        self.state.pop("waiting", None)
        self._save()

    def _stop_message(self, outcome: AttemptResult) -> str:
        job_id, reason = self.job.job_id, self.state["stop_reason"]
        logs = self.run_dir.logs_dir(len(self.state["attempts"]) - 1)
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
        attempt = len(self.state["attempts"])
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

    def _run_attempt(self, attempt: int, job_started: float, early=None) -> AttemptResult:
        self._giving_way = self._growing = None
        # An elastic job's attempt may run on fewer GPUs than the job asks for: everything about
        # this attempt (its ranks, results, bill) is about this one.
        job = self._attempt_job = self.job.resized(self._next_gpus)
        self._next_gpus = self.job.resources.gpus
        if job is not self.job:
            early = None  # the agent started ahead was the full job's (it is never started for a resized one)
        submitted = time.time()
        # started_at: when the ranks started, the start of the billed time and of the cap.
        record: AttemptRecord = {
            "attempt": attempt,
            "submitted_at": submitted,
            "started_at": None,
            "ended_at": None,
            "status": AttemptStatus.RUNNING.value,
            "gpus": job.resources.gpus,
        }
        self.state["attempts"].append(record)
        self._set_status(JobStatus.RUNNING)
        handle = streamer = None
        try:
            checkpoint_before = self._latest_checkpoint()
            try:
                env = self._attempt_env(job, attempt, submitted)
            except BaseException:
                if early is not None:
                    early.discard()
                raise
            if early is not None:
                handle = early.start(env)
            else:
                placement = self.placement if job is self.job else None  # a resized attempt is placed anew
                handle = self.backend.submit(job, self.run_dir, attempt, env, placement=placement)
            streamer = LogStreamer(self.run_dir, attempt, job.world_size, job.log_ranks, self.out)
            code, stopped_by = self._watch(job, attempt, handle, streamer, record, job_started)
            streamer.finish()
            outcome = read_attempt(
                self.run_dir,
                attempt,
                job.world_size,
                job.policy,
                stopped_by=stopped_by,
                saved_checkpoint=lambda: self._latest_checkpoint() != checkpoint_before,
            )
            self._end_attempt(record, outcome.status, code, outcome)
            return outcome
        except _Resized as resized:
            self._abandon(record, handle, streamer, AttemptStatus.RESIZED, None, cause=[str(resized)])
            self._next_gpus = resized.gpus
            report(f"{resized}", self.out)
            return AttemptResult(AttemptStatus.RESIZED)
        except KeyboardInterrupt:
            if record["ended_at"] is None:
                self._abandon(record, handle, streamer, AttemptStatus.CANCELLED, None)
                self._set_status(JobStatus.CANCELLED)
            raise
        except BaseException as exc:
            # The backend (e.g. Spark giving up on busy GPUs), a callback, the run dir: whatever
            # broke, the ranks are stopped and the attempt is ended, so callbacks close their
            # books (the usage journal) instead of leaving it "running" forever.
            if record["ended_at"] is None:
                self._abandon(record, handle, streamer, AttemptStatus.FAILED, exc)
            raise

    def _watch(
        self, job: JobSpec, attempt: int, handle, streamer: LogStreamer, record: AttemptRecord, job_started: float
    ):
        """Polls the attempt (of ``job``, resized for this attempt) until it ends or a limit stops it.

        Returns:
            ``(exit code, stopped_by)``: the code is ``None`` and ``stopped_by`` a :class:`StoppedBy`
            when the supervisor stopped the ranks itself.

        Raises:
            _Resized: an elastic job's ranks waited ``elastic_wait`` for their GPUs and fewer are free.
        """
        policy = job.policy
        size = job.resources.gpus
        ranks_started: float | None = None  # monotonic
        next_start_check = next_policy_check = time.monotonic()
        stop_requested: float | None = None
        cap_signalled = False
        while (code := self.backend.poll(handle)) is None:
            streamer.pump()
            if self._cancel_requested():
                self._abandon(record, handle, streamer, AttemptStatus.CANCELLED, None)
                self._set_status(JobStatus.CANCELLED)
                raise JobCancelledError(
                    f"job {self.job.job_id} was cancelled; its ranks were stopped. Logs: "
                    f"{self.run_dir.logs_dir(attempt)}"
                )
            now = time.monotonic()
            if ranks_started is None and now >= next_start_check:
                next_start_check = now + 1.0
                ranks_started = self._ranks_started(handle, record)
            if policy.timeout is not None and now - job_started > policy.timeout:
                self._abandon(record, handle, streamer, AttemptStatus.TIMED_OUT, None)
                self._set_status(JobStatus.TIMED_OUT)
                raise JobTimeoutError(
                    f"job {self.job.job_id} ran longer than its timeout of {policy.timeout:g}s and was "
                    f"stopped; raise timeout= (or SPARKGPU_TIMEOUT), or checkpoint and set max_runtime= "
                    f"so it resumes. Logs: {self.run_dir.logs_dir(attempt)}"
                )
            if ranks_started is None:  # waiting for GPUs: nothing runs, nothing is spent
                if self.elastic is not None:
                    smaller = self.elastic.shrink_to(size, time.time() - record["submitted_at"], now)
                    if smaller is not None and self._ranks_started(handle, record) is None:
                        raise _Resized(
                            smaller,
                            f"attempt {attempt} waited {self.job.elastic_wait:g}s (elastic_wait) for {size} GPUs; going "
                            f"on from the latest checkpoint with the {smaller} free (min_gpus={self.elastic.minimum}), "
                            f"growing back to {self.elastic.target} at a checkpoint once they are free",
                        )
                time.sleep(_POLL_SECONDS)
                continue
            ran = now - ranks_started
            if now >= next_policy_check and stop_requested is None and not self.state.get("stop_reason"):
                next_policy_check = now + 1.0
                if (
                    self._check_stop(job, attempt, ran)
                    or self._check_preemption(attempt)
                    or self._check_growth(attempt, size, now)
                ):
                    stop_requested = now
            if stop_requested is not None and now - stop_requested > policy.checkpoint_grace:
                # Ranks that never call should_checkpoint() would otherwise run on until the cap
                # (7 days remotely). SIGTERM first: a Checkpointer takes it as a save request.
                report(
                    f"the ranks did not stop within checkpoint_grace ({policy.checkpoint_grace:g}s) "
                    f"of the request; stopping them (SIGTERM, SIGKILL after {policy.shutdown_grace:g}s)",
                    self.out,
                )
                self.backend.cancel(handle, policy.shutdown_grace)
                if self._giving_way is not None:
                    return None, StoppedBy.PRIORITY
                return None, StoppedBy.RESIZE if self._growing is not None else StoppedBy.POLICY
            if policy.max_runtime is not None:
                if (
                    not cap_signalled
                    and isinstance(self.backend, DeferredStart)
                    and ran >= policy.max_runtime - policy.checkpoint_grace
                ):
                    cap_signalled = True
                    self._ask_to_checkpoint(
                        attempt, f"the runtime cap of {policy.max_runtime:g}s is {policy.checkpoint_grace:g}s away"
                    )
                if ran > policy.max_runtime:
                    # Ranks had checkpoint_grace to checkpoint and stop; the cap is hard.
                    self.backend.cancel(handle, policy.shutdown_grace)
                    return None, StoppedBy.CAP
            time.sleep(_POLL_SECONDS)
        if ranks_started is None:
            self._ranks_started(handle, record)  # they may have started and ended between two checks
        return code, None

    def _cancel_requested(self) -> bool:
        return self.cancel_event.is_set() or self.run_dir.read_control(self.run_dir.cancel_request_file) is not None

    def _ranks_started(self, handle, record: AttemptRecord) -> float | None:
        """Records when the attempt's ranks started, once known; returns it on the monotonic clock."""
        started_at = record["started_at"]
        if started_at is None:
            backend = self.backend
            started = backend.ranks_started_at(handle) if isinstance(backend, DeferredStart) else record["submitted_at"]
            if started is None:
                return None
            started_at = record["started_at"] = min(started, time.time())
            self._save()
            for callback in self.callbacks:
                callback.on_ranks_started(self._attempt_job, record["attempt"], started_at)
        return time.monotonic() - (time.time() - started_at)

    def _ask_to_checkpoint(self, attempt: int, why: str) -> None:
        stop_file = self.run_dir.file(RunLayout.stop(attempt))
        if self.run_dir.read_control(stop_file) is None:  # a policy's reason, already there, says more
            self.run_dir.write_control(stop_file, f"{why}\n".encode())

    def _abandon(
        self,
        record: AttemptRecord,
        handle,
        streamer: LogStreamer | None,
        status: AttemptStatus,
        exc: BaseException | None,
        cause: list[str] | None = None,
    ) -> None:
        """Stops and ends an attempt that an exception interrupted, recording the exception (else
        ``cause``) as its cause."""
        cause = [f"{type(exc).__name__}: {exc}"] if exc is not None else list(cause or [])
        if handle is not None:
            try:
                self.backend.cancel(handle, self.job.policy.shutdown_grace)
            except Exception as cancel_exc:  # the original error is what the caller must see
                cause.append(f"stopping the ranks failed too: {type(cancel_exc).__name__}: {cancel_exc}")
                report(
                    f"could not stop attempt {record['attempt']}'s ranks ({cancel_exc}); they may still be running",
                    self.out,
                )
            try:
                self._ranks_started(handle, record)  # bill what ran before the error, if anything did
            except Exception as start_exc:
                cause.append(f"when its ranks started is unknown: {type(start_exc).__name__}: {start_exc}")
        if streamer is not None:
            try:
                streamer.finish()
            except OSError as log_exc:
                cause.append(f"reading the ranks' logs failed: {log_exc}")
        self._end_attempt(record, status, None, cause=cause, error=exc)

    def _check_stop(self, job: JobSpec, attempt: int, attempt_seconds: float) -> bool:
        """Asks the callbacks whether the job (``job``: as this attempt runs it) must stop; if so,
        asks the ranks to checkpoint."""
        for callback in self.callbacks:
            reason = callback.stop_reason(job, attempt, attempt_seconds)
            if reason:
                self.state["stop_reason"] = reason
                self._save()
                self._ask_to_stop(attempt, reason, f": {reason}")
                return True
        return False

    def _ask_to_stop(self, attempt: int, reason: str, said: str) -> None:
        """Writes ``reason`` into the attempt's stop file (ranks then checkpoint and stop) and tells
        the caller, ``said`` following "within checkpoint_grace (...)"."""
        self.run_dir.write_control(self.run_dir.file(RunLayout.stop(attempt)), (reason + "\n").encode())
        report(
            f"asking every rank to checkpoint and stop within checkpoint_grace "
            f"({self.job.policy.checkpoint_grace:g}s){said}",
            self.out,
        )

    def _check_preemption(self, attempt: int) -> bool:
        """Asks the ranks to checkpoint and stop when a genuine request of a critical job asks this
        best-effort job to give way (the backend judges it); the job's own decision, not the requester's."""
        if not isinstance(self.backend, Preemptible):
            return False
        reason = self.backend.preemption_request(self.job)
        if reason is None:
            return False
        self._giving_way = reason
        self._ask_to_stop(attempt, reason, f" to give way: {reason}; the job resumes by itself, using no restart")
        return True

    def _check_growth(self, attempt: int, size: int, now: float) -> bool:
        """Asks an elastic attempt on fewer GPUs than the job's to checkpoint and stop once all of
        them are free: the next attempt resumes on every GPU, using no restart."""
        if self.elastic is None or not self.elastic.grows(size, now):
            return False
        target = self.elastic.target
        self._growing = f"all {target} GPUs of the job are free again; growing back from {size}"
        self._ask_to_stop(
            attempt, self._growing, f": {self._growing}; the job resumes on {target} GPUs by itself, using no restart"
        )
        return True

    def _end_attempt(
        self,
        record: AttemptRecord,
        status: AttemptStatus,
        code: int | None,
        outcome: AttemptResult | None = None,
        cause: tuple[str, ...] | list[str] = (),
        error: BaseException | None = None,
    ):
        cause = tuple(cause)
        ended_at = record["ended_at"] = time.time()
        record["status"] = status.value
        record["exit_code"] = code
        started_at = record["started_at"]
        if started_at is None:
            started_at = record["started_at"] = ended_at  # its ranks never started: nothing ran, nothing is billed
        if outcome is not None and outcome.report is not None and outcome.lost:
            # Billed up to when the node was last seen alive, not to when the client noticed.
            lost_at = outcome.report.lost_at or ended_at
            ended_at = record["ended_at"] = max(started_at, min(ended_at, lost_at))
            record["lost"] = [dataclasses.asdict(n) for n in outcome.report.lost]
            cause += (outcome.lost,)
        if outcome is not None and outcome.failures:
            record["cause"] = (
                list(cause) + [f"rank {f.rank}: {f.exc_type or 'exit'}: {f.message}" for f in outcome.failures]
            )[:8]
        elif cause:
            record["cause"] = list(cause)[:8]
        self._save()
        if error is None and outcome is not None:
            error = outcome.root_exception
        for callback in self.callbacks:
            callback.after_attempt(
                self._attempt_job,
                AttemptOutcome(
                    attempt=record["attempt"],
                    status=status,
                    started_at=started_at,
                    ended_at=ended_at,
                    gpus=self._attempt_job.resources.gpus,
                    gpu_type=self.job.resources.gpu_type or "",
                    error=error,
                    cause=outcome.lost if outcome is not None else "",
                ),
            )

    # -- reading an attempt back -------------------------------------------------------
    def _latest_checkpoint(self) -> tuple[int, float] | None:
        """``(step, created)`` of the newest complete checkpoint in the job's checkpoint dir:
        a Checkpointer's, or a Trainer's sealed one (``created`` 0 for those)."""
        directory = self.backend.checkpoint_dir(self.run_dir)
        try:
            # Only markers sealed under this job's key count: a planted one would make a capped
            # attempt pass for a preemption, which uses up no restart.
            signing = SigningKey(derive_key(self.key, "checkpoints"), self.job.job_id)
            info = CheckpointDirectory(directory, key=signing).latest()
            store = Store(directory, what="the job's checkpoint store")
            sealed = sealed_files.latest_sealed(store.child(sealed_files.TRAINER_FOLDER), signing)
        except Exception as exc:  # unreadable (permissions, a store that is down: fsspec raises its own types)
            report(
                f"cannot read the checkpoints in {directory} ({exc}); an attempt stopped "
                "at the runtime cap counts as preempted only if its ranks stop for a restart",
                self.out,
            )
            return None
        found = [] if info is None else [(info.step, info.created)]
        if sealed is not None:
            found.append((sealed[0], 0.0))
        return max(found) if found else None

    def _restart_point(self) -> str:
        """Where the next attempt starts, for the restart message: the step of the newest checkpoint."""
        latest = self._latest_checkpoint()
        return "from the start: no checkpoint" if latest is None else f"from step {latest[0]}"
