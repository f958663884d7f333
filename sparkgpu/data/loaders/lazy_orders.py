"""Shuffled epoch orders worked out as far as batches need them, so a first batch waits for its own part only.

:func:`~sparkgpu.data.loaders.order.epoch_order` sorts one random position per sample, and the
fragment shuffle permutes every window of its layout: on the 2M rows of the table benchmark,
0.1-0.4 s before the first batch of an epoch can even be planned when done whole. These work the
same orders out a part at a time: the part a batch needs when it is first needed, the rest on a
background task (``EpochOrders``' ``finish``). A saved position therefore means the same thing
however far the order had been worked out.

* :class:`BandedOrder` (the windowed shuffle) cuts the random positions into bands of
  ``BAND_WIDTH`` positions (one radix pass on 16-bit band numbers) and sorts each band, equal
  positions by sample id; bands can be sorted by several threads at once. Where each shard's
  samples lie in the order is worked out from the positions without the sort: a sample's place
  is the count of samples before its band plus its rank inside it.
* :class:`FragmentOrder` (the fragment shuffle) lays the shards out in a random order and
  permutes windows of it in turn, drawing from the one generator in sequence as the whole
  permutation does. Each shard's span is given to the window: a shard's rows stay inside the
  windows its place in the layout overlaps.

A DataLoader worker forked while a parent's thread was working on an order finishes that work
itself (:func:`_after_fork`).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from sparkgpu.data.loaders.order import argsort_ties_by_id, shuffle_positions

__all__ = ["LazyOrder", "BandedOrder", "FragmentOrder", "BAND_WIDTH"]

BAND_WIDTH = 1 << 16  # positions per band: about as many samples, a few ms to sort
_MAX_BANDS = 60_000  # band numbers stay 16-bit: numpy radix-sorts those in one pass

_live: weakref.WeakSet[LazyOrder] = weakref.WeakSet()


class LazyOrder:
    """An epoch's order, final as far as it has been worked out.

    Attributes:
        order: Every sample id once; positions before :meth:`ensure`'s ``end`` are final, the rest
            not yet written.
    """

    order: np.ndarray

    def __len__(self) -> int:
        return len(self.order)

    def ensure(self, end: int) -> np.ndarray:
        """Works the order out at least up to position ``end``; returns :attr:`order`. Thread-safe."""
        raise NotImplementedError

    def complete(self) -> np.ndarray:
        """The whole order, working out what is left."""
        return self.ensure(len(self.order))

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        """``(first, last)`` position in the order of each shard's samples (inclusive), as far as a
        reader plans its reads by them, without working the whole order out."""
        raise NotImplementedError

    def _forked(self) -> None:
        """In a forked child: a fresh lock, and work a parent's thread left unfinished given back."""
        raise NotImplementedError


