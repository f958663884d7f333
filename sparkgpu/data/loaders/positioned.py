"""The position of the table and files datasets, kept exact with or without DataLoader workers.

Both datasets cut a rank's share of an epoch into numbered batches (files: one file each), and
inside torch DataLoader workers worker ``w`` of ``W`` builds batches ``w, w + W, ...``, which the
DataLoader hands out in order: the rank reads the same batches with or without workers, and
the workers' counts differ by at most one. Workers run on copies of the dataset, so its
position in the training process can only follow what the training process receives:
:meth:`Positioned.loader` is a ``torch.utils.data.DataLoader`` that advances the dataset's
position as each batch arrives, so ``state_dict()`` taken between batches resumes exactly.
"""

from __future__ import annotations

import torch

from sparkgpu.data.loaders._base import Resumable, worker_batches
from sparkgpu.rundir import progress as _progress
from sparkgpu.errors import ConfigurationError

__all__ = ["Positioned", "PositionedLoader"]


class Positioned(Resumable, torch.utils.data.IterableDataset):
    """An iterable dataset with an epoch and a count of rows consumed by all ranks in it.

    Subclasses define ``_plan(epoch, start)`` (an :class:`~sparkgpu.data.loaders.order.EpochPlan`),
    ``world_size``, ``epoch`` and ``_consumed``, and their state's layout (:class:`~sparkgpu.data.loaders._base.Resumable`).
    """

    world_size: int

    def loader(self, num_workers: int = 2, **dataloader_options) -> "PositionedLoader":
        """A DataLoader reading this dataset in ``num_workers`` worker processes, keeping its position.

        Args:
            num_workers: Worker processes (each builds every ``num_workers``-th batch).
            **dataloader_options: Other ``torch.utils.data.DataLoader`` arguments
                (``pin_memory``, ``prefetch_factor``, ``multiprocessing_context``, ...).

        Returns:
            A :class:`PositionedLoader`; iterate it once per epoch.

        Raises:
            ConfigurationError: An option the position cannot follow (``batch_size``, a
                ``sampler``, ``persistent_workers=True``).
        """
        return PositionedLoader(self, num_workers=num_workers, **dataloader_options)

    def _batch_numbers(self, plan) -> range:
        """The batches of ``plan`` this process builds: all, or every W-th in DataLoader worker w."""
        return worker_batches(plan.num_batches)


class PositionedLoader(torch.utils.data.DataLoader):
    """A ``torch.utils.data.DataLoader`` over a :class:`Positioned` dataset that keeps its position.

    The dataset yields whole batches (``batch_size=None``); each batch received here moves the
    dataset's position past it, and reading the loader to its end moves it to the next epoch.
    """

    dataset: Positioned

    def __init__(self, dataset: Positioned, **options):
        for name in ("batch_size", "sampler", "batch_sampler", "shuffle", "drop_last"):
            if options.get(name) not in (None, False):
                raise ConfigurationError(
                    f"{name}= is set on the dataset, not its loader: the dataset yields whole "
                    f"batches in its own order; drop {name}= from loader()"
                )
        if options.get("persistent_workers"):
            raise ConfigurationError(
                "persistent_workers=True would keep the workers' copies of the dataset at an old "
                "position; leave it out (workers start again each epoch)"
            )
        options = {
            k: v
            for k, v in options.items()
            if k not in ("batch_size", "sampler", "batch_sampler", "shuffle", "drop_last")
        }
        super().__init__(dataset, batch_size=None, **options)

    def __iter__(self):
        dataset = self.dataset
        plan, start = dataset._begin_epoch(), dataset._consumed  # before the workers copy the dataset
        received = 0
        for batch in super().__iter__():
            received += 1
            dataset._advance(plan, start, received)
            _progress.note()  # a batch reached the rank: progress, for hang detection
            yield batch
        dataset.epoch, dataset._consumed = dataset.epoch + 1, 0

    def __len__(self) -> int:
        return len(self.dataset)
