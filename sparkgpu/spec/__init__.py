"""What to run, apart from where it runs: frozen, validated descriptions of a job.

A :class:`JobSpec` is built and validated once on the client, before any process starts,
then handed to a backend. It round-trips through JSON (``to_dict`` / ``from_dict``) because
it is written into the run directory, where workers, ``sparkgpu jobs`` and ``sparkgpu
resume`` read it.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import re
import secrets
from typing import Any, Callable

from sparkgpu.spec.catalog import AcceleratorShape, lookup_accelerator_type, lookup_gpu_type
from sparkgpu.errors import ConfigurationError
from sparkgpu.failure_class import parse_failure_classes
from sparkgpu.spec.priority import Priority
from sparkgpu.spec.units import parse_duration

__all__ = [
    "Resources",
    "RunPolicy",
    "JobSpec",
    "ELASTIC_WAIT",
    "new_job_id",
    "requested_resources",
    "log_rank_selection",
]

#: Seconds an elastic job waits for all its GPUs before going on with fewer, unless it says.
#: Replacing a cloud GPU node takes 10 to 30 minutes; a quarter of an hour keeps most of a
#: replacement's time and loses little when none comes.
ELASTIC_WAIT = 15 * 60.0


def new_job_id(name: str) -> str:
    """A job id that sorts by time and says what ran: ``<name>-<utc timestamp>-<random>``."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40] or "job"
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{slug}-{stamp}-{secrets.token_hex(3)}"


@dataclasses.dataclass(frozen=True)
class Resources:
    """The accelerators a job asks for.

    Attributes:
        gpus: Number of ranks; one GPU each (one CPU process each for ``gpu_type="cpu"``).
        gpu_type: Canonical catalog name (``"H100"``, ``"A10"``, ``"cpu"``, ...) or ``None``
            for "whatever this host has" on local runs.
        remote: Run on a remote GPU pool (the Spark backend) instead of this host.
        gpus_per_node: GPUs each node of the pool carries, when a node shape was asked for
            (``accelerator_type="GPU_8xH100"``: 8); ``None`` lets the backend choose. A
            remote job's ``gpus`` must then be a whole number of nodes.
        min_gpus: Makes a remote job elastic: when its ``gpus`` do not come back within
            ``elastic_wait`` (after a lost node, or at submit), it goes on from its last
            checkpoint with as many as are free, down to ``min_gpus``, and grows back to
            ``gpus`` at a checkpoint once they are free again. ``None``: always ``gpus``.
    """

    gpus: int = 1
    gpu_type: str | None = None
    remote: bool = False
    gpus_per_node: int | None = None
    min_gpus: int | None = None

    def __post_init__(self):
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int):
            raise ConfigurationError(f"gpus must be a positive integer, got {self.gpus!r}")
        if self.gpus < 1:
            raise ConfigurationError(f"gpus must be at least 1, got {self.gpus}")
        if not isinstance(self.remote, bool):
            raise ConfigurationError(f"remote must be True or False, got {self.remote!r}")
        if self.gpu_type is not None:
            gpu = lookup_gpu_type(self.gpu_type)
            object.__setattr__(self, "gpu_type", gpu.name)
        if self.remote and self.gpu_type is None:
            raise ConfigurationError(
                "remote=True needs a gpu_type, e.g. @distributed(gpus=8, gpu_type='H100', remote=True)"
            )
        per_node = self.gpus_per_node
        if per_node is not None:
            if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
                raise ConfigurationError(f"gpus_per_node must be a positive integer, got {per_node!r}")
            if self.remote and self.gpus % per_node:
                raise ConfigurationError(
                    f"{self.gpus} GPUs are not a whole number of {per_node}-GPU nodes; ask for a multiple "
                    f"of {per_node} (e.g. {per_node * max(1, round(self.gpus / per_node))})"
                )

        self._check_min_gpus()

    def _check_min_gpus(self) -> None:
        low = self.min_gpus
        if low is None:
            return
        if isinstance(low, bool) or not isinstance(low, int) or not 1 <= low <= self.gpus:
            raise ConfigurationError(f"min_gpus must be an integer from 1 to gpus={self.gpus}, got {low!r}")
        if not self.remote:
            raise ConfigurationError(
                "min_gpus= makes a remote job elastic (its nodes may be lost and replaced); a local job runs on "
                "this host's GPUs: drop min_gpus=, or pass remote=True"
            )
        per_node = self.gpus_per_node
        if per_node is not None and low % per_node:
            raise ConfigurationError(
                f"min_gpus={low} is not a whole number of {per_node}-GPU nodes; ask for a multiple of {per_node}"
            )

    @property
    def is_cpu(self) -> bool:
        return self.gpu_type == "cpu"

    @property
    def elastic(self) -> bool:
        """Whether the job may run on fewer GPUs than it asks for (``min_gpus`` below ``gpus``)."""
        return self.min_gpus is not None and self.min_gpus < self.gpus

    def resized(self, gpus: int) -> "Resources":
        """The same request for ``gpus`` ranks: what one attempt of an elastic job runs on."""
        return dataclasses.replace(
            self, gpus=gpus, min_gpus=None if self.min_gpus is None else min(self.min_gpus, gpus)
        )


