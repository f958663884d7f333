"""The interface every backend implements: where a job runs, apart from what it runs.

A backend turns a validated :class:`~sparkgpu.spec.JobSpec` plus a staged run directory
into running ranks. ``resolve`` checks capacity once per job and returns a
:class:`ResolvedJob`, whose ``placement`` the caller hands back to every ``plan`` and ``submit``
of that job: a backend keeps no per-job state between them. The supervisor drives it through
``plan`` (a printable dry run), ``submit``, ``poll`` and ``cancel``; results, tracebacks and
logs come back through the run directory, never through the backend's own channels.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from typing import Any

from sparkgpu.errors import ConfigurationError
from sparkgpu.launch.rundir.directory import RunDir
from sparkgpu.spec import JobSpec, Resources

__all__ = [
    "Backend",
    "LaunchPlan",
    "ResolvedJob",
    "AttemptHandle",
    "create_backend",
    "backend_name",
    "BACKENDS",
]


@dataclasses.dataclass(frozen=True)
class ResolvedJob:
    """A job as its backend will run it.

    Attributes:
        job: The spec with what the backend decided filled in (GPU type, devices, simulated).
        placement: How the backend places the ranks (the Spark backend's
            :class:`~sparkgpu.launch.backends.spark.capacity.RankPlacement`); ``None`` when ``job``
            says it all. Pass it back to ``plan`` and ``submit``.
    """

    job: JobSpec
    placement: Any = None


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What ``submit`` will do for one attempt, printable before anything starts.

    Attributes:
        backend: Backend name.
        attempt: Attempt number.
        nodes: Number of nodes (agents).
        ranks_per_node: Ranks each node starts.
        devices: Device addresses per rank on each node (empty on CPU).
        commands: The agent command line of each node.
        env: Environment variables added for the workers (secrets masked).
    """

    backend: str
    attempt: int
    nodes: int
    ranks_per_node: int
    devices: tuple[str, ...]
    commands: tuple[tuple[str, ...], ...]
    env: dict[str, str]

    def __str__(self) -> str:
        lines = [
            f"backend={self.backend} attempt={self.attempt} nodes={self.nodes} "
            f"ranks_per_node={self.ranks_per_node} devices={list(self.devices) or 'cpu'}"
        ]
        lines += ["  env " + " ".join(f"{k}={v}" for k, v in sorted(self.env.items()))]
        lines += ["  $ " + " ".join(cmd) for cmd in self.commands]
        return "\n".join(lines)


class AttemptHandle(abc.ABC):
    """A running attempt, as its backend tracks it."""

    attempt: int


