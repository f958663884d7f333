"""What a backend may do beyond the core interface, each capability a protocol of its own.

The supervisor, ``prepare`` and ``resume`` ask ``isinstance(backend, Capability)`` before they
use one. A backend has a capability by defining its methods; the real ones also name theirs
among their bases, so that mypy checks the signatures. Which backend has which is in
:mod:`sparkgpu.launch.backends.base`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from sparkgpu.launch.backends.base import AttemptHandle, Backend
    from sparkgpu.launch.client.progress_source import ProgressSource
    from sparkgpu.rundir.directory import RunDir
    from sparkgpu.spec import JobSpec

__all__ = [
    "QueuedCapacity",
    "Preemptible",
    "ElasticCapacity",
    "DeferredStart",
    "Reattachable",
    "LocalRanks",
    "WatchedProgress",
]


@runtime_checkable
class LocalRanks(Protocol):
    """The attempt's ranks may run on the client's host, where the supervisor can signal them by pid
    (to dump their stacks, to kill a hung attempt at once)."""

    def ranks_on_this_host(self) -> bool:
        """Whether they do for this backend."""
        ...


@runtime_checkable
class WatchedProgress(Protocol):
    """The supervisor can follow an attempt's ranks' progress while it runs (hang detection,
    :mod:`sparkgpu.launch.client.progress_watch`)."""

    def progress_source(self, handle: AttemptHandle, run_dir: RunDir) -> ProgressSource | None:
        """Where the attempt's ranks' progress is read, their stacks asked for and they are
        stopped; ``None`` when this attempt's cannot be followed."""
        ...


@runtime_checkable
class QueuedCapacity(Protocol):
    """Jobs wait in the backend's queue for their GPUs, by priority, outside any attempt."""

    def await_capacity(self, job: JobSpec, wait: float | None) -> None:
        """Waits in the queue for the job's GPUs.

        Called before the job's first attempt, and after it gave way, before its next one:
        outside any attempt, so that nobody is billed for the wait.

        Args:
            wait: Seconds to wait; ``None`` for the backend's default (``SPARKGPU_SPARK_WAIT_TIMEOUT``).

        Raises:
            CapacityError: they did not come free within ``wait`` seconds.
        """
        ...


@runtime_checkable
class Preemptible(QueuedCapacity, Protocol):
    """A more urgent job may ask a running one to checkpoint and give its GPUs up.

    The job that gave way then waits in the queue (:meth:`QueuedCapacity.await_capacity`) for its
    next attempt.
    """

    def preemption_request(self, job: JobSpec) -> str | None:
        """Why a more urgent job asks ``job`` to give way; ``None`` when none does.

        Only a request judged genuine counts (:mod:`sparkgpu.spec.priority`). Polled while the job runs.
        """
        ...

    def give_way(self, job: JobSpec) -> None:
        """Frees the GPUs ``job`` holds after it checkpointed and stopped for a more urgent job."""
        ...


@runtime_checkable
class ElasticCapacity(Protocol):
    """The backend tells how many GPUs an elastic job (``min_gpus=``) could run on now.

    The job then shrinks and grows (:mod:`sparkgpu.launch.scheduling.elastic`); without this
    capability it always waits for all its GPUs.
    """

    def available_gpus(self, job: JobSpec) -> int | None:
        """How many GPUs an elastic ``job`` could run on now; ``None`` when the backend cannot tell.

        Counts those the job holds, in whole nodes of its shape, at most ``job.resources.gpus``.
        """
        ...


@runtime_checkable
class DeferredStart(Protocol):
    """An attempt's ranks may start long after ``submit`` (waiting for busy GPUs).

    The supervisor then bills the attempt and counts its runtime cap from when they started, and
    asks them to checkpoint before the cap through the stop file; without this capability the
    ranks start at ``submit`` and get their deadline in their environment.
    """

    def ranks_started_at(self, handle: AttemptHandle) -> float | None:
        """Unix time the attempt's ranks started; ``None`` while they still wait for resources."""
        ...


@runtime_checkable
class Reattachable(Protocol):
    """A job can be continued from its run dir in another process (``sparkgpu resume``).

    The backend is rebuilt to reach where the job ran, and the nodes of attempts whose client
    died, which outlive it, are stopped first. ``resume`` looks the job's backend class up by name
    (:func:`~sparkgpu.launch.backends.base.backend_class`) and uses the two class methods; a
    backend without the capability is created anew
    (:func:`~sparkgpu.launch.backends.base.create_backend`) and has nothing to stop.
    """

    def job_written(self, job: JobSpec, run_dir: RunDir) -> None:
        """Keeps in the just written run dir what :meth:`reattach` needs.

        Called at once, so that a client that dies before the first attempt (while the job waits
        for GPUs) leaves a job that can be continued.
        """
        ...

    def detach_refusal(self) -> str | None:
        """Why this backend's jobs cannot be continued by a process of their own now (a detached
        job's keeper rebuilds the backend with :meth:`reattach`); ``None`` when they can."""
        ...

    @classmethod
    def reattach(cls, run_dir: RunDir) -> Backend:
        """The backend for the job in ``run_dir``, continued in this process: where it ran before."""
        ...

    @classmethod
    def stop_lost_attempts(cls, job: JobSpec, run_dir: RunDir, attempts: list[int]) -> None:
        """Stops the nodes of ``attempts``, whose client died while they ran, and waits (bounded).

        The next attempt must not run beside them on the same GPUs and checkpoints.
        """
        ...
