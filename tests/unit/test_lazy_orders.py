"""Shuffled orders worked out a part at a time are the whole orders, wherever they are cut, shared or forked."""

from __future__ import annotations

import multiprocessing
import threading

import numpy as np
import pytest

from sparkgpu.data.loaders import lazy_orders
from sparkgpu.data.loaders.lazy_orders import BandedOrder, FragmentOrder, LazyOrder
from sparkgpu.data.loaders.order import epoch_order, shard_spans


def fragment_order(shard_sizes: np.ndarray, *, seed: int, epoch: int, window: int) -> np.ndarray:
    """The fragment shuffle worked out whole, in one permutation of every window: what
    :class:`FragmentOrder` must equal however it is cut."""
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, 1]))
    layout = rng.permutation(len(sizes))
    starts = np.cumsum(sizes) - sizes
    lengths = sizes[layout]
    order = np.arange(int(lengths.sum()), dtype=np.int64)
    order += np.repeat(starts[layout] - (np.cumsum(lengths) - lengths), lengths)
    whole = len(order) - len(order) % window
    order[:whole] = rng.permuted(order[:whole].reshape(-1, window), axis=1).reshape(-1)
    order[whole:] = rng.permutation(order[whole:])
    return order


SIZES = {
    "row groups of a 2M-row table": np.r_[np.full(30, 65536), 33920],
    "uneven shards": np.random.default_rng(3).integers(1, 5000, size=200),
    "one sample": np.array([7]),
    "one-sample shards": np.array([1, 1, 1]),
    "a shard larger than the window": np.array([300_000, 5, 1_000_000]),
}


