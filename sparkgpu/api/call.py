"""Async calls: ``fn.submit(...)`` returns a :class:`DistributedFunctionCall` at once; :func:`attach` finds it again.

```python
call = train.submit(epochs=3)      # validated and started; returns at once
call.status()                      # JobStatus.RUNNING
call.logs(follow=True)             # streams every rank's output until the job ends
results = call.result()            # per-rank results, or the error .distributed() raises

call = sparkgpu.attach(job_id)     # from another process or notebook
call.cancel()                      # stops the ranks wherever the job is supervised
```

A submitted job is supervised by processes of its own (:mod:`~sparkgpu.launch.client.detached`:
a keeper in its own session runs the :class:`~sparkgpu.launch.client.supervisor.Supervisor`
and replaces it should it die), not by the caller: the caller only observes, through the job's
run dir (``state.json``, the logs, a cancel request). A script that submits and exits, a killed
notebook, a closed terminal change nothing for the job; ``attach`` from any process of the
machine finds it again. A job supervised by its caller instead (``.distributed()`` without
``detach=True``, or a backend given as an object, which another process cannot rebuild) runs in
a background thread of that caller, and an interpreter that exits normally cancels those jobs.

When the process that supervises a job is gone for good (its keeper too: both killed, or
the machine rebooted) and the job has not ended, :func:`attach` takes the supervision over as
``sparkgpu resume`` does: the next attempt starts from the latest checkpoint, under a new
keeper for a job that was detached.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from sparkgpu._util.report import console, report
from sparkgpu.errors import (
    CallNotFinishedError,
    ConfigurationError,
    JobCancelledError,
    JobStateError,
    JobTimeoutError,
    PolicyViolationError,
    SparkGPUError,
)
from sparkgpu.launch.client.attempt_verdict import read_attempt
from sparkgpu.launch.client.detached import Keeper, keeper_alive, start_keeper, supervision_record
from sparkgpu.rundir.keyring import load_key
from sparkgpu.launch.client.job_state import JobBook
from sparkgpu.launch.client.logs import LogStreamer
from sparkgpu.launch.client.resume import client_is_gone, find_run_dir, take_over
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.states import AttemptStatus, JobState, JobStatus
from sparkgpu.launch.client.supervision_lock import SupervisionLock
from sparkgpu.launch.client.supervisor import CANCEL_REQUEST_FILE, Supervisor, cancel_abandoned
from sparkgpu.spec import JobSpec

__all__ = ["DistributedFunctionCall", "attach", "collect_outputs_or_raise"]

_POLL_SECONDS = 0.25
#: Seconds past the job's shutdown grace that exiting waits for a cancelled job's supervisor.
_EXIT_MARGIN = 30.0

#: job id -> the call whose thread supervises that job in this process
_supervised: dict[str, "DistributedFunctionCall"] = {}
_supervised_lock = threading.Lock()
_exit_hook_registered = False


class _Discard(io.TextIOBase):
    """Where a background job's live output goes: it stays in the run dir for ``DistributedFunctionCall.logs``."""

    def write(self, text: str) -> int:
        return len(text)


