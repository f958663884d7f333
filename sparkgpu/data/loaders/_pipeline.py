"""How batches get made: in this process, in DataLoader workers, on a thread, onto the GPU.

Internal to :mod:`sparkgpu.data.loaders.mds_loader`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Collection

import numpy as np
import torch

from sparkgpu.data.augment.columns import ColumnCrops
from sparkgpu.data.mds.decode import BatchDecoder
from sparkgpu.data.mds.features import FeatureGather
from sparkgpu.data.loaders._base import worker_batches
from sparkgpu.data.loaders._shards import map_shard, open_shard_cache
from sparkgpu.data.loaders.order import EpochPlan, epoch_order, locate
from sparkgpu.data.mds.reader import ShardReader
from sparkgpu.data.transforms import BatchTransforms
from sparkgpu.errors import DataError

__all__ = ["Producer", "WorkerBatches", "in_background", "prefetch_to_device"]

_MAX_OPEN_SHARDS = 32
# Feature batches of consecutive steps are gathered together up to this many bytes.
_FEATURE_BLOCK_BYTES = 1 << 20


class Producer:
    """Decodes a plan's batches in this process: cache, open shards, decoder."""

    def __init__(self, spec: dict, pinned: bool):
        index = spec["index"]
        self.index = index
        self.cache = open_shard_cache(spec)
        # decode= columns stay encoded bytes here; self.crops decodes them, cropped, per batch.
        self.crops = ColumnCrops(spec.get("decode"), seed=spec["seed"], pinned=pinned)
        self.decoder = BatchDecoder(
            index.columns,
            lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=pinned),
            encoded=tuple(self.crops.decode),
        )
        sizes = index.shard_sizes
        self._ends = np.cumsum(sizes)
        self._readers: dict[int, ShardReader] = {}
        self._last_shards: np.ndarray | None = None
        self._last_readers: list[ShardReader] = []
        # Only a cache of a volume evicts shards; a local dataset folder keeps every file.
        self._evictable = self.cache.volume is not None
        self._row_bytes = self.decoder.row_bytes
        self.transforms = BatchTransforms(spec.get("transform"), spec.get("batch_transform"), seed=spec["seed"])
        layout = spec.get("features")
        self.features = FeatureGather(layout, index.columns, pinned) if layout is not None else None

    def run(self, plan: EpochPlan, batch_numbers, raw_rows: bool = False, epoch: int = 0):
        """Yields the decoded (and transformed) batches ``batch_numbers`` of ``plan``, in order.

        With ``raw_rows`` and no transforms, a fixed-width batch is yielded as its buffer of
        gathered rows (:meth:`BatchDecoder.split_rows` turns it into columns). With
        ``features``, batches are ``(x, y)`` (:mod:`sparkgpu.data.mds.features`). ``epoch``
        seeds the transforms' randomness.
        """
        transforms = self.transforms
        features = self.features
        if features is not None and features.fixed_width:
            decode = features.gather
        elif features is not None:
            decoder, matrix = self.decoder.decode, features.from_columns

            def decode(readers, source_ids, rows):
                return matrix(decoder(readers, source_ids, rows))
        elif raw_rows and self.decoder.fixed_width and not transforms:
            decode = self.decoder.gather_rows
        else:
            decode = self.decoder.decode
        batch_numbers = list(batch_numbers)
        size = plan.batch_size
        # Whole-epoch arrays once, so each batch costs slices, not searches.
        if plan.shards is not None and plan.rows is not None:
            shard_of, rows_of = plan.shards, plan.rows  # worked out ahead, with the epoch's order
        else:
            shard_of, rows_of = locate(plan.samples, self.index.shard_sizes)
        steps = _shards_per_batch(shard_of, size, batch_numbers, len(self._ends))
        self.cache.set_plan(steps)
        self._last_shards = None
        if features is not None and features.fixed_width and not transforms:
            yield from self._feature_blocks(plan, batch_numbers, steps, shard_of, rows_of)
            return
        try:
            for step, number in enumerate(batch_numbers):
                shards = steps[step]
                readers = self._open(step, shards)
                lo, hi = number * size, (number + 1) * size
                source_ids = None if len(shards) == 1 else np.searchsorted(shards, shard_of[lo:hi]).astype(np.int32)
                try:
                    batch = decode(readers, source_ids, rows_of[lo:hi])
                except IndexError as exc:
                    raise _damaged(readers, exc) from None
                if self.crops:  # before the transforms, which see the cropped images
                    batch = self.crops(batch, epoch=epoch, sample_ids=plan.samples[lo:hi])
                if transforms:
                    shard_names = [self.index.shards[s].basename for s in shard_of[lo:hi].tolist()]
                    batch = transforms(batch, epoch=epoch, sample_ids=plan.samples[lo:hi], shards=shard_names)
                del readers
                yield batch
        finally:
            if self._evictable:
                self._release(keep=())

    def _feature_blocks(self, plan: EpochPlan, batch_numbers: list[int], steps, shard_of, rows_of):
        # (x, y) batches cost a few microseconds of copying each, so the per-call work around
        # the copy (allocation, argument checks, this loop) would be most of their time.
        # Consecutive batches over the same shards are gathered in one call instead and
        # handed out as views of the block, in the same order and with the same rows.
        features = self.features
        assert features is not None
        size, total = plan.batch_size, len(plan.samples)
        block = max(1, _FEATURE_BLOCK_BYTES // max(1, size * features.batch_row_bytes))
        count = len(batch_numbers)
        try:
            step = 0
            while step < count:
                shards = steps[step]
                end = step + 1
                while (
                    end < count
                    and end - step < block
                    and steps[end] is shards
                    and batch_numbers[end] == batch_numbers[end - 1] + 1
                ):
                    end += 1
                readers = self._open(step, shards)
                lo, hi = batch_numbers[step] * size, min((batch_numbers[end - 1] + 1) * size, total)
                source_ids = None if len(shards) == 1 else np.searchsorted(shards, shard_of[lo:hi]).astype(np.int32)
                try:
                    gathered = features.gather(readers, source_ids, rows_of[lo:hi])
                except IndexError as exc:
                    raise _damaged(readers, exc) from None
                del readers
                if end - step == 1:
                    yield gathered
                else:
                    x, y = gathered if isinstance(gathered, tuple) else (gathered, None)
                    for start in range(0, hi - lo, size):
                        yield (
                            x[start : start + size] if y is None else (x[start : start + size], y[start : start + size])
                        )
                step = end
        finally:
            if self._evictable:
                self._release(keep=())

    def _open(self, step: int, shards: np.ndarray) -> list[ShardReader]:
        if shards is self._last_shards:
            # Same shards as the batch before (the common case): nothing to fetch or open. The
            # prefetcher hears of the reader's position when the set of shards changes.
            return self._last_readers
        paths = self.cache.acquire(step, shards)
        keys = shards.tolist()
        if self._evictable:
            # A mapping keeps an evicted shard's disk space (evicted by this cache or another
            # rank's), uncounted by cache_limit: only the shards this step reads stay mapped.
            # Sets change a few times per shard, so reopening costs next to nothing.
            self._release(keep=set(keys))
        if any(s not in self._readers for s in keys):
            if len(self._readers) > _MAX_OPEN_SHARDS:
                self._release(keep=set(keys))
            for shard, path in zip(keys, paths):
                if shard not in self._readers:
                    self._readers[shard] = map_shard(self.cache, shard, path, self._row_bytes)
        self._last_shards, self._last_readers = shards, [self._readers[s] for s in keys]
        return self._last_readers

    def _release(self, keep: Collection[int]) -> None:
        for shard in [s for s in self._readers if s not in keep]:
            self._readers.pop(shard).close()
        if not keep:
            self._last_shards, self._last_readers = None, []

    def close(self) -> None:
        self.cache.close()
        self._release(keep=set())


def _damaged(readers: list[ShardReader], exc: IndexError) -> DataError:
    names = ", ".join(r.info.basename for r in readers)
    return DataError(
        f"a sample in shard(s) {names} points outside its shard ({exc}); the shard is damaged: "
        "clear it from the cache (sparkgpu cache clear) or write the dataset again"
    )


def _shards_per_batch(
    shard_of: np.ndarray, batch_size: int, batch_numbers: list[int], num_shards: int
) -> list[np.ndarray]:
    """The sorted shard positions each batch reads."""
    if not len(shard_of):
        return [np.empty(0, dtype=np.int64) for _ in batch_numbers]
    # Most batches of a shard-aware order read one or two shards: a min/max per batch
    # settles the first case without looking at the samples again.
    bounds = np.arange(0, len(shard_of), batch_size)
    low, high = np.minimum.reduceat(shard_of, bounds), np.maximum.reduceat(shard_of, bounds)
    singles = {}
    steps: list[np.ndarray] = []
    for b in batch_numbers:
        first, last = int(low[b]), int(high[b])
        if first == last:
            if first not in singles:
                singles[first] = np.array([first], dtype=np.int64)
            steps.append(singles[first])
        else:
            counts = np.bincount(shard_of[b * batch_size : (b + 1) * batch_size] - first, minlength=last - first + 1)
            shards = np.flatnonzero(counts) + first
            # A shuffled window's batches mostly read the same shards as the batch before: the
            # same object then, so the reader opens nothing and gathers them as one block.
            if steps and np.array_equal(steps[-1], shards):
                shards = steps[-1]
            steps.append(shards)
    return steps


class WorkerBatches(torch.utils.data.IterableDataset):
    """What each DataLoader worker process iterates: its share of the rank's batches.

    Worker ``w`` of ``k`` decodes batches ``w, w + k, ...``; the DataLoader takes one batch
    from each worker in turn, which restores the rank's order exactly. ``position`` holds
    ``(epoch, samples consumed)`` for the iteration that starts; the worker's cache and open
    shards live as long as the worker.
    """

    def __init__(self, spec: dict, position):
        self.spec, self.position = spec, position
        self._producer = None
        self._order = (None, None)

    def __iter__(self):
        s = self.spec
        epoch, start = int(self.position[0]), int(self.position[1])
        if self._order[0] != epoch:
            self._order = (
                epoch,
                epoch_order(
                    s["index"].shard_sizes,
                    shuffle=s["shuffle"],
                    seed=s["seed"],
                    epoch=epoch,
                    block_size=s["shuffle_block_size"],
                ),
            )
        plan = EpochPlan.for_rank(
            self._order[1],
            start=start,
            rank=s["rank"],
            world_size=s["world_size"],
            batch_size=s["batch_size"],
            drop_last=s["drop_last"],
        )
        if self._producer is None:
            self._producer = Producer(s, pinned=False)  # the DataLoader pins in the main process
        yield from self._producer.run(plan, worker_batches(plan.num_batches), raw_rows=True, epoch=epoch)


def in_background(batches, depth: int):
    """Runs ``batches`` on a thread, ``depth`` batches ahead of the consumer."""
    done = object()
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce():
        try:
            for batch in batches:
                while not stop.is_set():
                    try:
                        slots.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            slots.put(done)
        except BaseException as exc:  # handed to the consumer, which raises it
            slots.put(exc)
        finally:
            batches.close()

    thread = threading.Thread(target=produce, name="sparkgpu-batches", daemon=True)
    thread.start()
    try:
        while True:
            item = slots.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting for a free slot
            try:
                slots.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.05)


