"""Why an attempt failed, by class: :class:`FailureClass` and :func:`classify`.

A CUDA out-of-memory, an NCCL timeout, a segfault, the host's OOM killer and a user's
``KeyError`` call for different answers: a transient NCCL error is worth a restart, a
deterministic bug or an allocation that does not fit is not. :func:`classify` reads what an
attempt really left (each failing rank's exception type and message, its exit signal, the
backend's lost-node record) and names the class of the root cause rank's failure (as
:func:`~sparkgpu.errors.first_failure` picks it), with a one-line detail.

Both sides read this module: the client (its failure policy, ``state.json``, ``sparkgpu jobs``,
tracking) and the node (it records the cgroup's OOM-kill evidence beside a killed rank's
exit, :func:`oom_kills`). It imports the standard library and :mod:`sparkgpu.errors` only.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

from sparkgpu.errors import (
    DataError,
    EnvironmentMismatchError,
    HangError,
    HydrationError,
    PayloadSignatureError,
    PreflightError,
    RankFailure,
    ResultError,
    first_failure,
)

__all__ = ["FailureClass", "Classified", "classify", "oom_kills", "own_cgroup", "OOM_KILLED", "parse_failure_classes"]


class FailureClass(str, enum.Enum):
    """The class of an attempt's failure; ``str``-valued, as ``state.json`` holds it."""

    USER_EXCEPTION = "user_exception"  # the user's code raised (the detail names the type)
    CUDA_OOM = "cuda_oom"  # torch.cuda.OutOfMemoryError, "CUDA out of memory"
    NCCL = "nccl"  # an NCCL error or a watchdog's collective timeout
    NATIVE_CRASH = "native_crash"  # SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE
    HOST_OOM = "host_oom"  # SIGKILL with the cgroup's oom_kill counter risen
    KILLED = "killed"  # a signal from outside
    LOST_NODE = "lost_node"  # the backend lost a node of the attempt
    BAD_NODE = "bad_node"  # a node failed its pre-flight check: sparkgpu.errors.PreflightError
    HANG = "hang"  # no progress for progress_timeout: sparkgpu.errors.HangError, named by the supervisor
    DATA_ERROR = "data_error"  # sparkgpu.errors.DataError and its subclasses
    ENVIRONMENT_ERROR = "environment_error"  # environment mismatch, an import that fails, hydration
    RESULT_ERROR = "result_error"  # the function returned, its result could not be written back

    def __str__(self) -> str:
        return str(self.value)


@dataclasses.dataclass(frozen=True)
class Classified:
    """An attempt's failure class and a one-line detail (``"CUDA out of memory at step 812: ..."``)."""

    cls: FailureClass
    detail: str

    def __str__(self) -> str:
        return f"{self.cls.value}: {self.detail}" if self.detail else self.cls.value


#: What read_attempt appends to a SIGKILLed rank's description when its node saw the cgroup's
#: ``oom_kill`` counter rise while the rank ran: the host's OOM killer, not a person, killed it.
OOM_KILLED = "the host's OOM killer killed it (its cgroup's memory.events oom_kill rose)"

_NATIVE = {"SIGSEGV", "SIGABRT", "SIGBUS", "SIGILL", "SIGFPE"}
_CUDA_OOM = re.compile(r"CUDA out of memory", re.IGNORECASE)
_NCCL = re.compile(r"\bNCCL\b|Watchdog caught collective operation timeout|ProcessGroupNCCL", re.IGNORECASE)
_STEP = re.compile(r"\bstep[ =:]+(\d+)", re.IGNORECASE)
_TRIED = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", re.IGNORECASE)
_IN_USE = re.compile(r"([\d.]+ [KMGT]?i?B) (?:is |already )?(?:allocated|in use)", re.IGNORECASE)
_IMPORT = ("ImportError", "ModuleNotFoundError", "builtins.ImportError", "builtins.ModuleNotFoundError")
_ENVIRONMENT = (EnvironmentMismatchError, PayloadSignatureError, HydrationError, ImportError)


def parse_failure_classes(value, *, name: str = "restart_on") -> tuple[str, ...]:
    """``value`` (class names or :class:`FailureClass` members) as a tuple of class names.

    Raises:
        ValueError: a name that is no class; the message lists the classes.
    """
    known = {c.value for c in FailureClass}
    try:
        items = [value] if isinstance(value, (str, FailureClass)) else list(value)
    except TypeError:
        raise ValueError(
            f"{name}= takes failure class names, got {value!r}; use some of {', '.join(sorted(known))}"
        ) from None
    names: list[str] = []
    for item in items:
        text = item.value if isinstance(item, FailureClass) else str(item)
        if text not in known:
            raise ValueError(f"{name}= got {item!r}, which is no failure class; use some of {', '.join(sorted(known))}")
        if text not in names:
            names.append(text)
    return tuple(names)


