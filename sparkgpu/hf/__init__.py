"""Hugging Face fine-tuning inside a job: Trainers that run at the job's world size and resume by themselves.

Inside a ``@distributed`` function or ``spark.gpu.train``, a ``transformers.Trainer`` (and
TRL's ``SFTTrainer``, a subclass) written as for GPUs needs nothing from this module: the rank's
environment makes Accelerate see the job, and the rank patches ``Trainer.train`` when
``transformers`` is imported, so that checkpoints are sealed into the job's checkpoint store and
a restarted attempt resumes from the newest genuine one (``SPARKGPU_HF_RESUME=0`` turns the
patch off). :func:`resumable` does the same for one Trainer explicitly. A sparkgpu loader is a
Trainer's ``train_dataset`` as it is; TRL's ``SFTTrainer`` takes it through :func:`as_hf_dataset`.
With such a loader a resumed Trainer takes its epoch and step accounting from the loader's
position, so an elastic job's attempt of another world size trains each sample once
(:mod:`sparkgpu.hf.elastic`).

Names load lazily: importing this package does not import ``transformers``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["resumable", "JobCheckpointCallback", "train_dataset", "as_hf_dataset"]

_LAZY = {
    "resumable": "sparkgpu.hf.resume",
    "JobCheckpointCallback": "sparkgpu.hf.resume",
    "train_dataset": "sparkgpu.hf.datasets",
    "as_hf_dataset": "sparkgpu.hf.sft",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sparkgpu.hf' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
