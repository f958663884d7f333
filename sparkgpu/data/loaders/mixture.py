"""Dataset mixtures: ``data.dataset(streams=[data.Stream(...), ...], epoch_size=...)``.

```python
mix = data.dataset(streams=[data.Stream(remote="s3://b/web", proportion=0.7),
                            data.Stream(remote="s3://b/code", proportion=0.3)],
                   epoch_size=1_000_000, batch_size=64, shuffle=True)
```

Samples per stream and epoch follow MosaicML Streaming's ``Stream`` weights exactly
(``Stream.apply_weights``):

* ``proportion`` (all streams or none): ``epoch_size`` (default: all samples of all streams)
  times each stream's share of the proportions, rounded down; the shortfall goes one sample
  each to streams drawn with ``numpy.random.default_rng(seed)``, as mosaic does.
* no weights and an ``epoch_size``: the same, with proportions from the streams' sizes.
* otherwise per stream: ``repeat`` times its samples (rounded down), or ``choose`` samples,
  or all of them once; ``epoch_size`` must then be left out.

Which samples. A stream drawing ``n`` of its ``size`` samples reads all of them
``n // size`` times and ``n % size`` more. Each pass is an epoch order of the stream
(:func:`sparkgpu.data.loaders.order.epoch_order`, keyed by seed, epoch, stream and pass), and the
extra samples are the first ``n % size`` of one more pass. Where mosaic draws that remainder
sample by sample over the whole stream (``sampling_granularity=1``), this takes it from a
stretch of the shuffled stream: a random subset, but from fewer shards, so a small cache
holds it. Without ``shuffle`` the remainder is the stream's first samples.

Mixing. The epoch interleaves the streams: with ``shuffle``, the stream of each position of
the epoch is a random permutation of the streams' counts; without, the streams are spread
evenly (stream ``s``'s ``k``-th sample sits at ``(k + 0.5) / n_s`` of the epoch). Mosaic
instead shuffles all streams' shards together and partitions them over nodes and workers;
the counts per epoch are the same, the order is not. The epoch is then split over ranks as
any dataset's (:mod:`sparkgpu.data.loaders.order`): the same number of samples and batches on
every rank, and a position of "samples consumed" that resumes exactly.

Workers. With ``num_workers > 0`` (image mixtures need them), DataLoader worker ``w`` of
``k`` decodes the rank's batches ``w, w + k, ...`` of the same plan, and the DataLoader hands
them out one worker after the other: the rank gets the same batches in the same order as
with ``num_workers=0``, so the position, and a resume from it, are the same too.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from typing import Any

import numpy as np
import torch

from sparkgpu.data.mds.decode import BatchDecoder
from sparkgpu.data.loaders.metrics import LoaderMetrics
from sparkgpu.data.loaders.mds_loader import open_mds
from sparkgpu.data.loaders._base import ReadOptions, Resumable, StateLayout, worker_batches
from sparkgpu.data.loaders._shards import map_shard, open_shard_cache
from sparkgpu.data.loaders.order import EpochPlan, check_int, epoch_order
from sparkgpu.data.mds.reader import ShardReader
from sparkgpu.errors import ConfigurationError

__all__ = ["Stream", "MixtureLoader", "samples_per_stream"]

_MAX_OPEN_SHARDS = 32  # shards a local stream keeps mapped between batches


@dataclasses.dataclass(frozen=True)
class Stream:
    """One dataset of a mixture, with its weight.

    Args:
        remote: Volume URL of the stream's MDS folder (``None``: the shards in ``local``).
        local: With ``remote``, this stream's cache root (default: the mixture's ``local``,
            else ``SPARKGPU_CACHE_DIR``); without, the stream's dataset folder.
        proportion: Relative weight; set it on every stream or none.
        repeat: Passes over this stream per epoch (``0.5``: a random half).
        choose: Samples of this stream per epoch.

    Raises:
        ConfigurationError: More than one weight, a negative weight, or no location.
    """

    remote: str | None = None
    local: str | os.PathLike | None = None
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None

    def __post_init__(self):
        if self.remote is None and self.local is None:
            raise ConfigurationError("Stream needs remote= (a volume URL), local= (a folder of shards), or both")
        weights = {
            k: v
            for k, v in (("proportion", self.proportion), ("repeat", self.repeat), ("choose", self.choose))
            if v is not None
        }
        if len(weights) > 1:
            raise ConfigurationError(
                f"Stream takes one of proportion, repeat and choose, got {sorted(weights)}; keep one"
            )
        for name, value in weights.items():
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or value < 0
                or (name == "choose" and value != int(value))
            ):
                raise ConfigurationError(
                    f"Stream {name}={value!r} must be a {'whole ' if name == 'choose' else ''}number >= 0"
                )


def samples_per_stream(streams, sizes, epoch_size: int | None, seed: int) -> np.ndarray:
    """Samples each stream contributes to every epoch (mosaic's ``Stream.apply_weights``).

    Args:
        streams: The :class:`Stream` weights.
        sizes: Samples in each stream.
        epoch_size: Samples per epoch, or ``None``.
        seed: Seed that places the rounding shortfall.

    Raises:
        ConfigurationError: Proportions on some streams only, or ``epoch_size`` with absolute weights.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    relative = [s.proportion is not None for s in streams]
    if any(relative) and not all(relative):
        raise ConfigurationError(
            "set proportion on every stream or on none (mix proportions with repeat/choose "
            "by giving every stream a proportion instead)"
        )
    unweighted = all(s.repeat is None and s.choose is None for s in streams)
    if all(relative) or (unweighted and epoch_size):
        shares = np.array([s.proportion for s in streams] if all(relative) else sizes, dtype=np.float64)
        if shares.sum() <= 0:
            raise ConfigurationError(
                "the streams' proportions add up to 0; give at least one stream a positive proportion"
            )
        total = int(epoch_size) if epoch_size else int(sizes.sum())
        counts = (total * (shares / shares.sum())).astype(np.int64)
        shortfall = total - int(counts.sum())
        counts[np.random.default_rng(seed).choice(len(streams), shortfall, False)] += 1
        return counts
    if epoch_size:
        raise ConfigurationError(
            "epoch_size= applies to relative weights (proportion, or none at all); with repeat/choose "
            "the epoch is the sum of the streams' samples: leave epoch_size out or use proportions"
        )
    return np.array(
        [
            int(s.repeat * n) if s.repeat is not None else int(s.choose) if s.choose is not None else int(n)
            for s, n in zip(streams, sizes)
        ],
        dtype=np.int64,
    )


def mixture_dataset(
    streams,
    options: ReadOptions,
    *,
    local,
    epoch_size,
    prefetch_batches,
    device,
    allow_unsafe_types,
    **unsupported,
) -> "MixtureLoader":
    """Opens each stream as :func:`sparkgpu.data.dataset` would and mixes them (see the module doc)."""
    if not isinstance(streams, (list, tuple)) or not streams or not all(isinstance(s, Stream) for s in streams):
        raise ConfigurationError(f"streams= takes a non-empty list of data.Stream, got {streams!r:.200}")
    if epoch_size is not None:
        check_int("epoch_size", epoch_size, 1)
    check_int("num_workers", options.num_workers, 0)
    bad = sorted(k for k, v in unsupported.items() if v)
    if bad:
        raise ConfigurationError(f"{bad} are not supported with streams=; leave them out")
    in_process = dataclasses.replace(options, num_workers=0)  # each stream's loader; the mixture has the workers
    opened = []
    for stream in streams:
        where = stream.local if stream.local is not None else (local if stream.remote is not None else None)
        opened.append(
            open_mds(
                stream.remote,
                where,
                in_process,
                prefetch_batches=prefetch_batches,
                device=device,
                allow_unsafe_types=allow_unsafe_types,
            )
        )
    first = opened[0].index.columns
    for number, loader in enumerate(opened[1:], 1):
        if [(c.name, c.encoding) for c in loader.index.columns] != [(c.name, c.encoding) for c in first]:
            raise ConfigurationError(
                f"stream {number} has columns {[(c.name, c.encoding) for c in loader.index.columns]} but stream 0 has "
                f"{[(c.name, c.encoding) for c in first]}; mixed streams need the same columns and encodings: "
                "convert them with the same schema"
            )
    counts = samples_per_stream(streams, [o.num_samples for o in opened], epoch_size, options.seed)
    return MixtureLoader(opened, counts, prefetch_batches=prefetch_batches, num_workers=options.num_workers)


@dataclasses.dataclass(frozen=True)
class _StreamSpec:
    """What a mixture needs of one opened stream: plain data, so worker processes can have it."""

    index: Any
    num_samples: int
    directory: str
    volume_url: str | None
    storage_options: dict | None
    cache_limit: int | None
    download_threads: int
    batch_size: int
    shuffle: bool
    seed: int
    shuffle_block_size: int
    drop_last: bool
    rank: int
    world_size: int
    device: Any = None

    @classmethod
    def of(cls, loader) -> "_StreamSpec":
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: getattr(loader, name) for name in names})