def requested_resources(
    *,
    num_accelerators=None,
    accelerator_type=None,
    gpus=None,
    num_gpus=None,
    gpu_type=None,
    remote: bool = False,
    min_gpus=None,
    host_gpu_count: Callable[[], int] = lambda: 0,
) -> Resources:
    """The :class:`Resources` that ``@distributed``'s arguments ask for, in either API's names.

    ``num_accelerators`` / ``gpus`` / ``num_gpus`` name the count and ``accelerator_type`` /
    ``gpu_type`` the hardware; names of one meaning may be combined only when they agree.
    ``accelerator_type`` is a node shape (``"GPU_8xH100"``) or, as Databricks still accepts, a
    plain GPU type (``"H100"``). A ``(min, max)`` pair as the count asks for ``max`` GPUs and
    makes the job elastic down to ``min`` (the same as ``min_gpus=min``).

    Args:
        host_gpu_count: Called for the count when none is given on a local GPU job: every GPU
            of this host (one CPU rank when it has none).

    Raises:
        ConfigurationError: unknown type or shape, a non-positive count, names that disagree,
            or a remote count that is not a whole number of nodes of the shape.
    """
    counts = {
        name: value
        for name, value in (("num_accelerators", num_accelerators), ("gpus", gpus), ("num_gpus", num_gpus))
        if value is not None
    }
    for name, value in list(counts.items()):
        if isinstance(value, (tuple, list)):  # (min, max): an elastic job
            if len(value) != 2:
                raise ConfigurationError(f"{name}={value!r}: give one count, or a (min, max) pair such as (8, 16)")
            low, counts[name] = value
            if min_gpus is not None and min_gpus != low:
                raise ConfigurationError(f"{name}={value!r} and min_gpus={min_gpus!r} disagree; pass only one")
            min_gpus = low
    if len(set(map(repr, counts.values()))) > 1:
        given = " and ".join(f"{k}={v!r}" for k, v in counts.items())
        raise ConfigurationError(f"{given} disagree; pass only num_accelerators=")
    count = next(iter(counts.values()), None)

    shape: AcceleratorShape | None = None
    accelerator = getattr(accelerator_type, "value", accelerator_type)  # an Enum member works too
    if accelerator is not None:
        if isinstance(accelerator, str) and accelerator.strip().upper().startswith("GPU_"):
            shape = lookup_accelerator_type(accelerator)
            accelerator = shape.gpu.name
        else:
            accelerator = lookup_gpu_type(accelerator).name
        if gpu_type is not None and lookup_gpu_type(gpu_type).name != accelerator:
            raise ConfigurationError(
                f"accelerator_type={accelerator_type!r} and gpu_type={gpu_type!r} name different GPUs; "
                "pass only accelerator_type="
            )
    chosen_type = accelerator if accelerator is not None else gpu_type

    if count is None:
        if remote:
            count = shape.gpus_per_node if shape else 1  # one node of the shape
        elif chosen_type is not None and lookup_gpu_type(chosen_type).is_cpu:
            count = 1
        else:
            count = host_gpu_count() or 1
    return Resources(
        gpus=count,
        gpu_type=chosen_type,
        remote=remote,
        gpus_per_node=shape.gpus_per_node if shape else None,
        min_gpus=min_gpus,
    )


