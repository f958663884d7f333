"""The client's verdict on how an attempt ended, read back from the run dir: :class:`AttemptVerdict`
and :func:`read_attempt`.

The supervisor reads each attempt this way when its launchers are done, and a later
``attach(job_id).result()`` reads a finished job's last attempt the same way, so both raise the
same error with the same root cause. Three records say how an attempt ended, each its own
thing: the backend's :class:`~sparkgpu.launch.client.attempt_report.AttemptReport` (its
``report.json``: how each node ended, as the backend saw it) is one input of the verdict; the
verdict (the status, each rank's result or failure) decides the supervisor's next step; the
callbacks hear it as a :class:`~sparkgpu.callbacks.AttemptOutcome` (the status, the times, the
GPUs billed).
"""

from __future__ import annotations

import dataclasses
import enum
import signal
from collections.abc import Callable
from typing import Any

from sparkgpu.errors import NodeLostError, PreflightError, RankFailure, first_failure, worker_failed_error
from sparkgpu.failure_class import OOM_KILLED
from sparkgpu.launch.client.attempt_report import AttemptReport
from sparkgpu.launch.client.hang_record import HangRecord
from sparkgpu.rundir.exit_codes import EXIT_PREEMPTED
from sparkgpu.rundir.states import AttemptStatus, RankExit
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout

__all__ = ["AttemptVerdict", "StoppedBy", "read_attempt"]


class StoppedBy(enum.Enum):
    """Why the supervisor stopped an attempt's ranks itself."""

    CAP = "cap"  # the attempt reached its runtime cap (max_runtime)
    USAGE_POLICY = "policy"  # a usage policy asked it to stop, and checkpoint_grace passed
    PRIORITY = "priority"  # it was asked to give way to a critical job, and checkpoint_grace passed
    RESIZE = "resize"  # an elastic job was asked to stop to grow back to all its GPUs, and checkpoint_grace passed
    HANG = "hang"  # its ranks made no progress for progress_timeout (launch.client.progress_watch)


@dataclasses.dataclass
class AttemptVerdict:
    """How one attempt ended, judged from what its ranks, launchers and backend left in the run dir."""

    status: AttemptStatus  # SUCCEEDED, PREEMPTED, FAILED or STOPPED (by a usage policy, without a checkpoint)
    #: A succeeded attempt's results, one per rank, signature-checked but not unpickled (:meth:`results`).
    result_payloads: list[memoryview] | None = None
    failures: list[RankFailure] = dataclasses.field(default_factory=list)
    exceptions: dict[int, BaseException] = dataclasses.field(default_factory=dict)
    report: AttemptReport | None = None  # the backend's account of its nodes, when it wrote one

    def results(self) -> list[Any]:
        """The succeeded attempt's results, one per rank, unpickled here (which imports what they need)."""
        import cloudpickle

        assert self.result_payloads is not None, "only a succeeded attempt has results"
        return [cloudpickle.loads(payload) for payload in self.result_payloads]

    @property
    def lost(self) -> str:
        """``"executor 1 on host h was lost (...)"`` when the backend lost a node of the attempt, else ``""``."""
        return self.report.lost_message() if self.report is not None and self.report.lost else ""

    def error(self, job_id: str, logs_dir: str):
        """The error a failed attempt raises on the client (the live call and ``attach(...).result()`` alike)."""
        if self.lost:
            return NodeLostError(self.failures, job_id, logs_dir, lost=self.lost)
        return worker_failed_error(self.failures, self.exceptions, job_id, logs_dir)

    @property
    def root_exception(self) -> BaseException | None:
        """The unpickled exception of the rank that failed first, when it unpickles."""
        if not self.failures:
            return None
        return self.exceptions.get(first_failure(self.failures).rank)


def _bad_nodes(report: AttemptReport, exceptions: dict) -> AttemptVerdict:
    """The verdict on an attempt whose nodes did not start because some failed their pre-flight
    check: a :class:`~sparkgpu.errors.PreflightError` for the ranks of each (rank 0 for one that
    held no node), which another executor can replace (the backend raises at the next submit when
    none can). The other nodes' ranks, which never started, are no failure of their own."""
    bad: list[RankFailure] = []
    for node in report.bad:
        message = f"{node.where} failed its pre-flight check: {node.cause}"
        for rank in node.ranks or [0]:
            bad.append(RankFailure(rank, f"{PreflightError.__module__}.{PreflightError.__qualname__}", message))
            exceptions.setdefault(rank, PreflightError(message, replaceable=True))
    return AttemptVerdict(AttemptStatus.FAILED, failures=bad, exceptions=exceptions, report=report)


