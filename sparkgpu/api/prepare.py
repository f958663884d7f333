"""Prepare a job once, then launch what was prepared.

:func:`prepare` does, once per call, everything that can refuse a job before a process starts:
the backend resolves capacity and placement (:meth:`~sparkgpu.launch.backends.base.Backend.resolve`),
the usage policy checks the resolved job, and the function, arguments and callbacks are pickled
(an error names the argument at fault). Nothing is written: :meth:`PreparedJob.write` ships the
environment (remote jobs) and writes and signs the run dir, and only then can the job launch.

``fn.dryrun()`` is a prepared job's :meth:`~PreparedJob.plan`; ``fn.distributed()`` and
``fn.submit()`` write it and hand it to a supervisor; ``spark.gpu.train(data=...)`` prepares the
job, converts the data only if that succeeded, adds ``data_url`` to the prepared arguments and
launches that same job: one job id, one capacity probe, one pickling of each argument. What a
step needs from an earlier one travels in the :class:`PreparedJob`, never in a backend's memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from sparkgpu._util.report import report
from sparkgpu.config import settings
from sparkgpu.errors import SparkGPUError
from sparkgpu.launch.backends.base import Backend, LaunchPlan
from sparkgpu.launch.backends.capabilities import Reattachable
from sparkgpu.callbacks import JobCallback
from sparkgpu.rundir.keyring import forget_key, new_key, save_key
from sparkgpu.rundir.directory import RunDir
from sparkgpu.launch.client.retention import prune_runs
from sparkgpu.launch.node.preload import modules_to_preload
from sparkgpu.rundir.serialization import add_keyword_arguments, client_sys_path, serialize_payload
from sparkgpu.spec import JobSpec
from sparkgpu.usage.meter import enforce_policy, enforce_pool_policy

__all__ = ["PreparedJob", "prepare"]


@dataclasses.dataclass(frozen=True)
class PreparedJob:
    """A job checked and pickled once, ready to be written and launched.

    Attributes:
        job: The spec as the backend resolved it (GPU type, devices, simulated GPUs, pool tag).
        placement: The backend's placement of the ranks, as ``resolve`` returned it; handed back
            to the backend's ``plan`` and ``submit``. ``None`` when the spec says it all.
        backend: The backend that resolved the job and runs it.
        callbacks: The job's callbacks (they travel inside the payload too).
        payload: The pickled function, arguments and callbacks.
        run_dir: The job's run dir; it exists once :attr:`written`.
        key: The key that signs the run dir and the ranks' results.
        ship_environment: Whether :meth:`write` ships this Python environment to the workers.
        environment: The shipped environment's manifest once written; ``None`` otherwise.
        written: Whether the run dir is written and the key saved: only then can it launch.
    """

    job: JobSpec
    placement: Any
    backend: Backend
    callbacks: list[JobCallback]
    payload: bytes
    run_dir: RunDir
    key: bytes
    ship_environment: bool = False
    environment: dict | None = None
    written: bool = False
    preload: list = dataclasses.field(default_factory=list)  # sparkgpu.launch.node.preload

    def plan(self, attempt: int = 0) -> LaunchPlan:
        """What the backend will start for ``attempt``: the printable dry run."""
        return self.backend.plan(
            self.job, self.run_dir, attempt, {"SPARKGPU_JOB_ID": self.job.job_id}, placement=self.placement
        )

    def with_kwargs(self, **extra: Any) -> "PreparedJob":
        """This job with more keyword arguments for the function; only those are pickled.

        Raises:
            SerializationError: an argument cannot be sent to the workers.
            SparkGPUError: the job is written already (its signed payload cannot change).
        """
        if self.written:
            raise SparkGPUError(f"job {self.job.job_id} is written and signed; add arguments before write()")
        return dataclasses.replace(self, payload=add_keyword_arguments(self.payload, extra))

    def write(self) -> "PreparedJob":
        """Ships the environment (when asked), writes and signs the run dir and saves the key.

        Starts no process. Old finished jobs' run dirs beyond ``SPARKGPU_KEEP_RUNS`` are removed.

        Returns:
            The written job, ready for :meth:`supervisor`.

        Raises:
            EnvironmentTooLargeError, EnvironmentMismatchError: the environment cannot be
                shipped; raised before the run dir is written.
            SparkGPUError: the job is written already.
        """
        if self.written:
            raise SparkGPUError(f"job {self.job.job_id} is written already; prepare a new job to launch again")
        spec, extra_files, sys_path, environment = self.job.to_dict(), {}, client_sys_path(), None
        if self.preload:
            spec["preload"] = self.preload
        if self.ship_environment:
            from sparkgpu.env import stage_environment, worker_bootstrap_files

            staged = stage_environment(worker_has=self.backend.worker_image())
            report(f"environment staged: {staged.report}")
            spec["env"] = environment = staged.manifest
            extra_files.update(worker_bootstrap_files())
            sys_path = []  # the caller's code travels in the overlay, not as client paths
        self.run_dir.create(spec, self.payload, self.key, sys_path, extra_files)
        save_key(self.job.job_id, self.key)
        if isinstance(self.backend, Reattachable):  # what `sparkgpu resume` needs, before any attempt
            self.backend.job_written(self.job, self.run_dir)
        prune_runs(keep=self.job.job_id)
        return dataclasses.replace(self, environment=environment, written=True)

    def discard(self) -> None:
        """Removes a written job that never started: its run dir and its key."""
        import shutil

        shutil.rmtree(self.run_dir.path, ignore_errors=True)
        forget_key(self.job.job_id)

    def supervisor(self, out=None):
        """A :class:`~sparkgpu.launch.client.supervisor.Supervisor` for this written job; starts nothing.

        Raises:
            SparkGPUError: the job is not written yet.
        """
        from sparkgpu.launch.client.supervisor import Supervisor

        if not self.written:
            raise SparkGPUError(f"job {self.job.job_id} is not written yet; call write() first")
        return Supervisor(
            self.job, self.run_dir, self.backend, self.key, self.callbacks, out=out, placement=self.placement
        )


def prepare(
    spec: JobSpec,
    fn: Callable,
    args: tuple,
    kwargs: dict,
    *,
    backend: Backend,
    callbacks: list[JobCallback],
    ship_environment: bool = False,
) -> PreparedJob:
    """Checks and pickles a job once; writes nothing and starts nothing.

    Args:
        spec: The job as asked for (not yet resolved); its ``job_id`` names the run dir.
        fn: The function every rank runs.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        backend: Where it runs; resolves the spec.
        callbacks: The job's callbacks; a usage meter among them brings its policy.
        ship_environment: Ship this environment to the workers when the job is written.

    Returns:
        The prepared job: ``.plan()`` is its dry run, ``.write()`` makes it launchable.

    Raises:
        CapacityError: the backend can never give these GPUs (within seconds).
        PolicyViolationError: the usage policy refuses the job.
        SerializationError: the function, an argument or a callback does not pickle.
    """
    placed = backend.place(spec)  # e.g. the GPU pool: cheap, no probe yet
    enforce_pool_policy(placed)  # that pool's usage policy refuses before any probe runs
    resolved = backend.resolve(placed)  # capacity and gpu_type checks, within seconds
    job = resolved.job
    enforce_policy(job, callbacks)  # usage policy, on the resolved GPU type
    payload = serialize_payload(fn, args, kwargs, callbacks)  # picklability, naming the culprit
    return PreparedJob(
        job=job,
        placement=resolved.placement,
        backend=backend,
        callbacks=list(callbacks),
        payload=payload,
        run_dir=RunDir(settings().staging_root / job.job_id),
        key=new_key(),
        ship_environment=ship_environment,
        preload=modules_to_preload(fn),
    )
