"""A job's priority class: which waiting job gets free GPUs first, and which running job gives way.

``priority=`` on ``@distributed``, ``spark.gpu.train``, a job file and ``sparkgpu run
--priority``. Three classes, as ``databricks.air``'s ``priority_class`` has them:

- ``best_effort``: runs on GPUs nobody more urgent needs. A ``critical`` job that does not fit
  asks it to checkpoint and stop (``runtime.should_checkpoint()`` turns True, as at the runtime
  cap); it resumes by itself, in a new attempt that uses no restart, once GPUs come free.
- ``normal`` (the default): waits its turn, is never stopped for another job.
- ``critical``: goes first in the queue and may preempt ``best_effort`` jobs.

Within a class, waiting jobs are served in the order they asked.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TypeVar

from sparkgpu.errors import ConfigurationError

__all__ = ["Priority", "fewest_to_stop"]

_Job = TypeVar("_Job")


class Priority(str, enum.Enum):
    """A job's priority class; ``str``-valued, so a spec's JSON holds ``"best_effort"``."""

    BEST_EFFORT = "best_effort"
    NORMAL = "normal"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        """Higher goes first: ``critical`` 2, ``normal`` 1, ``best_effort`` 0."""
        return _RANKS[self]

    @property
    def preemptible(self) -> bool:
        """Whether a ``critical`` job may ask a running job of this class to checkpoint and stop."""
        return self is Priority.BEST_EFFORT

    @classmethod
    def parse(cls, value: object) -> Priority:
        """The class from ``"best_effort"``, ``"BEST_EFFORT"`` (databricks' spelling), ``"best-effort"``,
        a :class:`Priority`, or ``None`` (``normal``).

        Raises:
            ConfigurationError: anything else; names the accepted values.
        """
        if value is None:
            return cls.NORMAL
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            with_underscores = value.strip().lower().replace("-", "_")
            for member in cls:
                if member.value == with_underscores:
                    return member
        raise ConfigurationError(
            f"priority={value!r}: use 'best_effort', 'normal' or 'critical' "
            "(databricks' BEST_EFFORT / NORMAL / CRITICAL are accepted too, in any case)"
        )


_RANKS = {Priority.BEST_EFFORT: 0, Priority.NORMAL: 1, Priority.CRITICAL: 2}


def fewest_to_stop(held: Sequence[tuple[_Job, int]], *, free: int, need: int) -> list[_Job]:
    """The preemptible jobs a critical job asks to give way: the first of ``held`` (each job with
    the GPUs it holds, in the caller's order of preference, most GPUs first for the fewest jobs)
    whose GPUs, with the ``free`` ones, make up ``need``. None when even all of them would not:
    stopping them would only idle their GPUs behind the jobs that hold the rest."""
    if free + sum(gpus for _, gpus in held) < need:
        return []
    chosen = []
    for job, gpus in held:
        if free >= need:
            break
        chosen.append(job)
        free += gpus
    return chosen
