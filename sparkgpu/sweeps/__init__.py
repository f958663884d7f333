"""Hyperparameter sweeps on the GPU pools: an Optuna study whose trials are sparkgpu jobs.

``sparkgpu.sweep(train, space=..., n_trials=..., direction=...)`` (:func:`~sparkgpu.sweeps.api.sweep`)
runs each trial as a job of ``gpus`` ranks; the ranks read the trial's parameters with
``runtime.trial()`` and report with ``runtime.report(step, value)``; Optuna's samplers and
pruners decide, on the sweep's side. See the Sweeps guide.

Modules: :mod:`~sparkgpu.sweeps.api` (the entry points), :mod:`~sparkgpu.sweeps.driver` (the
loop), :mod:`~sparkgpu.sweeps.trial_job` (a trial's job: parameters in, stop request out),
:mod:`~sparkgpu.sweeps.reports` (the ranks' side), :mod:`~sparkgpu.sweeps.folder` (what a resume
reads), :mod:`~sparkgpu.sweeps.options`, :mod:`~sparkgpu.sweeps.tracking` (MLflow). Optuna is
imported only once a sweep runs: ``import sparkgpu`` does not need it.
"""

from __future__ import annotations

from sparkgpu._util.modules import lazy_attributes

__all__ = ["sweep", "resume_sweep", "DetachedSweep", "SweepResult", "SweepStoppedError", "list_sweeps", "find_sweep"]

__getattr__ = lazy_attributes(
    __name__,
    {
        "sweep": ("sparkgpu.sweeps.api", "sweep"),
        "resume_sweep": ("sparkgpu.sweeps.api", "resume_sweep"),
        "DetachedSweep": ("sparkgpu.sweeps.api", "DetachedSweep"),
        "SweepResult": ("sparkgpu.sweeps.driver", "SweepResult"),
        "SweepStoppedError": ("sparkgpu.sweeps.driver", "SweepStoppedError"),
        "list_sweeps": ("sparkgpu.sweeps.folder", "list_sweeps"),
        "find_sweep": ("sparkgpu.sweeps.folder", "find_sweep"),
    },
)
