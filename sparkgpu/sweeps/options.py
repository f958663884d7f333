"""A sweep's settings, checked before anything starts, and kept in its folder for a resume."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from sparkgpu.errors import ConfigurationError

__all__ = ["SweepOptions", "parse_budget"]

_GPU_HOURS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*gpu[- _]?h(?:ours?)?\s*$", re.IGNORECASE)


def parse_budget(budget) -> float | None:
    """GPU-hours from ``"40 GPU-hours"`` (or a number of GPU-hours); ``None`` for no budget.

    Raises:
        ConfigurationError: anything else; names the form.
    """
    if budget is None:
        return None
    if isinstance(budget, (int, float)) and not isinstance(budget, bool):
        hours = float(budget)
    elif isinstance(budget, str) and (match := _GPU_HOURS.match(budget)):
        hours = float(match.group(1))
    else:
        raise ConfigurationError(
            f"budget={budget!r} is not a sweep budget; write GPU-hours, e.g. budget='40 GPU-hours' (or 40). "
            "A money budget over many jobs is a usage policy's (sparkgpu usage)"
        )
    if hours <= 0:
        raise ConfigurationError(f"budget={budget!r} must be more than 0 GPU-hours")
    return hours


def _positive(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name}={value!r} must be an int >= 1")


@dataclasses.dataclass
class SweepOptions:
    """What a sweep runs and within which limits (``sweep.json``'s ``options``).

    Attributes:
        name: Its trials' job names start with it (the training function's name by default).
        n_trials: Trials of this sweep in all, finished or not (a resume goes on to this many).
        max_concurrent: Trials at once at most (running, or waiting in the GPU queue).
        gpus: Ranks of each trial's job; ``None``: the decorated function's.
        gpu_type: Their GPU type; ``None``: the decorated function's.
        max_failures: Failed trials after which no new trial starts; ``None``: no limit.
        budget_gpu_hours: GPU-hours of the sweep's trials after which no new trial starts.
        priority: The trials' jobs' priority; ``None``: the decorated function's.
        register_best_as: Registers the best trial's model (rank 0's return value) under this name.
        experiment: MLflow experiment of the parent run and its trials.
        storage: ``"journal"`` (the default: Optuna's JournalStorage in the sweep's folder) or
            ``"user"`` (the caller's study; a resume needs it again).
        study_name: The study's name in its storage.
    """

    name: str
    n_trials: int
    max_concurrent: int = 1
    gpus: int | None = None
    gpu_type: str | None = None
    max_failures: int | None = 3
    budget_gpu_hours: float | None = None
    priority: str | None = None
    register_best_as: str | None = None
    experiment: str | None = None
    storage: str = "journal"
    study_name: str = ""

    def __post_init__(self) -> None:
        _positive("n_trials", self.n_trials)
        _positive("max_concurrent", self.max_concurrent)
        _positive("gpus", self.gpus, allow_none=True)
        if self.max_failures is not None and (
            isinstance(self.max_failures, bool) or not isinstance(self.max_failures, int) or self.max_failures < 0
        ):
            raise ConfigurationError(f"max_failures={self.max_failures!r} must be an int >= 0, or None for no limit")
        if self.register_best_as is not None:
            from sparkgpu.tracking.names import parse_model_name

            parse_model_name(self.register_best_as)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "SweepOptions":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})
