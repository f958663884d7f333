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
from typing import Any

from sparkgpu.config import lookup_gpu_type
from sparkgpu.errors import ConfigurationError

__all__ = ["Resources", "RunPolicy", "JobSpec", "parse_duration", "new_job_id"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, None: 1}


def parse_duration(value, *, name: str = "duration") -> float | None:
    """Seconds from ``None``, a number of seconds, a ``timedelta`` or a string like ``"7d"``.

    Raises:
        ConfigurationError: the value is negative or not a duration.
    """
    if value is None:
        return None
    if isinstance(value, _dt.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    else:
        raise ConfigurationError(
            f"{name}={value!r} is not a duration; pass seconds or a string such as '90s', '30m', '12h', '7d'"
        )
    if seconds <= 0:
        raise ConfigurationError(f"{name}={value!r} must be positive")
    return seconds


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
    """

    gpus: int = 1
    gpu_type: str | None = None
    remote: bool = False

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

    @property
    def is_cpu(self) -> bool:
        return self.gpu_type == "cpu"


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
    """

    timeout: float | None = None
    max_runtime: float | None = None
    checkpoint_grace: float = 60.0
    max_restarts: int = 0
    shutdown_grace: float = 10.0
    init_timeout: float = 600.0

    def __post_init__(self):
        for field in ("timeout", "max_runtime"):
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
