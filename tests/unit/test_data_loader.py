"""sparkgpu.data.dataset: order, split over ranks, resume, decoding, and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sparkgpu import data
from sparkgpu.data import _gather
from sparkgpu.data.loaders.lazy_orders import FragmentOrder
from sparkgpu.data.loaders.order import (
    EpochOrders,
    EpochPlan,
    epoch_order,
    locate,
    located_order,
    shard_spans,
)
from sparkgpu.errors import ConfigurationError, DataError
from tests.mosaic import streaming_dataset
from tests.unit.test_data_loader_support import check_tabular_batch, collect_ids, write_tabular


@pytest.fixture(scope="module")
def tabular(tmp_path_factory):
    """1,003 samples in 10 shards of about 100 (an odd count on purpose)."""
    return write_tabular(tmp_path_factory.mktemp("mds") / "tabular", 1003)


def test_one_rank_reads_every_sample_once_in_dataset_order(tabular, gather_backend):
    ds = data.dataset(local=tabular, batch_size=64)
    ids = np.concatenate(collect_ids(ds))
    np.testing.assert_array_equal(ids, np.arange(1003))
    assert len(ds) == 16


def test_ranks_together_read_every_sample_once_and_drop_fewer_than_world_size(tabular, gather_backend):
    world = 3
    per_rank = [
        np.concatenate(
            collect_ids(data.dataset(local=tabular, batch_size=50, shuffle=True, seed=7, rank=r, world_size=world))
        )
        for r in range(world)
    ]
    sizes = {len(ids) for ids in per_rank}
    assert sizes == {1003 // world}, "every rank gets the same number of samples, so DDP steps stay in lockstep"
    union = np.concatenate(per_rank)
    assert len(np.unique(union)) == len(union) == 1003 - 1003 % world


def test_ranks_get_the_same_number_of_batches_even_with_a_short_last_batch(tabular):
    loaders = [data.dataset(local=tabular, batch_size=128, rank=r, world_size=2) for r in range(2)]
    counts = [sum(1 for _ in loader) for loader in loaders]
    assert counts[0] == counts[1] == len(loaders[0]) == 4  # 501 samples each: 3 full batches and one of 117


def test_drop_last_leaves_out_the_short_batch(tabular):
    batches = collect_ids(data.dataset(local=tabular, batch_size=128, drop_last=True))
    assert [len(b) for b in batches] == [128] * 7


def test_shuffle_is_a_permutation_determined_by_seed_and_epoch(tabular):
    def first_epoch(seed):
        return np.concatenate(collect_ids(data.dataset(local=tabular, batch_size=100, shuffle=True, seed=seed)))

    a, b, c = first_epoch(3), first_epoch(3), first_epoch(4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert sorted(a.tolist()) == list(range(1003))
    ds = data.dataset(local=tabular, batch_size=100, shuffle=True, seed=3)
    epoch0, epoch1 = np.concatenate(collect_ids(ds)), np.concatenate(collect_ids(ds))
    np.testing.assert_array_equal(epoch0, a)
    assert not np.array_equal(epoch0, epoch1) and sorted(epoch1.tolist()) == list(range(1003))
    assert ds.epoch == 2


def test_shuffle_mixes_neighbouring_shards_only_within_the_block():
    sizes = np.full(100, 1000)
    order = epoch_order(sizes, shuffle=True, seed=0, epoch=0, block_size=4000)
    shard_of = order // 1000
    # Any 1,000 consecutive samples come from a handful of shards, not from all 100.
    windows = [len(np.unique(shard_of[i : i + 1000])) for i in range(0, 100_000, 1000)]
    assert max(windows) <= 10 and np.mean(windows) > 3
    order_big = epoch_order(sizes, shuffle=True, seed=0, epoch=0, block_size=1 << 20)
    assert np.mean([len(np.unique(order_big[i : i + 1000] // 1000)) for i in range(0, 100_000, 1000)]) > 50


def test_resume_mid_epoch_yields_exactly_the_rest_bit_identical(tabular, gather_backend):
    def open_loader():
        return data.dataset(local=tabular, batch_size=40, shuffle=True, seed=11, shuffle_block_size=300)

    uninterrupted = [dict((k, v.clone()) for k, v in b.items()) for b in open_loader()]
    first = open_loader()
    seen = []
    for batch in first:
        seen.append(batch)
        if len(seen) == 9:
            break
    state = json.loads(json.dumps(first.state_dict()))  # it must survive a JSON round trip
    assert state["epoch"] == 0 and state["samples_consumed"] == 9 * 40
    resumed = open_loader()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(seen) + len(rest) == len(uninterrupted)
    for got, want in zip(seen + rest, uninterrupted):
        for name in want:
            assert torch.equal(got[name], want[name])
    assert resumed.state_dict()["epoch"] == 1


def test_iterating_again_after_a_break_continues_the_epoch(tabular):
    ds = data.dataset(local=tabular, batch_size=100)
    for i, _ in enumerate(ds):
        if i == 2:
            break
    rest = np.concatenate(collect_ids(ds))
    np.testing.assert_array_equal(rest, np.arange(300, 1003))


def test_resume_with_another_world_size_still_reads_each_sample_once(tabular):
    # Two ranks consume 3 steps of 50, then the job resumes on three ranks.
    ranks = [data.dataset(local=tabular, batch_size=50, shuffle=True, seed=5, rank=r, world_size=2) for r in range(2)]
    seen = []
    for loader in ranks:
        for step, batch in enumerate(loader):
            seen.append(check_tabular_batch(batch))
            if step == 2:
                break
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict() and state["samples_consumed"] == 300
    for r in range(3):
        loader = data.dataset(local=tabular, batch_size=50, shuffle=True, seed=5, rank=r, world_size=3)
        loader.load_state_dict(state)
        seen.extend(collect_ids(loader))
    everything = np.concatenate(seen)
    assert len(np.unique(everything)) == len(everything) >= 1003 - 2


def test_load_state_dict_refuses_another_seed_or_dataset(tabular, tmp_path):
    state = data.dataset(local=tabular, batch_size=10, shuffle=True, seed=1).state_dict()
    with pytest.raises(ConfigurationError, match="seed=1 but this loader has seed=2"):
        data.dataset(local=tabular, batch_size=10, shuffle=True, seed=2).load_state_dict(state)
    other = write_tabular(tmp_path / "other", 50)
    with pytest.raises(ConfigurationError, match="num_samples"):
        data.dataset(local=other, batch_size=10, shuffle=True, seed=1).load_state_dict(state)
    with pytest.raises(ConfigurationError, match="not a loader state"):
        data.dataset(local=tabular, batch_size=10).load_state_dict({"epoch": 1})


def test_epoch_plan_splits_positions_round_robin():
    order = np.arange(10, dtype=np.int64)[::-1].copy()
    plans = [EpochPlan.for_rank(order, start=2, rank=r, world_size=3, batch_size=2, drop_last=False) for r in range(3)]
    assert [p.samples.tolist() for p in plans] == [[7, 4], [6, 3], [5, 2]]
    assert plans[0].dropped == 2 and plans[0].num_batches == 1


def test_variable_width_columns_decode_like_they_were_written(tmp_path, gather_backend):
    from streaming import MDSWriter

    columns = {
        "text": "str",
        "blob": "bytes",
        "tokens": "ndarray:int32",
        "any": "ndarray",
        "grid": "ndarray:float32:2,3",
        "meta": "json",
        "label": "int64",
        "count": "str_int",
        "score": "str_float",
        "w": "float16",
    }
    rng = np.random.default_rng(0)
    rows = []
    for i in range(300):
        rows.append(
            {
                "text": "é" * (i % 7) + str(i),
                "blob": bytes(range(i % 13)) + b"!",
                "tokens": np.arange(i % 9 + 1, dtype=np.int32) * i,
                "any": rng.random((i % 3 + 1, 2)).astype(np.float64 if i % 2 else np.int16),
                "grid": np.full((2, 3), i, np.float32),
                "meta": {"i": i, "odd": bool(i % 2)},
                "label": i,
                "count": i * 3,
                "score": i / 8,
                "w": np.float16(i % 50),
            }
        )
    with MDSWriter(out=str(tmp_path / "mixed"), columns=columns, size_limit=3000) as writer:
        for row in rows:
            writer.write(row)
    batches = list(
        data.dataset(local=str(tmp_path / "mixed"), batch_size=32, shuffle=True, seed=0, shuffle_block_size=64)
    )
    seen = 0
    for batch in batches:
        assert batch["grid"].shape[1:] == (2, 3) and batch["w"].dtype == torch.float16
        for k, label in enumerate(batch["label"].tolist()):
            row = rows[label]
            assert batch["text"][k] == row["text"] and batch["blob"][k] == row["blob"]
            assert batch["meta"][k] == row["meta"]
            np.testing.assert_array_equal(batch["tokens"][k].numpy(), row["tokens"])
            np.testing.assert_array_equal(batch["any"][k].numpy(), row["any"])
            assert batch["any"][k].numpy().dtype == row["any"].dtype
            np.testing.assert_array_equal(batch["grid"][k].numpy(), row["grid"])
            assert batch["count"][k].item() == row["count"] and batch["score"][k].item() == row["score"]
            assert batch["w"][k].item() == float(row["w"])
            seen += 1
    assert seen == 300


def _assert_decodes_like_streaming(folder, batch_size: int) -> None:
    """Every sample of ``data.dataset`` equals Mosaic Streaming's own decoding of it (value, dtype, shape)."""
    reference = streaming_dataset(local=str(folder), shuffle=False, batch_size=1)
    expected = [reference[i] for i in range(len(reference))]
    seen = 0
    for batch in data.dataset(local=str(folder), batch_size=batch_size):
        for k, i in enumerate(batch["i"].tolist()):
            for name, value in expected[i].items():
                got = batch[name][k]
                if isinstance(value, np.ndarray):
                    got = got.numpy()
                    assert got.dtype == value.dtype and got.shape == value.shape, (name, i, got, value)
                    np.testing.assert_array_equal(got, value)
                else:
                    assert (got.item() if isinstance(got, torch.Tensor) else got) == value, (name, i)
            seen += 1
    assert seen == len(expected)


