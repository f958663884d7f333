"""A shuffled epoch order that is sorted a band at a time, so a first batch waits for its band only.

:func:`~sparkgpu.data.loaders.order.epoch_order` sorts one random position per sample: about
0.15-0.4 s for 2M samples, all of it before the first batch of an epoch can be planned. Here
the positions are cut into bands of ``BAND_WIDTH`` positions (one pass of a radix sort
on the band numbers) and each band is sorted when it is first needed, or ahead by a
background task. Sorting band by band, equal positions by sample id, gives exactly the
order :func:`epoch_order` gives, so a saved position means the same thing under both.

Where each shard's samples lie in the order (what a reader plans its reads by) is worked out
from the positions without the sort: a sample's place is the count of samples before its
band plus its rank inside it.
"""

from __future__ import annotations

import os
import threading
import weakref

import numpy as np

from sparkgpu.data.loaders.order import argsort_ties_by_id, shuffle_positions

__all__ = ["BandedOrder", "BAND_WIDTH"]

BAND_WIDTH = 1 << 16  # positions per band: about as many samples, a few ms to sort
_MAX_BANDS = 60_000  # band numbers stay 16-bit: numpy radix-sorts those in one pass

_live: weakref.WeakSet[BandedOrder] = weakref.WeakSet()


class BandedOrder:
    """An epoch's shuffled order, final up to where it has been sorted.

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
            width = max(float(BAND_WIDTH), span / (_MAX_BANDS - 1))
            band = ((self._positions - low) / width).astype(np.uint16)
            self._members = np.argsort(band, kind="stable")  # each band's samples, by id
            self._band_of = band
            ends = np.cumsum(np.bincount(band))
        else:
            self._members, self._band_of, ends = np.empty(0, np.int64), np.empty(0, np.uint16), np.empty(0, np.int64)
        self._bounds = np.concatenate([[0], ends]).astype(np.int64)
        self._done = np.zeros(len(ends), dtype=bool)
        self._final = 0  # bands [0, _final) are sorted into `order`
        self._claimed = 0  # bands [0, _claimed) are sorted or being sorted by some thread
        self._changed = threading.Condition()
        _live.add(self)

    def __len__(self) -> int:
        return len(self.order)

    @property
    def sorted_until(self) -> int:
        """Positions of :attr:`order` already final."""
        return int(self._bounds[self._final])

    def ensure(self, end: int) -> np.ndarray:
        """Sorts the bands that hold positions before ``end``; returns :attr:`order`.

        Safe from several threads: each band is sorted once, by the first thread to claim it,
        so a thread that needs the first bands does not wait for a background sort of the rest.
        """
        needed = int(
            np.searchsorted(self._bounds[:-1], min(end, len(self.order)), side="left")
        )  # bands starting before
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

    def complete(self) -> np.ndarray:
        """The whole order, sorting what is left."""
        return self.ensure(len(self.order))

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        """``(first, last)`` position in the order of each shard's samples, as
        :func:`~sparkgpu.data.loaders.order.shard_spans` gives them, without the whole sort."""
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
        bands = self._band_of[samples]
        for band in np.unique(bands).tolist():
            lo, hi = self._bounds[band], self._bounds[band + 1]
            members = self._members[lo:hi]
            keys = self._positions[members]
            for i in np.flatnonzero(bands == band).tolist():
                sample, key = samples[i], self._positions[samples[i]]
                places[i] = lo + np.count_nonzero(keys < key) + np.count_nonzero((keys == key) & (members < sample))
        return places

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_changed"]
        state["_claimed"] = state["_final"]  # a band being sorted elsewhere is sorted again
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._changed = threading.Condition()
        _live.add(self)


def _after_fork() -> None:
    # A band the parent's background thread was sorting at the fork is never finished in the
    # child, where that thread does not exist, and a lock it held stays held: each order gets a
    # fresh lock and gives such bands back, to be sorted again.
    # A fork between a band's sort and the advance past it leaves that advance to the child.
    for order in list(_live):
        order._changed = threading.Condition()
        while order._final < len(order._done) and order._done[order._final]:
            order._final += 1
        order._claimed = order._final


os.register_at_fork(after_in_child=_after_fork)
