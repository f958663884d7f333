"""Which sample goes where: the epoch's order, and its split over ranks, batches and workers.

Shuffle. A shard-aware shuffle of the same family as MosaicML Streaming's ``py1e``: each
epoch, shards are laid out in a random order; every sample then draws a random position
uniformly inside a window of ``block_size`` samples centred on its shard's place in that
layout (or inside its shard's own span, when the shard is larger than the window); sorting
by position gives the order. Samples therefore mix across neighbouring shards, while at any
point of the epoch only the few shards overlapping one window are needed — what keeps a
small cache enough and lets downloads be planned ahead. The order depends only on
``(seed, epoch)`` and the shard sizes.

Split. Position ``p`` of the epoch's order goes to rank ``p % world_size``, so all ranks walk
the same window of shards at the same time (one node's ranks share one cache), and a batch
step of all ranks consumes one contiguous stretch of the order: the loader's state is just
"samples consumed", which stays valid when the job resumes with another world size.

Uneven counts. When the samples left in an epoch do not divide by ``world_size``, the last
``remaining % world_size`` of them (fewer than ``world_size``) are left out of this epoch,
so every rank gets the same number of samples and batches (DDP never waits on a rank that
has run out) and no sample is ever seen twice in an epoch. With shuffling these are
different samples each epoch. Within a rank, the last batch may be short unless
``drop_last`` is set; ranks' batch counts still match because their sample counts do.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Any, Callable

import numpy as np

from sparkgpu.errors import ConfigurationError

__all__ = [
    "epoch_order",
    "locate",
    "shard_spans",
    "EpochPlan",
    "DEFAULT_BLOCK_SIZE",
    "restore_position",
    "EpochOrders",
]

DEFAULT_BLOCK_SIZE = 1 << 18


def epoch_order(
    shard_sizes: np.ndarray, *, shuffle: bool, seed: int, epoch: int, block_size: int = DEFAULT_BLOCK_SIZE
) -> np.ndarray:
    """Returns every sample id of the dataset once, in this epoch's order.

    Args:
        shard_sizes: Samples per shard, in index order (sample ids number shards in order).
        shuffle: Shuffle; when False the order is the dataset's.
        seed: Seed of the run; the same ``(seed, epoch)`` gives the same order.
        epoch: Epoch number.
        block_size: Width, in samples, of the window each shard's samples spread over.

    Returns:
        ``int64`` array of length ``shard_sizes.sum()``.
    """
    if not shuffle:
        return np.arange(int(np.sum(shard_sizes)), dtype=np.int64)
    return argsort_ties_by_id(shuffle_positions(shard_sizes, seed=seed, epoch=epoch, block_size=block_size))


def shuffle_positions(shard_sizes: np.ndarray, *, seed: int, epoch: int, block_size: int) -> np.ndarray:
    """Each sample's random position (``float64``, by sample id); the shuffled order sorts by it, ties by id."""
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch]))
    layout = rng.permutation(len(sizes))
    starts = np.empty(len(sizes), dtype=np.float64)
    starts[layout] = np.cumsum(sizes[layout]) - sizes[layout]
    width = np.maximum(sizes, block_size).astype(np.float64)
    low = starts + sizes / 2.0 - width / 2.0
    return np.repeat(low, sizes) + rng.random(int(sizes.sum())) * np.repeat(width, sizes)