def read_attempt(
    rd: RunDir,
    attempt: int,
    world_size: int,
    run_policy,
    *,
    stopped_by: StoppedBy | None = None,
    saved_checkpoint: Callable[[], bool] | None = None,
) -> AttemptVerdict:
    """How attempt ``attempt`` ended, from what its ranks, launchers and backend left in the run dir.

    Args:
        rd: The job's run dir.
        attempt: The attempt to read.
        world_size: The job's ranks.
        run_policy: The job's :class:`~sparkgpu.spec.RunPolicy` (its cap names the fix when an attempt
            stopped at the cap had not checkpointed).
        stopped_by: Why the supervisor stopped the attempt, when it did; else ``None``.
        saved_checkpoint: Whether the attempt committed a new checkpoint; asked only for an
            attempt the supervisor stopped whose ranks did not stop for a restart.

    A rank's result, error or preemption marker is its own account; a rank that left none is
    judged from its launcher's exit record, then from the backend's :class:`AttemptReport`
    (a lost node names the cause before its peers' errors), then from node 0's launcher log.
    """
    results: dict[int, memoryview] = {}
    failures: list[RankFailure] = []
    exceptions: dict[int, BaseException] = {}
    preempted, silent = [], []
    for rank in range(world_size):
        if rd.file(RunLayout.result(attempt, rank)).exists():
            results[rank] = rd.read_result_payload(attempt, rank)  # checked; unpickled by whoever uses it
        elif rd.file(RunLayout.error(attempt, rank)).exists():
            failure, exc = rd.read_error(attempt, rank)
            failures.append(failure)
            if exc is not None:
                exceptions[rank] = exc
        elif rd.file(RunLayout.preempted(attempt, rank)).exists():
            preempted.append(rank)
        else:
            silent.append(rank)
    exits = rd.read_node_exits(attempt)
    report = AttemptReport.read(rd.file(RunLayout.attempt(attempt)))
    if stopped_by is StoppedBy.HANG and len(results) < world_size:
        unfinished = [r for r in range(world_size) if r not in results]
        hang = HangRecord.read(rd, attempt) or HangRecord.unrecorded(
            unfinished, str(rd.file(RunLayout.hang_stacks(attempt)))
        )
        # What the ranks wrote once they were killed (a peer left the collective) follows from the hang.
        hung, hung_exceptions = hang.failures()
        return AttemptVerdict(AttemptStatus.FAILED, failures=hung, exceptions=hung_exceptions, report=report)
    own_failure = bool(failures) or any(
        i.exitcode not in (EXIT_PREEMPTED, -signal.SIGTERM) for r, i in exits.items() if r in silent
    )
    # A rank that stopped for a restart ends its node's ranks: torch's agent stops the others with
    # SIGTERM, which can reach one a moment before it stops for the restart itself.
    restarting = bool(preempted) or any(i.exitcode == EXIT_PREEMPTED for r, i in exits.items() if r in silent)
    for rank in silent:
        info = exits.get(rank)
        if info is None:
            continue  # stopped by the agent because another rank failed
        if info.exitcode == EXIT_PREEMPTED:
            preempted.append(rank)  # stopped for a restart; its marker may be lost with the node
            continue
        if (own_failure or restarting) and info.exitcode == -signal.SIGTERM:
            continue  # torn down after another rank failed or stopped for a restart: not a failure of its own
        if stopped_by and info.exitcode in (-signal.SIGTERM, -signal.SIGKILL):
            continue  # the supervisor stopped it (cap or usage policy): judged below
        failures.append(
            RankFailure(
                rank,
                None,
                _describe_exit(info),
                exitcode=info.exitcode,
                log_tail=rd.log_tail(attempt, rank),
                timestamp=info.time,  # when it exited: a quiet exit is the cause of its peers' errors
            )
        )
    if report is not None and report.lost:
        # The lost node's ranks are silent; the others' errors (a peer left the collective) follow from it.
        lost = [
            RankFailure(rank, None, f"{node.where} was lost: {node.cause}", timestamp=report.lost_at)
            for node in report.lost
            for rank in node.ranks
        ]
        lost_ranks = {f.rank for f in lost}
        return AttemptVerdict(
            AttemptStatus.FAILED,
            failures=lost + [f for f in failures if f.rank not in lost_ranks],
            exceptions=exceptions,
            report=report,
        )
    if report is not None and report.bad and not results:
        # No rank started: the nodes that failed their pre-flight check are the cause.
        return _bad_nodes(report, exceptions)
    if failures:
        return AttemptVerdict(AttemptStatus.FAILED, failures=failures, exceptions=exceptions, report=report)
    if len(results) == world_size:
        return AttemptVerdict(AttemptStatus.SUCCEEDED, result_payloads=[results[r] for r in range(world_size)])
    if preempted:
        return AttemptVerdict(AttemptStatus.PREEMPTED)
    if stopped_by:
        # Stopped at the cap: resuming makes sense only if this attempt saved progress;
        # otherwise the next attempt would do the same work again, forever.
        if saved_checkpoint is not None and saved_checkpoint():
            return AttemptVerdict(AttemptStatus.PREEMPTED)
        if stopped_by in (StoppedBy.PRIORITY, StoppedBy.RESIZE):
            # Its work since the latest checkpoint is lost, but giving way is no failure of its own.
            return AttemptVerdict(AttemptStatus.PREEMPTED)
        if stopped_by is StoppedBy.USAGE_POLICY:
            return AttemptVerdict(AttemptStatus.STOPPED)
        message = _not_checkpointed_message(run_policy)
        return AttemptVerdict(
            AttemptStatus.FAILED,
            failures=[
                RankFailure(r, None, message, log_tail=rd.log_tail(attempt, r))
                for r in range(world_size)
                if r not in results
            ],
        )
    missing = silent or list(range(world_size))
    if any(rd.read_control(path) is not None for path in rd.node_exit_files(attempt).values()):
        # Launchers recorded the attempt but no exit of these ranks: an exit with code 0
        # that could not be watched, or a node whose launcher was lost.
        return AttemptVerdict(
            AttemptStatus.FAILED,
            failures=[
                RankFailure(
                    r,
                    None,
                    "the process ended without returning a result or raising an exception, and "
                    "its launcher recorded no failure for it (an exit with code 0, as after os._exit(0), "
                    "or its node's launcher was lost)",
                    log_tail=rd.log_tail(attempt, r),
                )
                for r in missing
            ],
        )
    # No launcher recorded anything: it failed itself (bad interpreter, port clash, ...).
    agent_log = rd.file(RunLayout.agent_log(attempt, 0))
    tail = "\n".join(agent_log.read_text(errors="replace").splitlines()[-30:]) if agent_log.exists() else ""
    if report is not None and report.notes:  # what the backend knows that no launcher could write
        tail = "\n".join([*(f"sparkgpu: {note}" for note in report.notes), tail])
    return AttemptVerdict(
        AttemptStatus.FAILED,
        failures=[
            RankFailure(
                r,
                None,
                "the rank never reported a result: its node's launcher ended without recording "
                "how its ranks ended (the launcher's log is below)",
                log_tail=tail,
            )
            for r in missing
        ],
    )


def _not_checkpointed_message(run_policy) -> str:
    return (
        f"the attempt reached its runtime cap (max_runtime={run_policy.max_runtime:g}s) and was stopped, but the "
        "function did not checkpoint before it: no rank stopped for a restart and no new complete checkpoint "
        "was saved, so resuming would only repeat the same work. Save with sparkgpu.train.Checkpointer "
        "(ckpt.maybe_save(step, ...) after every step) and call runtime.stop_for_restart() once ckpt.should_stop "
        f"is True (runtime.should_checkpoint() turns True checkpoint_grace={run_policy.checkpoint_grace:g}s before "
        "the cap), or raise max_runtime="
    )


def _describe_exit(info: RankExit) -> str:
    if info.signal:
        died = f"the process died from signal {info.signal} (exit code {info.exitcode}) without a Python exception"
        return f"{died}: {OOM_KILLED}" if info.oom_killed else died
    if info.exitcode == 0:
        return (
            "the process exited with code 0 without returning a result or raising an exception "
            "(os._exit(0), or a library that calls exit(0))"
        )
    return f"the process exited with code {info.exitcode} without a Python exception"