class _StreamReader:
    """One stream's cache, open shards and decoder."""

    def __init__(self, loader: "_StreamSpec", pinned: bool):
        self.index = loader.index
        self.cache = open_shard_cache(vars(loader))  # the spec's fields include the shards' source
        self.decoder = BatchDecoder(self.index.columns, lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=pinned))
        self.ends = np.cumsum(self.index.shard_sizes)
        self._readers: dict[int, ShardReader] = {}
        # Only a cache of a volume evicts shards; a local dataset folder keeps every file.
        self._evictable = self.cache.volume is not None
        self._last_key: bytes | None = None
        self._last_readers: list[ShardReader] = []

    def plan(self, steps: list[np.ndarray]) -> None:
        """Tells the cache which of its shards each coming batch reads (for prefetching and eviction)."""
        self.cache.set_plan(steps)
        self._last_key = None

    def open(self, step: int, shards: np.ndarray) -> list[ShardReader]:
        """The mapped shards ``shards`` (sorted) that step ``step`` reads."""
        key = shards.tobytes()
        if key == self._last_key:
            # The same shards as this stream's last batch (the common case): nothing to fetch or
            # open; the prefetcher hears of the position when the set changes.
            return self._last_readers
        paths = self.cache.acquire(step, shards)
        keys = shards.tolist()
        if self._evictable or len(self._readers) > _MAX_OPEN_SHARDS:
            # A mapping keeps an evicted shard's disk space uncounted by cache_limit: with a
            # volume, only the shards this step reads stay mapped.
            self._release(keep=set(keys))
        for shard, path in zip(keys, paths):
            if shard not in self._readers:
                self._readers[shard] = map_shard(self.cache, shard, path, self.decoder.row_bytes)
        self._last_key, self._last_readers = key, [self._readers[s] for s in keys]
        return self._last_readers

    def _release(self, keep: set) -> None:
        for shard in [s for s in self._readers if s not in keep]:
            self._readers.pop(shard).close()
        self._last_key, self._last_readers = None, []

    def close(self) -> None:
        self._release(keep=set())
        self.cache.close()


