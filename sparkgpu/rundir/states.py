"""The run dir's protocol: the states its files hold and the records written in more than one place.

Every process that reads or writes a job's run dir (the client's supervisor, ``sparkgpu
resume`` / ``jobs`` / ``logs``, the node agents, the warm pool's zygote, the Spark node tasks), and
the callbacks that hear how an attempt ended (tracking, metering: ``AttemptOutcome.status``),
take the states from here; none compares a state as a bare string. It sits below every
sub-package and uses the standard library only. The enums are
``str``-valued: the JSON on disk holds plain strings.

:class:`JobStatus`, ``state.json``'s ``status`` (the job as a whole); it changes only along
:data:`JOB_TRANSITIONS`, the one drawing of its transitions. ``PENDING``: staged, no attempt
submitted yet. ``RUNNING``: an attempt is submitted or runs (also between attempts, while a
restart is prepared). ``SUCCEEDED``: every rank of the last
attempt returned. ``FAILED``: an attempt failed and the failure policy raised (or the
supervisor itself failed). ``TIMED_OUT``: the job ran past ``job.policy.timeout``.
``CANCELLED``: cancelled (``DistributedFunctionCall.cancel``, the cancel file, Ctrl-C). ``STOPPED``: a usage
policy stopped it (its ranks were asked to checkpoint). ``SUCCEEDED`` is final;
``sparkgpu resume`` takes every other state back to ``RUNNING``.

:class:`AttemptStatus`, each ``state.json`` attempt's ``status``; it changes only along
:data:`ATTEMPT_TRANSITIONS` (``RUNNING`` to any other state, once). ``PREEMPTED``: its ranks
checkpointed and stopped (at the runtime cap, for a restart, to give way to a critical job, or for an elastic job to grow back to all its GPUs); the next attempt
resumes without using up a restart. ``RESIZED``: an elastic job's attempt that waited
``elastic_wait`` for its GPUs was withdrawn before its ranks started; the next attempt goes on
with fewer (the record's ``gpus``), using no restart and billing nothing. ``STOPPED``: stopped by a usage policy without a
checkpoint. ``TIMED_OUT`` and ``CANCELLED``: as for the job. ``LOST``: its client died while
it ran; ``sparkgpu resume`` records that when it takes the job over. Every state but
``RUNNING`` is final.

:class:`ListedStatus`: what ``sparkgpu jobs`` shows beside a :class:`JobStatus`, derived and
never written: ``STAGED`` (no ``state.json``: a dry run, or a launch that died early) and
``LOST`` (``RUNNING`` in ``state.json``, but its client process is gone) and ``WAITING`` (its
client waits in this host's GPU queue: before its first attempt, or after it gave way to a
critical job).

:class:`NodeState`, the state of one Spark node task (its result row, its ``ended`` marker
and its entry in the attempt's report). Before the agent starts::

    READY | BAD_NODE | SPARE | SPARK_RETRY | NO_RUN_DIR | STORE_UNREACHABLE | BAD_SIGNATURE
    READY -> PEER_NOT_READY          (a peer was not READY: nobody starts)
    READY -> RUNNING -> SUCCEEDED | FAILED | CANCELLED | CLIENT_LOST | PEER_FAILED | PEER_LOST
    any -> STORE_PUSH_FAILED          (the node's last files did not reach the staging store)

``BAD_NODE``: the task failed its pre-flight check (:mod:`sparkgpu.launch.node.preflight`).
``SPARE``: the attempt ran more tasks than nodes to stand in for executors that failed the
check before; this one was not needed (or sat on such an executor) and starts nothing.
``SPARK_RETRY``: Spark re-ran the barrier stage; the task starts nothing (restarts are the
supervisor's). ``NO_RUN_DIR``: the executor cannot see the client's run dir.
``STORE_UNREACHABLE``: it cannot read or write the staging store. ``BAD_SIGNATURE``: the
payload's signature does not hold. ``RUNNING`` is the agent's state while it runs, never
a final one: it ends ``SUCCEEDED`` or ``FAILED`` by the agent's exit code, or by what stopped
it (``CANCELLED`` by the client, ``CLIENT_LOST``: the client stopped beating,
``PEER_FAILED``: another node's ranks failed, ``PEER_LOST``: another node stopped beating).
The client's own account adds ``EXECUTOR_LOST`` (written ``"lost"``: the node stopped beating
without an end marker, its executor is gone) and ``UNKNOWN`` (no row and no end marker).

:class:`JobState` / :class:`AttemptRecord` / :class:`ClientInfo`: ``state.json``'s keys, typed
for the checker; the state stays a plain dict (its ``status`` values are the enums' strings).

:class:`NodeExit` / :class:`RankExit`: a node's exit record (``attempts/<k>/node-<n>.json``),
written by the node agent and by the warm pool's zygote, read by the supervisor and by the Spark
nodes watching their peers.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, TypedDict

__all__ = [
    "JobStatus",
    "AttemptStatus",
    "JOB_TRANSITIONS",
    "ATTEMPT_TRANSITIONS",
    "ListedStatus",
    "NodeState",
    "NodeExit",
    "RankExit",
    "JobState",
    "AttemptRecord",
    "ClientInfo",
    "WaitingInfo",
]


class _StrEnum(str, enum.Enum):
    """A ``str`` whose ``str()`` and format are its value (``enum.StrEnum`` from Python 3.11 on)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, format_spec: str) -> str:
        return format(str(self.value), format_spec)


