"""Delta (deltalake, no Spark), Parquet and Arrow sources -> MDS that StreamingDataset reads row for row."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from sparkgpu import data
from sparkgpu.data.convert.conversion import data_fingerprint, ensure_mds, read_conversion
from sparkgpu.errors import ConfigurationError, DataError
from tests.mosaic import streaming_dataset

pytestmark = pytest.mark.integration


def feature_table(rows: int, seed: int = 0, start: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "id": np.arange(start, start + rows, dtype=np.int64),
            "x": rng.standard_normal(rows).astype(np.float32),
            "label": rng.integers(0, 2, rows).astype(np.int8),
            "name": [f"user-{i}" for i in range(start, start + rows)],
            "emb": pa.FixedSizeListArray.from_arrays(pa.array(rng.standard_normal(rows * 4).astype(np.float32)), 4),
        }
    )


def streamed_rows(url: str, **kwargs) -> list[dict]:
    kwargs.setdefault("local", url)
    dataset = streaming_dataset(shuffle=False, batch_size=1, **kwargs)
    return [dataset[i] for i in range(len(dataset))]


def assert_same_rows(url: str, expected: pa.Table, **kwargs) -> None:
    got = streamed_rows(url, **kwargs)
    assert len(got) == expected.num_rows
    for i, row in enumerate(expected.to_pylist()):
        sample = got[i]
        assert sample["id"] == row["id"] and sample["name"] == row["name"] and sample["label"] == row["label"], i
        assert sample["x"] == np.float32(row["x"]), i
        np.testing.assert_array_equal(sample["emb"], np.asarray(row["emb"], np.float32))


def shard_mtimes(url: str) -> dict:
    return {
        os.path.join(root, f): os.stat(os.path.join(root, f)).st_mtime_ns
        for root, _, files in os.walk(url)
        for f in files
        if f.startswith("shard.")
    }


def test_parquet_folder_of_several_files_round_trips_in_order(tmp_path):
    table = feature_table(12_000)
    source = tmp_path / "parquet"
    source.mkdir()
    for i in range(3):  # several files, several row groups each: more work units than workers
        pq.write_table(table.slice(i * 4000, 4000), source / f"part-{i}.parquet", row_group_size=1500)
    result = data.to_mds(str(source), str(tmp_path / "out"), max_workers=3, size_limit="64kb", progress=False)
    assert result.samples == 12_000 and result.shards > 3
    assert result.source == {"type": "parquet", "path": str(source), "files": 3}
    assert sorted(p for p in os.listdir(result.url) if p.startswith("part-")) == [
        "part-00000",
        "part-00001",
        "part-00002",
    ]
    assert_same_rows(result.url, table)


def test_delta_old_and_new_versions_convert_with_their_version_recorded(tmp_path):
    from deltalake import DeltaTable, write_deltalake

    uri = str(tmp_path / "delta")
    first, second = feature_table(3000, seed=1), feature_table(1000, seed=2, start=3000)
    write_deltalake(uri, first)
    write_deltalake(uri, second, mode="append")

    old = data.to_mds(uri, str(tmp_path / "v0"), version=0, progress=False)
    assert old.source["version"] == 0 and old.samples == 3000
    assert_same_rows(old.url, first)

    latest = data.to_mds(uri, str(tmp_path / "latest"), progress=False)
    assert latest.source["version"] == 1 and latest.samples == 4000
    assert_same_rows(latest.url, DeltaTable(uri).to_pyarrow_dataset().to_table())
    assert old.fingerprint != latest.fingerprint

    index = json.loads((tmp_path / "v0" / "index.json").read_text())
    assert index["sparkgpu"]["source"]["version"] == 0
    assert index["sparkgpu"]["fingerprint"] == data_fingerprint(uri, version=0)


def test_delta_timestamp_and_partition_columns(tmp_path):
    import datetime

    from deltalake import DeltaTable, write_deltalake

    uri = str(tmp_path / "delta")
    table = feature_table(600).append_column("day", pa.array(np.arange(600) % 3, pa.int32()))
    write_deltalake(uri, table, partition_by=["day"])
    after_first = datetime.datetime.now(datetime.timezone.utc)
    write_deltalake(uri, table.slice(0, 60), mode="append", partition_by=["day"])
    result = data.to_mds(uri, str(tmp_path / "out"), timestamp=after_first, progress=False)
    assert result.source["version"] == 0 and result.samples == 600
    expected = DeltaTable(uri, version=0).to_pyarrow_dataset().to_table()
    got = streamed_rows(result.url)
    assert [(s["id"], s["day"]) for s in got] == list(zip(expected["id"].to_pylist(), expected["day"].to_pylist()))


def test_arrow_table_and_pandas_frame(tmp_path):
    table = feature_table(500)
    assert_same_rows(data.to_mds(table, str(tmp_path / "arrow"), progress=False).url, table)
    frame = table.drop_columns(["emb"]).to_pandas()
    rows = streamed_rows(data.to_mds(frame, str(tmp_path / "pandas"), progress=False).url)
    assert [r["name"] for r in rows] == frame["name"].tolist()


def test_zstd_and_hashes_are_verified_by_streaming_dataset(tmp_path):
    table = feature_table(4000)
    result = data.to_mds(
        table, str(tmp_path / "out"), compression="zstd", hashes=("sha1", "xxh64"), size_limit=20_000, progress=False
    )
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    first = index["shards"][0]
    assert first["compression"] == "zstd" and first["zip_data"]["basename"].endswith(".mds.zstd")
    assert set(first["zip_data"]["hashes"]) == {"sha1", "xxh64"}
    assert result.bytes < sum(s["raw_data"]["bytes"] for s in index["shards"])
    # Reading from a "remote" makes StreamingDataset download, verify and decompress each shard.
    assert_same_rows(result.url, table, remote=result.url, local=str(tmp_path / "cache"), validate_hash="xxh64")


def test_unsupported_column_fails_before_anything_is_written(tmp_path):
    table = pa.table({"id": [1, 2], "when": pa.array([1, 2], pa.timestamp("s"))})
    with pytest.raises(DataError, match="'when'.*timestamp.*cast"):
        data.to_mds(table, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_existing_dataset_and_foreign_folders_are_not_overwritten_silently(tmp_path):
    table = feature_table(100)
    out = str(tmp_path / "out")
    data.to_mds(table, out, progress=False)
    with pytest.raises(ConfigurationError, match="overwrite=True"):
        data.to_mds(table, out, progress=False)
    result = data.to_mds(table.slice(0, 10), out, overwrite=True, progress=False)
    assert len(streamed_rows(result.url)) == 10

    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep me")
    with pytest.raises(ConfigurationError, match="not empty.*mine.txt"):
        data.to_mds(table, str(foreign), progress=False)
    assert (foreign / "mine.txt").read_text() == "keep me"


def test_wrong_source_and_time_travel_arguments(tmp_path):
    pq.write_table(feature_table(10), tmp_path / "f.parquet")
    with pytest.raises(ConfigurationError, match="not a Delta table"):
        data.to_mds(str(tmp_path / "f.parquet"), str(tmp_path / "out"), version=3)
    with pytest.raises(DataError, match="cannot read"):
        data.to_mds(str(tmp_path / "missing"), str(tmp_path / "out"))
    with pytest.raises(ConfigurationError, match="cannot convert a list"):
        data.to_mds([1, 2, 3], str(tmp_path / "out"))


def test_ensure_mds_converts_once_per_fingerprint(tmp_path):
    from deltalake import write_deltalake

    uri = str(tmp_path / "delta")
    write_deltalake(uri, feature_table(2000))
    cache = str(tmp_path / "cache")

    first = ensure_mds(uri, cache, progress=False)
    assert not first.reused and first.samples == 2000
    mtimes = shard_mtimes(first.url)

    again = ensure_mds(uri, cache, progress=False)
    assert again.reused and again.url == first.url and again.fingerprint == first.fingerprint
    assert shard_mtimes(first.url) == mtimes  # nothing rewritten

    pinned = ensure_mds(uri, cache, version=0, progress=False)
    assert pinned.reused and pinned.url == first.url

    write_deltalake(uri, feature_table(10, start=2000), mode="append")
    newer = ensure_mds(uri, cache, progress=False)
    assert not newer.reused and newer.url != first.url and newer.samples == 2010
    assert read_conversion(first.url).samples == 2000  # the old version stays cached

    compressed = ensure_mds(uri, cache, compression="zstd", progress=False)
    assert not compressed.reused and compressed.url != newer.url


def test_parquet_fingerprint_follows_file_changes(tmp_path):
    path = tmp_path / "f.parquet"
    pq.write_table(feature_table(10), path)
    before = data_fingerprint(str(path))
    assert data_fingerprint(str(path)) == before
    pq.write_table(feature_table(11), path)
    assert data_fingerprint(str(path)) != before


def test_remote_fsspec_url_output(tmp_path):
    """Output through fsspec (memory://): the same commit protocol, no local path involved."""
    import fsspec

    table = feature_table(300)
    data.to_mds(table, "memory://sparkgpu-test/out", size_limit=4096, progress=False)
    fs = fsspec.filesystem("memory")
    assert fs.exists("/sparkgpu-test/out/index.json") and not fs.exists("/sparkgpu-test/out/.sparkgpu-writing")
    local = tmp_path / "copy"
    fs.get("/sparkgpu-test/out", str(local), recursive=True)
    assert_same_rows(str(local), table)
    assert read_conversion("memory://sparkgpu-test/out").samples == 300
    fs.rm("/sparkgpu-test", recursive=True)


def test_hive_partitioned_parquet_keeps_partition_column(tmp_path):
    table = feature_table(300).append_column("part", pa.array(np.arange(300) % 3, pa.int32()))
    pads.write_dataset(table, tmp_path / "pq", format="parquet", partitioning=["part"], partitioning_flavor="hive")
    result = data.to_mds(str(tmp_path / "pq"), str(tmp_path / "out"), progress=False)
    assert result.columns["part"] == "int32"
    assert sorted((s["id"], s["part"]) for s in streamed_rows(result.url)) == [(i, i % 3) for i in range(300)]


def test_parquet_behind_an_fsspec_url(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    table = feature_table(700)
    with fs.open("/sparkgpu-src/data/a.parquet", "wb") as f:
        pq.write_table(table, f, row_group_size=200)
    try:
        result = data.to_mds("memory://sparkgpu-src/data", str(tmp_path / "out"), progress=False)
        assert_same_rows(result.url, table)
        assert data_fingerprint("memory://sparkgpu-src/data") == result.fingerprint
    finally:
        fs.rm("/sparkgpu-src", recursive=True)


def test_empty_source_is_an_error_and_leaves_no_index(tmp_path):
    empty = pa.table({"id": pa.array([], pa.int64())})
    with pytest.raises(DataError, match="no rows"):
        data.to_mds(empty, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out" / "index.json").exists()