@pytest.mark.parametrize("block_size", [1 << 18, 1000, 1])
@pytest.mark.parametrize("name", list(SIZES))
def test_every_prefix_the_whole_order_and_the_spans_are_the_epoch_orders(name, block_size):
    sizes = SIZES[name]
    for epoch in (0, 1):
        expected = epoch_order(sizes, shuffle=True, seed=5, epoch=epoch, block_size=block_size)
        order = BandedOrder(sizes, seed=5, epoch=epoch, block_size=block_size)
        first, last = order.spans()
        want_first, want_last = shard_spans(expected, sizes)
        assert (first == want_first).all() and (last == want_last).all()
        for end in (1, len(expected) // 7, len(expected) // 2):
            got = order.ensure(end)
            assert order.sorted_until >= end
            assert (got[:end] == expected[:end]).all()
        assert (order.complete() == expected).all() and order.sorted_until == len(expected)


@pytest.mark.parametrize("window", [4096, 16, 1, 7000])
@pytest.mark.parametrize("name", list(SIZES))
def test_a_fragment_order_is_the_whole_permutation_and_its_spans_hold_every_row(name, window):
    sizes = SIZES[name]
    for epoch in (0, 1):
        expected = fragment_order(sizes, seed=5, epoch=epoch, window=window)
        order = FragmentOrder(sizes, seed=5, epoch=epoch, window=window)
        for end in (1, len(expected) // 7, len(expected) // 2):
            got = order.ensure(end)
            assert order.sorted_until >= end
            assert (got[:end] == expected[:end]).all()
        assert (order.complete() == expected).all() and order.sorted_until == len(expected)
        # Each span holds the shard's rows and is widened to whole windows, by less than one at each end.
        first, last = order.spans()
        want_first, want_last = shard_spans(expected, sizes)
        assert (first <= want_first).all() and (last >= want_last).all()
        assert (want_first - first < window).all() and (last - want_last < window).all()


def test_equal_positions_keep_sample_id_order_in_the_order_and_the_spans(monkeypatch):
    def rounded(sizes, *, seed, epoch, block_size):  # whole numbers: most positions tie
        rng = np.random.default_rng(seed)
        return np.floor(rng.random(int(np.sum(sizes))) * 200.0)

    monkeypatch.setattr(lazy_orders, "shuffle_positions", rounded)
    sizes = np.array([40, 300, 17, 900, 3])
    order = BandedOrder(sizes, seed=1, epoch=0, block_size=64)
    positions = rounded(sizes, seed=1, epoch=0, block_size=64)
    expected = np.argsort(positions, kind="stable")  # by position, equal ones by id
    first, last = order.spans()
    want_first, want_last = shard_spans(expected, sizes)
    assert (first == want_first).all() and (last == want_last).all()
    assert (order.complete() == expected).all()


def _assert_threads_agree(order: LazyOrder, expected: np.ndarray, ends: list[int]) -> None:
    """Threads needing different prefixes at once each get theirs, and the order ends whole."""
    seen: dict[int, bool] = {}

    def need(end):
        seen[end] = bool((order.ensure(end)[:end] == expected[:end]).all())

    threads = [threading.Thread(target=need, args=(end,)) for end in ends]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {end: True for end in ends}
    assert (order.order == expected).all()


def test_threads_that_need_a_fragment_orders_different_prefixes_agree():
    sizes = SIZES["row groups of a 2M-row table"]
    expected = fragment_order(sizes, seed=2, epoch=3, window=64)
    order = FragmentOrder(sizes, seed=2, epoch=3, window=64)
    _assert_threads_agree(order, expected, [len(expected), 4096, 1, 500_000, len(expected) // 2])


def test_threads_that_need_different_prefixes_sort_each_band_once(monkeypatch):
    sorted_sizes = []
    real = lazy_orders.argsort_ties_by_id

    def counting(keys):
        sorted_sizes.append(len(keys))
        return real(keys)

    monkeypatch.setattr(lazy_orders, "argsort_ties_by_id", counting)
    sizes = SIZES["row groups of a 2M-row table"]
    expected = epoch_order(sizes, shuffle=True, seed=2, epoch=3, block_size=1 << 18)
    order = BandedOrder(sizes, seed=2, epoch=3, block_size=1 << 18)
    _assert_threads_agree(order, expected, [len(expected), 4096, 1, 500_000, len(expected) // 2, 4096 * 32])
    bands = len(order._bounds) - 1
    assert len(sorted_sizes) == bands and sum(sorted_sizes) == len(expected)


@pytest.mark.parametrize("kind", ["banded", "fragments"])
def test_a_batch_needing_the_first_part_does_not_wait_for_the_background_to_finish(kind, monkeypatch):
    sizes = SIZES["row groups of a 2M-row table"]
    if kind == "banded":
        order = BandedOrder(sizes, seed=1, epoch=0, block_size=1 << 18)
        last_part = len(order._bounds) - 2
        real = lazy_orders.argsort_ties_by_id
        parts: list[int] = []

        def work(keys):
            parts.append(len(keys))
            if len(parts) == last_part + 1:  # the background's last band waits for the batch's return
                assert returned.wait(30)
            return real(keys)

        monkeypatch.setattr(lazy_orders, "argsort_ties_by_id", work)
        expected = epoch_order(sizes, shuffle=True, seed=1, epoch=0, block_size=1 << 18)
    else:
        order = FragmentOrder(sizes, seed=1, epoch=0, window=4096)
        real_step = order._step
        steps: list[int] = []

        def step(done, state):
            steps.append(done)
            if done > 4 * FragmentOrder._STEP:  # the background's later steps wait for the batch's return
                assert returned.wait(30)
            return real_step(done, state)

        order._step = step
        expected = fragment_order(sizes, seed=1, epoch=0, window=4096)
    returned = threading.Event()
    background = threading.Thread(target=order.complete)
    background.start()
    batch = threading.Thread(target=lambda: order.ensure(4096 * 32) is not None and returned.set())
    batch.start()
    batch.join(30)
    finished_first = returned.is_set()
    returned.set()
    background.join(30)
    assert finished_first, "the first batch waited for the background's whole order"
    assert (order.order == expected).all()


def _finish_in_child(order: LazyOrder, expected: np.ndarray, out) -> None:
    out.send(bool((order.complete() == expected).all()))


def _assert_a_forked_child_finishes(order: LazyOrder, expected: np.ndarray) -> None:
    """Forks (as a DataLoader starts its workers) while the caller holds the order's state as a
    parent's thread would, and checks the child works the whole order out by itself."""
    receive, send = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(
        target=_finish_in_child, args=(order, expected, send), daemon=True
    )
    child.start()
    try:
        assert receive.poll(60), "the child never finished the order"
        assert receive.recv() is True
        child.join(10)
        assert child.exitcode == 0
    finally:
        child.kill()


def test_a_forked_child_goes_on_with_a_fragment_order_its_parents_thread_was_working_out():
    sizes = SIZES["uneven shards"]
    expected = fragment_order(sizes, seed=9, epoch=0, window=16)
    order = FragmentOrder(sizes, seed=9, epoch=0, window=16)
    order.ensure(len(expected) // 4)
    with order._advanced:  # the parent's thread is drawing the next windows when the worker forks
        order._drawing = True
        _assert_a_forked_child_finishes(order, expected)


@pytest.mark.parametrize("when", ["bands claimed, not sorted", "bands sorted, not yet passed"])
def test_a_forked_child_finishes_what_its_parents_threads_were_doing(when):
    sizes = SIZES["uneven shards"]
    expected = epoch_order(sizes, shuffle=True, seed=9, epoch=0, block_size=1000)
    order = BandedOrder(sizes, seed=9, epoch=0, block_size=1000)
    order.ensure(len(expected) // 4)
    with order._changed:  # what the parent's sorting threads left when the DataLoader worker forked
        if when == "bands claimed, not sorted":
            order._claimed = min(order._final + 3, len(order._done))
        else:  # every band sorted, the order not yet moved past them
            order.order[:] = expected
            order._done[:] = True
            order._claimed = len(order._done)
        _assert_a_forked_child_finishes(order, expected)