class JobStatus(_StrEnum):
    """A job's status in ``state.json`` (its transitions: :data:`JOB_TRANSITIONS`)."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    STOPPED = "stopped"  # checkpointed and stopped by a usage policy (budget); resumable by hand

    @property
    def is_terminal(self) -> bool:
        """Whether the job ended (its supervisor returned or raised); only ``resume`` continues it."""
        return self not in (JobStatus.PENDING, JobStatus.RUNNING)


class AttemptStatus(_StrEnum):
    """An attempt's status in ``state.json`` (its transitions: :data:`ATTEMPT_TRANSITIONS`)."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    PREEMPTED = "preempted"
    STOPPED = "stopped"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    LOST = "lost"
    RESIZED = "resized"  # an elastic job's attempt withdrawn before its ranks started, to go on with fewer GPUs


_RESUMABLE = frozenset({JobStatus.RUNNING, JobStatus.FAILED, JobStatus.CANCELLED})

#: The job's status -> the statuses it may change to: every legal change of ``state.json``'s
#: ``status``, and the only drawing of them (the client's ``JobBook`` refuses any other).
JOB_TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    # Its first attempt, or it ended before one (its GPUs never came, Ctrl-C in the queue).
    JobStatus.PENDING: frozenset({JobStatus.RUNNING, JobStatus.FAILED, JobStatus.CANCELLED}),
    # The next attempt (a restart, a resume, a resize), or the job's end.
    JobStatus.RUNNING: frozenset(
        {
            JobStatus.RUNNING,
            JobStatus.SUCCEEDED,
            JobStatus.FAILED,
            JobStatus.TIMED_OUT,
            JobStatus.CANCELLED,
            JobStatus.STOPPED,
        }
    ),
    # ``sparkgpu resume`` continues it; it may end again before its attempt.
    JobStatus.FAILED: _RESUMABLE,
    JobStatus.TIMED_OUT: _RESUMABLE,
    JobStatus.CANCELLED: _RESUMABLE,
    JobStatus.STOPPED: _RESUMABLE,
    JobStatus.SUCCEEDED: frozenset(),  # final
}

#: An attempt's status -> the statuses it may change to: a running attempt ends once, in any way.
ATTEMPT_TRANSITIONS: dict[AttemptStatus, frozenset[AttemptStatus]] = {
    status: frozenset(AttemptStatus) - {AttemptStatus.RUNNING} if status is AttemptStatus.RUNNING else frozenset()
    for status in AttemptStatus
}


class ListedStatus(_StrEnum):
    """The statuses ``sparkgpu jobs`` derives beside :class:`JobStatus`'s; never written."""

    STAGED = "staged"
    LOST = "lost"
    WAITING = "waiting"  # in this host's GPU queue (sparkgpu.launch.scheduling.gpu_queue), its client alive


class NodeState(_StrEnum):
    """A Spark node task's state (transitions in the module docstring)."""

    READY = "ready"
    BAD_NODE = "bad-node"
    SPARE = "spare"
    SPARK_RETRY = "spark-retry"
    NO_RUN_DIR = "no-run-dir"
    STORE_UNREACHABLE = "store-unreachable"
    STORE_PUSH_FAILED = "store-push-failed"
    BAD_SIGNATURE = "bad-signature"
    PEER_NOT_READY = "peer-not-ready"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    CLIENT_LOST = "client-lost"
    PEER_FAILED = "peer-failed"
    PEER_LOST = "peer-lost"
    EXECUTOR_LOST = "lost"  # the client's account: the node stopped beating, its executor gone
    UNKNOWN = "unknown"