#: What turns hang detection off (``progress_timeout="off"`` or ``False``); held as 0 in the policy.
PROGRESS_OFF = ("off", "none", False, 0, 0.0)


def parse_progress_timeout(value) -> float | None:
    """``progress_timeout=`` as the policy holds it: seconds, ``None`` (the default) or 0 (off).

    Raises:
        ConfigurationError: a negative or malformed value; the message names what it takes.
    """
    if value is None:
        return None
    if (isinstance(value, str) and value.strip().lower() in PROGRESS_OFF) or (
        not isinstance(value, str) and value in PROGRESS_OFF
    ):
        return 0.0
    fix = "pass seconds or a duration such as '10m', None for the default, or 'off' to turn hang detection off"
    try:
        return parse_duration(value, name="progress_timeout")
    except ConfigurationError as exc:
        raise ConfigurationError(f"{exc}; {fix}") from None


@dataclasses.dataclass(frozen=True)
class RunPolicy:
    """How long a job may run and how it recovers.

    Attributes:
        timeout: Limit on the whole call in seconds (all attempts); ``None`` for none.
        max_runtime: Cap on one attempt in seconds. ``checkpoint_grace`` before it, ranks see
            ``runtime.should_checkpoint()`` turn True; the job then resumes in a new attempt.
        checkpoint_grace: Seconds before the cap at which ranks are asked to checkpoint.
        max_restarts: Attempts restarted after a failure before the failure is raised.
        shutdown_grace: Seconds ranks get to exit after SIGTERM before SIGKILL.
        init_timeout: Seconds the process group waits for all ranks to join.
        priority: The job's :class:`~sparkgpu.spec.priority.Priority` class: its place among jobs
            waiting for GPUs, and whether a ``critical`` job may preempt it.
        capacity_wait: Seconds a remote attempt may wait for its GPUs (at submit, after a lost
            node, after giving way) before the job fails; ``None``: its ``max_runtime``, else
            ``SPARKGPU_SPARK_WAIT_TIMEOUT``. Nothing is billed while it waits.
        elastic_wait: Seconds an elastic job's attempt waits for all its GPUs before it goes on
            with fewer (:attr:`Resources.min_gpus`); ``None``: :data:`ELASTIC_WAIT`.
        restart_on: The failure classes (:class:`~sparkgpu.failure_class.FailureClass` values)
            restarted while restarts are left; ``None``: the default failure policy's
            (:data:`~sparkgpu.launch.client.failure_policy.DEFAULT_POLICY`).
        progress_timeout: Seconds a rank may go without progress (optimizer steps, checkpoint
            steps, loader batches, ``runtime.heartbeat()``) before the attempt counts as hung:
            every rank's stacks are dumped, the ranks are stopped and the failure is ``hang``
            (restarted from the latest checkpoint by the default failure policy). ``None``: the default,
            :func:`~sparkgpu.launch.client.progress_watch.default_progress_timeout` once a rank
            made progress; ``0``: off (``"off"`` or ``False`` as given to ``distributed``).
        preflight: Each node checks its cache disk and its GPUs before its ranks start
            (:mod:`sparkgpu.launch.node.preflight`); a node that fails is named and left out.
    """

    timeout: float | None = None
    max_runtime: float | None = None
    checkpoint_grace: float = 60.0
    max_restarts: int = 0
    shutdown_grace: float = 10.0
    init_timeout: float = 600.0
    priority: Priority = Priority.NORMAL
    capacity_wait: float | None = None
    elastic_wait: float | None = None
    restart_on: tuple[str, ...] | None = None
    progress_timeout: float | None = None
    preflight: bool = True

    def __post_init__(self):
        object.__setattr__(self, "progress_timeout", parse_progress_timeout(self.progress_timeout))
        if self.restart_on is not None:
            try:
                object.__setattr__(self, "restart_on", parse_failure_classes(self.restart_on))
            except ValueError as exc:
                raise ConfigurationError(str(exc)) from None
        object.__setattr__(self, "priority", Priority.parse(self.priority))
        for field in ("timeout", "max_runtime", "capacity_wait", "elastic_wait"):
            object.__setattr__(self, field, parse_duration(getattr(self, field), name=field))
        for field in ("checkpoint_grace", "shutdown_grace", "init_timeout"):
            object.__setattr__(self, field, parse_duration(getattr(self, field), name=field))
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigurationError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        if self.max_runtime is not None and self.checkpoint_grace >= self.max_runtime:
            raise ConfigurationError(
                f"checkpoint_grace ({self.checkpoint_grace:g}s) must be shorter than max_runtime "
                f"({self.max_runtime:g}s); lower checkpoint_grace or raise max_runtime"
            )


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One validated job: what runs, with which resources and policy, on which backend.

    Attributes:
        job_id: Unique id, also the run directory's name.
        name: Human name (the function's name by default).
        resources: Accelerators asked for.
        policy: Timeouts, runtime cap and restarts.
        backend: Name of the backend that runs it (``"local"`` or ``"spark"``).
        log_ranks: Ranks whose output streams to the caller; ``None`` for all.
        tags: Free-form tags (team, project, ...) for tracking and cost attribution.
        devices: Device addresses assigned on each node (resolved at launch; empty on CPU).
        simulated: True when GPU addresses are simulated and ranks run on CPU.
    """

    job_id: str
    name: str
    resources: Resources
    policy: RunPolicy = dataclasses.field(default_factory=RunPolicy)
    backend: str = "local"
    log_ranks: tuple[int, ...] | None = (0,)
    tags: dict[str, str] = dataclasses.field(default_factory=dict)
    devices: tuple[str, ...] = ()
    simulated: bool = False

    @property
    def world_size(self) -> int:
        return self.resources.gpus

    @property
    def elastic_wait(self) -> float:
        """Seconds an attempt of this elastic job waits for all its GPUs before going on with fewer."""
        return ELASTIC_WAIT if self.policy.elastic_wait is None else self.policy.elastic_wait

    def resized(self, gpus: int) -> "JobSpec":
        """This job as one attempt that runs on ``gpus`` ranks (an elastic job short of GPUs)."""
        if gpus == self.resources.gpus:
            return self
        return dataclasses.replace(self, resources=self.resources.resized(gpus))

    @property
    def uses_cuda(self) -> bool:
        """Ranks run on real CUDA devices (nccl); otherwise on CPU (gloo)."""
        return not self.resources.is_cpu and not self.simulated

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["log_ranks"] = list(self.log_ranks) if self.log_ranks is not None else None
        data["devices"] = list(self.devices)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JobSpec":
        """The spec from its dict; keys the run dir adds beside it (``env``, ...) are ignored."""
        fields = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in fields}
        data["resources"] = Resources(**data["resources"])
        data["policy"] = RunPolicy(**data["policy"])
        data["log_ranks"] = tuple(data["log_ranks"]) if data.get("log_ranks") is not None else None
        data["devices"] = tuple(data.get("devices", ()))
        return cls(**data)


def log_rank_selection(value) -> tuple[int, ...] | None:
    """The ranks whose output streams to the caller, from any spelling of ``log_ranks``.

    ``"main"``: rank 0; ``"all"``: every rank (``None``); ``"none"`` or ``None``: no rank
    (``()``); a list of ranks, or ``"0,2"`` as a command line or job file writes it.

    Raises:
        ConfigurationError: Anything else.
    """
    if value == "main":
        return (0,)
    if value == "all":
        return None
    if value is None or value == "none":
        return ()
    parts = value.split(",") if isinstance(value, str) else value
    try:
        if isinstance(parts, (bytes, dict)) or any(isinstance(p, bool) for p in parts):
            raise TypeError
        return tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        raise ConfigurationError(
            f"log_ranks={value!r}: use 'main', 'all', 'none' (or None) or a list of ranks such as [0, 2]"
        ) from None
