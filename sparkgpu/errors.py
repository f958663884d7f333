"""The project's errors: one root, a few subclasses, each message names the fix.

Every error survives pickling (it crosses process boundaries between workers and the
client), so subclasses keep all constructor state in ``self.args`` or override
``__reduce__``.

This module imports the standard library only: a worker loads it by file path, before the
environment that may bring sparkgpu is rehydrated (:mod:`sparkgpu.env.hydrate`), so that what
it raises there are these very classes.
"""

from __future__ import annotations

import functools
import importlib
import re
import signal

__all__ = [
    "SparkGPUError",
    "ConfigurationError",
    "JobStateError",
    "CapacityError",
    "SerializationError",
    "ResultError",
    "MissingDependencyError",
    "JobTimeoutError",
    "LocalExecutionTimeoutError",
    "JobCancelledError",
    "CallNotFinishedError",
    "WorkerFailedError",
    "NodeLostError",
    "worker_failed_error",
    "first_failure",
    "RankFailure",
    "PayloadSignatureError",
    "DataError",
    "HangError",
    "PreflightError",
    "CheckpointError",
    "PolicyViolationError",
    "PermissionDeniedError",
    "EnvironmentTooLargeError",
    "EnvironmentMismatchError",
    "HydrationError",
    "RayClusterError",
]


class SparkGPUError(Exception):
    """Root of every error this package raises on purpose."""


class ConfigurationError(SparkGPUError, ValueError):
    """An argument or setting is wrong; the message says which value to use instead."""


class JobStateError(ConfigurationError):
    """The job is in a state that does not allow the operation (already succeeded, not ended yet,
    supervised by another live client); the message says what to do instead.

    A :class:`ConfigurationError` as well, so ``except ConfigurationError`` catches it.
    """


class CapacityError(SparkGPUError):
    """More GPUs (or GPUs of another type) were asked for than the backend can ever give."""


class SerializationError(SparkGPUError):
    """The function, an argument or a result cannot be pickled or unpickled."""


class ResultError(SerializationError):
    """A rank's function returned, but what it returned could not be written back (it does not pickle).

    Never restarted: a new attempt would run the whole function again only to fail the same
    way at its end. ``saved`` maps the place of each model in the return value (``"model"``)
    to where the rank saved it in the job's run dir before failing; the message says the same.
    """

    def __init__(self, message: str, saved: dict[str, str] | None = None):
        super().__init__(message)
        self.saved = dict(saved or {})

    def __reduce__(self):
        return (type(self), (self.args[0], self.saved))


class MissingDependencyError(SparkGPUError, ImportError):
    """An optional integration is not installed; the message holds the pip command."""

    def __init__(self, feature: str, install: str):
        super().__init__(f"{feature} needs an optional dependency: run `{install}`")
        self.feature = feature
        self.install = install

    def __reduce__(self):
        return (type(self), (self.feature, self.install))


class JobTimeoutError(SparkGPUError, TimeoutError):
    """The whole call ran longer than its ``timeout``."""


# databricks.air's name for the same error: `except LocalExecutionTimeoutError` catches it.
LocalExecutionTimeoutError = JobTimeoutError


class JobCancelledError(SparkGPUError):
    """The job was cancelled (``DistributedFunctionCall.cancel()``, from this process or another one) before it ended."""


class CallNotFinishedError(SparkGPUError, TimeoutError):
    """``DistributedFunctionCall.result(timeout=)`` gave up waiting; the job itself runs on."""


class PayloadSignatureError(SparkGPUError):
    """A worker was handed a payload that is unsigned or does not match its signature."""


class DataError(SparkGPUError):
    """Input data cannot be converted or read (unsupported column type, corrupt shard, ...)."""


class HangError(SparkGPUError):
    """A rank made no progress for the job's ``progress_timeout``: the attempt was stopped as hung.

    The message names the rank(s) behind and where each rank was; every rank's Python stacks are
    in the attempt's ``hang.txt`` in the run dir.
    """


class PreflightError(SparkGPUError):
    """A node failed its pre-flight check before any rank started (its cache disk, its GPUs).

    The message names the node, its executor and host, each check that failed and its fix.

    Attributes:
        replaceable: Whether the job has other nodes to run on: on Spark the next attempt
            leaves the node's executor out; on one host there is nothing to leave it for.
    """

    def __init__(self, message: str = "", replaceable: bool = False):
        super().__init__(message)
        self.replaceable = replaceable

    def __reduce__(self):  # pickled into the rank's error file, with its flag
        return (type(self), (str(self), self.replaceable))


