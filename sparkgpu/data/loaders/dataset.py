"""``sparkgpu.data.dataset``: one MDS dataset, or a mixture of several, for training.

```python
from sparkgpu import data
ds = data.dataset(remote="s3://bucket/feats/v1", local="/local_disk0/cache", batch_size=1024, shuffle=True, seed=0)
xy = data.dataset(remote="s3://bucket/feats/v1", batch_size=1024, features="f*", target="label")  # (x, y)
mix = data.dataset(streams=[data.Stream(remote="s3://b/web", proportion=0.7),
                            data.Stream(remote="s3://b/code", proportion=0.3)], epoch_size=1_000_000, batch_size=64)
```

One dataset opens as an :class:`~sparkgpu.data.loaders.mds_loader.MDSLoader`
(:mod:`sparkgpu.data.loaders.mds_loader`); ``streams=`` opens each stream the same way and mixes
them (:mod:`sparkgpu.data.loaders.mixture`).
"""

from __future__ import annotations

import os

from sparkgpu.data.loaders._base import ReadOptions
from sparkgpu.data.loaders.mds_loader import MDSLoader, open_mds
from sparkgpu.data.loaders.mixture import MixtureLoader, mixture_dataset
from sparkgpu.errors import ConfigurationError

__all__ = ["dataset"]


