"""Per-sample and per-batch transforms with reproducible randomness, and how results collate.

A loader hands each decoded batch to :class:`BatchTransforms`, which runs the user's
``transform(sample, rng)`` on every sample and ``batch_transform(batch)`` on the collated
batch. Every random draw is a function of ``(seed, epoch, global sample index)``:

* ``rng`` is a :class:`numpy.random.Generator` seeded from those three numbers;
* torch's global CPU generator is seeded from them too for the duration of the call (and
  restored afterwards), so ``torchvision.transforms.v2`` augmentations, which draw from it,
  repeat exactly.

So an epoch's augmentations are the same on every run, after a resume, and whatever the
number of worker processes or ranks reads it. Python's :mod:`random` module is not seeded:
draw from ``rng`` or torch instead.

Any loader can reuse this: decode a batch as ``{column: tensor or list}``, then call
``BatchTransforms(...)(batch, epoch=..., sample_ids=..., shards=...)``.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

import numpy as np
import torch

from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["BatchTransforms", "TransformError", "collate", "sample_rng", "check_transform"]

# Distinguishes the batch transform's seed from the sample transform's for the same first sample.
_BATCH_STREAM = 1 << 32


class TransformError(DataError):
    """A ``transform=`` or ``batch_transform=`` raised, or returned something unusable.

    The message names the global sample index, its shard and the epoch; the original
    exception is chained (``__cause__``) and, from a worker process, its traceback is in the
    message.
    """


def check_transform(name: str, fn) -> None:
    """Raises :class:`ConfigurationError` unless ``fn`` is ``None`` or callable."""
    if fn is not None and not callable(fn):
        raise ConfigurationError(
            f"{name}={fn!r} is not callable; pass a function such as "
            f"{'def prepare(sample, rng): return sample' if name == 'transform' else 'def prepare_batch(batch): return batch'}"
        )


def sample_rng(seed: int, epoch: int, sample_id: int, stream: int = 0) -> tuple[np.random.Generator, int]:
    """The numpy generator and torch seed for one sample of one epoch.

    Returns:
        ``(generator, torch_seed)``, independent of each other and of every other sample's.
    """
    numpy_seq, torch_seq = np.random.SeedSequence([seed, epoch, sample_id, stream]).spawn(2)
    torch_seed = int(torch_seq.generate_state(1, np.uint64)[0]) & ((1 << 63) - 1)
    return np.random.Generator(np.random.PCG64(numpy_seq)), torch_seed


class BatchTransforms:
    """Runs ``transform`` per sample and ``batch_transform`` per batch, reproducibly.

    Args:
        transform: ``fn(sample: dict, rng: numpy.random.Generator) -> dict``, or ``None``.
        batch_transform: ``fn(batch: dict) -> dict`` on the collated batch, or ``None``; its
            randomness (torch's generator) is seeded from the batch's first sample.
        seed: The dataset's seed.
    """

    def __init__(self, transform: Callable | None, batch_transform: Callable | None, *, seed: int):
        self.transform = transform
        self.batch_transform = batch_transform
        self.seed = seed

    def __bool__(self) -> bool:
        return self.transform is not None or self.batch_transform is not None

    def __call__(self, batch: dict, *, epoch: int, sample_ids: np.ndarray, shards: Sequence[str]) -> dict:
        """Transforms one decoded batch.

        Args:
            batch: ``{column: tensor of shape (n, ...) or list of n values}``.
            epoch: The epoch the batch belongs to.
            sample_ids: Global sample index of each of the ``n`` samples.
            shards: Name of the shard each sample comes from (for error messages).

        Raises:
            TransformError: A transform raised or returned something other than a dict.
        """
        ids = [int(i) for i in sample_ids]
        if self.transform is not None:
            samples = [self._one(batch, i, sample_id, epoch, shards[i]) for i, sample_id in enumerate(ids)]
            batch = collate(samples)
        if self.batch_transform is not None and ids:
            _, torch_seed = sample_rng(self.seed, epoch, ids[0], _BATCH_STREAM)
            try:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(torch_seed)
                    out = self.batch_transform(batch)
            except Exception as exc:
                raise TransformError(
                    _message("batch_transform", exc, ids[0], shards[0], epoch, "the batch starting at ")
                ) from exc
            if not isinstance(out, dict):
                raise TransformError(
                    f"batch_transform returned {type(out).__name__} for the batch starting at sample {ids[0]} "
                    f"(shard {shards[0]}, epoch {epoch}); return a dict of columns"
                )
            batch = out
        return batch

    def _one(self, batch: dict, i: int, sample_id: int, epoch: int, shard: str) -> dict:
        transform = self.transform
        assert transform is not None  # called only when there is a per-sample transform
        sample = {name: values[i] for name, values in batch.items()}
        rng, torch_seed = sample_rng(self.seed, epoch, sample_id)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(torch_seed)
                out = transform(sample, rng)
        except Exception as exc:
            raise TransformError(_message("transform", exc, sample_id, shard, epoch)) from exc
        if not isinstance(out, dict):
            raise TransformError(
                f"transform returned {type(out).__name__} for sample {sample_id} (shard {shard}, "
                f"epoch {epoch}); return a dict of columns, e.g. {{'image': tensor, 'label': 3}}"
            )
        return out


def _message(name, exc, sample_id, shard, epoch, what="") -> str:
    return (
        f"{name} raised {type(exc).__name__}: {exc} on {what}sample {sample_id} of shard {shard} (epoch {epoch}); "
        f"fix the {name} or the sample (the original traceback follows)"
    )


def collate(samples: list[dict]) -> dict:
    """Collates per-sample dicts into a batch.

    Each key becomes a tensor of shape ``(n, ...)`` when every value is a tensor, numpy array
    or number of one shape and dtype; otherwise a list of the ``n`` values.

    Raises:
        TransformError: The samples do not all have the same keys.
    """
    if not samples:
        return {}
    keys = list(samples[0])
    for position, sample in enumerate(samples):
        if sample.keys() != samples[0].keys():
            raise TransformError(
                f"transform returned keys {sorted(sample)} for the sample at position {position} of the "
                f"batch but {sorted(keys)} for the first; return the same keys for every sample"
            )
    return {key: _collate_values([sample[key] for sample in samples]) for key in keys}


def _collate_values(values: list):
    first = values[0]
    if isinstance(first, torch.Tensor):
        if all(isinstance(v, torch.Tensor) and v.shape == first.shape and v.dtype == first.dtype for v in values):
            return torch.stack(values)
        return values
    if isinstance(first, np.ndarray):
        if all(isinstance(v, np.ndarray) and v.shape == first.shape and v.dtype == first.dtype for v in values):
            return torch.from_numpy(np.stack(values))
        return values
    if isinstance(first, (bool, np.bool_)) and all(isinstance(v, (bool, np.bool_)) for v in values):
        return torch.tensor(values, dtype=torch.bool)
    if isinstance(first, numbers.Integral) and all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values
    ):
        return torch.tensor([int(v) for v in values], dtype=torch.int64)
    if isinstance(first, numbers.Real) and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
        return torch.tensor([float(v) for v in values], dtype=torch.float64)
    return values
