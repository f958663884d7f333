"""Experiment tracking and a catalog-style model registry, on MLflow.

* :class:`MLflowCallback` — one MLflow run per job, shared by every rank and attempt.
* :func:`log` — metrics from any rank (``sparkgpu.log``); :func:`log_checkpoint` — lineage.
* :mod:`sparkgpu.tracking.registry` — ``register`` / ``load`` models as ``catalog.schema.model``.
* :func:`flush_spool` — forwards what a job left unsent (its store was down when it ended).

Importing this package is cheap; MLflow is imported when a callback or the registry is used.
"""

from __future__ import annotations

from sparkgpu._util.modules import lazy_attributes

from sparkgpu.tracking.autolog import log, log_checkpoint

__all__ = [
    "MLflowCallback",
    "log",
    "log_checkpoint",
    "registry",
    "environment_lock",
    "resolve_target",
    "default_experiment_name",
    "flush_spool",
]

_LAZY = {
    "MLflowCallback": ("sparkgpu.tracking.mlflow_run", "MLflowCallback"),
    "environment_lock": ("sparkgpu.tracking.mlflow_run", "environment_lock"),
    "registry": ("sparkgpu.tracking.registry", None),
    "resolve_target": ("sparkgpu.tracking.target", "resolve_target"),
    "default_experiment_name": ("sparkgpu.tracking.target", "default_experiment_name"),
    "flush_spool": ("sparkgpu.tracking.flusher", "flush_spool"),
}


__getattr__ = lazy_attributes(__name__, _LAZY)