def dataset(
    remote: str | None = None,
    local: str | os.PathLike | None = None,
    *,
    batch_size: int,
    shuffle: bool = False,
    seed: int = 0,
    shuffle_block_size: int | None = None,
    drop_last: bool = False,
    num_workers: int = 0,
    prefetch_batches: int = 0,
    pin_memory: bool = False,
    device=None,
    cache_limit: int | str | None = None,
    download_threads: int = 8,
    rank: int | None = None,
    world_size: int | None = None,
    storage_options: dict | None = None,
    allow_unsafe_types: bool = False,
    streams: list | None = None,
    epoch_size: int | None = None,
    transform=None,
    batch_transform=None,
    features: list[str] | tuple[str, ...] | str | None = None,
    target: str | None = None,
    decode: dict | None = None,
) -> MDSLoader | MixtureLoader:
    """Opens an MDS dataset for training: an iterable of batches with a resumable position.

    Args:
        remote: Volume URL of the dataset folder (local folder, ``s3://``, ``gs://``,
            ``abfs://``, ``http(s)://``). ``None``: read the shards in ``local`` directly.
        local: With ``remote``, the cache root on local disk (default ``SPARKGPU_CACHE_DIR``);
            each volume gets its own folder in it. Without ``remote``, the dataset folder.
        batch_size: Samples per batch on each rank.
        shuffle: Shuffle the samples, differently each epoch, the same for the same seed.
        seed: Seed of the shuffle; every rank must use the same one.
        shuffle_block_size: Samples of neighbouring shards mix within windows of this many
            samples (default 262144): larger shuffles better, smaller needs fewer shards at once.
        drop_last: Leave out each rank's short last batch of the epoch.
        num_workers: DataLoader worker processes decoding batches (0: decode in this process).
        prefetch_batches: Batches decoded ahead of the training step: with ``num_workers=0``
            on a background thread (0, the default, decodes on demand: a fixed-width batch
            costs tens of microseconds, less than handing it between threads); with workers,
            per worker (0 means 2).
        pin_memory: Put batches in page-locked memory, for fast, asynchronous copies to a GPU.
        device: Deliver batches on this device (e.g. ``"cuda"``; implies ``pin_memory``): the
            copy of the next batch runs on a side CUDA stream while the current one is used.
        cache_limit: Most bytes of shards kept in the cache (int, or a string like ``"200GB"``);
            default ``SPARKGPU_CACHE_LIMIT`` or no limit. Shards needed furthest in the
            future are evicted first.
        download_threads: Parallel shard downloads.
        rank: This process's rank (default: from the job, :func:`sparkgpu.runtime.get_global_rank`).
        world_size: Number of ranks (default: :func:`sparkgpu.runtime.get_world_size`).
        storage_options: Options for the volume's fsspec filesystem (credentials, endpoint).
        allow_unsafe_types: Allow ``pkl`` columns (unpickling runs arbitrary code).
        streams: Mix several datasets instead (a list of :class:`sparkgpu.data.Stream`, in
            place of ``remote``): see :mod:`sparkgpu.data.loaders.mixture`.
        epoch_size: With ``streams``, samples per epoch (all ranks together).
        transform: ``fn(sample: dict, rng: numpy.random.Generator) -> dict`` run on every
            sample where batches are decoded (in the worker processes with
            ``num_workers > 0``); ``rng`` and torch's global generator are seeded from
            ``(seed, epoch, sample index)``, so augmentations repeat exactly on every run and
            after a resume. Results are stacked into tensors where shapes agree, lists
            otherwise (see :mod:`sparkgpu.data.transforms`).
        batch_transform: ``fn(batch: dict) -> dict`` run on each collated batch, after
            ``transform``, in the same place and equally reproducible.
        features: Yield feature matrices instead of dicts: the fixed-width numeric columns
            named here (a list, in ``x``'s column order, or a glob pattern such as ``"f*"``,
            in the dataset's order, which for ``to_mds`` output is by name: ``f10`` before
            ``f2``) gathered straight from the rows into one
            ``(batch, n_features)`` tensor ``x``. One dtype: the columns' own when they
            share it, else the type torch promotes them to (``float32`` with ``int64`` gives
            ``float32``). See :mod:`sparkgpu.data.mds.features`.
        target: With ``features``, the column yielded as ``y`` (shape ``(batch, ...)``, its
            own dtype): batches are ``(x, y)``; without it, ``x`` alone.
        decode: ``{column: crop}``: JPEG columns decoded, cropped, resized and flipped in one
            fused step (``data.RandomResizedCrop(224)`` for training, ``data.CenterCrop(224)``
            for evaluation), each into one ``(batch, 3, H, W)`` ``uint8`` tensor instead of a
            list of whole images; crops are seeded from ``(seed, epoch, sample index)``, so they
            repeat after a resume. Runs before ``transform=``. ``jpeg`` (or ``bytes``) columns
            only: see :mod:`sparkgpu.data.augment`.

    Returns:
        An :class:`MDSLoader` (a :class:`~sparkgpu.data.loaders.mixture.MixtureLoader` with ``streams``).

    Raises:
        ConfigurationError: An argument is invalid (the message says what to pass instead).
        DataError: The dataset cannot be read (no index, not MDS, damaged).
        TransformError: (while iterating) a transform raised; names the sample and shard.
        MissingDependencyError: The volume's filesystem package is not installed.
    """
    options = ReadOptions.of(locals())
    if streams is not None or epoch_size is not None:  # a mixture: each stream opens through open_mds
        if streams is None or remote is not None:
            raise ConfigurationError(
                "pass remote= for one dataset, or streams=[data.Stream(...), ...] (with an optional epoch_size=) to mix several"
            )
        if any(arg is not None for arg in (transform, batch_transform, features, target, decode)):
            raise ConfigurationError(
                "transform=, batch_transform=, features=, target= and decode= work on one dataset, not yet on "
                "streams=; apply them to the mixture's batches in your loop"
            )
        return mixture_dataset(
            streams,
            options,
            local=local,
            epoch_size=epoch_size,
            prefetch_batches=prefetch_batches,
            device=device,
            allow_unsafe_types=allow_unsafe_types,
            pin_memory=pin_memory,
        )
    return open_mds(
        remote,
        local,
        options,
        prefetch_batches=prefetch_batches,
        pin_memory=pin_memory,
        device=device,
        allow_unsafe_types=allow_unsafe_types,
        transform=transform,
        batch_transform=batch_transform,
        features=features,
        target=target,
        decode=decode,
    )
