"""Whether a failed attempt is restarted: :class:`FailurePolicy` and its :class:`Decision`.

A restart is worth its GPU time only where the next attempt may end otherwise. Each failure
has a class (:func:`~sparkgpu.failure_class.classify`), and :data:`DEFAULT_POLICY` says per
class whether it is restarted and why; ``restart_on=`` (:class:`~sparkgpu.spec.RunPolicy`)
names the restarted classes instead. Raised at once by default, whatever restarts are left:

* ``environment_error``: failures the same payload on the same workers meets again (a payload
  whose signature does not match, a worker environment that does not fit the client's, an
  import that fails);
* ``result_error``: a failure after the function returned (its result could not be written
  back): a new attempt would train again and fail the same way at its end;
* ``data_error``, and ``cuda_oom``: the same batch needs the same memory again (the message
  names the fixes);
* whatever the class, the same exception at the same place as in the previous failed attempt
  (:func:`failure_location`): the restart it had changed nothing.

A ``bad_node`` (a node failed its pre-flight check) is restarted where the next attempt can leave
the node out (Spark), and raised at once where it cannot (one host).

Everything else (``nccl``, ``lost_node``, ``bad_node``, ``killed``, ``host_oom``, ``native_crash``, a user
exception at a new place) is restarted while restarts are left.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence

from sparkgpu.errors import RankFailure, first_failure
from sparkgpu.failure_class import Classified, FailureClass, classify

__all__ = ["Decision", "FailurePolicy", "failure_location", "DEFAULT_POLICY", "RESTARTED_BY_DEFAULT"]


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


#: The default failure policy, per class: restarted (while restarts are left) or raised at once, and why.
DEFAULT_POLICY: dict[FailureClass, tuple[bool, str]] = {
    FailureClass.USER_EXCEPTION: (
        True,
        "an exception at a new place may not happen again (the same place twice is raised)",
    ),
    FailureClass.NCCL: (True, "a collective's error or timeout is often transient"),
    FailureClass.LOST_NODE: (True, "the next attempt runs on nodes that are there"),
    FailureClass.BAD_NODE: (True, "the next attempt leaves the node out"),
    FailureClass.KILLED: (True, "a signal from outside says nothing of the job"),
    FailureClass.HOST_OOM: (True, "the host's memory may be free again"),
    FailureClass.NATIVE_CRASH: (True, "a crash in a kernel or a library may be transient"),
    FailureClass.HANG: (True, "a hang may be transient"),
    FailureClass.CUDA_OOM: (False, "the same batch on the same GPUs needs the same memory again"),
    FailureClass.DATA_ERROR: (False, "the same data fails the same way"),
    FailureClass.ENVIRONMENT_ERROR: (False, "the same payload meets the same environment again"),
    FailureClass.RESULT_ERROR: (False, "a new attempt would train again and fail the same way at its end"),
}
#: The classes the default failure policy restarts.
RESTARTED_BY_DEFAULT = tuple(c.value for c, (restart, _) in DEFAULT_POLICY.items() if restart)


class FailurePolicy:
    """Restart a failed attempt while restarts are left, then raise; raise at once what no restart fixes.

    Args:
        max_restarts: Restarts a job may use.
        restart_on: The failure classes (:class:`~sparkgpu.failure_class.FailureClass` values)
            restarted; ``None``: :data:`DEFAULT_POLICY`'s. The same exception at the same place
            twice is raised whatever it names.

    See the module docstring for what is never restarted.
    """

    def __init__(self, max_restarts: int, restart_on: Sequence[str] | None = None):
        self.max_restarts = max_restarts
        self.restart_on = frozenset(RESTARTED_BY_DEFAULT if restart_on is None else restart_on)
        self.explicit = restart_on is not None

    def decide(
        self,
        restarts_used: int,
        exceptions: dict[int, BaseException],
        failures: Sequence[RankFailure] = (),
        previous: Sequence[RankFailure] = (),
        lost: str = "",
    ) -> Decision:
        """Restart or raise.

        Args:
            restarts_used: Restarts the job used so far.
            exceptions: The ranks' exceptions (those that unpickled here) by rank.
            failures: The failed attempt's :class:`~sparkgpu.errors.RankFailure` of every failed rank.
            previous: Those of the job's previous failed attempt, if any.
            lost: The backend's account of a lost node of the attempt, ``""`` when none.
        """
        if self.unrestartable(exceptions, failures, previous, lost) is not None:
            return Decision.RAISE
        return Decision.RESTART if restarts_used < self.max_restarts else Decision.RAISE

    def unrestartable(
        self,
        exceptions: dict[int, BaseException],
        failures: Sequence[RankFailure] = (),
        previous: Sequence[RankFailure] = (),
        lost: str = "",
    ) -> str | None:
        """Why no restart can fix the failure (``"it failed after ..."``), or ``None`` when one may; args as :meth:`decide`'s."""
        found = classify(failures, exceptions, lost=lost)
        # A payload or an environment that fails on any rank fails there again, whichever rank failed first.
        for rank_found in _each_rank(exceptions, failures):
            if rank_found.cls in _ANY_RANK and rank_found.cls.value not in self.restart_on:
                found = rank_found
                break
        here = failure_location(failures) if not lost else None
        if found.cls.value not in self.restart_on:
            return self._why_not(found)
        if found.cls is FailureClass.BAD_NODE and not _replaceable(exceptions, failures):
            return f"({found}): the job has no other node to run on; fix the node, then `sparkgpu resume` the job"
        if here is not None and here == failure_location(previous):
            return f"with {here[0]} at {here[1]} again, as the attempt before it"
        return None

    def _why_not(self, found: Classified) -> str:
        if self.explicit:
            return f"({found}), a class restart_on= does not name ({', '.join(sorted(self.restart_on)) or 'none'})"
        if found.cls is FailureClass.RESULT_ERROR:
            return "after its function returned: its result could not be written back"
        if found.cls is FailureClass.CUDA_OOM:
            return (
                f"({found}): the same batch on the same GPUs needs the same memory again; lower the batch size "
                "per rank, turn on gradient checkpointing (or a smaller model, fewer sequence tokens), or pass "
                "restart_on= with cuda_oom among the classes to retry anyway"
            )
        if found.cls is FailureClass.ENVIRONMENT_ERROR:
            return f"({found}), which the same payload meets again"
        return f"({found}): {DEFAULT_POLICY[found.cls][1]}"


def _replaceable(exceptions: dict[int, BaseException], failures: Sequence[RankFailure]) -> bool:
    """Whether the root cause rank's :class:`~sparkgpu.errors.PreflightError` says another node can stand in."""
    root = first_failure(list(failures)).rank if failures else min(exceptions, default=None)
    return bool(getattr(exceptions.get(root) if root is not None else None, "replaceable", True))


#: Classes that decide the attempt's fate when any rank meets them, not only the root cause rank.
_ANY_RANK = (FailureClass.RESULT_ERROR, FailureClass.ENVIRONMENT_ERROR)


def _each_rank(exceptions: dict[int, BaseException], failures: Sequence[RankFailure]) -> list[Classified]:
    by_rank = {f.rank: f for f in failures}
    ranks = sorted(set(exceptions) | set(by_rank))
    found = [
        classify([by_rank[r]] if r in by_rank else [], {r: exceptions[r]} if r in exceptions else {}) for r in ranks
    ]
    return sorted(found, key=lambda c: _ANY_RANK.index(c.cls) if c.cls in _ANY_RANK else len(_ANY_RANK))
