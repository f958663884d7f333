"""data.dataset(features=..., target=...): (x, y) batches equal to the dict form stacked, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparkgpu import data
from sparkgpu.data import _gather
from sparkgpu.errors import ConfigurationError
from tests.unit.test_data_loader_support import write_tabular

FEATURES = [f"f{j:02d}" for j in range(4)]


@pytest.fixture(scope="module")
def tabular(tmp_path_factory):
    return write_tabular(tmp_path_factory.mktemp("mds") / "tabular", 1003)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Features of four dtypes (and an array column), with a text column beside them."""
    from streaming import MDSWriter

    path = tmp_path_factory.mktemp("mds") / "mixed"
    columns = {"a": "float32", "b": "int32", "vec": "ndarray:float32:3", "c": "float64", "y": "int16"}
    with MDSWriter(out=str(path), columns=columns, size_limit=1 << 12) as writer:
        for i in range(501):
            writer.write(
                {
                    "a": np.float32(i / 8),
                    "b": np.int32(-i),
                    "vec": np.array([i, i + 0.5, -i], dtype=np.float32),
                    "c": np.float64(i * 1e-3),
                    "y": np.int16(i % 7),
                }
            )
    with MDSWriter(out=str(path) + "-text", columns={**columns, "note": "str"}, size_limit=1 << 12) as writer:
        for i in range(301):
            writer.write(
                {
                    "a": np.float32(i),
                    "b": np.int32(i),
                    "vec": np.zeros(3, np.float32) + i,
                    "c": np.float64(-i),
                    "y": np.int16(i),
                    "note": "x" * (i % 5),
                }
            )
    return str(path)


def stacked(batch: dict, names, dtype) -> torch.Tensor:
    return torch.cat([batch[n].reshape(len(batch[n]), -1).to(dtype) for n in names], 1)


def assert_same(pairs, dicts, names, target, dtype):
    pairs, dicts = list(pairs), list(dicts)
    assert len(pairs) == len(dicts) > 1
    for (x, y), batch in zip(pairs, dicts):
        assert x.dtype == dtype and x.shape == (len(batch[target]), x.shape[1]) and x.is_contiguous()
        torch.testing.assert_close(x, stacked(batch, names, dtype), rtol=0, atol=0)
        torch.testing.assert_close(y, batch[target], rtol=0, atol=0)


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
def test_feature_matrix_equals_the_stacked_dict_form(tabular, gather_backend, shuffle):
    options = dict(local=tabular, batch_size=64, shuffle=shuffle, seed=3, shuffle_block_size=300)
    pairs = data.dataset(**options, features="f*", target="id")
    dicts = data.dataset(**options)
    for _ in range(2):  # two epochs: the shuffle differs per epoch, the batches must still agree
        assert_same(pairs, dicts, FEATURES, "id", torch.float32)


def test_mixed_dtypes_are_cast_to_the_promoted_type_in_the_order_named(mixed, gather_backend):
    names = ["c", "vec", "b", "a"]  # not the row order, and four dtypes
    pairs = data.dataset(local=mixed, batch_size=50, shuffle=True, features=names, target="y")
    assert_same(pairs, data.dataset(local=mixed, batch_size=50, shuffle=True), names, "y", torch.float64)
    # float32 with int32 promotes to float32, as torch does
    pairs = data.dataset(local=mixed, batch_size=50, features=["b", "a"], target="y")
    assert_same(pairs, data.dataset(local=mixed, batch_size=50), ["b", "a"], "y", torch.float32)


def test_datasets_with_variable_width_columns_give_the_same_matrix(mixed):
    names = ["a", "b", "vec"]
    pairs = data.dataset(local=mixed + "-text", batch_size=40, features=names, target="y")
    assert_same(pairs, data.dataset(local=mixed + "-text", batch_size=40), names, "y", torch.float32)


def test_without_a_target_batches_are_x_alone(tabular):
    first = next(iter(data.dataset(local=tabular, batch_size=8, features=["f01", "f00"])))
    assert isinstance(first, torch.Tensor) and first.shape == (8, 2)
    np.testing.assert_array_equal(first[:, 0].numpy(), np.arange(8, dtype=np.float32) + 0.25)
    # a pattern leaves the target out: "*" means every other column
    x, y = next(iter(data.dataset(local=tabular, batch_size=8, features="*", target="f02")))
    assert x.shape == (8, 4) and x.dtype == torch.float32  # f00, f01, f03 and id (int64 -> float32)
    np.testing.assert_array_equal(x[:, 3].numpy(), y.numpy() - 0.5)


@pytest.fixture(scope="module")
def large_shards(tmp_path_factory):
    """Two shards of about 500 samples: in order, most batches read one shard."""
    return write_tabular(tmp_path_factory.mktemp("mds") / "large", 1003, size_limit=600 * 24)