class MixtureLoader(Resumable):
    """An epoch-by-epoch iterable of batches mixed from several streams, with an exact position.

    Built by :func:`sparkgpu.data.dataset` with ``streams=``.

    Attributes:
        counts: Samples each stream contributes to every epoch.
        num_samples: Samples in an epoch (all ranks together).
        epoch: The epoch the next iteration reads.
    """

    def __init__(self, streams: list, counts: np.ndarray, prefetch_batches: int = 0, num_workers: int = 0):
        # One stream's index, location and settings each (taken from an MDSLoader opened for it).
        self.streams = [s if isinstance(s, _StreamSpec) else _StreamSpec.of(s) for s in streams]
        first = streams[0]
        self.counts = counts
        self.num_samples = int(counts.sum())
        self.batch_size, self.shuffle, self.seed = first.batch_size, first.shuffle, first.seed
        self.shuffle_block_size, self.drop_last = first.shuffle_block_size, first.drop_last
        self.rank, self.world_size, self.device = first.rank, first.world_size, first.device
        self.prefetch_batches = prefetch_batches
        self.num_workers = num_workers
        self._workers: torch.utils.data.DataLoader | None = None  # with num_workers > 0, made on first use
        self._offsets = np.concatenate([[0], np.cumsum(counts)])
        self._readers: list[_StreamReader] | None = None  # opened by the first iteration, dropped by close()
        self.epoch = 0
        self._consumed = 0
        self.metrics = LoaderMetrics(self.rank)

    # Position.

    def state_dict(self) -> dict:
        """The position after the last batch handed out, as plain JSON (the same on every rank)."""
        return self._saved_state()

    def load_state_dict(self, state: dict) -> None:
        """Continues from a saved position: the next iteration yields the rest of that epoch.

        Raises:
            ConfigurationError: The state comes from other streams, weights or shuffle.
        """
        self.epoch, self._consumed = self._restored_position(state)

    _layout = StateLayout(
        fields=("seed", "shuffle", "shuffle_block_size"),
        checked=("seed", "shuffle", "shuffle_block_size", "counts", "datasets"),
        fix="open the same streams with the same weights, seed and shuffle to resume",
        marks=("counts",),
        name="a mixture",
        what="mixture",
    )

    def _state_identity(self) -> dict:
        return {"counts": self.counts.tolist(), "datasets": [s.index.fingerprint for s in self.streams]}

    def _state_extent(self, state: dict) -> tuple[int, str]:
        return self.num_samples, f"epoch of {self.num_samples} samples"

    def stats(self) -> dict:
        """This rank's loader figures so far, all streams' caches together."""
        return self.metrics.snapshot([r.cache for r in self._readers] if self._readers else None)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's samples in order, as mixture ids (stream ``s``'s sample ``i`` is
        ``offsets[s] + i`` where ``offsets`` are the cumulative sizes of the streams)."""
        labels = self._stream_of_positions(epoch)
        order = np.empty(self.num_samples, dtype=np.int64)
        sizes = [s.num_samples for s in self.streams]
        bases = np.concatenate([[0], np.cumsum(sizes)])
        for s, count in enumerate(self.counts.tolist()):
            order[labels == s] = bases[s] + self._stream_samples(epoch, s, count)
        return order

    # Iteration.

    def __iter__(self):
        from sparkgpu.data.loaders._pipeline import in_background, prefetch_to_device

        plan, start = self._begin_epoch(), self._consumed
        caches = None
        if self.num_workers:
            source = self._in_workers(start)
        else:
            if self._readers is None:
                self._readers = [_StreamReader(s, pinned=self.device is not None) for s in self.streams]
            caches = [r.cache for r in self._readers]
            source = self._batches(plan, range(plan.num_batches))
            if self.prefetch_batches:
                source = in_background(source, self.prefetch_batches)
        if self.device is not None:
            source = prefetch_to_device(source, self.device)
        yield from self._hand_out(plan, start, self.metrics.timed(source, caches), source)

    def _in_workers(self, start: int):
        # As the MDS loader's workers: they persist across epochs, and each iteration tells
        # them where it starts through shared memory they inherited.
        if self._workers is None:
            self._worker_position = multiprocessing.Array("q", 2, lock=False)
            copy = MixtureLoader(self.streams, self.counts)  # plain data: what a worker needs
            self._workers = torch.utils.data.DataLoader(
                _WorkerBatches(copy, self._worker_position),
                batch_size=None,
                num_workers=self.num_workers,
                pin_memory=self.device is not None,
                prefetch_factor=self.prefetch_batches or 2,
                persistent_workers=True,
            )
        self._worker_position[0], self._worker_position[1] = self.epoch, start
        return iter(self._workers)

    def close(self) -> None:
        """Stops background downloads and frees open shards."""
        for reader in self._readers or ():
            reader.close()
        self._readers = None
        self._workers = None  # dropping the DataLoader stops its worker processes

    def _plan(self, epoch: int, start: int) -> EpochPlan:
        return self._rank_plan(self.epoch_order(epoch), start)

    def _open_readers(self) -> list[_StreamReader]:
        assert self._readers is not None, "the mixture is closed"  # opened by __iter__ before it reads batches
        return self._readers

    def _batches(self, plan: EpochPlan, batch_numbers):
        """Yields batches ``batch_numbers`` of ``plan``, in order."""
        from sparkgpu.data import _gather
        from sparkgpu.data.loaders._pipeline import _shards_per_batch

        # Every stream's shards numbered in one sequence (stream 0's, then stream 1's, ...), as
        # mixture ids number samples: whole-epoch arrays once, so each batch costs slices.
        sizes = [reader.index.shard_sizes for reader in self._open_readers()]
        ends = np.cumsum(np.concatenate(sizes)) if sizes else np.empty(0, np.int64)
        first_shard = np.cumsum([0] + [len(z) for z in sizes])
        stream_of_shard = np.repeat(np.arange(len(sizes)), [len(z) for z in sizes])
        shard_of = np.searchsorted(ends, plan.samples, side="right")
        rows_of = plan.samples - (ends - np.concatenate(sizes))[shard_of]
        size = plan.batch_size
        numbers = list(batch_numbers)
        steps = _shards_per_batch(shard_of, size, numbers, len(ends))
        by_stream = [stream_of_shard[shards] for shards in steps]
        for s, reader in enumerate(self._open_readers()):
            reader.plan([shards[of == s] - first_shard[s] for shards, of in zip(steps, by_stream)])
        decoder = self._open_readers()[0].decoder
        for step, (number, shards, of) in enumerate(zip(numbers, steps, by_stream)):
            lo, hi = number * size, (number + 1) * size
            streams = np.unique(of).tolist()
            opened = {s: self._open_readers()[s].open(step, shards[of == s] - first_shard[s]) for s in streams}
            batch_shards, rows = shard_of[lo:hi], rows_of[lo:hi]
            if decoder.fixed_width:  # every stream has the same row layout: one gather of the whole batch
                # Streams' decoders allocate batches, and fixed-width rows have a size.
                assert decoder.allocate is not None and decoder.row_bytes is not None
                readers = [r for s in streams for r in opened[s]]
                source_ids = None if len(readers) == 1 else np.searchsorted(shards, batch_shards).astype(np.int32)
                buffer = decoder.allocate(len(rows) * decoder.row_bytes)
                _gather.gather_rows(
                    buffer.numpy().reshape(len(rows), decoder.row_bytes), [r.rows for r in readers], source_ids, rows
                )
                yield decoder.split_rows(buffer)
                continue
            stream_of, parts = stream_of_shard[batch_shards], []
            for s in streams:
                mine = np.flatnonzero(stream_of == s)
                readers = opened[s]
                source_ids = (
                    None if len(readers) == 1 else np.searchsorted(shards[of == s], batch_shards[mine]).astype(np.int32)
                )
                parts.append((mine, self._open_readers()[s].decoder.decode(readers, source_ids, rows[mine])))
            yield _merge(parts, len(rows))

    def _stream_of_positions(self, epoch: int) -> np.ndarray:
        if self.shuffle:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch, 0x6D6978]))  # "mix"
            return rng.permutation(np.repeat(np.arange(len(self.counts)), self.counts))
        spots = (
            np.concatenate([(np.arange(n) + 0.5) / n for n in self.counts.tolist()])
            if self.num_samples
            else np.empty(0)
        )
        labels = np.repeat(np.arange(len(self.counts)), self.counts)
        return labels[np.argsort(spots, kind="stable")]

    def _stream_samples(self, epoch: int, stream: int, count: int) -> np.ndarray:
        loader = self.streams[stream]
        size = loader.num_samples
        passes, rest = divmod(count, size)
        orders = []
        for number in range(passes + (1 if rest else 0)):
            seed = int(np.random.SeedSequence([self.seed, stream, number]).generate_state(1)[0]) if self.shuffle else 0
            orders.append(
                epoch_order(
                    loader.index.shard_sizes,
                    shuffle=self.shuffle,
                    seed=seed,
                    epoch=epoch,
                    block_size=self.shuffle_block_size,
                )
            )
        if rest:
            orders[-1] = orders[-1][:rest]
        return np.concatenate(orders) if orders else np.empty(0, dtype=np.int64)


class _WorkerBatches(torch.utils.data.IterableDataset):
    """What each DataLoader worker iterates: batches ``w, w + k, ...`` of the rank's plan.

    ``position`` holds ``(epoch, samples consumed)`` for the iteration that starts; the
    worker's caches and open shards live as long as the worker.
    """

    def __init__(self, mixture: MixtureLoader, position):
        self.mixture, self.position = mixture, position

    def __iter__(self):
        mixture = self.mixture
        plan = mixture._plan(int(self.position[0]), int(self.position[1]))
        if mixture._readers is None:
            mixture._readers = [_StreamReader(s, pinned=False) for s in mixture.streams]  # pinned by the DataLoader
        yield from mixture._batches(plan, worker_batches(plan.num_batches))


def _merge(parts: list, n: int) -> dict:
    """One batch from each stream's share: ``parts`` is ``(positions in the batch, decoded dict)``."""
    if len(parts) == 1:
        return parts[0][1]
    batch: dict[str, Any] = {}
    for name, first in parts[0][1].items():
        if isinstance(first, torch.Tensor):
            tensor = first.new_empty((n, *first.shape[1:]))
            for positions, values in parts:
                tensor[torch.from_numpy(positions)] = values[name]
            batch[name] = tensor
        else:
            items: list[Any] = [None] * n
            for positions, values in parts:
                for position, value in zip(positions.tolist(), values[name]):
                    items[position] = value
            batch[name] = items
    return batch
