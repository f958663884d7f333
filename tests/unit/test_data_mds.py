"""The MDS encoder: what StreamingDataset decodes back, and byte equality with MDSWriter."""

from __future__ import annotations

import decimal
import filecmp
import json
import os

import numpy as np
import pyarrow as pa
import pytest

from sparkgpu.data.mds.encoding import encode_batch, plan_columns
from sparkgpu.data.mds.writer import ShardOptions, check_compression, check_hashes, index_document, parse_size_limit
from sparkgpu.errors import ConfigurationError, DataError
from sparkgpu.store import Store
from tests.mosaic import streaming_dataset


def write_flat(table: pa.Table, folder, *, columns=None, batch_rows=1000, **settings) -> ShardOptions:
    """Writes ``table`` as a flat MDS dataset (shards and index.json directly in ``folder``)."""
    options = ShardOptions.create(plan_columns(table.schema, columns), **settings)
    writer = options.writer(Store(str(folder)), "")
    for batch in table.to_batches(max_chunksize=batch_rows):
        writer.write_batch(batch)
    (folder / "index.json").write_bytes(index_document(writer.finish()))
    return options


def read_all(folder, **kwargs) -> list[dict]:
    dataset = streaming_dataset(local=str(folder), shuffle=False, batch_size=1, **kwargs)
    return [dataset[i] for i in range(len(dataset))]


rng = np.random.default_rng(7)
N = 300


def _numeric_columns() -> dict:
    columns = {}
    for dtype in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"):
        info = np.iinfo(dtype)
        columns[dtype] = pa.array(rng.integers(info.min, info.max, N, dtype=dtype, endpoint=True))
    for dtype in ("float16", "float32", "float64"):
        columns[dtype] = pa.array(rng.standard_normal(N).astype(dtype))
    return columns


def test_every_numeric_width_round_trips_exactly(tmp_path):
    table = pa.table(_numeric_columns())
    options = write_flat(table, tmp_path, batch_rows=77)
    assert options.columns == {name: name for name in table.column_names}
    samples = read_all(tmp_path)
    for name in table.column_names:
        expected = table[name].to_numpy()
        got = np.array([s[name] for s in samples])
        assert got.dtype == expected.dtype, name
        np.testing.assert_array_equal(got, expected, err_msg=name)


