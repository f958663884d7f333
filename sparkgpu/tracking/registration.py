"""``register_as=`` done where the job is supervised: rank 0's model is registered once the job succeeded.

A job supervised by its caller registers its model in the caller (``.distributed()``); a
detached one (:mod:`sparkgpu.launch.client.detached`) registers it in its own supervisor, so
that the model is registered also when nobody waits for the job. The supervisor records what
happened in the run dir's ``registered.json`` (the version, or the registration's error) for
whoever follows the job: ``.distributed(detach=True)`` sets ``last_model_version`` from it, or
raises the error with the job's results on it, as an attached call does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.callbacks import JobCallback
from sparkgpu.errors import ConfigurationError

__all__ = ["ModelRegistration", "register_result", "read_registration", "tracking_run_id", "REGISTERED_FILE"]

logger = logging.getLogger(__name__)

#: In the run dir: what the supervisor's registration of the job's model gave.
REGISTERED_FILE = "registered.json"


def register_result(model, name: str, job_id: str, run_id: str | None):
    """Registers rank 0's return value (a ``torch.nn.Module``, or a transformers model as
    ``{"model": ..., "tokenizer": ...}``) under ``name``, with lineage.

    Raises:
        ConfigurationError: the value is no model.
    """
    import torch

    from sparkgpu.tracking import registry

    if not isinstance(model, torch.nn.Module) and not registry.is_transformers_model(model):
        raise ConfigurationError(
            f"register_as={name!r} registers rank 0's return value, which must be a torch.nn.Module "
            f"or {{'model': model, 'tokenizer': tokenizer}} for a transformers model; it returned "
            f"{type(model).__name__}. Return the model from rank 0, or call sparkgpu.registry.register(...) yourself"
        )
    return registry.register(model, name, run_id=run_id, tags={"sparkgpu.job_id": job_id})


class ModelRegistration(JobCallback):
    """Registers rank 0's return value as ``name`` after the job succeeded, in the supervisor's process.

    Args:
        name: ``catalog.schema.model`` (checked when the function was decorated).
    """

    def __init__(self, name: str):
        self.name = name
        self._run_dir: str | None = None

    def before_job(self, job, run_dir: str) -> None:
        self._run_dir = run_dir

    def after_job(self, job, results, error: BaseException | None) -> None:
        if error is not None or not results or self._run_dir is None:
            return
        run_dir = Path(self._run_dir)
        try:
            version = register_result(results[0], self.name, job.job_id, tracking_run_id(run_dir))
        except Exception as exc:  # the job succeeded: its results stay, the error is the follower's to raise
            logger.exception("job %s succeeded, only registering its model as %r failed", job.job_id, self.name)
            record: dict[str, Any] = {"name": self.name, "error": f"{type(exc).__name__}: {exc}"}
        else:
            record = {"name": self.name, "version": dataclasses.asdict(version)}
        atomic_write_bytes(run_dir / REGISTERED_FILE, json.dumps(record).encode(), mode=0o600)


def read_registration(run_dir: Path):
    """The model version the job's supervisor registered; ``None`` if it registered none.

    Raises:
        ConfigurationError: the registration failed; its message says why.
    """
    from sparkgpu.tracking.registry import ModelVersionInfo

    try:
        record = json.loads((run_dir / REGISTERED_FILE).read_text())
    except FileNotFoundError:
        return None
    if "error" in record:
        raise ConfigurationError(f"registering the job's model as {record['name']!r} failed: {record['error']}")
    version = dict(record["version"])
    version["aliases"] = tuple(version.get("aliases") or ())
    return ModelVersionInfo(**version)


def tracking_run_id(run_dir: Path) -> str | None:
    """The id of the job's MLflow run, once its supervisor started it; ``None`` for an untracked job."""
    try:
        return json.loads((run_dir / RunLayout.TRACKING_RUN).read_text()).get("run_id")
    except (FileNotFoundError, ValueError):
        return None