class BandedOrder(LazyOrder):
    """The windowed shuffle's order, final up to where it has been sorted.

    Args:
        shard_sizes: Samples per shard, in index order.
        seed: Seed of the run.
        epoch: Epoch number.
        block_size: The shuffle's window (as :func:`~sparkgpu.data.loaders.order.epoch_order`).

    Attributes:
        order: Every sample id once; positions before :meth:`ensure`'s ``end`` are final, the rest
            not yet written.
    """

    def __init__(self, shard_sizes: np.ndarray, *, seed: int, epoch: int, block_size: int):
        self._sizes = np.asarray(shard_sizes, dtype=np.int64)
        self._positions = shuffle_positions(self._sizes, seed=seed, epoch=epoch, block_size=block_size)
        total = len(self._positions)
        self.order = np.empty(total, dtype=np.int64)
        if total:
            # Bounds from the shards' windows, without a pass over the positions: a shard's window
            # is centred on its place, which lies between 0 and the total.
            spill = float(np.max(np.maximum(self._sizes, block_size) - self._sizes)) / 2.0
            low, span = -spill, total + 2.0 * spill
            self._low, self._width = low, max(float(BAND_WIDTH), span / (_MAX_BANDS - 1))
            band = self._band_of(self._positions)
            self._members = np.argsort(band, kind="stable")  # each band's samples, by id
            ends = np.cumsum(np.bincount(band))
        else:
            self._members, ends = np.empty(0, np.int64), np.empty(0, np.int64)
        self._bounds = np.concatenate([[0], ends]).astype(np.int64)
        self._done = np.zeros(len(ends), dtype=bool)
        self._final = 0  # bands [0, _final) are sorted into `order`
        self._claimed = 0  # bands [0, _claimed) are sorted or being sorted by some thread
        self._changed = threading.Condition()
        _live.add(self)

    @property
    def sorted_until(self) -> int:
        """Positions of :attr:`order` already final."""
        return int(self._bounds[self._final])

    def _band_of(self, positions: np.ndarray) -> np.ndarray:
        return ((positions - self._low) / self._width).astype(np.uint16)

    def ensure(self, end: int) -> np.ndarray:
        """Sorts the bands that hold positions before ``end``; returns :attr:`order`.

        Safe from several threads: each band is sorted once, by the first thread to claim it,
        so a thread that needs the first bands does not wait for a background sort of the rest.
        """
        # The bands that start before `end`.
        needed = int(np.searchsorted(self._bounds[:-1], min(end, len(self.order)), side="left"))
        while True:
            with self._changed:
                if self._final >= needed:
                    return self.order
                while self._claimed < needed and self._done[self._claimed]:
                    self._claimed += 1
                if self._claimed >= needed:  # the rest is being sorted by another thread
                    self._changed.wait()
                    continue
                band = self._claimed
                self._claimed += 1
            lo, hi = self._bounds[band], self._bounds[band + 1]
            members = self._members[lo:hi]  # ascending ids: ties sort by id
            self.order[lo:hi] = members[argsort_ties_by_id(self._positions[members])]
            with self._changed:
                self._done[band] = True
                while self._final < len(self._done) and self._done[self._final]:
                    self._final += 1
                self._changed.notify_all()

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        """Exactly :func:`~sparkgpu.data.loaders.order.shard_spans` of the order, without the sort."""
        starts = np.cumsum(self._sizes) - self._sizes
        lowest, highest = np.empty_like(starts), np.empty_like(starts)
        for shard, (begin, size) in enumerate(zip(starts.tolist(), self._sizes.tolist())):
            keys = self._positions[begin : begin + size]
            lowest[shard] = begin + int(np.argmin(keys))  # equal keys: the smallest id comes first
            highest[shard] = begin + size - 1 - int(np.argmax(keys[::-1]))  # ... and the largest last
        places = self._places(np.concatenate([lowest, highest]))
        return places[: len(starts)], places[len(starts) :]

    def _places(self, samples: np.ndarray) -> np.ndarray:
        """Each sample's position in the order: the samples before its band, and those before it in it."""
        places = np.empty(len(samples), dtype=np.int64)
        bands = self._band_of(self._positions[samples])
        for band in np.unique(bands).tolist():
            lo, hi = self._bounds[band], self._bounds[band + 1]
            members = self._members[lo:hi]
            keys = self._positions[members]
            for i in np.flatnonzero(bands == band).tolist():
                sample, key = samples[i], self._positions[samples[i]]
                places[i] = lo + np.count_nonzero(keys < key) + np.count_nonzero((keys == key) & (members < sample))
        return places

    def _forked(self) -> None:
        # A band a parent's thread was sorting at the fork is never finished here, and a lock it
        # held stays held; a fork between a band's sort and the advance past it leaves that too.
        self._changed = threading.Condition()
        while self._final < len(self._done) and self._done[self._final]:
            self._final += 1
        self._claimed = self._final

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_changed"]
        state["_claimed"] = state["_final"]  # a band being sorted elsewhere is sorted again
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._changed = threading.Condition()
        _live.add(self)