class CheckpointError(SparkGPUError):
    """A checkpoint cannot be written or no complete checkpoint can be restored."""


class PolicyViolationError(SparkGPUError):
    """A job breaks a usage policy (GPU type, GPU count, runtime, budget)."""


class PermissionDeniedError(SparkGPUError, PermissionError):
    """The tracking server or model registry refused an operation.

    The message names the permission that is missing, on which object, and who can grant it.
    """


class EnvironmentTooLargeError(SparkGPUError):
    """The environment to ship to the workers is over the size limit.

    The message lists the largest distributions and how to leave them out.
    """


class EnvironmentMismatchError(SparkGPUError):
    """The client's Python, torch or platform cannot run on the workers; names both versions.

    Raised on the client when ``worker_has=`` describes the workers, and on a worker when it
    rehydrates the job's environment.
    """


class HydrationError(SparkGPUError):
    """A worker cannot rehydrate the job's environment (missing or corrupt blob, bad manifest)."""


class RayClusterError(SparkGPUError):
    """The Ray cluster of a ``@ray_launch`` job could not be started or was lost."""


class RankFailure:
    """What went wrong on one rank, in a form that pickles without the user's classes.

    Attributes:
        rank: Global rank of the failed process.
        exc_type: Qualified name of the exception type, or ``None`` when the process died
            without a Python exception (signal, ``os._exit``).
        message: ``str()`` of the exception, or a description of the exit.
        traceback: The formatted remote traceback (may be empty).
        exitcode: Process exit code (negative for a signal) when known.
        log_tail: Last lines of the rank's log, for deaths without a traceback.
        timestamp: Unix time of the failure when known; the earliest is the likely root cause
            (the others often fail only because a peer left a collective).
    """

    __slots__ = ("rank", "exc_type", "message", "traceback", "exitcode", "log_tail", "timestamp")

    def __init__(self, rank, exc_type, message, traceback="", exitcode=None, log_tail="", timestamp=None):
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.traceback = traceback
        self.exitcode = exitcode
        self.log_tail = log_tail
        self.timestamp = timestamp

    def __reduce__(self):
        return (
            RankFailure,
            (self.rank, self.exc_type, self.message, self.traceback, self.exitcode, self.log_tail, self.timestamp),
        )

    def __repr__(self):
        return f"RankFailure(rank={self.rank}, exc_type={self.exc_type!r}, message={self.message!r})"

    @property
    def signature(self) -> tuple:
        """Key under which identical failures on several ranks are grouped."""
        return (self.exc_type, self.message, _strip_rank_noise(self.traceback), self.exitcode)