def test_every_kind_of_ndarray_column_decodes_like_streaming(tmp_path, gather_backend):
    # One-byte dtypes next to variable-width columns once came back as None (a TypeError):
    # ndarray:uint8/int8 arrays, uint8 values in a dtype-less ndarray column, uint8 scalars.
    from streaming import MDSWriter

    columns = {
        "i": "int64",
        "flag": "uint8",
        "ids": "ndarray:int32",
        "mask": "ndarray:uint8",
        "small": "ndarray:int8",
        "any": "ndarray",
        "grid": "ndarray:uint8:2,3",
        "emb": "ndarray:float16:3",
        "text": "str",
    }
    dtypes = ["uint8", "int8", "int32", "float64", "uint16", "float16"]
    rng = np.random.default_rng(1)
    with MDSWriter(out=str(tmp_path / "arrays"), columns=columns, size_limit=4000) as writer:
        for i in range(200):
            length = [1, 3, 255, 256, 300, 2][i % 6]  # uint8 and uint16 shape headers in one batch
            writer.write(
                {
                    "i": i,
                    "flag": np.uint8(i % 256),
                    "ids": rng.integers(-(2**31), 2**31, length, dtype=np.int32),
                    "mask": (np.arange(length) % 2).astype(np.uint8),
                    "small": np.full(i % 5 + 1, -i % 128, np.int8),
                    "any": rng.integers(0, 100, (i % 3 + 1,) * (i % 2 + 1)).astype(dtypes[i % len(dtypes)]),
                    "grid": np.full((2, 3), i % 256, np.uint8),
                    "emb": np.full(3, i / 4, np.float16),
                    "text": "é" * (i % 4),
                }
            )
    assert len(list((tmp_path / "arrays").glob("*.mds"))) > 1
    _assert_decodes_like_streaming(tmp_path / "arrays", batch_size=13)