def locate(samples: np.ndarray, shard_sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The shard and the row inside it of each sample id.

    Args:
        samples: ``int64`` sample ids.
        shard_sizes: Samples per shard, in index order.

    Returns:
        ``(shards, rows)``: ``int32`` shard position and ``int64`` row of each sample.
    """
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    if len(sizes) and sizes[0] > 0 and np.all(sizes[:-1] == sizes[0]) and sizes[-1] <= sizes[0]:
        # Shards of one size (all but a shorter last one, as a size limit writes them): one
        # division per sample instead of a binary search, about 8x faster on a shuffled order.
        shards = samples // sizes[0]
        return shards.astype(np.int32), samples - shards * sizes[0]
    ends = np.cumsum(sizes)
    if not len(samples):
        return np.empty(0, np.int32), np.empty(0, np.int64)
    # Uneven shards: one table look-up per sample instead of a binary search (about 3x faster).
    # The table holds the shard of the first sample of every block of `block` samples; with
    # blocks no larger than the smallest shard, a sample lies in that shard or a later one,
    # which a comparison or two finds. Blocks grow where the table would pass 4M entries.
    block = 1 << int(np.log2(max(1, int(sizes[sizes > 0].min()))))
    block = max(block, 1 << (int(ends[-1]) >> 22).bit_length())
    shift = block.bit_length() - 1
    table = np.searchsorted(ends, np.arange(0, int(ends[-1]), block, dtype=np.int64), side="right")
    shards = table.astype(np.int32)[samples >> shift]
    while True:
        past = samples >= ends[shards]
        if not past.any():
            return shards, samples - (ends - sizes)[shards]
        shards += past


def shard_spans(order: np.ndarray | None, shard_sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each shard's samples lie in the epoch's order: its first and last position.

    Knowing these, a reader can plan which shards to fetch ahead and when to drop them from
    sizes alone, without finding the shard of every sample first.

    Args:
        order: The epoch's order (:func:`epoch_order`), or ``None`` for the dataset's own order.
        shard_sizes: Samples per shard, in index order; every shard holds at least one.

    Returns:
        ``(first, last)``: ``int64`` arrays, one entry per shard (both inclusive).
    """
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    ends = np.cumsum(sizes)
    if order is None:
        return ends - sizes, ends - 1
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order), dtype=np.int64)
    starts = ends - sizes
    return np.minimum.reduceat(position, starts), np.maximum.reduceat(position, starts)