class DistributedFunctionCall:
    """A distributed call that runs in the background: one job, supervised here or elsewhere.

    Built by ``fn.submit(...)`` (this process supervises the job) or :func:`attach` /
    :meth:`from_job_id` (this process observes it, or takes its supervision over when its
    client is gone). Every method is safe to call from any thread.

    Attributes:
        job_id: The job's id (``sparkgpu jobs`` lists it; ``attach`` takes it).
        run_dir: The job's run directory.
    """

    def __init__(self, job_id: str, run_dir: RunDir, backend=None):
        self.job_id = job_id
        self.run_dir = run_dir
        self._backend = backend  # where a take-over runs the job; its own backend by default
        self._spec = JobSpec.from_dict(json.loads(run_dir.spec_file.read_text()))
        self._supervisor: Supervisor | None = None
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._results: list[Any] | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        # Held while this process supervises the job: two attaching processes never both take
        # over a job whose client is gone, nor one beside `sparkgpu resume`.
        self._supervision = SupervisionLock(run_dir)

    def __repr__(self) -> str:
        role = "supervised here" if self._supervisor is not None else "observed"
        return f"<DistributedFunctionCall {self.job_id} {self.status().value} ({role})>"

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_job_id(cls, job_id: str, backend=None) -> "DistributedFunctionCall":
        """The call of ``job_id``: see :func:`attach`."""
        return attach(job_id, backend=backend)

    @classmethod
    def _detach(cls, run_dir: RunDir, keeper: Keeper | None = None) -> "DistributedFunctionCall":
        """Hands the job written in ``run_dir`` (its key on it) to ``keeper``, or to a keeper started
        now, and returns its observing call."""
        if keeper is not None:
            keeper.hand(run_dir)
        else:
            start_keeper(run_dir)
        return cls(run_dir.job_id, run_dir)

    @classmethod
    def _supervise(cls, supervisor: Supervisor) -> "DistributedFunctionCall":
        """Starts ``supervisor`` in a background thread of this process and returns its call."""
        call = cls(supervisor.job.job_id, supervisor.run_dir)
        call._start(supervisor)
        return call

    def _lock_supervision(self) -> bool:
        """Takes the run dir's supervision lock for this process; False if another process holds it."""
        return self._supervision.acquire()

    def _unlock_supervision(self) -> None:
        self._supervision.release()

    def _start(self, supervisor: Supervisor) -> None:
        global _exit_hook_registered
        if not self._lock_supervision():
            raise JobStateError(
                f"job {self.job_id} is already supervised by {self._supervision.holder()}; attach() to it"
            )
        supervisor.lock = self._supervision
        supervisor.out = _Discard()
        self._supervisor = supervisor
        self._thread = threading.Thread(
            target=self._run, args=(supervisor,), daemon=True, name=f"sparkgpu-call-{self.job_id}"
        )
        with _supervised_lock:
            _supervised[self.job_id] = self
            if not _exit_hook_registered:
                atexit.register(_cancel_at_exit)
                _exit_hook_registered = True
        self._thread.start()

    def _run(self, supervisor: Supervisor) -> None:
        try:
            self._results = supervisor.run()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever calls result()
            self._error = exc
        finally:
            with _supervised_lock:
                _supervised.pop(self.job_id, None)
            self._unlock_supervision()
            self._done.set()

    # -- reading the job -------------------------------------------------------------------
    def _state(self) -> JobState | None:
        if self._supervisor is not None:
            return self._supervisor.state  # live, written by the supervising thread: read it, never copy it
        try:
            return json.loads(self.run_dir.state_file.read_text())
        except FileNotFoundError:
            return None  # staged; its client has not started the first attempt yet

    def status(self) -> JobStatus:
        """The job's status now: pending, running, or how it ended."""
        state = self._state()
        return JobStatus(state["status"]) if state else JobStatus.PENDING

    def done(self) -> bool:
        """True once the job has ended, however it ended, and its supervisor is done with it
        (its MLflow run ended, its model registered)."""
        return self._done.is_set() if self._thread is not None else self._ended(self._state())

    @staticmethod
    def _ended(state: JobState | None) -> bool:
        if not state or not JobStatus(state["status"]).is_terminal:
            return False
        # Its supervisor marks it finished after its callbacks; one that died before has nothing more to do.
        return state.get("finished_at") is not None or client_is_gone(state.get("client"))

    def wait(self, timeout: float | None = None) -> JobStatus:
        """Blocks until the job ends or ``timeout`` seconds pass; returns its status then.

        An observed job whose client dies meanwhile is taken over, as by :func:`attach`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._thread is not None:
                self._done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                return self.status()
            state = self._state()
            status = JobStatus(state["status"]) if state else JobStatus.PENDING
            if self._ended(state):
                return status
            if self._take_over_if_abandoned():
                continue
            if deadline is not None and time.monotonic() >= deadline:
                return status
            time.sleep(_POLL_SECONDS if deadline is None else max(0.0, min(_POLL_SECONDS, deadline - time.monotonic())))

    def result(self, timeout: float | None = None) -> list[Any]:
        """The per-rank results, once the job has ended.

        Args:
            timeout: Seconds to wait; ``None`` waits for as long as the job runs.

        Returns:
            One return value per rank, ordered by rank.

        Raises:
            CallNotFinishedError: ``timeout`` passed first; the job runs on.
            WorkerFailedError, JobTimeoutError, PolicyViolationError, ...: the job failed,
                as ``.distributed()`` raises it (from another process: rebuilt from the run dir).
            JobCancelledError: the job was cancelled.
        """
        status = self.wait(timeout)
        if not self.done():
            raise CallNotFinishedError(
                f"job {self.job_id} is still {status.value} after {timeout:g}s; call result() again, or cancel() it"
            )
        if self._thread is not None:
            if self._error is not None:
                raise self._error
            assert self._results is not None  # the thread ended without an error: it set them
            return self._results
        return self._outcome(status)

    def _outcome(self, status: JobStatus) -> list[Any]:
        """The result, or the error, of a job that ended in another process, read from its run dir."""
        state: Mapping[str, Any] = self._state() or {}
        attempts = state.get("attempts") or []
        last = attempts[-1] if attempts else {}
        cause = "; ".join(last.get("cause") or ()) or state.get("cause") or "no cause was recorded"
        logs = self.run_dir.logs_dir(last.get("attempt", 0))
        if status is JobStatus.SUCCEEDED:
            signed = RunDir(self.run_dir.path, load_key(self.job_id))
            # An elastic job may end on fewer ranks than it asked for: one result per rank of the last attempt.
            ranks = last.get("gpus", self._spec.world_size)
            return [signed.read_result(last["attempt"], rank) for rank in range(ranks)]
        if status is JobStatus.CANCELLED:
            raise JobCancelledError(f"job {self.job_id} was cancelled; its ranks were stopped. Logs: {logs}")
        if status is JobStatus.TIMED_OUT:
            raise JobTimeoutError(
                f"job {self.job_id} ran longer than its timeout ({self._spec.policy.timeout}s) "
                f"and was stopped; raise timeout= (or SPARKGPU_TIMEOUT). Logs: {logs}"
            )
        if status is JobStatus.STOPPED:
            raise PolicyViolationError(
                f"job {self.job_id} was stopped by a usage policy: "
                f"{state.get('stop_reason') or cause}; continue it with `sparkgpu resume "
                f"{self.job_id}` once the policy allows"
            )
        if last.get("exit_code") is not None or last.get("status") == AttemptStatus.FAILED:
            # Read back the way the supervisor that ran it did: same failures, same root cause.
            run_dir = RunDir(self.run_dir.path, load_key(self.job_id))
            ranks = last.get("gpus", self._spec.world_size)
            verdict = read_attempt(run_dir, last["attempt"], ranks, self._spec.policy)
            if verdict.failures:
                # The same error class the live call raised: `except ValueError` catches it here too.
                error = verdict.error(self.job_id, str(logs))
                raise error from verdict.root_exception
        raise SparkGPUError(f"job {self.job_id} failed: {cause}. Logs: {logs}")

    def logs(self, follow: bool = False, rank: int | None = None, out=None) -> str | None:
        """The job's rank logs, each line prefixed ``[rankN]``.

        Args:
            follow: Stream new lines to ``out`` until the job ends (following restarts into
                their new attempt) instead of returning what is there now.
            rank: Only this rank's log; every rank's by default.
            out: Where ``follow`` writes (this process's stdout by default).

        Returns:
            The latest attempt's logs so far, or ``None`` when following.
        """
        world = self._spec.world_size
        if rank is not None and not 0 <= rank < world:
            raise ConfigurationError(f"rank={rank}: job {self.job_id} has ranks 0..{world - 1}")
        ranks = None if rank is None else [rank]
        if not follow:
            text = io.StringIO()
            LogStreamer(self.run_dir, self._latest_attempt(), world, ranks, text).finish()
            return text.getvalue()
        self._follow_logs(out if out is not None else console(), ranks)
        return None

    def _follow_logs(self, out, ranks: Sequence[int] | None) -> None:
        """Streams the logs of ``ranks`` (every rank: ``None``) to ``out`` until the job ends."""
        world = self._spec.world_size
        attempt = self._latest_attempt()
        streamer = LogStreamer(self.run_dir, attempt, world, ranks, out)
        while True:
            streamer.pump()
            ended = self.done()  # read before the newest attempt: nothing starts after the end
            if (newest := self._latest_attempt()) > attempt:
                streamer.finish()
                attempt = newest
                out.write(f"--- attempt {attempt} ---\n")
                streamer = LogStreamer(self.run_dir, attempt, world, ranks, out)
                continue
            if ended:
                streamer.finish()
                return
            self._take_over_if_abandoned()
            time.sleep(_POLL_SECONDS)

    def _latest_attempt(self) -> int:
        state = self._state()
        attempts = (state.get("attempts") if state else None) or []
        return attempts[-1]["attempt"] if attempts else 0

    # -- control ---------------------------------------------------------------------------
    def cancel(self, timeout: float | None = None) -> JobStatus:
        """Stops the job's ranks and waits until they stopped; returns how the job ended.

        Cancels wherever the job is supervised: here directly, in another live client through
        a request in the run dir. A job that ended first keeps its status (``succeeded``, ...).

        Args:
            timeout: Seconds to wait for the job to end; ``None`` waits for as long as
                stopping its ranks takes (their shutdown grace, then SIGKILL).
        """
        if self._supervisor is not None:
            self._supervisor.cancel_event.set()
        elif not self.status().is_terminal:
            who = f"cancelled by pid {os.getpid()} on {socket.gethostname()}\n"
            self.run_dir.write_control(self.run_dir.cancel_request_file, who.encode())
        return self.wait(timeout)

    def _abandoned(self, state: JobState | None) -> bool:
        """Whether nobody supervises the job any more and nobody will: its supervisor and its keeper are gone."""
        if state is None:
            # Staged, never started: abandoned only if a keeper was started and died before its supervisor ran.
            return supervision_record(self.run_dir) is not None and not keeper_alive(self.run_dir)
        if JobStatus(state["status"]).is_terminal or not client_is_gone(state.get("client")):
            return False
        return not keeper_alive(self.run_dir)  # a live keeper starts the next supervisor itself

    def _take_over_if_abandoned(self) -> bool:
        """Takes the supervision of an observed job over when it is abandoned (:meth:`_abandoned`); True if it did.

        A job that was detached gets a new keeper; any other is supervised by this process from then on.
        """
        with self._lock:
            if self._thread is not None or not self._abandoned(self._state()):
                return False
            if not self._lock_supervision():
                return False  # another process is taking it over: observe that one
            try:
                state = self._state()  # as it is now that nobody else can take over
                if not self._abandoned(state):
                    self._unlock_supervision()
                    return False
                if state is not None and self.run_dir.read_control(self.run_dir.cancel_request_file) is not None:
                    _end_cancelled(self.run_dir, state)  # asked to stop: nothing to continue
                    self._unlock_supervision()
                    return True
                if supervision_record(self.run_dir) is not None and self._backend is None:
                    report(f"the supervisor of job {self.job_id} is gone; starting another, detached")
                    start_keeper(RunDir(self.run_dir.path, load_key(self.job_id)))
                    self._unlock_supervision()  # the new keeper's supervisor waits for it
                    return True
                report(f"the client of job {self.job_id} is gone; continuing it here from its latest checkpoint")
                self._start(take_over(self.job_id, backend=self._backend, lock=self._supervision))
            except BaseException:
                self._unlock_supervision()
                raise
            return True


def attach(job_id: str, backend=None) -> DistributedFunctionCall:
    """The :class:`DistributedFunctionCall` of a job started by ``submit`` or ``.distributed()``, here or in another process.

    While the job's client runs, the call observes it: ``status``, ``logs``, ``result`` (read
    from the run dir once the job ended) and ``cancel`` (a request the client acts on). When
    the client is gone and the job has not ended, this process takes the supervision over,
    as ``sparkgpu resume`` does: the next attempt starts from the latest checkpoint.

    Args:
        job_id: The job's id, as ``call.job_id``, ``fn.last_job_id`` or ``sparkgpu jobs`` show it.
        backend: Where to continue the job if this process takes it over: a backend name or
            instance (e.g. ``spark.gpu.backend()`` for a given session); the job's own by default.

    Raises:
        ConfigurationError: no such job under the staging root, or (when taking over) no
            signing key for it on this machine.
    """
    with _supervised_lock:
        own = _supervised.get(job_id)
    if own is not None:
        return own  # supervised by this very process: one supervisor per job
    if isinstance(backend, str):
        from sparkgpu.launch.backends.base import create_backend

        backend = create_backend(backend)
    run_dir = find_run_dir(job_id)
    call = DistributedFunctionCall(run_dir.job_id, run_dir, backend)
    call._take_over_if_abandoned()
    return call


def collect_outputs_or_raise(
    calls: DistributedFunctionCall | Sequence[DistributedFunctionCall], timeout: float | None = None
) -> Any:
    """Waits for one call or a sweep of calls and returns their per-rank results, or raises.

    Every call is waited for before anything is raised, so a sweep's failure never leaves its
    other jobs unobserved; the error raised is that of the first failed call in the order given.

    Args:
        calls: One call (``fn.distributed(...)`` with ``run_async=True``, ``fn.submit(...)``,
            :func:`attach`), or a list of them.
        timeout: Seconds to wait for all of them together; ``None`` waits as long as they run.

    Returns:
        For one call, its results (one per rank); for a list, a list of those, in order.

    Raises:
        CallNotFinishedError: ``timeout`` passed first; the jobs run on.
        WorkerFailedError, JobTimeoutError, JobCancelledError, ...: a job failed, as
            :meth:`DistributedFunctionCall.result` raises it.
    """
    if isinstance(calls, DistributedFunctionCall):
        return collect_outputs_or_raise([calls], timeout)[0]
    deadline = None if timeout is None else time.monotonic() + timeout
    for call in calls:
        call.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    unfinished = [call.job_id for call in calls if not call.done()]
    if unfinished:
        raise CallNotFinishedError(
            f"{len(unfinished)} of {len(calls)} jobs still run after {timeout:g}s ({', '.join(unfinished)}); "
            "collect them again, or cancel() them"
        )
    return [call.result() for call in calls]


def _end_cancelled(run_dir: RunDir, state: JobState) -> None:
    """Records that an abandoned job whose cancel was asked for is cancelled, without running it again."""
    cancel_abandoned(JobBook(run_dir.state_file, state))
    (run_dir.path / CANCEL_REQUEST_FILE).unlink(missing_ok=True)


def _cancel_at_exit() -> None:
    """Cancels the jobs this process still supervises, and waits (bounded) until their ranks stopped."""
    with _supervised_lock:
        calls = list(_supervised.values())
    for call in calls:
        report(f"cancelling job {call.job_id} at exit (attach() continues only jobs whose client was killed)")
        if call._supervisor is not None:  # always, for a call in _supervised
            call._supervisor.cancel_event.set()
    for call in calls:
        call._done.wait(call._spec.policy.shutdown_grace + _EXIT_MARGIN)