def test_bool_string_binary_and_decimal_round_trip(tmp_path):
    strings = ["", "a", "héllo wörld", "x" * 1000] * (N // 4)
    blobs = [b"", b"\x00\xff", os.urandom(300), b"abc"] * (N // 4)
    decimals = [
        decimal.Decimal("1.50"),
        decimal.Decimal("-12345.678"),
        decimal.Decimal("0.001"),
        decimal.Decimal("7"),
    ] * (N // 4)
    table = pa.table(
        {
            "flag": pa.array([i % 3 == 0 for i in range(N)]),
            "text": pa.array(strings),
            "large_text": pa.array(strings, pa.large_string()),
            "blob": pa.array(blobs, pa.binary()),
            "fixed_blob": pa.array([bytes([i % 256]) * 4 for i in range(N)], pa.binary(4)),
            "price": pa.array(decimals, pa.decimal128(12, 3)),
            "category": pa.array(["red", "green", "blue"] * (N // 3)).dictionary_encode(),
        }
    )
    options = write_flat(table, tmp_path, batch_rows=64)
    assert options.columns == {
        "flag": "uint8",
        "text": "str",
        "large_text": "str",
        "blob": "bytes",
        "fixed_blob": "bytes",
        "price": "str_decimal",
        "category": "str",
    }
    samples = read_all(tmp_path)
    assert len(samples) == N  # every row, not only the ones the loop happens to see
    for i, sample in enumerate(samples):
        assert sample["flag"] == (i % 3 == 0)
        assert sample["text"] == strings[i] and sample["large_text"] == strings[i]
        assert sample["blob"] == blobs[i]
        assert sample["fixed_blob"] == bytes([i % 256]) * 4
        assert sample["price"] == decimals[i]
        assert sample["category"] == ["red", "green", "blue"][i % 3]


def test_arrays_static_and_dynamic_shapes_round_trip(tmp_path):
    # Lengths straddle 256 so one batch mixes uint8 and uint16 shape headers; 0 is legal too.
    lengths = rng.integers(0, 600, N)
    ragged = [rng.standard_normal(int(k)).astype(np.float32) for k in lengths]
    images = rng.integers(0, 255, (N, 2, 3, 4), dtype=np.uint8)
    table = pa.table(
        {
            "ragged": pa.array(ragged, pa.list_(pa.float32())),
            "ragged_bool": pa.array([[True, False][: i % 3] for i in range(N)], pa.large_list(pa.bool_())),
            "vector": pa.FixedSizeListArray.from_arrays(pa.array(rng.standard_normal(N * 8)), 8),
            "image": pa.FixedSizeListArray.from_arrays(
                pa.FixedSizeListArray.from_arrays(
                    pa.FixedSizeListArray.from_arrays(pa.array(images.reshape(-1)), 4), 3
                ),
                2,
            ),
            "tensor": pa.FixedShapeTensorArray.from_numpy_ndarray(rng.standard_normal((N, 3, 5)).astype(np.float32)),
        }
    )
    options = write_flat(table, tmp_path, batch_rows=50)
    assert options.columns == {
        "ragged": "ndarray:float32",
        "ragged_bool": "ndarray:uint8",
        "vector": "ndarray:float64:8",
        "image": "ndarray:uint8:2,3,4",
        "tensor": "ndarray:float32:3,5",
    }
    tensors = table["tensor"].combine_chunks().to_numpy_ndarray()
    samples = read_all(tmp_path)
    assert len(samples) == N  # every row, not only the ones the loop happens to see
    for i, sample in enumerate(samples):
        np.testing.assert_array_equal(sample["ragged"], ragged[i])
        assert sample["ragged"].dtype == np.float32
        np.testing.assert_array_equal(sample["ragged_bool"], np.array([1, 0][: i % 3], np.uint8))
        np.testing.assert_array_equal(sample["vector"], table["vector"][i].values.to_numpy())
        np.testing.assert_array_equal(sample["image"], images[i])
        np.testing.assert_array_equal(sample["tensor"], tensors[i])


def test_encoding_overrides_fix_shape_and_narrow_numbers(tmp_path):
    table = pa.table(
        {
            "emb": pa.array([np.full(6, i, np.float64) for i in range(N)], pa.list_(pa.float64())),
            "label": pa.array(np.arange(N) % 10, pa.int64()),
            "id": pa.array(np.arange(N), pa.int64()),
        }
    )
    options = write_flat(table, tmp_path, columns={"emb": "ndarray:float32:2,3", "label": "uint8", "id": "int"})
    assert options.columns == {"emb": "ndarray:float32:2,3", "label": "uint8", "id": "int"}
    assert [s.size for s in options.specs] == [24, 8, 1]
    samples = read_all(tmp_path)
    assert len(samples) == N  # every row, not only the ones the loop happens to see
    for i, sample in enumerate(samples):
        assert sample["emb"].shape == (2, 3) and sample["emb"].dtype == np.float32
        assert np.all(sample["emb"] == i)
        assert sample["label"] == i % 10 and isinstance(sample["label"], np.uint8)
        assert sample["id"] == i and type(sample["id"]) is int


def test_column_selection_keeps_only_named_columns(tmp_path):
    table = pa.table({"a": [1, 2], "b": ["x", "y"], "c": [1.0, 2.0]})
    options = write_flat(table, tmp_path, columns=["c", "a"])
    assert [s.name for s in options.specs] == ["a", "c"]
    assert read_all(tmp_path)[1] == {"a": 2, "c": 2.0}


@pytest.mark.parametrize(
    "compression, hashes, size_limit",
    [(None, (), 1 << 26), (None, (), 4096), ("zstd", ("sha1", "xxh64"), 4096), ("gz:5", ("md5",), 10_000)],
)
def test_shards_and_index_are_byte_identical_to_mdswriter(tmp_path, monkeypatch, compression, hashes, size_limit):
    import gzip
    import types

    from streaming import MDSWriter

    # A gzip header holds the time it was written, in seconds: both writers see the same clock,
    # or the two sets of shards differ whenever the writes straddle a second.
    monkeypatch.setattr(gzip, "time", types.SimpleNamespace(time=lambda: 1_700_000_000.0))

    lengths = rng.integers(1, 40, N)
    table = pa.table(
        {
            "x": rng.standard_normal(N).astype(np.float32),
            "id": np.arange(N),
            "name": [f"row-{i}" * (i % 4) for i in range(N)],
            "vec": pa.array([np.arange(k, dtype=np.int32) for k in lengths], pa.list_(pa.int32())),
            "pair": pa.FixedSizeListArray.from_arrays(pa.array(rng.standard_normal(2 * N)), 2),
        }
    )
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    options = write_flat(table, ours, batch_rows=37, compression=compression, hashes=hashes, size_limit=size_limit)
    with MDSWriter(
        out=str(theirs), columns=options.columns, compression=compression, hashes=sorted(hashes), size_limit=size_limit
    ) as writer:
        for row in table.to_pylist():
            row["vec"] = np.asarray(row["vec"], np.int32)
            row["pair"] = np.asarray(row["pair"], np.float64)
            writer.write(row)
    names = sorted(os.listdir(theirs))
    assert sorted(os.listdir(ours)) == names
    assert len(names) > 2 or size_limit == 1 << 26
    assert json.loads((ours / "index.json").read_text()) == json.loads((theirs / "index.json").read_text())
    for name in names:
        if name != "index.json":
            assert filecmp.cmp(ours / name, theirs / name, shallow=False), name


def test_fixed_width_batch_is_one_matrix_of_rows():
    table = pa.table({"b": pa.array([1, 2], pa.int16()), "a": pa.array([1.5, 2.5], pa.float32())})
    encoded = encode_batch(table.to_batches()[0], plan_columns(table.schema))
    assert encoded.lengths.tolist() == [6, 6]
    assert encoded.data.tobytes() == (
        np.float32(1.5).tobytes() + np.int16(1).tobytes() + np.float32(2.5).tobytes() + np.int16(2).tobytes()
    )


@pytest.mark.parametrize(
    "arrow_type, fix",
    [
        (pa.timestamp("us"), "unix_micros"),
        (pa.date32(), "cast"),
        (pa.struct([("x", pa.float64())]), "vector_to_array"),
        (pa.map_(pa.string(), pa.int32()), "to_json"),
        (pa.list_(pa.string()), "serialize"),
        (pa.list_(pa.list_(pa.float32())), "flatten"),
        (pa.null(), "drop"),
    ],
)
def test_unsupported_type_names_column_type_and_fix(arrow_type, fix):
    schema = pa.schema([("ok", pa.int32()), ("bad_col", arrow_type)])
    with pytest.raises(DataError) as info:
        plan_columns(schema)
    message = str(info.value)
    assert "'bad_col'" in message and str(arrow_type) in message and fix in message


def test_wrong_override_and_unknown_column_are_data_errors():
    schema = pa.schema([("name", pa.string()), ("x", pa.float32())])
    with pytest.raises(DataError, match="'name'.*'float32'"):
        plan_columns(schema, {"name": "float32"})
    with pytest.raises(DataError, match=r"\['nope'\] are not in the source"):
        plan_columns(schema, ["nope"])
    with pytest.raises(DataError, match="dtype 'bool'"):
        plan_columns(pa.schema([("v", pa.list_(pa.float32()))]), {"v": "ndarray:bool"})
    with pytest.raises(DataError, match="more than once"):
        plan_columns(pa.schema([("a", pa.int8()), ("a", pa.int8())]))


def test_nulls_and_wrong_lengths_are_data_errors_naming_the_column():
    table = pa.table({"x": pa.array([1.0, None, 3.0])})
    with pytest.raises(DataError, match="column 'x' has 1 null values.*fillna"):
        encode_batch(table.to_batches()[0], plan_columns(table.schema))
    table = pa.table({"v": pa.array([[1.0, 2.0], [3.0]])})
    specs = plan_columns(table.schema, {"v": "ndarray:float64:2"})
    with pytest.raises(DataError, match="needs 2 values per row, row 1 of a batch has 1"):
        encode_batch(table.to_batches()[0], specs)
    table = pa.table({"v": pa.array([[1.0, None]])})
    with pytest.raises(DataError, match="null array elements"):
        encode_batch(table.to_batches()[0], plan_columns(table.schema))
    table = pa.table({"small": pa.array([1, 300], pa.int64())})
    with pytest.raises(DataError, match="do not fit uint8"):
        encode_batch(table.to_batches()[0], plan_columns(table.schema, {"small": "uint8"}))


def test_settings_are_checked_with_the_fix_in_the_message():
    assert check_compression("zstd:7") == "zstd:7" and check_compression(None) is None
    with pytest.raises(ConfigurationError, match="use one of"):
        check_compression("lz4")
    with pytest.raises(ConfigurationError, match="levels 1..22"):
        check_compression("zstd:99")
    assert check_hashes(["xxh64", "sha1"]) == ["sha1", "xxh64"]
    with pytest.raises(ConfigurationError, match="unknown hash"):
        check_hashes(["crc99"])
    assert parse_size_limit("64MiB") == 1 << 26 and parse_size_limit(None) is None
    with pytest.raises(ConfigurationError, match="uint32"):
        parse_size_limit(1 << 32)