class ClientInfo(TypedDict):
    """The process that supervises a job: ``sparkgpu jobs`` shows a job whose client died as lost."""

    host: str  # for people
    machine: str | None  # host, boot and PID namespace (sparkgpu._util.process.machine_id)
    pid: int
    pid_started: str | None  # its start in clock ticks since boot: tells a recycled pid from the client


class _AttemptFields(TypedDict):
    attempt: int
    submitted_at: float
    started_at: float | None  # when its ranks started: billing and the runtime cap start there
    ended_at: float | None
    status: str  # an AttemptStatus value


class AttemptRecord(_AttemptFields, total=False):
    """One attempt in ``state.json`` (a plain dict on disk and in memory, so the file reads as it always did)."""

    exit_code: int | None
    lost: list[dict[str, Any]]  # the lost nodes' NodeReport fields
    cause: list[str]  # at most 8 sentences on why it ended
    gpus: int  # the ranks it ran on: fewer than the job's for an elastic job short of GPUs
    failure_class: str  # a failed attempt's class (a sparkgpu.failure_class.FailureClass value)
    failure_detail: str  # one line on it ("CUDA out of memory: tried to allocate ...")


class _JobFields(TypedDict):
    job_id: str
    status: str  # a JobStatus value
    backend: str
    attempts: list[AttemptRecord]
    restarts: int
    preemptions: int
    created_at: float


class WaitingInfo(TypedDict):
    """``state.json``'s ``waiting``: a job that checkpointed and gave way waits for GPUs between attempts."""

    since: float  # Unix time it started waiting
    reason: str  # who it gave way to


class JobState(_JobFields, total=False):
    """``state.json``: the supervisor's state, rewritten atomically after every transition."""

    client: ClientInfo
    stop_reason: str  # why a usage policy stopped the job
    cause: str  # why a job ended that no supervisor could run (launch.client.detached)
    finished_at: float  # when its supervisor was done with it: status final, callbacks run
    failed_before: list[dict[str, Any]]  # the last restarted attempt's rank failures (the failure policy's memory)
    waiting: WaitingInfo  # while a job that gave way to a critical one waits for GPUs again


@dataclasses.dataclass
class RankExit:
    """How one rank's process exited, as its node's launcher saw it.

    Attributes:
        exitcode: Its exit code; ``-N`` when signal ``N`` ended it.
        signal: The signal's name (``"SIGKILL"``), or ``None`` when it exited.
        pid: Its process id, when the launcher knew it.
        time: Unix time it exited, when known: a quiet exit is the cause of its peers' errors.
        oom_killed: True when its node's cgroup counted an OOM kill (``memory.events``'
            ``oom_kill``) while it ran and it died from SIGKILL: the host's OOM killer.
    """

    exitcode: int
    signal: str | None = None
    pid: int | None = None
    time: float | None = None
    oom_killed: bool = False

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"exitcode": self.exitcode, "signal": self.signal, "pid": self.pid, "time": self.time}
        if self.oom_killed:
            data["oom_killed"] = True
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankExit:
        return cls(
            exitcode=data["exitcode"],
            signal=data.get("signal"),
            pid=data.get("pid"),
            time=data.get("time"),
            oom_killed=bool(data.get("oom_killed", False)),
        )


@dataclasses.dataclass
class NodeExit:
    """A node's exit record: its launcher's exit status and the ranks that did not exit cleanly.

    Attributes:
        node_rank: The node's index.
        status: The launcher's exit status: ``0``, or non-zero when a rank failed (the other
            nodes then stop their ranks too).
        failures: By global rank, the ranks that failed (or exited quietly with code 0).
        refused: Why the node started none of its ranks (a payload signature that does not
            hold), or ``None``.
    """

    node_rank: int
    status: int
    failures: dict[int, RankExit] = dataclasses.field(default_factory=dict)
    refused: str | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "node_rank": self.node_rank,
            "status": self.status,
            "failures": {str(rank): f.to_json() for rank, f in self.failures.items()},
        }
        if self.refused is not None:
            data["refused"] = self.refused
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeExit:
        """Reads a record; the fields an older or a partial writer left out take their defaults."""
        return cls(
            node_rank=data.get("node_rank", -1),
            status=data.get("status", 0),
            failures={int(rank): RankExit.from_json(f) for rank, f in data.get("failures", {}).items()},
            refused=data.get("refused"),
        )