def prefetch_to_device(batches, device):
    """Copies each batch (a buffer of rows, an ``(x, y)`` pair, or a dict) to ``device`` on a side stream, one ahead.

    Pinned sources make the copies asynchronous: the next batch crosses the bus while the
    training step runs on the current one.
    """
    stream = torch.cuda.Stream(device=device)

    def move(batch):
        with torch.cuda.stream(stream):
            if isinstance(batch, torch.Tensor):
                return batch.to(device, non_blocking=True)
            if isinstance(batch, tuple):
                return tuple(t.to(device, non_blocking=True) for t in batch)
            return {k: _to_device(v, device) for k, v in batch.items()}

    iterator = iter(batches)
    try:
        ahead = move(next(iterator))
    except StopIteration:
        return
    for batch in iterator:
        current = ahead
        _hand_over(current, stream, device)
        ahead = move(batch)  # starts before `current` is used: the copy overlaps the step
        yield current
    _hand_over(ahead, stream, device)
    yield ahead


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        return [v.to(device, non_blocking=True) for v in value]
    return value


def _hand_over(batch, stream, device):
    consumer = torch.cuda.current_stream(device)
    consumer.wait_stream(stream)
    values = [batch] if isinstance(batch, torch.Tensor) else batch if isinstance(batch, tuple) else batch.values()
    for value in values:
        for tensor in value if isinstance(value, list) else [value]:
            if isinstance(tensor, torch.Tensor):
                # Memory allocated on the side stream is now used on the consumer's: tell the
                # caching allocator, or it could hand the block out again too early.
                tensor.record_stream(consumer)