@pytest.mark.parametrize("drop_last", [False, True], ids=["short-last", "drop-last"])
def test_consecutive_batches_of_one_shard_are_gathered_together_and_equal_the_dict_form(large_shards, drop_last):
    options = dict(local=large_shards, batch_size=64, drop_last=drop_last)
    loader = data.dataset(**options, features="f*", target="id")
    pairs = list(loader)
    assert_same(pairs, data.dataset(**options), FEATURES, "id", torch.float32)
    # Gathered as blocks: the first shard's batches are views of one buffer, in order.
    first_shard = pairs[: int(loader.index.shard_sizes[0]) // 64]
    assert len(first_shard) > 4
    assert len({x.untyped_storage().data_ptr() for x, _ in first_shard}) == 1
    # A batch is a view of its own rows only: writing into it leaves its neighbours alone.
    pairs[0][0].fill_(-1)
    assert float(pairs[1][0].min()) >= 0
    assert sum(len(y) for _, y in pairs) == ((1003 // 64) * 64 if drop_last else 1003)


@pytest.mark.parametrize(
    "source, options, taken",
    [
        ("tabular", dict(shuffle=True, seed=5, shuffle_block_size=300), 4),
        ("large_shards", {}, 3),  # in order: the position falls inside a gathered block
    ],
    ids=["shuffled", "inside-a-block"],
)
def test_resume_mid_epoch_yields_the_rest_of_the_dict_form(request, gather_backend, source, options, taken):
    options = dict(local=request.getfixturevalue(source), batch_size=64, **options)
    first = data.dataset(**options, features=FEATURES, target="id")
    iterator = iter(first)
    head = [next(iterator) for _ in range(taken)]
    state = first.state_dict()
    del iterator
    resumed = data.dataset(**options, features=FEATURES, target="id")
    resumed.load_state_dict(state)
    assert_same(head + list(resumed), data.dataset(**options), FEATURES, "id", torch.float32)


def test_workers_yield_the_same_batches_and_resume_exactly(tabular):
    options = dict(local=tabular, batch_size=64, shuffle=True, seed=1, shuffle_block_size=300)
    dicts = list(data.dataset(**options))
    loader = data.dataset(**options, features="f*", target="id", num_workers=2)
    iterator = iter(loader)
    head = [next(iterator) for _ in range(5)]
    state = loader.state_dict()
    del iterator
    loader.close()
    resumed = data.dataset(**options, features="f*", target="id", num_workers=2)
    resumed.load_state_dict(state)
    assert_same(head + list(resumed), dicts, FEATURES, "id", torch.float32)
    resumed.close()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"features": ["f00", "nope"]}, "does not have"),
        ({"features": "g*"}, "matches no column"),
        ({"features": []}, "non-empty list"),
        ({"features": ["f00", "f00"]}, "twice"),
        ({"features": ["f00", "f01"], "target": "f00"}, "also in features"),
        ({"features": "f*", "target": "nope"}, "not a column"),
        ({"target": "id"}, "goes with features"),
        ({"features": "f*", "transform": lambda s, rng: s}, "apply them to x and y"),
    ],
)
def test_bad_feature_requests_fail_before_the_epoch_starts(tabular, kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        data.dataset(local=tabular, batch_size=8, **kwargs)


def test_a_variable_width_feature_names_the_fix(mixed):
    with pytest.raises(ConfigurationError, match="not fixed-width.*without features="):
        data.dataset(local=mixed + "-text", batch_size=8, features=["a", "note"])


def test_gather_fields_copies_many_columns_of_random_rows_from_many_sources(gather_backend):
    """A wide table's shuffled batch: more fields than one pass sets up (64), of 1 to 8 bytes,
    rows at random from several row groups, more rows than are fetched ahead; the large batch
    is split across threads."""
    rng = np.random.default_rng(1)
    widths = [4, 8, 2, 1, 4, 8, 3] * 11  # 77 fields
    row_bytes = sum(widths) + 3
    sources = [rng.integers(0, 255, (n, row_bytes), dtype=np.uint8) for n in (300, 1, 4000)]
    n = 20_000
    ids = rng.integers(0, 3, n).astype(np.int32)
    rows = (rng.random(n) * np.array([300, 1, 4000])[ids]).astype(np.int64)
    dsts = [np.empty((n, width), np.uint8) for width in widths]
    offsets = np.concatenate([[0], np.cumsum(widths)[:-1]])
    fields = np.array([[o, w, f, 0, w] for f, (o, w) in enumerate(zip(offsets, widths))], dtype=np.int64)
    _gather.gather_fields(dsts, sources, ids, rows, row_bytes, fields)
    picked = np.stack([sources[s][r] for s, r in zip(ids, rows)])
    for f, (o, w) in enumerate(zip(offsets, widths)):
        np.testing.assert_array_equal(dsts[f], picked[:, o : o + w])


def test_gather_fields_native_and_numpy_agree_and_reject_bad_fields(gather_backend):
    rng = np.random.default_rng(0)
    sources = [rng.integers(0, 255, (50, 24), dtype=np.uint8) for _ in range(2)]
    ids = rng.integers(0, 2, 30).astype(np.int32)
    rows = rng.integers(0, 50, 30).astype(np.int64)
    x, y = np.empty((30, 4), np.float32), np.empty(30, np.int64)
    fields = np.array([[4, 12, 0, 0, 16], [20, 4, 0, 12, 16], [16, 4, 1, 2, 8]], dtype=np.int64)
    _gather.gather_fields([x, y], sources, ids, rows, 24, fields)
    picked = np.stack([sources[s][r] for s, r in zip(ids, rows)])
    np.testing.assert_array_equal(x.view(np.uint8), np.concatenate([picked[:, 4:16], picked[:, 20:24]], 1))
    np.testing.assert_array_equal(y.view(np.uint8).reshape(30, 8)[:, 2:6], picked[:, 16:20])
    with pytest.raises(IndexError):
        _gather.gather_fields([x, y], sources, ids, rows + 50, 24, fields)
    with pytest.raises(IndexError):  # a field past the end of the destination row
        _gather.gather_fields([x, y], sources, ids, rows, 24, np.array([[0, 8, 1, 4, 8]]))