def located_order(
    shard_sizes: np.ndarray, *, shuffle: bool, seed: int, epoch: int, block_size: int = DEFAULT_BLOCK_SIZE
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`epoch_order` and :func:`locate` of it: ``(order, shards, rows)``."""
    order = epoch_order(shard_sizes, shuffle=shuffle, seed=seed, epoch=epoch, block_size=block_size)
    return (order, *locate(order, shard_sizes))


def argsort_ties_by_id(keys: np.ndarray) -> np.ndarray:
    """The order that sorts ``keys``, equal keys by index: the same on every machine."""
    # Quicksort is 2-3x faster than a stable sort, but which of two equal keys comes first
    # would then depend on the numpy build and CPU (SIMD sorts), and ranks on different
    # machines must agree on every position. Equal float64 keys are rare, so reorder just
    # those runs by sample id: the result is the unique stable order, computed fast.
    order = np.argsort(keys, kind="quicksort")
    ranked = keys[order]
    tied = np.flatnonzero(ranked[1:] == ranked[:-1])
    if tied.size:
        run_starts = tied[np.r_[True, np.diff(tied) > 1]]
        run_ends = tied[np.r_[np.diff(tied) > 1, True]] + 2
        for begin, end in zip(run_starts.tolist(), run_ends.tolist()):
            order[begin:end].sort()
    return order.astype(np.int64, copy=False)


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    """One rank's share of an epoch, from a given point on, cut into batches.

    Attributes:
        samples: The rank's sample ids, in order.
        batch_size: Samples per batch.
        drop_last: Leave out a short last batch.
        dropped: Samples of the epoch (from ``start``) that no rank gets (see module doc).
        shards: The shard of each of ``samples`` (:func:`locate`), when it was worked out
            ahead; ``None`` otherwise.
        rows: The row of each of ``samples`` inside its shard, with ``shards``.
        first_position: Position in the epoch's order of ``samples[0]``.
        stride: Positions of the order between consecutive ``samples`` (the world size).
    """

    samples: np.ndarray
    batch_size: int
    drop_last: bool
    dropped: int
    shards: np.ndarray | None = None
    rows: np.ndarray | None = None
    first_position: int = 0
    stride: int = 1

    @classmethod
    def for_rank(
        cls,
        order: np.ndarray,
        *,
        start: int,
        rank: int,
        world_size: int,
        batch_size: int,
        drop_last: bool,
        located: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> "EpochPlan":
        """Splits ``order[start:]`` over ranks and takes this rank's part.

        Args:
            order: The epoch's order (:func:`epoch_order`).
            start: Samples of the epoch consumed already by all ranks together.
            rank: This rank.
            world_size: Number of ranks.
            batch_size: Samples per batch.
            drop_last: Leave out a short last batch.
            located: ``(shards, rows)`` of every sample of ``order`` (:func:`located_order`),
                split the same way into the plan's ``shards`` and ``rows``.
        """
        remaining = len(order) - start
        usable = remaining - remaining % world_size
        part = slice(start + rank, start + usable, world_size)
        shards, rows = (located[0][part], located[1][part]) if located is not None else (None, None)
        return cls(order[part], batch_size, drop_last, remaining - usable, shards, rows, start + rank, world_size)

    @property
    def num_batches(self) -> int:
        full, rest = divmod(len(self.samples), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def batch(self, index: int) -> np.ndarray:
        """Sample ids of batch ``index``."""
        return self.samples[index * self.batch_size : (index + 1) * self.batch_size]

    def batch_samples(self, index: int) -> int:
        """Number of samples in batch ``index``."""
        return len(self.batch(index))

    def batches_between(self, first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The first and last of this rank's batches holding a position of the order in ``[first, last]``.

        Args:
            first: First positions of the epoch's order (one per span, :func:`shard_spans`).
            last: Last positions, inclusive.

        Returns:
            ``(first_batch, last_batch)``; ``first_batch > last_batch`` where none of the span's
            positions fall to this rank (before the plan's start, dropped, or another rank's).
        """
        lo = -((self.first_position - np.asarray(first, dtype=np.int64)) // self.stride)  # rounded up
        hi = (np.asarray(last, dtype=np.int64) - self.first_position) // self.stride
        lo = np.maximum(lo, 0)
        hi = np.minimum(hi, min(self.num_batches * self.batch_size, len(self.samples)) - 1)
        none = lo > hi
        return np.where(none, 1, lo // self.batch_size), np.where(none, 0, hi // self.batch_size)


def restore_position(
    state: dict, mine: dict, *, keys, total: int, unit: str, what: str, fix: str, counter: str = "samples_consumed"
) -> tuple[int, int]:
    """Checks a saved loader position against this loader's own state; every loader resumes so.

    Args:
        state: The saved ``state_dict()``.
        mine: This loader's ``state_dict()``.
        keys: What must match for the rest of the epoch to be the part not yet seen.
        total: How far ``counter`` may go in an epoch.
        unit: What ``total`` counts, for the message (``"dataset of 1000 samples"``).
        what: The loader, for the message (``"loader"``, ``"mixture"``).
        fix: What to do instead; ``{key}`` names the key that differs.
        counter: The state's position entry.

    Returns:
        ``(epoch, consumed)`` to continue from.

    Raises:
        ConfigurationError: A key differs, or the position lies outside the epoch.
    """
    for key in keys:
        if state.get(key) != mine[key]:
            raise ConfigurationError(
                f"the saved state has {key}={state.get(key)!r} but this {what} has "
                f"{key}={mine[key]!r}; {fix.format(key=key)}"
            )
    consumed = int(state[counter])
    if not 0 <= consumed <= total:
        raise ConfigurationError(f"{counter}={consumed} is outside this {unit}")
    return int(state["epoch"]), consumed


def check_int(name: str, value, minimum: int) -> None:
    """Raises :class:`ConfigurationError` unless ``value`` is an integer (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigurationError(f"{name}={value!r} must be an integer >= {minimum}")


class PlannedEpochs:
    """The position of a loader that plans each epoch (``_plan(epoch, start)`` returns an
    :class:`EpochPlan` for this rank) and counts the samples all ranks consumed of the current one."""

    epoch: int
    _consumed: int

    def _plan(self, epoch: int, start: int) -> EpochPlan:
        """This rank's plan of ``epoch``, from sample ``start`` of all ranks on (each loader's own)."""
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        """Starts the next iteration at the beginning of ``epoch``."""
        check_int("epoch", epoch, 0)
        self.epoch, self._consumed = int(epoch), 0

    def __len__(self) -> int:
        """Batches (rows for a loader that hands out single rows, ``batch_size=None``) this rank reads in a whole epoch."""
        return self._handed_out(self._plan(self.epoch, 0))

    def position(self) -> tuple[int, int]:
        """``(epoch, left)``: the epoch the next iteration reads and what this rank has left of it at
        this world size, counted as ``len()`` counts."""
        epoch, _, plan = self._next_plan()
        return epoch, self._handed_out(plan)

    def _handed_out(self, plan: EpochPlan) -> int:
        """What iterating ``plan`` yields: its batches, or its rows one by one with ``batch_size=None``."""
        return plan.num_batches if getattr(self, "batch_size", 1) else len(plan.samples)

    def _begin_epoch(self) -> EpochPlan:
        """Moves to where the next iteration starts (:meth:`_next_plan`) and returns this rank's plan of it."""
        self.epoch, self._consumed, plan = self._next_plan()
        return plan

    def _next_plan(self) -> tuple[int, int, EpochPlan]:
        """``(epoch, start, plan)`` of the next iteration: the rest of the current epoch, or the next
        epoch whole when the current one was read to its end (a checkpoint taken after its last batch)."""
        plan = self._plan(self.epoch, self._consumed)
        if plan.num_batches == 0 and self._consumed > 0:
            return self.epoch + 1, 0, self._plan(self.epoch + 1, 0)
        return self.epoch, self._consumed, plan


class EpochOrders:
    """Each epoch's order (with what a loader derives from it), worked out once per epoch.

    A shuffled order costs a sort of the whole dataset, about 0.1 s per million samples. When
    the order changes from epoch to epoch, the next epoch's is worked out on a background
    thread while this one is read, so only the first epoch's first batch waits for one (for
    the part of it that batch needs alone, where the loader's order is a
    :class:`~sparkgpu.data.loaders.lazy_orders.LazyOrder` finished with ``finish``). An
    unshuffled order is the same every epoch: worked out once. The thread is the process's
    own: a forked DataLoader worker starts its own, and work its parent left pending is redone.

    Args:
        compute: ``compute(epoch)``: the epoch's order and whatever the loader derives from it.
        per_epoch: Whether ``compute``'s result differs from epoch to epoch.
        finish: ``finish(result)``: work on a result that may come after it is handed out (the
            rest of a :class:`~sparkgpu.data.loaders.lazy_orders.LazyOrder`), run on the
            background thread right after ``compute``.
    """

    def __init__(self, compute: Callable[[int], Any], per_epoch: bool, finish: Callable[[Any], None] | None = None):
        self.compute, self.per_epoch, self.finish = compute, per_epoch, finish
        self._results: dict[int, concurrent.futures.Future] = {}
        self._pool: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None

    def get(self, epoch: int):
        """``compute(epoch)``, from its earlier or background run when there was one."""
        key = epoch if self.per_epoch else 0
        if self._pool is not None and self._pool[0] != os.getpid():  # forked: the parent's thread is not here
            self._pool = None
            self._results = {k: f for k, f in self._results.items() if f.done()}
            for future in self._results.values():  # what the parent's thread had left to finish
                self._finish(future)
        if key not in self._results:
            self._results[key] = self._submit(key)
        result = self._results[key].result()
        if self.per_epoch and key + 1 not in self._results:
            self._results = {key: self._results[key], key + 1: self._submit(key + 1)}
        return result

    def _submit(self, epoch: int) -> concurrent.futures.Future:
        future = self._executor().submit(self.compute, epoch)
        self._finish(future)
        return future

    def _finish(self, future: concurrent.futures.Future) -> None:
        if self.finish is not None:
            finish = self.finish
            self._executor().submit(lambda: future.exception() is None and finish(future.result()))

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = (os.getpid(), concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sparkgpu-order"))
        return self._pool[1]

    def close(self) -> None:
        """Stops background work and forgets every order."""
        if self._pool is not None and self._pool[0] == os.getpid():
            self._pool[1].shutdown(wait=False, cancel_futures=True)
        self._pool, self._results = None, {}

    def __getstate__(self) -> dict:
        return {
            "compute": self.compute,
            "per_epoch": self.per_epoch,
            "finish": self.finish,
            "_results": {},
            "_pool": None,
        }
