"""Whether a failed attempt is restarted: :class:`FailurePolicy` and its :class:`Decision`.

A restart is worth its GPU time only where the next attempt may end otherwise. Raised at once,
whatever restarts are left:

* failures the same payload on the same workers meets again: a payload whose signature does
  not match (:class:`~sparkgpu.errors.PayloadSignatureError`), a worker environment that does
  not fit the client's (:class:`~sparkgpu.errors.EnvironmentMismatchError`);
* a failure after the function returned (:class:`~sparkgpu.errors.ResultError`: its result
  could not be written back): a new attempt would train again and fail the same way at its end;
* the same exception at the same place as in the previous failed attempt (:func:`failure_location`):
  the restart it had changed nothing.

Everything else (a lost node, a rank killed by a signal, an exception at a new place) is
restarted while restarts are left.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence

from sparkgpu.errors import (
    EnvironmentMismatchError,
    PayloadSignatureError,
    RankFailure,
    ResultError,
    first_failure,
)

__all__ = ["Decision", "FailurePolicy", "failure_location"]


class Decision(enum.Enum):
    RESTART = "restart"
    RAISE = "raise"


#: A frame of a formatted traceback: its file, line and function.
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)', re.MULTILINE)
#: Where library code lives, on any machine: installed packages, the standard library, frozen modules.
_LIBRARY = re.compile(r"[/\\](site|dist)-packages[/\\]|[/\\]lib[/\\]python\d+(\.\d+)?[/\\]|^<frozen ")


def failure_location(failures: Sequence[RankFailure]) -> tuple[str, str] | None:
    """Where an attempt failed: the first failure's exception type and innermost frame of user code.

    The innermost frame outside installed packages and the standard library, or the innermost
    frame of all when every frame is library code, as ``"file:line in function"``. ``None``
    when the first failure has no Python exception or traceback (a signal, a lost node):
    those are no place to fail at again.
    """
    if not failures:
        return None
    first = first_failure(list(failures))
    if first.exc_type is None or not first.traceback:
        return None
    # The last traceback of a chain is the one raised; the chained ones above it led there.
    raised = first.traceback.rsplit("\nThe above exception was the direct cause", 1)[-1]
    raised = raised.rsplit("\nDuring handling of the above exception", 1)[-1]
    frames = [(m["file"], m["line"], m["name"]) for m in _FRAME.finditer(raised)]
    if not frames:
        return None
    user = [frame for frame in frames if not _LIBRARY.search(frame[0])]
    file, line, name = (user or frames)[-1]
    return first.exc_type, f"{file}:{line} in {name}"


class FailurePolicy:
    """Restart a failed attempt while restarts are left, then raise; raise at once what no restart fixes.

    See the module docstring for what is never restarted.
    """

    PERMANENT = (PayloadSignatureError, EnvironmentMismatchError, ResultError)

    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts

    def decide(
        self,
        restarts_used: int,
        exceptions: dict[int, BaseException],
        failures: Sequence[RankFailure] = (),
        previous: Sequence[RankFailure] = (),
    ) -> Decision:
        """Restart or raise.

        Args:
            restarts_used: Restarts the job used so far.
            exceptions: The ranks' exceptions (those that unpickled here) by rank.
            failures: The failed attempt's :class:`~sparkgpu.errors.RankFailure` of every failed rank.
            previous: Those of the job's previous failed attempt, if any.
        """
        if self.unrestartable(exceptions, failures, previous) is not None:
            return Decision.RAISE
        return Decision.RESTART if restarts_used < self.max_restarts else Decision.RAISE

    def unrestartable(
        self,
        exceptions: dict[int, BaseException],
        failures: Sequence[RankFailure] = (),
        previous: Sequence[RankFailure] = (),
    ) -> str | None:
        """Why no restart can fix the failure (``"it failed after ..."``), or ``None`` when one may; args as :meth:`decide`'s."""
        permanent = _names(self.PERMANENT)  # for a rank whose exception did not unpickle here
        found = [type(exc) for exc in exceptions.values() if isinstance(exc, self.PERMANENT)]
        found_names = [f.exc_type for f in failures if f.exc_type in permanent]
        if any(issubclass(cls, ResultError) for cls in found) or _names([ResultError]) & set(found_names):
            return "after its function returned: its result could not be written back"
        if found or found_names:
            return f"with {(found[0].__name__ if found else found_names[0])}, which the same payload meets again"
        here = failure_location(failures)
        if here is not None and here == failure_location(previous):
            return f"with {here[0]} at {here[1]} again, as the attempt before it"
        return None


def _names(classes: Iterable[type]) -> frozenset[str]:
    # How a RankFailure names its exception type (sparkgpu.launch.rundir.serialization.serialize_error).
    return frozenset(f"{cls.__module__}.{cls.__qualname__}" for cls in classes)