def test_empty_and_one_byte_arrays_from_to_mds_decode_like_streaming(tmp_path, gather_backend):
    # MDSWriter refuses empty arrays; sparkgpu's writer stores them (an empty Spark array), and
    # Spark booleans and bytes become uint8/int8 arrays. The first batch is all empty arrays.
    import pyarrow as pa

    from sparkgpu.data.mds.columns import plan_columns
    from sparkgpu.data.mds.writer import ShardOptions, index_document
    from sparkgpu.store import Store

    n = 120
    lengths = [0] * 8 + [0, 3, 0, 1, 300, 0, 2, 7] * 14
    table = pa.table(
        {
            "i": pa.array(np.arange(n)),
            "ids": pa.array([np.arange(k, dtype=np.int32) for k in lengths], pa.list_(pa.int32())),
            "mask": pa.array([[True, False] * (k // 2) for k in lengths], pa.list_(pa.bool_())),
            "bytes": pa.array([np.arange(k % 5, dtype=np.int8) for k in lengths], pa.list_(pa.int8())),
            "quad": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(4 * n, dtype=np.int64) % 100, pa.int8()), 4),
        }
    )
    options = ShardOptions.create(plan_columns(table.schema), size_limit=3000)
    assert options.columns["mask"] == "ndarray:uint8" and options.columns["quad"] == "ndarray:int8:4"
    writer = options.writer(Store(str(tmp_path / "own")), "")
    for batch in table.to_batches(max_chunksize=50):
        writer.write_batch(batch)
    (tmp_path / "own" / "index.json").write_bytes(index_document(writer.finish()))
    _assert_decodes_like_streaming(tmp_path / "own", batch_size=8)


def test_fixed_width_columns_at_unaligned_offsets_are_copied_out_correctly(tmp_path, gather_backend):
    from streaming import MDSWriter

    with MDSWriter(
        out=str(tmp_path / "odd"), columns={"a": "uint8", "b": "float64", "c": "ndarray:int16:3"}, size_limit=500
    ) as w:
        for i in range(100):
            w.write({"a": np.uint8(i), "b": float(i) / 3, "c": np.array([i, -i, 7], np.int16)})
    batch = next(iter(data.dataset(local=str(tmp_path / "odd"), batch_size=100)))
    np.testing.assert_array_equal(batch["a"].numpy(), np.arange(100, dtype=np.uint8))
    np.testing.assert_array_equal(batch["b"].numpy(), np.arange(100) / 3)
    np.testing.assert_array_equal(batch["c"][:, 1].numpy(), -np.arange(100))


def test_batches_are_writable_tensors_that_do_not_alias_each_other(tabular):
    first, second = list(data.dataset(local=tabular, batch_size=500))[:2]
    first["f00"].add_(1000)  # a training step may modify its batch in place
    assert second["f00"][0].item() == 500.0


def test_gather_native_and_numpy_agree_and_reject_bad_indices():
    if not _gather.native_available():
        pytest.skip("sparkgpu._native is not built")
    rng = np.random.default_rng(1)
    sources = [rng.integers(0, 255, size=(n, 24), dtype=np.uint8) for n in (50, 70, 30)]
    ids = rng.integers(0, 3, size=200).astype(np.int32)
    rows = np.array([rng.integers(0, len(sources[i])) for i in ids], dtype=np.int64)
    flat = [s.reshape(-1) for s in sources]
    starts = np.array([rng.integers(0, len(flat[i]) - 40) for i in ids], dtype=np.int64)
    lengths = rng.integers(0, 40, size=200).astype(np.int64)
    offsets = np.cumsum(lengths) - lengths
    results = []
    for native in (True, False):
        previous = _gather.set_native_enabled(native)
        try:
            rows_out = np.zeros((200, 24), np.uint8)
            _gather.gather_rows(rows_out, sources, ids, rows)
            spans_out = np.zeros(int(lengths.sum()), np.uint8)
            _gather.gather_spans(spans_out, offsets, flat, ids, starts, lengths)
            results.append((rows_out, spans_out))
            bad = rows.copy()
            bad[5] = len(sources[ids[5]])
            with pytest.raises(IndexError):
                _gather.gather_rows(rows_out, sources, ids, bad)
            with pytest.raises(IndexError):
                _gather.gather_spans(spans_out, offsets, flat, ids, starts + 10_000, lengths)
        finally:
            _gather.set_native_enabled(previous)
    np.testing.assert_array_equal(results[0][0], np.stack([sources[i][r] for i, r in zip(ids, rows)]))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "batch_size=0 must be an integer >= 1"),
        ({"batch_size": 8, "seed": -1}, "seed=-1"),
        ({"batch_size": 8, "rank": 2, "world_size": 2}, r"rank=2 must be an integer in \[0, world_size=2\)"),
        ({"batch_size": 8, "cache_limit": "lots"}, "is not a size"),
        ({"batch_size": 8, "device": "tpu"}, "device="),
    ],
)
def test_bad_arguments_fail_before_anything_starts(tabular, kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        data.dataset(remote=tabular, **kwargs)


def test_missing_arguments_or_index_name_the_fix(tmp_path, tabular):
    with pytest.raises(ConfigurationError, match="pass remote="):
        data.dataset(batch_size=8)
    with pytest.raises(DataError, match="has no index.json"):
        data.dataset(local=str(tmp_path), batch_size=8)
    with pytest.raises(ConfigurationError, match="cache_limit applies"):
        data.dataset(local=tabular, batch_size=8, cache_limit="1GB")
    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(DataError, match="is not an MDS index.json"):
        data.dataset(local=str(tmp_path), batch_size=8)


def test_pickled_columns_need_explicit_consent(tmp_path):
    from streaming import MDSWriter

    with MDSWriter(out=str(tmp_path / "pkl"), columns={"obj": "pkl"}) as writer:
        writer.write({"obj": {"a": 1}})
    with pytest.raises(DataError, match="allow_unsafe_types=True"):
        data.dataset(local=str(tmp_path / "pkl"), batch_size=1)
    batch = next(iter(data.dataset(local=str(tmp_path / "pkl"), batch_size=1, allow_unsafe_types=True)))
    assert batch["obj"] == [{"a": 1}]


def test_pin_memory_without_cuda_warns_and_still_works(tabular):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: pinning is real here")
    with pytest.warns(UserWarning, match="pin_memory=True needs CUDA"):
        ds = data.dataset(local=tabular, batch_size=500, pin_memory=True)
    assert sum(len(b) for b in collect_ids(ds)) == 1003


def test_the_package_works_without_the_c_extension(tabular):
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys
        sys.modules["sparkgpu._native"] = None  # what an install without a C compiler looks like
        import numpy as np
        from sparkgpu import data
        from sparkgpu.data import _gather
        assert not _gather.native_available() and not _gather.native_enabled()
        ids = np.concatenate([b["id"].numpy() for b in data.dataset(local={tabular!r}, batch_size=100, shuffle=True)])
        assert sorted(ids.tolist()) == list(range(1003))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_local_folder_of_compressed_shards_reads_through_the_cache(tmp_path):
    import numpy as np
    import pyarrow as pa

    from sparkgpu.data import dataset, to_mds

    out = tmp_path / "zstd"
    to_mds(pa.table({"x": np.arange(1000, dtype=np.int64)}), str(out), compression="zstd", size_limit=2048)
    ids = [int(v) for batch in dataset(local=str(out), batch_size=100) for v in batch["x"]]
    assert sorted(ids) == list(range(1000))


@pytest.mark.parametrize(
    "sizes",
    [[100, 100, 100, 37], [100, 100, 100], [50, 100, 7, 100], [100, 100, 120], [3, 0, 1, 0, 0, 9, 2, 500, 1]],
    ids=str,
)
def test_locate_finds_every_samples_shard_and_row(sizes):
    # Equal shards take the division path, uneven ones (empty ones too) the table look-up: both
    # must agree with a scan.
    order = epoch_order(np.array(sizes), shuffle=True, seed=1, epoch=2, block_size=64)
    shards, rows = locate(order, np.array(sizes))
    starts = np.cumsum([0, *sizes[:-1]])
    expected_shard = np.array([np.flatnonzero((starts <= s) & (s < starts + np.array(sizes)))[0] for s in order])
    np.testing.assert_array_equal(shards, expected_shard)
    np.testing.assert_array_equal(rows, order - starts[expected_shard])
    assert shards.dtype == np.int32 and rows.dtype == np.int64
    plan = EpochPlan.for_rank(
        *located_order(np.array(sizes), shuffle=True, seed=1, epoch=2, block_size=64)[:1],
        start=5,
        rank=1,
        world_size=3,
        batch_size=8,
        drop_last=False,
        located=(shards, rows),
    )
    np.testing.assert_array_equal(plan.shards, expected_shard[6::3][: len(plan.samples)])
    np.testing.assert_array_equal(plan.rows, plan.samples - starts[plan.shards])


@pytest.mark.parametrize("kind", ["in order", "fragments", "shuffled"])
def test_shard_spans_bound_each_shards_batches_on_every_rank(kind):
    # A reader plans its reads ahead from these bounds alone: a shard must never be needed by a
    # batch outside its span (it would be dropped before use), and in order the span is exact.
    sizes = np.array([5, 17, 1, 64, 30, 9, 40, 3])
    if kind == "in order":
        order, given = np.arange(sizes.sum(), dtype=np.int64), None
    elif kind == "fragments":
        order = given = FragmentOrder(sizes, seed=3, epoch=1, window=12).complete()
    else:
        order = given = epoch_order(sizes, shuffle=True, seed=3, epoch=1, block_size=50)
    first, last = shard_spans(given, sizes)
    shard_at = locate(order, sizes)[0]
    for shard in range(len(sizes)):
        positions = np.flatnonzero(shard_at == shard)
        assert (first[shard], last[shard]) == (positions.min(), positions.max())
    for start, world_size, rank, drop_last in [(0, 1, 0, False), (7, 3, 1, False), (7, 3, 2, True), (101, 4, 3, False)]:
        plan = EpochPlan.for_rank(
            order, start=start, rank=rank, world_size=world_size, batch_size=5, drop_last=drop_last
        )
        low, high = plan.batches_between(first, last)
        shard_of_row = locate(plan.samples, sizes)[0]
        for shard in range(len(sizes)):
            batches = {int(j) // 5 for j in np.flatnonzero(shard_of_row == shard) if j // 5 < plan.num_batches}
            if batches:
                assert low[shard] <= min(batches) and max(batches) <= high[shard], (shard, batches)
            if kind == "in order":
                assert (low[shard], high[shard]) == ((min(batches), max(batches)) if batches else (1, 0))


def test_epoch_orders_work_each_epoch_out_once_and_the_next_one_ahead(tmp_path):
    import functools
    import operator
    import pickle
    import time

    calls = []

    def compute(epoch):
        calls.append(epoch)
        return epoch * 10

    shuffled = EpochOrders(compute, per_epoch=True)
    assert shuffled.get(0) == 0 and shuffled.get(0) == 0
    deadline = time.monotonic() + 10
    while 1 not in calls and time.monotonic() < deadline:  # epoch 1 is worked out in the background
        time.sleep(0.01)
    assert calls == [0, 1]
    assert shuffled.get(1) == 10 and shuffled.get(3) == 30
    assert calls.count(1) == 1 and 3 in calls
    shuffled.close()
    fixed = EpochOrders(compute, per_epoch=False)
    calls.clear()
    assert fixed.get(0) == fixed.get(7) == 0 and calls == [0]
    # A DataLoader worker gets a copy without the parent's thread or results, and works on.
    copied = pickle.loads(pickle.dumps(EpochOrders(functools.partial(operator.mul, 10), per_epoch=True)))
    assert copied.get(4) == 40
    copied.close()
    # What is finished after a result is handed out runs on the background thread, once per result.
    finished = []
    finishing = EpochOrders(compute, per_epoch=True, finish=finished.append)
    assert finishing.get(0) == 0
    deadline = time.monotonic() + 10
    while len(finished) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert finished == [0, 10]
    finishing.close()