def classify(
    failures: Sequence[RankFailure],
    exceptions: Mapping[int, BaseException] | None = None,
    *,
    lost: str = "",
) -> Classified:
    """The class of an attempt's failure: its root cause rank's, with a one-line detail.

    Args:
        failures: The attempt's failed ranks (``AttemptVerdict.failures``).
        exceptions: Their exceptions that unpickled on this side, by rank: their type decides
            where present (a subclass of ``DataError`` counts as one); else the qualified type
            name and the message do.
        lost: The backend's account of a lost node (``AttemptVerdict.lost``), ``""`` when none.
    """
    if lost:
        return Classified(FailureClass.LOST_NODE, lost)
    if not failures and exceptions:
        # Only exceptions (a caller that has no rank records): the lowest rank's stands for the attempt.
        rank = min(exceptions)
        only = exceptions[rank]
        failures = [RankFailure(rank, f"{type(only).__module__}.{type(only).__qualname__}", str(only))]
    if not failures:
        return Classified(FailureClass.USER_EXCEPTION, "")
    root = first_failure(list(failures))
    exc = (exceptions or {}).get(root.rank)
    message = _first_line(root.message)
    if root.exc_type is None:
        return _classify_exit(root, message)
    name = root.exc_type
    short = name.rsplit(".", 1)[-1]
    text = f"{root.message}\n{root.traceback}"
    if _is(exc, name, HangError):
        return Classified(FailureClass.HANG, message)
    if _is(exc, name, PreflightError):
        return Classified(FailureClass.BAD_NODE, message)
    if _is(exc, name, ResultError):
        return Classified(FailureClass.RESULT_ERROR, f"{short}: {message}")
    if _is(exc, name, DataError):
        return Classified(FailureClass.DATA_ERROR, f"{short}: {message}")
    if _is(exc, name, *_ENVIRONMENT) or name in _IMPORT:
        return Classified(FailureClass.ENVIRONMENT_ERROR, f"{short}: {message}")
    if short == "OutOfMemoryError" or _CUDA_OOM.search(root.message):
        return Classified(FailureClass.CUDA_OOM, _oom_detail(text, root.message))
    distributed = name.startswith("torch.distributed.") or short in ("DistBackendError", "DistError")
    if _NCCL.search(root.message) or (distributed and _NCCL.search(text)):
        return Classified(FailureClass.NCCL, f"{short}: {message}")
    return Classified(FailureClass.USER_EXCEPTION, f"{short}: {message}")


def oom_kills(cgroup: str | Path) -> int | None:
    """The ``oom_kill`` count in ``<cgroup>/memory.events`` (cgroup v2), ``None`` where unreadable."""
    try:
        text = (Path(cgroup) / "memory.events").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, count = line.partition(" ")
        if key == "oom_kill" and count.strip().isdigit():
            return int(count)
    return None


def own_cgroup(proc_self: str | Path = "/proc/self/cgroup", root: str | Path = "/sys/fs/cgroup") -> Path | None:
    """This process's cgroup v2 directory, from ``/proc/self/cgroup``; ``None`` where there is none."""
    try:
        lines = Path(proc_self).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return Path(root) / line[3:].strip().lstrip("/")
    return None


def _classify_exit(root: RankFailure, message: str) -> Classified:
    name = _signal_name(root.exitcode)
    if name in _NATIVE:
        return Classified(FailureClass.NATIVE_CRASH, f"the process died from {name}")
    if name == "SIGKILL" and OOM_KILLED in root.message:
        return Classified(FailureClass.HOST_OOM, "the process was killed by the host's OOM killer")
    if name is not None:
        return Classified(FailureClass.KILLED, f"the process was killed by {name}")
    return Classified(FailureClass.USER_EXCEPTION, message)


def _signal_name(exitcode: int | None) -> str | None:
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _is(exc: BaseException | None, name: str, *classes: type) -> bool:
    if exc is not None:
        return isinstance(exc, classes)
    # Not unpickled here: the qualified name, as sparkgpu's serialize_error writes it.
    return name in {f"{c.__module__}.{c.__qualname__}" for c in classes}


def _oom_detail(text: str, message: str) -> str:
    detail = "CUDA out of memory"
    step = _STEP.search(text)
    if step:
        detail += f" at step {step[1]}"
    figures = []
    tried = _TRIED.search(message)
    if tried:
        figures.append(f"tried to allocate {tried[1]}")
    in_use = _IN_USE.search(message)
    if in_use:
        figures.append(f"{in_use[1]} in use")
    return f"{detail}: {'; '.join(figures)}" if figures else detail


#: Most characters of a detail; a longer first line is cut at a word, marked with an ellipsis.
DETAIL_CHARS = 300


def _first_line(text: str) -> str:
    lines = (text or "").strip().splitlines()
    if not lines:
        return ""
    line = lines[0]
    if len(line) <= DETAIL_CHARS:
        return line
    cut = line[: DETAIL_CHARS - 1]
    return (cut[: cut.rfind(" ")] if " " in cut else cut).rstrip(" ,;(") + "…"
