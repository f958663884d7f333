"""Cross-cutting concerns (tracking, registry, metering) hook into a job through callbacks.

The supervisor and the worker entrypoint call these methods; every method has a no-op
default, so a callback overrides only what it needs. Callbacks must pickle: the worker-side
ones travel to the workers inside the payload.

This module is the one contract between the launcher (:mod:`sparkgpu.launch`) and the
integrations that implement it (:mod:`sparkgpu.tracking`, :mod:`sparkgpu.usage`): it imports
none of them, so neither side imports the other (``tests/unit/test_layering.py``), only the
run dir's states (:mod:`sparkgpu.rundir.states`), which all of them share.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sparkgpu.rundir.states import AttemptStatus

__all__ = ["JobCallback", "WorkerContext", "AttemptOutcome", "reads_results"]


@dataclasses.dataclass(frozen=True)
class WorkerContext:
    """What a worker knows about itself when callbacks run on it."""

    job_id: str
    run_dir: str
    attempt: int
    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    device: str


@dataclasses.dataclass(frozen=True)
class AttemptOutcome:
    """How one attempt ended: ``status`` is an :class:`~sparkgpu.rundir.states.AttemptStatus` (its
    value also converts): ``"succeeded"``, ``"failed"``, ``"preempted"``
    (stopped at the runtime cap or a budget after checkpointing), ``"stopped"`` (by a usage policy,
    without a checkpoint), ``"timed_out"``, ``"cancelled"`` or ``"resized"`` (an elastic job's
    attempt withdrawn before its ranks started, to go on with fewer GPUs). ``gpus`` is what the
    attempt ran on (an elastic job's may be fewer than it asked for). ``started_at`` is when its ranks started;
    ``cause`` says why a failed attempt failed when the backend knows more than the ranks (a
    lost node: ``"executor 1 on host h was lost (...)"``)."""

    attempt: int
    status: AttemptStatus
    started_at: float
    ended_at: float
    gpus: int
    gpu_type: str
    error: BaseException | None = None
    cause: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", AttemptStatus(self.status))


class JobCallback:
    """Hooks around a job. Client-side hooks run in the caller; worker-side hooks on every rank."""

    #: Whether :meth:`after_job` reads the job's results. A subclass whose ``after_job`` ignores
    #: them says ``False``: a supervisor whose callbacks all ignore them, and that returns them to
    #: nobody (a detached job's), then never unpickles them (a model's libraries stay unimported).
    reads_results: bool = True

    # -- client side ---------------------------------------------------------------
    def before_job(self, job, run_dir: str) -> None:
        """After the spec is validated and the payload staged, before the first attempt."""

    def before_attempt(self, job, attempt: int) -> dict[str, str]:
        """Before an attempt is submitted; returns extra environment variables for workers."""
        return {}

    def on_ranks_started(self, job, attempt: int, started_at: float) -> None:
        """Once per attempt, when its ranks started (Unix time): at submit, or on Spark when
        the GPUs they waited for were free. Not called for an attempt whose ranks never ran."""

    def after_attempt(self, job, outcome: AttemptOutcome) -> None:
        """After an attempt ended, whatever the outcome."""

    def on_straggler(self, job, attempt: int, straggler) -> None:
        """When a rank of a running attempt is named a straggler (once per rank and attempt):
        ``straggler`` is a :class:`~sparkgpu.launch.client.stragglers.Straggler` (its rank, node,
        factor, lateness and the job's step time)."""

    def stop_reason(self, job, attempt: int, attempt_seconds: float) -> str | None:
        """Polled about once a second while an attempt runs.

        Returning a reason (e.g. "budget 'team=ml' is spent") asks every rank to checkpoint
        and stop (``runtime.should_checkpoint()`` turns True); the job then ends with
        :class:`~sparkgpu.errors.PolicyViolationError` carrying the reason, and is not
        resumed automatically. Ranks still running ``checkpoint_grace`` after the request are
        stopped: SIGTERM first (a ``Checkpointer`` saves on it), SIGKILL ``shutdown_grace``
        later. ``attempt_seconds`` counts from when the attempt's ranks started.
        """
        return None

    def after_job(self, job, results: list[Any] | None, error: BaseException | None) -> None:
        """Once, when the job has completed or given up; ``results`` (one per rank) once it
        succeeded, else ``None``. A subclass that ignores ``results`` sets ``reads_results = False``."""

    # -- worker side -----------------------------------------------------------------
    def on_worker_start(self, ctx: WorkerContext) -> None:
        """On each rank after the process group is initialised, before the user function."""

    def on_worker_end(self, ctx: WorkerContext, error: BaseException | None) -> None:
        """On each rank after the user function returned or raised."""


def reads_results(callback: JobCallback) -> bool:
    """Whether ``callback``'s :meth:`~JobCallback.after_job` may read the job's results: it is
    overridden and does not say ``reads_results = False``."""
    return type(callback).after_job is not JobCallback.after_job and callback.reads_results