def _strip_rank_noise(traceback: str) -> str:
    # Tracebacks of identical failures differ only in the rank's file paths when the run dir
    # holds per-rank files; the last line (the exception) is what identifies the failure.
    lines = [line for line in traceback.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


_MAX_TRACEBACK_LINES = 60
_EXIT_TIME_SKEW = 2.0  # seconds; see first_failure
_PEER_GONE_SKEW = 20.0  # seconds; see first_failure
#: What a rank's collective raises when a peer process is gone (gloo, NCCL).
_PEER_GONE = re.compile(
    r"connection (closed|reset) by peer|remote process exited|communicator was aborted", re.IGNORECASE
)
#: Of those, the errors that say a peer's process left: an NCCL communicator aborts on a rank's own error too.
_PEER_LEFT = re.compile(r"connection (closed|reset) by peer|remote process exited", re.IGNORECASE)
#: Signals the launchers send to stop a rank (after a peer failed, at the shutdown grace).
_STOP_SIGNALS = (-signal.SIGKILL, -signal.SIGTERM)


def _peer_gone(failure: RankFailure) -> bool:
    """True when ``failure`` is a collective's error that says a peer left, not a cause of its own."""
    return failure.exc_type is not None and bool(_PEER_GONE.search(failure.message))


def first_failure(failures) -> RankFailure:
    """The failure that happened first among ``failures``: usually the root cause.

    A process that ended without a Python exception (a quiet exit, a signal) counts as first
    also when a peer's error is up to two seconds older: its time is when its launcher saw it
    end, which can trail the error it caused in a peer waiting in a collective. When that
    error says a peer left ("Connection closed by peer", an NCCL abort), an exit of its own (a
    quiet exit, an exit code, a crash) counts as first for up to twenty seconds: on a node whose
    cores are busy the launcher has been seen to trail by more than two. A rank stopped by
    SIGKILL or SIGTERM gets that margin only where the error says the peer's process left
    (gloo's closed connection, NCCL's "remote process exited"), and then after any exit of
    its own: such an error cannot follow from a peer the launchers stopped after it, and an
    NCCL abort can be the rank's own. Such a death is the cause even where its launcher could
    not time it (its time unknown).
    """
    timed = [f for f in failures if f.timestamp is not None]
    if not timed:
        return failures[0]
    first = min(timed, key=lambda f: f.timestamp)
    if first.exc_type is not None and _PEER_LEFT.search(first.message):
        left = [
            f
            for f in failures
            if f.exc_type is None and (f.timestamp is None or f.timestamp - first.timestamp <= _PEER_GONE_SKEW)
        ]
        if left:
            return min(left, key=lambda f: (f.exitcode in _STOP_SIGNALS, f.timestamp is None, f.timestamp or 0.0))

    def margin(death: RankFailure) -> float:
        if _peer_gone(first) and death.exitcode not in _STOP_SIGNALS:
            return _PEER_GONE_SKEW
        return _EXIT_TIME_SKEW

    deaths = [f for f in timed if f.exc_type is None and f.timestamp - first.timestamp <= margin(f)]
    return min(deaths, key=lambda f: f.timestamp) if deaths else first


def _truncate(text: str, max_lines: int = _MAX_TRACEBACK_LINES) -> str:
    lines = text.rstrip().splitlines()
    if len(lines) <= max_lines:
        return "\n".join(lines)
    head, tail = lines[:10], lines[-(max_lines - 10) :]
    return "\n".join(head + [f"    ... {len(lines) - max_lines} lines omitted ..."] + tail)


class WorkerFailedError(SparkGPUError):
    """One or more ranks of a distributed call failed.

    The message names every failing rank with its exception type, message and remote
    traceback; ranks that failed identically are grouped. ``failures`` holds one
    :class:`RankFailure` per failed rank, ordered by rank. When every failing rank raised
    the same exception type, the client raises a class derived from this one and that type
    (:func:`worker_failed_error`); ``rank_exception_type`` names it there.
    """

    rank_exception_type: type | None = None

    def __init__(self, failures, job_id: str | None = None, logs_dir: str | None = None):
        self.failures = sorted(failures, key=lambda f: f.rank)
        self.job_id = job_id
        self.logs_dir = logs_dir
        # Not super(): in a class derived from the ranks' exception type too (see
        # worker_failed_error) that would be the user's __init__, with arguments of its own.
        Exception.__init__(self, self._format())

    def __str__(self):
        # The message, also where the ranks' exception type formats its args otherwise (KeyError).
        return BaseException.__str__(self)

    def __reduce__(self):
        return (type(self), (self.failures, self.job_id, self.logs_dir))

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.failures]

    @property
    def first_failure(self) -> RankFailure:
        """The failure that happened first: usually the root cause (see :func:`first_failure`)."""
        return first_failure(self.failures)

    def _format(self) -> str:
        groups: dict[tuple, list[RankFailure]] = {}
        for failure in self.failures:
            groups.setdefault(failure.signature, []).append(failure)
        job = f" in job {self.job_id}" if self.job_id else ""
        parts = [f"{len(self.failures)} rank(s) failed{job}."]
        if len(self.failures) > 1:
            first = self.first_failure
            parts[0] += f" First to fail: rank {first.rank} ({first.exc_type or 'no Python exception'})."
        for members in groups.values():
            first = members[0]
            ranks = ", ".join(str(f.rank) for f in members)
            label = "rank" if len(members) == 1 else "ranks"
            if first.exc_type:
                parts.append(f"\n--- {label} {ranks}: {first.exc_type}: {first.message}")
                if first.traceback:
                    parts.append("Remote traceback:\n" + _truncate(first.traceback))
            else:
                parts.append(f"\n--- {label} {ranks}: {first.message}")
                if first.log_tail:
                    parts.append("Last lines of its log:\n" + _truncate(first.log_tail, 20))
        if self.logs_dir:
            parts.append(f"\nLogs of every rank: {self.logs_dir}")
        return "\n".join(parts)


