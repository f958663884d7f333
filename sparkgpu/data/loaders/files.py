"""``sparkgpu.data.files_dataset``: the files of a volume folder, split, shuffled, cached, resumable.

```python
from sparkgpu import data
files = data.files_dataset("s3://vol/images/", pattern="**/*.jpg", shuffle=True, seed=0)
for name, path in files:        # relative name, and a local path (as_bytes=True: the bytes)
    ...
```

The folder is listed once (sorted by name) when the dataset opens. Each epoch's order is a
seeded permutation of the files (the same for every rank); file ``p`` of it goes to rank
``p % world_size`` and, inside DataLoader workers, every ``W``-th of a rank's files to worker
``w``. The last ``remaining % world_size`` files of an epoch are left out of it, so every rank
gets the same number (the loader's remainder rule, :mod:`sparkgpu.data.loaders.order`). Files of a
remote volume land in the local cache (:class:`sparkgpu.data.storage.cache.ShardCache`: fetched ahead
of need in the order they will be read, evicted by next use when ``cache_limit`` is reached);
files of a local folder are read where they are.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable

import numpy as np

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.data.loaders._base import StateLayout, job_rank
from sparkgpu.data.loaders.order import EpochPlan, check_int, epoch_order
from sparkgpu.data.loaders.positioned import Positioned
from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["files_dataset", "FilesDataset"]

_LISTING = "files.json"


def files_dataset(
    url,
    pattern: str = "**/*",
    *,
    shuffle: bool = False,
    seed: int = 0,
    as_bytes: bool = False,
    transform: Callable | None = None,
    local: str | os.PathLike | None = None,
    cache_limit: int | str | None = None,
    download_threads: int = 8,
    rank: int | None = None,
    world_size: int | None = None,
    storage_options: dict | None = None,
) -> "FilesDataset":
    """Opens the files under a volume folder for training.

    Args:
        url: The folder: local path, ``file://``, or an fsspec URL (``s3://``, ``gs://``, ...).
        pattern: Glob of the files to take, relative to ``url`` (``"**/*.jpg"``).
        shuffle: A different seeded order each epoch; otherwise name order.
        seed: Seed of the shuffle; every rank must use the same one.
        as_bytes: Yield each file's bytes instead of its local path.
        transform: Called on each ``(name, path_or_bytes)`` pair; its result is yielded instead
            (decode images here; it runs in the DataLoader worker that reads the file).
        local: Cache root for a remote volume (default ``SPARKGPU_CACHE_DIR``).
        cache_limit: Most bytes of files kept in the cache (default ``SPARKGPU_CACHE_LIMIT``).
        download_threads: Parallel downloads.
        rank: This process's rank (default: from the job).
        world_size: Number of ranks (default: from the job).
        storage_options: fsspec options for the volume (credentials, endpoint).

    Raises:
        ConfigurationError: An argument is invalid.
        DataError: The folder cannot be listed or no file matches ``pattern``.
    """
    from sparkgpu.config import settings
    from sparkgpu.spec.units import parse_size
    from sparkgpu.data.storage.volume import Volume

    rank, world_size = job_rank(rank, world_size)
    check_int("seed", seed, 0)
    check_int("download_threads", download_threads, 1)
    if transform is not None and not callable(transform):
        raise ConfigurationError(f"transform={transform!r} must be a callable taking (name, path_or_bytes)")
    volume = Volume(os.fspath(url), storage_options)
    try:
        found = volume.fs.glob(f"{volume.root}/{pattern}", detail=True)
    except OSError as exc:
        raise DataError(f"cannot list {volume.url} ({exc}); check the URL and its credentials") from None
    prefix = volume.root.rstrip("/") + "/"
    listing = sorted(
        (name[len(prefix) :], int(info.get("size") or 0))
        for name, info in found.items()
        if info.get("type") == "file" and name.startswith(prefix)
    )
    if not listing:
        raise DataError(f"no file under {volume.url} matches pattern={pattern!r}")
    protocols = volume.fs.protocol if isinstance(volume.fs.protocol, tuple) else (volume.fs.protocol,)
    in_place = "file" in protocols
    cache = None
    if not in_place:
        limit = cache_limit if cache_limit is not None else settings().cache_limit_bytes
        limit = parse_size(limit, "cache_limit") if limit is not None else None
        cache = _open_cache(
            local if local is not None else settings().cache_dir,
            volume,
            listing,
            limit,
            download_threads,
            storage_options,
        )
    return FilesDataset(
        listing=listing,
        root=volume.root if in_place else None,
        cache=cache,
        shuffle=shuffle,
        seed=seed,
        as_bytes=as_bytes,
        transform=transform,
        rank=rank,
        world_size=world_size,
    )


def _open_cache(cache_root, volume, listing, limit, download_threads, storage_options):
    from sparkgpu.data.storage import cache as cache_module
    from sparkgpu.data.mds.reader import DatasetIndex, ShardInfo
    from sparkgpu.data.storage.volume import Volume

    raw = json.dumps(listing).encode()
    index = DatasetIndex(
        shards=tuple(ShardInfo(i, name, 1, size, {}) for i, (name, size) in enumerate(listing)),
        columns=(),
        fingerprint=hashlib.sha1(raw).hexdigest(),
    )
    entry = cache_module.entry_dir_for(cache_root, volume.url)
    meta = entry / cache_module._META
    meta.mkdir(parents=True, exist_ok=True)
    with cache_module._file_lock(meta / "cache.lock"):
        saved = entry / cache_module._META / _LISTING
        if not saved.exists() or saved.read_bytes() != raw:
            cache_module._remove_shards(entry)  # files changed on the volume: cached copies may be stale
            atomic_write_bytes(saved, raw, fsync=False)
    url = volume.url
    # A Volume per process: the clients of one made before a DataLoader forks its workers (an
    # event loop's thread, a connection pool's runtime) do not exist in the workers.
    return lambda: cache_module.ShardCache(entry, index, Volume(url, storage_options), limit, download_threads)


class FilesDataset(Positioned):
    """An epoch-by-epoch iterable of ``(relative_name, local_path or bytes)``, resumable.

    Built by :func:`files_dataset`. ``state_dict()`` / ``load_state_dict()`` work as in
    :class:`sparkgpu.data.loaders.mds_loader.MDSLoader`, counting files of the whole job.

    Attributes:
        names: The files' names relative to the folder, sorted.
        epoch: The epoch the next iteration reads.
    """

    def __init__(self, *, listing, root, cache, shuffle, seed, as_bytes, transform, rank, world_size):
        self.names = [name for name, _ in listing]
        self._root = root
        self._new_cache = cache
        self.shuffle, self.seed, self.as_bytes, self.transform = shuffle, seed, as_bytes, transform
        self.rank, self.world_size = rank, world_size
        self.fingerprint = hashlib.sha1(json.dumps(listing).encode()).hexdigest()
        self.epoch = 0
        self._consumed = 0

    def state_dict(self) -> dict:
        """The position after the last file handed out, as plain JSON (the same on every rank)."""
        return self._saved_state()

    def load_state_dict(self, state: dict) -> None:
        """Continues from a saved position: the next iteration yields the rest of that epoch.

        Raises:
            ConfigurationError: The state comes from another listing, seed or shuffle.
        """
        self.epoch, self._consumed = self._restored_position(state)

    _layout = StateLayout(
        fields=("seed", "shuffle", "world_size"),
        checked=("seed", "shuffle", "num_samples", "dataset"),
        fix="open the same files with the same seed and shuffle to resume",
        name="a files dataset",
        what="dataset",
    )

    def _state_identity(self) -> dict:
        return {"num_samples": len(self.names), "dataset": self.fingerprint}

    def _state_extent(self, state: dict) -> tuple[int, str]:
        return len(self.names), f"listing of {len(self.names)} files"

    def _plan(self, epoch: int, start: int) -> EpochPlan:
        # One-file "shards" and one-file windows: a uniform seeded permutation per epoch.
        order = epoch_order(
            np.ones(len(self.names), dtype=np.int64), shuffle=self.shuffle, seed=self.seed, epoch=epoch, block_size=1
        )
        return self._rank_plan(order, start, batch_size=1, drop_last=False)

    def __iter__(self):
        plan, start = self._begin_epoch(), self._consumed
        steps = self._batch_numbers(plan)
        cache = self._new_cache() if self._new_cache is not None else None
        try:
            if cache is not None:
                cache.set_plan([plan.samples[step : step + 1] for step in steps])
            for position, step in enumerate(steps):
                item = int(plan.samples[step])
                name = self.names[item]
                if cache is not None:
                    path = os.fspath(cache.acquire(position, plan.samples[step : step + 1])[0])
                else:
                    path = os.path.join(self._root, name)
                value = _read(path, name) if self.as_bytes else path
                self._advance(plan, start, step + 1)
                yield self.transform(name, value) if self.transform is not None else (name, value)
        finally:
            if cache is not None:
                cache.close()
        self.epoch, self._consumed = self.epoch + 1, 0


def _read(path: str, name: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        raise DataError(f"{name} vanished from the folder after it was listed; open the dataset again") from None