class Backend(abc.ABC):
    """Runs attempts of jobs somewhere."""

    name: str = ""
    #: Whether an attempt's ranks may start long after ``submit`` (waiting for busy GPUs).
    #: Such a backend says when they did through :meth:`ranks_started_at`; the supervisor
    #: bills the attempt and counts its runtime cap from then instead of from ``submit``.
    waits_for_resources: bool = False

    def place(self, job: JobSpec) -> JobSpec:
        """Where the job goes, before any capacity probe: e.g. the GPU pool it runs on, as a tag
        (:data:`~sparkgpu.pools.POOL_TAG`) whose usage policy is checked before :meth:`resolve`.
        Cheap and idempotent; the job unchanged by default."""
        return job

    @abc.abstractmethod
    def resolve(self, job: JobSpec) -> ResolvedJob:
        """Checks capacity and returns the job with devices assigned, and where its ranks go.

        Must finish within seconds and raise :class:`~sparkgpu.errors.CapacityError` when the
        request can never be satisfied, naming what exists.
        """

    @abc.abstractmethod
    def plan(
        self, job: JobSpec, run_dir: RunDir, attempt: int, env: dict[str, str], placement: Any = None
    ) -> LaunchPlan:
        """The dry run of one attempt.

        Args:
            placement: The :attr:`ResolvedJob.placement` of ``job``; ``None`` (a job continued from
                its run dir) places the ranks anew.
        """

    @abc.abstractmethod
    def submit(
        self, job: JobSpec, run_dir: RunDir, attempt: int, env: dict[str, str], placement: Any = None
    ) -> AttemptHandle:
        """Starts one attempt and returns at once.

        Args:
            placement: As for :meth:`plan`.
        """

    @abc.abstractmethod
    def poll(self, handle: AttemptHandle) -> int | None:
        """``None`` while the attempt runs, else its exit status (0 when every node succeeded)."""

    @abc.abstractmethod
    def cancel(self, handle: AttemptHandle, grace: float) -> None:
        """Stops the attempt: SIGTERM to its ranks, SIGKILL after ``grace`` seconds."""

    def prestart(self, job: JobSpec, run_dir: RunDir, attempt: int, env: dict[str, str]) -> Any:
        """Starts what an attempt can start before the job's callbacks give the rest of its
        environment; ``None`` when nothing can (then :meth:`submit` starts it all).

        Returns:
            An object whose ``start(env)`` returns the attempt's handle once given the whole
            environment, and whose ``discard()`` stops it unstarted.
        """
        return None

    def job_written(self, job: JobSpec, run_dir: RunDir) -> None:  # noqa: B027 - a hook: most backends keep nothing
        """The job's run dir was just written: keep in it what ``sparkgpu resume`` in another process
        needs, even if this client dies before the first attempt (while the job waits for GPUs)."""

    def end_job(self, job: JobSpec) -> None:  # noqa: B027 - a hook: a backend that keeps nothing per job has nothing to free
        """Frees what the backend kept for the job's later attempts; called once the job ended."""

    def preemption_request(self, job: JobSpec) -> str | None:
        """Why a more urgent job asks ``job`` to checkpoint and give way, once the request is
        judged genuine (:mod:`sparkgpu.priority`); ``None`` when none does. Polled while the job
        runs; a backend without a shared queue is never asked."""
        return None

    def give_way(self, job: JobSpec) -> None:  # noqa: B027 - a hook: a backend without a queue holds nothing
        """Frees the GPUs ``job`` holds after it checkpointed and stopped for a more urgent job."""

    def await_capacity(self, job: JobSpec, wait: float | None) -> None:  # noqa: B027 - a hook, as above
        """Waits, in the backend's queue, for the job's GPUs: before its first attempt, and after it
        gave way, before its next one; outside any attempt, so that nobody is billed for the wait.

        Args:
            wait: Seconds to wait; ``None`` for the backend's default (``SPARKGPU_SPARK_WAIT_TIMEOUT``).

        Raises:
            CapacityError: they did not come free within ``wait`` seconds.
        """

    def available_gpus(self, job: JobSpec) -> int | None:
        """How many GPUs an elastic ``job`` could run on now, counting those it holds, in whole
        nodes of its shape and at most ``job.resources.gpus``; ``None`` when the backend cannot
        tell (the job then always waits for all its GPUs)."""
        return None

    def ranks_started_at(self, handle: AttemptHandle) -> float | None:
        """Unix time the attempt's ranks started, ``None`` while they still wait for resources.

        Asked only of backends with :attr:`waits_for_resources`; the others start their ranks
        at ``submit``.
        """
        raise NotImplementedError(f"the {self.name or type(self).__name__} backend starts its ranks at submit")

    def checkpoint_dir(self, run_dir: RunDir) -> str:
        """Where the job's ranks keep checkpoints, shared by all its attempts: a path or fsspec
        URL that every rank and this client reach (``<run dir>/checkpoints`` by default)."""
        return str(run_dir.checkpoints)

    def describe_capacity(self, resources: Resources) -> str:  # pragma: no cover - informative
        return ""

    def worker_image(self) -> dict | None:
        """What the workers' Python already has (a ``hydrate --probe`` dict), so that shipping
        the environment leaves it out; ``None`` when unknown (everything is shipped)."""
        return None


# Imported lazily so the local path never imports pyspark.
BACKENDS = {
    "local": "sparkgpu.launch.backends.local.backend",
    "warm_pool": "sparkgpu.launch.backends.local.warm",
    "spark": "sparkgpu.launch.backends.spark.backend",
}


def backend_name(name: str) -> str:
    """``name`` itself, checked against the known backends."""
    if name not in BACKENDS:
        raise ConfigurationError(f"unknown backend {name!r}; use one of {', '.join(map(repr, BACKENDS))}")
    return name


def create_backend(name: str, **options) -> Backend:
    """Instantiates the backend ``name`` through its module's ``create_backend`` factory."""
    module = importlib.import_module(BACKENDS[backend_name(name)])
    return module.create_backend(**options)