class NodeLostError(WorkerFailedError):
    """A node of the job was lost: its executor or worker died while its ranks ran.

    ``lost`` says which: one sentence per lost node, naming its executor and host
    (``"executor 1 on host 10.0.0.7 was lost (...)"``); the message starts with it. The
    surviving nodes' ranks were stopped before the attempt ended.
    """

    def __init__(self, failures, job_id: str | None = None, logs_dir: str | None = None, lost: str = ""):
        self.lost = lost
        super().__init__(failures, job_id, logs_dir)

    def __reduce__(self):
        return (type(self), (self.failures, self.job_id, self.logs_dir, self.lost))

    def _format(self) -> str:
        job = f" of job {self.job_id}" if self.job_id else ""
        return (
            f"{self.lost}; the ranks of the other nodes{job} were stopped. Restart from the latest checkpoint "
            f"with max_restarts= (it waits for capacity up to capacity_wait=, by default the job's max_runtime).\n"
            + super()._format()
        )


def worker_failed_error(
    failures, exceptions=None, job_id: str | None = None, logs_dir: str | None = None
) -> WorkerFailedError:
    """The error that a failed call raises on the client.

    When every failing rank raised the same exception type, the error is an instance of a
    class derived from both :class:`WorkerFailedError` and that type (as Ray's
    ``RayTaskError.as_instanceof_cause``), so ``except ValueError:`` around a call still
    catches a rank's ``ValueError``. Otherwise (ranks that died without a Python exception,
    several types, a type that is not an ``Exception``, cannot be subclassed or did not
    unpickle on the client) it is a plain :class:`WorkerFailedError`.

    Args:
        failures: One :class:`RankFailure` per failed rank.
        exceptions: The ranks' unpickled exceptions, by rank (those that unpickled here).
        job_id: The job's id, for the message.
        logs_dir: Where every rank's log is, for the message.
    """
    cause = _common_exception_type(failures, exceptions or {})
    return _build(cause, failures, job_id, logs_dir)


def _build(cause: type | None, failures, job_id, logs_dir) -> WorkerFailedError:
    derived = _derived_class(cause) if cause is not None else None
    try:
        return (derived or WorkerFailedError)(failures, job_id, logs_dir)
    except Exception:  # the type's __new__ insists on arguments of its own (UnicodeDecodeError)
        return WorkerFailedError(failures, job_id, logs_dir)


def _common_exception_type(failures, exceptions) -> type | None:
    types = set()
    for failure in failures:
        exc = exceptions.get(failure.rank)
        if exc is None:  # a death without an exception, or a class the client lacks
            return None
        types.add(type(exc))
    return types.pop() if len(types) == 1 else None


@functools.lru_cache(maxsize=None)
def _derived_class(cause: type) -> type | None:
    """``WorkerFailedError(cause)``: both a WorkerFailedError and a ``cause``; ``None`` if impossible."""
    if not issubclass(cause, Exception) or issubclass(cause, WorkerFailedError):
        return None  # never make a rank's SystemExit or KeyboardInterrupt end the client
    namespace = {
        "__module__": __name__,
        "__qualname__": f"WorkerFailedError({cause.__qualname__})",
        "__doc__": f"A WorkerFailedError whose ranks raised {cause.__module__}.{cause.__qualname__}.",
        "__reduce__": _reduce_derived,
        "rank_exception_type": cause,
    }
    try:
        return type(f"WorkerFailedError({cause.__name__})", (WorkerFailedError, cause), namespace)
    except TypeError:  # final types (bool), incompatible instance layouts, a refusing __init_subclass__
        return None


def _reduce_derived(error: WorkerFailedError):
    # The derived class exists only in the process that made it: pickle the rank's exception
    # type by name and derive again on the other side.
    cause = type(error).rank_exception_type
    assert cause is not None  # only the derived classes, which all have one, reduce through here
    return (_rebuild, (cause.__module__, cause.__qualname__, error.failures, error.job_id, error.logs_dir))


def _rebuild(module: str, qualname: str, failures, job_id, logs_dir) -> WorkerFailedError:
    """Unpickles a derived error; a plain one where the rank's exception type cannot be imported."""
    try:
        cause = importlib.import_module(module)
        for part in qualname.split("."):
            cause = getattr(cause, part)
    except (ImportError, AttributeError):  # the type's module is missing or changed here
        cause = None
    return _build(cause if isinstance(cause, type) else None, failures, job_id, logs_dir)