class FragmentOrder(LazyOrder):
    """The fragment shuffle's order: shards in a random layout, rows permuted within windows.

    The shuffle ``pyarrow.dataset`` users write by hand (fragments in a random order, each
    record batch permuted), as an order: every shard is read whole and in one piece, so no
    batch mixes more than the two shards at a boundary. With ``window`` = batch size x world
    size, each rank's batch is a permutation of the rows it would get unshuffled. Depends only
    on ``(seed, epoch)`` and the sizes: the layout is one permutation of the shards, then each
    whole window is permuted in turn from the same generator, then the shorter last one.

    Args:
        shard_sizes: Samples per shard, in index order.
        seed: Seed of the run.
        epoch: Epoch number.
        window: Rows permuted together (the last window of the epoch may be shorter).
    """

    _STEP = 1 << 16  # rows permuted per step (whole windows): one generator call for many small windows

    def __init__(self, shard_sizes: np.ndarray, *, seed: int, epoch: int, window: int):
        self._sizes = np.asarray(shard_sizes, dtype=np.int64)
        rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, 1]))
        layout = rng.permutation(len(self._sizes))
        lengths = self._sizes[layout]
        self._slot_ends = np.cumsum(lengths)
        slot_starts = self._slot_ends - lengths
        # Position p of slot j holds sample p + _shift[j] before the windows are permuted.
        self._shift = (np.cumsum(self._sizes) - self._sizes)[layout] - slot_starts
        self._slot_of_shard = np.empty(len(layout), dtype=np.int64)
        self._slot_of_shard[layout] = np.arange(len(layout))
        total = int(self._sizes.sum())
        self.order = np.empty(total, dtype=np.int64)
        self._window = window
        self._whole = total - total % window
        # (positions final, the generator's state there), replaced whole: a fork sees both or neither.
        self._progress = (0, rng.bit_generator.state)
        self._drawing = False  # a thread is permuting the next step (outside the lock)
        self._advanced = threading.Condition()
        _live.add(self)

    @property
    def sorted_until(self) -> int:
        """Positions of :attr:`order` already final."""
        return self._progress[0]

    def ensure(self, end: int) -> np.ndarray:
        # Windows come from one generator in turn, so one thread draws at a time, a step at a time,
        # and a thread that needs less than another is drawing waits only until its part is done.
        end = min(end, len(self.order))
        with self._advanced:
            while self._progress[0] < end:
                if self._drawing:
                    self._advanced.wait()
                    continue
                self._drawing = True
                done, state = self._progress
                self._advanced.release()
                try:
                    stop, state = self._step(done, state)
                finally:
                    self._advanced.acquire()
                    self._drawing = False
                    self._advanced.notify_all()
                self._progress = (stop, state)
        return self.order

    def _step(self, done: int, state: Mapping[str, Any]) -> tuple[int, Mapping[str, Any]]:
        """Permutes the windows after position ``done`` from generator ``state``; returns where it
        stopped and the generator's state there."""
        rng = np.random.default_rng()
        rng.bit_generator.state = state
        if done < self._whole:
            stop = min(self._whole, done + -(-self._STEP // self._window) * self._window)
            windows = self._unshuffled(done, stop).reshape(-1, self._window)
            self.order[done:stop] = rng.permuted(windows, axis=1).reshape(-1)
        else:
            stop = len(self.order)
            self.order[done:] = rng.permutation(self._unshuffled(done, stop))
        return stop, rng.bit_generator.state

    def _unshuffled(self, begin: int, end: int) -> np.ndarray:
        """Positions ``[begin, end)`` of the layout before any window is permuted."""
        first = int(np.searchsorted(self._slot_ends, begin, side="right"))
        last = int(np.searchsorted(self._slot_ends, end - 1, side="right"))
        bounds = np.clip(np.concatenate([[begin], self._slot_ends[first:last], [end]]), begin, end)
        return np.arange(begin, end, dtype=np.int64) + np.repeat(self._shift[first : last + 1], np.diff(bounds))

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        """Each shard's span widened to whole windows (its rows lie in the windows its place in the
        layout overlaps, anywhere within them): at most a window wider than the rows' own span."""
        slot = self._slot_of_shard
        begin = self._slot_ends[slot] - self._sizes
        first = begin // self._window * self._window
        last = np.minimum(len(self.order), ((self._slot_ends[slot] - 1) // self._window + 1) * self._window) - 1
        return first, last

    def _forked(self) -> None:
        # Positions and generator state move together, so the child goes on from a consistent
        # point; a step a parent's thread was drawing is drawn again, and a lock it held replaced.
        self._advanced = threading.Condition()
        self._drawing = False

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_advanced"]
        state["_drawing"] = False
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._advanced = threading.Condition()
        _live.add(self)


def _after_fork() -> None:
    for order in list(_live):
        order._forked()


os.register_at_fork(after_in_child=_after_fork)
