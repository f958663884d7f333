"""``Trainer.hyperparameter_search`` inside a sparkgpu job: refused, pointing to ``sparkgpu.sweep``.

Called on every rank of a job, transformers' search would run one search per rank: each rank
samples its own parameters (Optuna, Ray Tune and the others know nothing of the other ranks),
so the ranks train different models in one process group and wait on each other's collectives
with mismatched shapes or step counts. A sweep whose trials are jobs of the job's world size is
:func:`sparkgpu.sweep`: its parameters are sampled once and reach every rank, and its pruning
stops all ranks at the same step.
"""

from __future__ import annotations

from typing import Any

from sparkgpu.errors import ConfigurationError

__all__ = ["patch_hyperparameter_search", "REFUSAL"]

_PATCHED = "__sparkgpu_refuses_search__"

REFUSAL = (
    "Trainer.hyperparameter_search() inside a sparkgpu job would run a separate search on every rank "
    "(each rank sampling its own parameters in one process group); run the search with sparkgpu.sweep(train, "
    "space=..., n_trials=..., direction=...) instead: each trial is a job of its own at this world size, the "
    "trial's parameters come from sparkgpu.runtime.trial() on every rank, report with "
    "sparkgpu.runtime.report(step, value). See the Sweeps guide."
)


def patch_hyperparameter_search(trainer_class: Any) -> None:
    """Makes ``trainer_class.hyperparameter_search`` raise :data:`REFUSAL` (a ConfigurationError) in this process."""
    if getattr(getattr(trainer_class, "hyperparameter_search", None), _PATCHED, False):
        return

    def hyperparameter_search(self, *args, **kwargs):
        raise ConfigurationError(REFUSAL)

    setattr(hyperparameter_search, _PATCHED, True)
    trainer_class.hyperparameter_search = hyperparameter_search
