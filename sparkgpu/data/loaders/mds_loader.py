"""The MDS loader behind ``sparkgpu.data.dataset``: batches of torch tensors from MDS shards, resumable mid-epoch.

```python
from sparkgpu import data
ds = data.dataset(remote="s3://bucket/feats/v1", local="/local_disk0/cache", batch_size=1024, shuffle=True, seed=0)
for batch in ds:                # {"column": tensor of shape (batch, ...)} (lists for text/bytes)
    ...
state = ds.state_dict()        # plain JSON: save it beside the model
ds.load_state_dict(state)      # the next iteration yields exactly the rest of that epoch

ds = data.dataset(remote=..., batch_size=1024, features="f*", target="label")
for x, y in ds:                 # x: (batch, n_features), one tensor gathered from the rows
    ...
```

Each rank reads its share of every epoch (see :mod:`sparkgpu.data.loaders.order` for the shuffle and
the split); shards come through the local cache (:mod:`sparkgpu.data.storage.cache`), fetched ahead of
need; batches are decoded whole from memory-mapped shards (:mod:`sparkgpu.data.mds.reader`).
With ``num_workers=0`` (the default) batches are decoded on demand in the calling thread (a
fixed-width batch is one gather and some views: tens of microseconds), while shards download
on background threads; ``prefetch_batches`` adds a decoding thread, ``num_workers>0`` decodes
in torch DataLoader worker processes instead, which pays for itself only for costly columns
(images). Either way the batches come in the same order, so the state does not depend on
the number of workers.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from sparkgpu.spec.units import parse_size
from sparkgpu.data.augment.columns import check_decode, check_decode_columns, check_decode_device
from sparkgpu.data.storage.cache import open_cache_entry
from sparkgpu.data.loaders._base import ReadOptions, ReadSettings, Resumable, StateLayout, job_rank
from sparkgpu.data.loaders._shards import SHARD_SOURCE
from sparkgpu.data.loaders.order import DEFAULT_BLOCK_SIZE, EpochOrders, EpochPlan, check_int, located_order
from sparkgpu.data.loaders._pipeline import Producer, WorkerBatches, in_background, prefetch_to_device
from sparkgpu.data.mds.decode import BatchDecoder
from sparkgpu.data.mds.features import resolve_features
from sparkgpu.data.loaders.metrics import LoaderMetrics
from sparkgpu.data.mds.reader import INDEX_NAME, DatasetIndex
from sparkgpu.data.transforms import check_transform
from sparkgpu.data.storage.volume import Volume
from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["open_mds", "MDSLoader"]

# The loader's attributes that say which batches are made and how (beside SHARD_SOURCE's, where
# its shards are and how the cache fetches them).
_PRODUCER = (
    *("shuffle", "seed", "shuffle_block_size", "rank", "world_size", "batch_size", "drop_last"),
    *("transform", "batch_transform", "features", "decode"),
)


def open_mds(
    remote: str | None,
    local: str | os.PathLike | None,
    options: ReadOptions,
    *,
    prefetch_batches: int = 0,
    pin_memory: bool = False,
    device=None,
    allow_unsafe_types: bool = False,
    transform=None,
    batch_transform=None,
    features=None,
    target: str | None = None,
    decode: dict | None = None,
) -> "MDSLoader":
    """Opens one MDS dataset: :func:`sparkgpu.data.dataset` without ``streams``.

    The arguments (``options``: the shared ones), the checks and the errors are
    :func:`~sparkgpu.data.loaders.dataset.dataset`'s; mixtures open each of their streams
    through here.
    """
    from sparkgpu.config import settings

    rank, world_size = job_rank(options.rank, options.world_size)
    check_int("batch_size", options.batch_size, 1)
    check_int("seed", options.seed, 0)
    check_int("num_workers", options.num_workers, 0)
    check_int("prefetch_batches", prefetch_batches, 0)
    check_int("download_threads", options.download_threads, 1)
    if options.shuffle_block_size is not None:
        check_int("shuffle_block_size", options.shuffle_block_size, 1)
    check_transform("transform", transform)
    check_transform("batch_transform", batch_transform)
    decode = check_decode(decode)
    if features is None and target is not None:
        raise ConfigurationError(
            f"target={target!r} goes with features= (the columns of x); pass features=[...] or a pattern such as 'f*'"
        )
    if features is not None and (transform is not None or batch_transform is not None):
        raise ConfigurationError(
            "features= gathers (x, y) straight from the rows, without per-sample dicts for transform= or "
            "batch_transform= to work on; apply them to x and y in your loop, or drop features="
        )
    if features is not None and decode is not None:
        raise ConfigurationError(
            "features= gathers (x, y) from fixed-width numeric columns, decode= crops image columns of dict "
            "batches: drop features= (and target=) to read images with decode="
        )
    if decode is not None:
        check_decode_device(decode, options.num_workers, _cuda_available())
    if remote is None and local is None:
        raise ConfigurationError(
            "pass remote= (the dataset's volume URL), local= (a folder holding the shards), or both"
        )
    cache_limit, storage_options = options.cache_limit, options.storage_options
    if cache_limit is None and remote is not None:
        cache_limit = settings().cache_limit_bytes
    limit = parse_size(cache_limit, "cache_limit") if cache_limit is not None else None
    if limit is not None and remote is None:
        raise ConfigurationError(
            "cache_limit applies to a cache of a remote volume; with remote=None the shards in local are the only copy"
        )
    device = _check_device(device)
    pin_memory = pin_memory or device is not None  # asynchronous host-to-device copies need pinned memory
    if pin_memory and not _cuda_available():
        # stacklevel 3: the line that called data.dataset or data.token_dataset
        warnings.warn(
            "pin_memory=True needs CUDA, which is not available here; batches stay in ordinary memory", stacklevel=3
        )
        pin_memory = False
    volume: Volume | None
    directory: str | Path
    if remote is not None:
        volume = Volume(remote, storage_options)
        directory, index = open_cache_entry(
            local if local is not None else settings().cache_dir, volume, allow_unsafe_types
        )
    else:
        assert local is not None  # checked above: remote, local or both
        volume, folder = None, os.fspath(local)
        index_path = os.path.join(folder, INDEX_NAME)
        if not os.path.isfile(index_path):
            raise DataError(
                f"{folder} has no {INDEX_NAME}; point local= at a folder written by MDSWriter or sparkgpu.data.to_mds, or pass remote="
            )
        with open(index_path, "rb") as handle:
            index = DatasetIndex.parse(handle.read(), index_path, allow_unsafe_types)
        directory = folder
        if any(shard.compression for shard in index.shards):
            # Compressed shards cannot be memory-mapped: read the folder as a volume through the
            # cache, which decompresses each shard once.
            volume = Volume(folder, storage_options)
            directory, index = open_cache_entry(settings().cache_dir, volume, allow_unsafe_types)
    if decode is not None:
        check_decode_columns(decode, index.columns)
    return MDSLoader(
        index=index,
        directory=directory,
        volume_url=volume.url if volume else None,
        options=dataclasses.replace(
            options,
            rank=rank,
            world_size=world_size,
            shuffle_block_size=options.shuffle_block_size or DEFAULT_BLOCK_SIZE,
            cache_limit=limit,
        ),
        prefetch_batches=prefetch_batches,
        pin_memory=pin_memory,
        device=device,
        transform=transform,
        batch_transform=batch_transform,
        features=resolve_features(index.columns, features, target) if features is not None else None,
        decode=decode,
    )


class MDSLoader(Resumable, ReadSettings):
    """An epoch-by-epoch iterable of batches with an exact, JSON-able position.

    Built by :func:`sparkgpu.data.dataset` (through :func:`open_mds`). Iterating yields the rest of the current epoch (all of it, unless
    the loader was stopped or restored mid-epoch), then moves to the next epoch. One iteration
    at a time.

    Attributes:
        index: The dataset's parsed index.
        num_samples: Samples in the dataset.
        epoch: The epoch the next iteration reads.
    """

    def __init__(
        self,
        *,
        index: DatasetIndex,
        directory,
        volume_url,
        options: ReadOptions,
        prefetch_batches,
        pin_memory,
        device,
        transform=None,
        batch_transform=None,
        features=None,
        decode=None,
    ):
        self.index = index
        self.directory = os.fspath(directory)
        self.volume_url = volume_url
        self._read_with(options)  # resolved: rank, world size, block size and cache limit worked out
        self.prefetch_batches = prefetch_batches
        self.pin_memory = pin_memory
        self.device = device
        self.transform = transform
        self.batch_transform = batch_transform
        self.features = features  # a FeatureLayout: batches are (x, y)
        self.decode = decode  # {column: crop} of the fused JPEG path
        self.num_samples = index.num_samples
        self.epoch = 0
        self._consumed = 0  # samples of self.epoch consumed by all ranks together
        self._orders = EpochOrders(self._located_order_of, per_epoch=bool(self.shuffle))
        self._producer: Producer | None = None
        self._workers: torch.utils.data.DataLoader | None = (
            None  # the DataLoader of num_workers > 0, created on first use
        )
        self._splitter = BatchDecoder(index.columns, allocate=None)
        self.metrics = LoaderMetrics(self.rank)  # wait and step times, cache figures: stats() and the job's run

    # Position.

    def state_dict(self) -> dict:
        """The position after the last batch handed out, as plain JSON.

        Ranks step in lockstep, so every rank's state is the same; saving rank 0's is enough.
        """
        return self._saved_state()

    def load_state_dict(self, state: dict) -> None:
        """Continues from a saved position: the next iteration yields the rest of that epoch.

        The world size and batch size may differ from the saved ones (the position counts
        samples of the whole job); seed, shuffle and dataset must match, or the rest of the
        epoch would not be the samples not yet seen.

        Raises:
            ConfigurationError: The state comes from another dataset or shuffle.
        """
        self.epoch, self._consumed = self._restored_position(state)

    _layout = StateLayout(
        fields=("seed", "shuffle", "shuffle_block_size", "world_size", "batch_size", "num_samples"),
        checked=("seed", "shuffle", "shuffle_block_size", "num_samples", "dataset"),
    )

    def _state_identity(self) -> dict:
        return {"dataset": self.index.fingerprint}

    def _state_extent(self, state: dict) -> tuple[int, str]:
        return self.num_samples, f"dataset of {self.num_samples} samples"

    # Iteration.

    def __iter__(self):
        plan, start = self._begin_epoch(), self._consumed
        # Fixed-width batches travel as one buffer of gathered rows (one shared-memory transfer
        # from a worker, one pin, one host-to-device copy) and become column views at the end.
        source = self._in_process(plan) if self.num_workers == 0 else self._in_workers(start)
        if self.device is not None:
            source = prefetch_to_device(source, self.device)
        if self._splitter.fixed_width and self.features is None:
            split = self._splitter.split_rows
            source = (split(batch) if isinstance(batch, torch.Tensor) else batch for batch in source)
        timed = self.metrics.timed(source, self._producer.cache if self._producer is not None else None)
        yield from self._hand_out(plan, start, timed, source)

    def stats(self) -> dict:
        """This rank's loader figures so far (:meth:`sparkgpu.data.loaders.metrics.LoaderMetrics.snapshot`);
        the cache's with ``num_workers=0`` only (workers keep their own caches)."""
        return self.metrics.snapshot(self._producer.cache if self._producer is not None else None)

    def close(self) -> None:
        """Stops background downloads and frees open shards."""
        if self._producer is not None:
            self._producer.close()
            self._producer = None
        self._workers = None  # dropping the DataLoader stops its worker processes
        self._orders.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            return

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return self._located_order(epoch)[0]

    def _located_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # Finding each sample's shard and row costs some 10 ms per million samples beside the
        # shuffle's sort; both are worked out ahead (EpochOrders).
        return self._orders.get(epoch)

    def _located_order_of(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return located_order(
            self.index.shard_sizes,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            block_size=self.shuffle_block_size,
        )

    def _plan(self, epoch: int, start: int) -> EpochPlan:
        order, shards, rows = self._located_order(epoch)
        return self._rank_plan(order, start, located=(shards, rows))

    def _in_process(self, plan: EpochPlan):
        if self._producer is None:
            self._producer = Producer(self._producer_spec(), pinned=self.pin_memory)
        batches = self._producer.run(plan, range(plan.num_batches), raw_rows=True, epoch=self.epoch)
        return in_background(batches, self.prefetch_batches) if self.prefetch_batches else batches

    def _in_workers(self, start: int):
        # Workers persist across epochs (starting them costs more than a short epoch); each
        # iteration tells them where to start through shared memory they inherited.
        if self._workers is None:
            self._worker_position = multiprocessing.Array("q", 2, lock=False)
            self._workers = torch.utils.data.DataLoader(
                WorkerBatches(self._producer_spec(), self._worker_position),
                batch_size=None,
                num_workers=self.num_workers,
                pin_memory=self.pin_memory,
                prefetch_factor=self.prefetch_batches or 2,
                persistent_workers=True,
            )
        self._worker_position[0], self._worker_position[1] = self.epoch, start
        return iter(self._workers)

    def _source_spec(self) -> dict:
        """Where the shards are and how the cache fetches them: what a loader reading them needs."""
        return {name: getattr(self, name) for name in SHARD_SOURCE}

    def _producer_spec(self) -> dict:
        """What decodes this loader's batches (:class:`~sparkgpu.data.loaders._pipeline.Producer`), here or in a worker."""
        return {name: getattr(self, name) for name in (*SHARD_SOURCE, *_PRODUCER)}


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _check_device(device):
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigurationError(
            f"device={device!r} is not a torch device ({exc}); pass e.g. 'cuda', 'cuda:1' or 'cpu'"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError(
            f"device={device} but CUDA is not available on this machine; leave device=None to get CPU batches"
        )
    if device.type not in ("cuda", "cpu"):
        raise ConfigurationError(f"device={device} is not supported; pass 'cuda[:N]' or 'cpu'")
    return None if device.type == "cpu" else device
