"""The interface every backend implements: where a job runs, apart from what it runs.

A backend turns a validated :class:`~sparkgpu.spec.JobSpec` plus a staged run directory
into running ranks. ``resolve`` checks capacity once per job and returns a
:class:`ResolvedJob`, whose ``placement`` the caller hands back to every ``plan`` and ``submit``
of that job (``None`` for a job continued from its run dir: the backend places it anew). The
supervisor drives it through ``plan`` (a printable dry run), ``submit``, ``poll`` and ``cancel``;
results, tracebacks and logs come back through the run directory, never through the backend's
own channels. A backend may keep what a job holds between its attempts (the local backend's
GPU lease and standby, the Spark backend's place in the cluster's queue and staging mirror),
keyed by job id; ``end_job`` frees it once the job ended.

The core is what every backend needs; what only some backends can do is a capability, a
protocol of :mod:`sparkgpu.launch.backends.capabilities` that callers check with ``isinstance``:

================  ===============================================================  =====  =====
Part              What it holds, and why there                                     local  spark
================  ===============================================================  =====  =====
core, abstract    ``resolve``, ``plan``, ``submit``, ``poll``, ``cancel``: what    yes    yes
                  running a job is
core, hooks       ``place``, ``prestart``, ``checkpoint_dir``, ``worker_image``,   yes    yes
                  ``end_job``: their defaults fit any backend (the job unchanged,
                  nothing started ahead, ``<run dir>/checkpoints``, image
                  unknown, nothing to free)
QueuedCapacity    ``await_capacity``: jobs wait for GPUs in a queue, by priority   yes    yes
Preemptible       ``preemption_request``, ``give_way``: a running job gives way    yes    yes
                  to an urgent one, then waits in the queue again
ElasticCapacity   ``available_gpus``: the GPUs free now, for elastic jobs          no     yes
DeferredStart     ``ranks_started_at``: ranks may start long after ``submit``      no     yes
Reattachable      ``job_written``, ``reattach``, ``stop_lost_attempts``,           no     yes
                  ``detach_refusal``: a resumed or detached job reaches where it
                  ran; its nodes outlive a dead client
LocalRanks        ``ranks_on_this_host``: the supervisor may signal its ranks by   yes    no
                  pid
WatchedProgress   ``progress_source``: where the supervisor reads the ranks'       yes    yes
                  progress, asks for their stacks and stops them (hang
                  detection): this host's memory; node 0's state on Spark
================  ===============================================================  =====  =====

The ``warm_pool`` backend is the local one with warm ranks, capabilities included. ``prestart``
stays a hook: its ``None`` lets the warm pool, a local backend, start nothing ahead.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from typing import Any

from sparkgpu.errors import ConfigurationError
from sparkgpu.rundir.directory import RunDir
from sparkgpu.spec import JobSpec

__all__ = [
    "Backend",
    "LaunchPlan",
    "ResolvedJob",
    "AttemptHandle",
    "create_backend",
    "backend_class",
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
    """Runs attempts of jobs somewhere: the core every backend has (the capabilities beyond it are
    :mod:`sparkgpu.launch.backends.capabilities`)."""

    name: str = ""

    def place(self, job: JobSpec) -> JobSpec:
        """Where the job goes, before any capacity probe: e.g. the GPU pool it runs on, as a tag
        (:data:`~sparkgpu.spec.pools.POOL_TAG`) whose usage policy is checked before :meth:`resolve`.
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

    def end_job(self, job: JobSpec) -> None:  # noqa: B027 - a hook: a backend that keeps nothing per job has nothing to free
        """Frees what the backend kept for the job's later attempts; called once the job ended."""

    def checkpoint_dir(self, run_dir: RunDir) -> str:
        """Where the job's ranks keep checkpoints, shared by all its attempts: a path or fsspec
        URL that every rank and this client reach (``<run dir>/checkpoints`` by default)."""
        return str(run_dir.checkpoints)

    def worker_image(self) -> dict | None:
        """What the workers' Python already has (a ``hydrate --probe`` dict), so that shipping
        the environment leaves it out; ``None`` when unknown (everything is shipped)."""
        return None


#: Each backend's name, and its class as ``module:class``; imported lazily so the local path
#: never imports pyspark.
BACKENDS = {
    "local": "sparkgpu.launch.backends.local.backend:LocalBackend",
    "warm_pool": "sparkgpu.launch.backends.local.warm:WarmBackend",
    "spark": "sparkgpu.launch.backends.spark.backend:SparkBackend",
}


def backend_name(name: str) -> str:
    """``name`` itself, checked against the known backends."""
    if name not in BACKENDS:
        raise ConfigurationError(f"unknown backend {name!r}; use one of {', '.join(map(repr, BACKENDS))}")
    return name


def backend_class(name: str) -> type[Backend]:
    """The class of the backend ``name``, its module imported: what its capabilities are, before
    any instance exists (``sparkgpu resume`` rebuilds a job's backend through it)."""
    module, _, cls = BACKENDS[backend_name(name)].partition(":")
    return getattr(importlib.import_module(module), cls)


def create_backend(name: str, **options) -> Backend:
    """Instantiates the backend ``name`` with ``options``."""
    return backend_class(name)(**options)
