"""Runs one attempt of a job: submits it, watches it with its monitors, and ends it.

The supervisor (:mod:`~sparkgpu.launch.client.supervisor`) decides what the job does once an
attempt ended; an :class:`AttemptRunner` runs each attempt up to that point. While it polls,
the attempt's monitors (:mod:`~sparkgpu.launch.client.monitors`) decide what happens to it: it
asks the ranks to checkpoint or stop (the stop file), stops them, resizes the attempt, or ends
the job at once. Whatever ends an attempt, the runner records the attempt's end in
``state.json`` (through the :class:`~sparkgpu.launch.client.job_state.JobBook`) and tells the
callbacks; it never moves the job's status. What happened comes back as data on the
:class:`Attempt` (its ``verdict``, ``resize_to``, ``ended_job``), and the supervisor decides
and writes the job's next status.

An attempt's runtime cap and billed time start when its ranks start: a
:class:`~sparkgpu.launch.backends.capabilities.DeferredStart` backend says when
(``ranks_started_at``), and its ranks learn of the cap from the stop file.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from sparkgpu import runtime
from sparkgpu._util.report import report
from sparkgpu.callbacks import AttemptOutcome, JobCallback
from sparkgpu.launch.backends.base import Backend
from sparkgpu.launch.backends.capabilities import DeferredStart, WatchedProgress
from sparkgpu.launch.client.attempt_verdict import AttemptVerdict, StoppedBy, read_attempt
from sparkgpu.launch.client.checkpoint_progress import latest_checkpoint
from sparkgpu.launch.client.job_state import JobBook
from sparkgpu.launch.client.logs import LogStreamer
from sparkgpu.launch.client.progress_watch import ProgressWatch
from sparkgpu.launch.client.stragglers import StragglerWatch
from sparkgpu.launch.rank import arrivals
from sparkgpu.config import settings
from sparkgpu.errors import PreflightError
from sparkgpu.failure_class import classify
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
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.launch.scheduling.elastic import ElasticPlan
from sparkgpu.rundir.states import AttemptRecord, AttemptStatus
from sparkgpu.spec import JobSpec

__all__ = ["Attempt", "AttemptRunner"]

_POLL_SECONDS = 0.1


@dataclasses.dataclass
class Attempt:
    """One attempt as the runner drives it."""

    job: JobSpec  # as this attempt runs it: resized, for an elastic job short of GPUs
    record: AttemptRecord
    handle: Any = None
    streamer: LogStreamer | None = None
    #: The stop asked of its ranks (a usage policy, giving way, growing back), why, and when (monotonic).
    asked: StoppedBy | None = None
    why: str = ""
    asked_at: float | None = None
    #: How it ended: read back from the run dir, or RESIZED with the GPUs of the next attempt.
    verdict: AttemptVerdict | None = None
    resize_to: int | None = None
    #: A monitor's end of the whole job (a cancel, the job's timeout): the supervisor sets its
    #: ``job_status`` and raises its ``error``; ``verdict`` is then ``None``.
    ended_job: EndJob | None = None

    @property
    def index(self) -> int:
        return self.record["attempt"]


class AttemptRunner:
    """Runs a job's attempts one at a time, with the supervisor's collaborators.

    Args:
        job: The job as asked for (an elastic job's attempt may run resized).
        run_dir: Its staged run directory.
        backend: Where attempts run.
        key: The job's signing key (to read its checkpoints' manifests).
        book: The job's ``state.json``.
        callbacks: Tracking, metering, ... hooks.
        out: Where the ranks' live output and the runner's reports go.
        placement: The backend's placement of the ranks, for an attempt of the full job.
        elastic: When and how an elastic job changes size; ``None`` for a fixed one.
        cancel_requested: Says whether someone asked to cancel the job.
    """

    def __init__(
        self,
        *,
        job: JobSpec,
        run_dir: RunDir,
        backend: Backend,
        key: bytes,
        book: JobBook,
        callbacks: Sequence[JobCallback],
        out: Any,
        placement: Any,
        elastic: ElasticPlan | None,
        cancel_requested: Callable[[], bool],
    ):
        self.job = job
        self.run_dir = run_dir
        self.backend = backend
        self.key = key
        self.book = book
        self.callbacks = list(callbacks)
        self.out = out
        self.placement = placement
        self.elastic = elastic
        self.cancel_requested = cancel_requested

    def prestart(self):
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
        found = settings()
        if found.straggler_factor and self.job.world_size > 1:  # each rank times its collectives for stragglers
            env[arrivals.LOOK_ENV] = repr(arrivals.look_seconds(found.straggler_window))
        if self.job.policy.max_runtime is not None and not isinstance(self.backend, DeferredStart):
            # Ranks start at submit here; elsewhere the runner writes the stop file in time.
            deadline = submitted + self.job.policy.max_runtime - self.job.policy.checkpoint_grace
            env[runtime.ENV_DEADLINE] = repr(deadline)
        return env

    def _attempt_env(self, job: JobSpec, attempt: int, submitted: float) -> dict[str, str]:
        env = self._base_env(attempt, submitted)
        for callback in self.callbacks:
            env.update(callback.before_attempt(job, attempt))
        return env

    def begin(self, index: int, gpus: int) -> Attempt:
        """Attempt ``index`` on ``gpus`` GPUs, added to the book: written with the job's ``RUNNING``,
        which the supervisor sets before it runs it (:meth:`run`)."""
        # An elastic job's attempt may run on fewer GPUs than the job asks for: everything about
        # this attempt (its ranks, results, bill) is about this one.
        job = self.job.resized(gpus)
        return Attempt(job, self.book.begin_attempt(index, time.time(), job.resources.gpus))

    def run(self, attempt: Attempt, job_started: float, early=None) -> Attempt:
        """Runs ``attempt`` (from :meth:`begin`) until it ends; its ``verdict`` says how, or its
        ``ended_job`` that a monitor ended the job. Moves no job status: the supervisor does."""
        job, index, submitted = attempt.job, attempt.index, attempt.record["submitted_at"]
        if job is not self.job:
            early = None  # the agent started ahead was the full job's (it is never started for a resized one)
        try:
            checkpoint_before = self.latest_checkpoint()
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
                attempt.ended_job = end
                return attempt
            if isinstance(end, Resize):
                self._abandon(attempt, AttemptStatus.RESIZED, None, cause=[end.why])
                attempt.resize_to = end.gpus
                report(end.why, self.out)
                attempt.verdict = AttemptVerdict(AttemptStatus.RESIZED)
                return attempt
            if isinstance(end, StopNow):
                if end.note:
                    report(end.note, self.out)
                self.backend.cancel(attempt.handle, job.policy.shutdown_grace)
                code, stopped_by = None, end.kind
            else:
                code = end
            attempt.streamer.finish()
            verdict = attempt.verdict = read_attempt(
                self.run_dir,
                index,
                job.world_size,
                job.policy,
                stopped_by=stopped_by,
                saved_checkpoint=lambda: self.latest_checkpoint() != checkpoint_before,
            )
            self._end_attempt(attempt, verdict.status, code, verdict)
            return attempt
        except KeyboardInterrupt:
            if attempt.record["ended_at"] is None:
                self._abandon(attempt, AttemptStatus.CANCELLED, None)
            raise  # the supervisor ends the job CANCELLED
        except BaseException as exc:
            # The backend (e.g. Spark giving up on busy GPUs), a callback, the run dir: whatever
            # broke, the ranks are stopped and the attempt is ended, so callbacks close their
            # books (the usage journal) instead of leaving it "running" forever.
            if attempt.record["ended_at"] is None:
                self._abandon(attempt, AttemptStatus.FAILED, exc)
            raise

    def _watch(self, attempt: Attempt, job_started: float) -> int | StopNow | EndJob | Resize:
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
            self.cancel_requested,
            str(self.run_dir.logs_dir(attempt.index)),
        )
        # 10 (monitors' docstring): hang detection, once the ranks started and while no stop was asked,
        # from where the backend says the ranks' progress is (this host's memory, node 0's state on Spark).
        source = (
            self.backend.progress_source(handle, self.run_dir) if isinstance(self.backend, WatchedProgress) else None
        )
        if source is not None:
            monitors.append(ProgressWatch(self.run_dir, job.world_size, job.policy.progress_timeout, source))
            found = settings()
            if found.straggler_factor and job.world_size > 1:  # 11: stragglers named, nothing stopped
                monitors.append(
                    StragglerWatch(
                        self.run_dir,
                        job,
                        job.world_size,
                        found.straggler_factor,
                        found.straggler_window,
                        source,
                        self.callbacks,
                        self.out,
                    )
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

    def _ranks_started(self, attempt: Attempt) -> float | None:
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
        if self.run_dir.read_control(stop_file) is None:  # a usage policy's reason, already there, says more
            self.run_dir.write_control(stop_file, f"{why}\n".encode())

    def _ask_to_stop(self, attempt: Attempt, ask: AskToStop, now: float) -> None:
        """Writes the reason into the attempt's stop file (ranks then checkpoint and stop) and tells the caller."""
        if ask.kind is StoppedBy.USAGE_POLICY:
            self.book.set_stop_reason(ask.reason)
        attempt.asked, attempt.why, attempt.asked_at = ask.kind, ask.reason, now
        self.run_dir.write_control(self.run_dir.file(RunLayout.stop(attempt.index)), (ask.reason + "\n").encode())
        report(
            f"asking every rank to checkpoint and stop within checkpoint_grace "
            f"({self.job.policy.checkpoint_grace:g}s){ask.said}",
            self.out,
        )

    def _abandon(
        self, attempt: Attempt, status: AttemptStatus, exc: BaseException | None, cause: list[str] | None = None
    ) -> None:
        """Stops and ends an attempt that an exception or a monitor interrupted, recording the
        exception (else ``cause``) as its cause."""
        cause = [f"{type(exc).__name__}: {exc}"] if exc is not None else list(cause or [])
        if isinstance(exc, PreflightError):  # refused at submit: the nodes it would need failed their check
            found = classify([], {attempt.index: exc})
            attempt.record["failure_class"], attempt.record["failure_detail"] = found.cls.value, found.detail
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
        attempt: Attempt,
        status: AttemptStatus,
        code: int | None,
        verdict: AttemptVerdict | None = None,
        cause: Sequence[str] = (),
        error: BaseException | None = None,
    ) -> None:
        causes = list(cause)
        report_ = verdict.report if verdict is not None else None
        lost = report_.lost if report_ is not None and verdict is not None and verdict.lost else []
        if lost:
            assert verdict is not None
            causes.append(verdict.lost)
        if verdict is not None and verdict.failures:
            causes += [f"rank {f.rank}: {f.exc_type or 'exit'}: {f.message}" for f in verdict.failures]
        started_at, ended_at = self.book.end_attempt(
            attempt.record, status, code, causes, lost_at=report_.lost_at if report_ else None, lost=lost
        )
        if error is None and verdict is not None:
            error = verdict.root_exception
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
                    cause=verdict.lost if verdict is not None else "",
                ),
            )

    def latest_checkpoint(self) -> tuple[int, float] | None:
        return latest_checkpoint(self.backend.checkpoint_dir(self.run_dir), self.key, self.job.job_id, self.out)
