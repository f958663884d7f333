"""``to_mds(spark_df)`` past Spark's row pipeline: plain scans are converted from their files,
other plans by the executors; the MDS content is the DataFrame's rows either way."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkgpu import data
from sparkgpu.data.convert.conversion import ensure_mds
from tests.unit.delta_dv import delete_rows
from tests.mosaic import streaming_dataset

pytestmark = [pytest.mark.integration, pytest.mark.spark]


def clicks(ids) -> pa.Table:
    ids = np.asarray(ids, dtype=np.int64)
    return pa.table(
        {
            "id": ids,
            "y": ids * 0.5,
            "tag": [f"t{i % 4}" for i in ids],
            "emb": pa.array([[float(i), float(i) + 1] for i in ids], type=pa.list_(pa.float32())),
        }
    )


def mds_rows(url: str) -> list[tuple]:
    """Every row of the MDS dataset as a sorted list of tuples, columns in name order."""
    dataset = streaming_dataset(local=url, shuffle=False, batch_size=1)
    rows = [dataset[i] for i in range(len(dataset))]
    return sorted(tuple(_plain(row[k]) for k in sorted(row)) for row in rows)


def frame_rows(df) -> list[tuple]:
    return sorted(tuple(_plain(row[k]) for k in sorted(row.asDict())) for row in df.collect())


def _plain(value):
    if isinstance(value, (np.ndarray, list)):
        return tuple(float(v) for v in value)
    return value.item() if isinstance(value, np.generic) else value


@pytest.fixture
def parquet_folder(tmp_path):
    folder = tmp_path / "clicks"
    folder.mkdir()
    pq.write_table(clicks(range(0, 300)), folder / "part-0.parquet", row_group_size=40)
    pq.write_table(clicks(range(300, 500)), folder / "part-1.parquet", row_group_size=40)
    return folder


def test_plain_parquet_scan_is_converted_from_its_files_and_reused_until_they_change(spark, parquet_folder, tmp_path):
    from pyspark.sql import functions as F

    def frame():
        return (
            spark.read.parquet(str(parquet_folder))
            .select("tag", "id", "emb")
            .filter((F.col("id") >= 37) & (F.col("tag") != "t1"))
        )

    result = data.to_mds(frame(), str(tmp_path / "out"), progress=False)
    assert result.source["via"] == "files" and result.source["files"]["type"] == "parquet"
    assert result.columns == {"emb": "ndarray:float32", "id": "int64", "tag": "str"}
    expected = frame_rows(frame())
    assert len(expected) == result.samples == len([i for i in range(37, 500) if i % 4 != 1])
    assert mds_rows(str(tmp_path / "out")) == expected

    cache = str(tmp_path / "cache")
    first = ensure_mds(frame(), cache, progress=False)
    assert not first.reused and ensure_mds(frame(), cache, progress=False).reused
    pq.write_table(clicks(range(500, 520)), parquet_folder / "part-2.parquet")  # new data: converted again
    changed = ensure_mds(frame(), cache, progress=False)
    assert not changed.reused and changed.url != first.url
    assert mds_rows(changed.url) == frame_rows(frame()) and changed.samples > first.samples


def test_delta_scan_with_a_filter_leaves_out_deleted_and_filtered_rows(spark, tmp_path):
    from deltalake import DeltaTable, WriterProperties, write_deltalake

    uri = str(tmp_path / "delta")
    table = clicks(range(400)).append_column("part", pa.array([f"p{i % 2}" for i in range(400)]))
    write_deltalake(
        uri,
        table,
        partition_by=["part"],
        configuration={"delta.enableDeletionVectors": "true"},
        writer_properties=WriterProperties(max_row_group_size=30),
    )
    gone = set()
    for add in pa.table(DeltaTable(uri).get_add_actions(flatten=True)).to_pylist():
        ids = pq.read_table(os.path.join(uri, add["path"]), columns=["id"]).column("id").to_pylist()
        delete_rows(uri, add["path"], [0, 5, 31, 100])
        gone |= {ids[p] for p in (0, 5, 31, 100)}
    # This Spark server has no Delta Lake: it cannot read the table, yet the plan names it, and
    # its rows are the table's, so the expected rows are computed from what was written.
    df = spark.read.format("delta").load(uri).filter("id >= 50").select("id", "part", "y")
    result = data.to_mds(df, str(tmp_path / "out"), progress=False)
    assert result.source["via"] == "files"
    assert result.source["files"]["type"] == "delta" and result.source["files"]["deletion_vectors"] == 2
    expected = sorted((i, f"p{i % 2}", i * 0.5) for i in range(50, 400) if i not in gone)
    assert mds_rows(str(tmp_path / "out")) == expected and len(gone) == 8

    # Time travel in the read: version 0 is the table before any deletion.
    old = spark.read.format("delta").option("versionAsOf", 0).load(uri).filter("id >= 50").select("id")
    assert mds_rows(data.to_mds(old, str(tmp_path / "v0"), progress=False).url) == [(i,) for i in range(50, 400)]


def test_join_and_aggregate_take_the_general_path_with_the_same_rows(spark, parquet_folder, tmp_path):
    from pyspark.sql import functions as F

    scan = spark.read.parquet(str(parquet_folder))
    names = spark.createDataFrame([(f"t{i}", f"name-{i}") for i in range(3)], "tag string, name string")
    for label, frame in [
        ("join", scan.join(names, "tag").select("id", "name", "emb")),
        ("aggregate", scan.groupBy("tag").agg(F.sum("y").alias("total"), F.count("id").alias("rows"))),
    ]:
        out = str(tmp_path / label)
        result = data.to_mds(frame, out, progress=False)
        assert result.source["type"] == "spark" and result.source["via"] == "mapInArrow", label
        assert mds_rows(out) == frame_rows(frame), label


def test_delta_table_with_column_mapping_is_left_to_spark(spark, tmp_path):
    from deltalake import write_deltalake

    from sparkgpu.data.convert.scan import plain_scan_source
    from sparkgpu.errors import DataError

    uri = str(tmp_path / "mapped")
    write_deltalake(
        uri,
        clicks(range(10)),
        configuration={
            "delta.columnMapping.mode": "name",
            "delta.minReaderVersion": "2",
            "delta.minWriterVersion": "5",
        },
    )
    # Its files name columns by physical ids: read by name, every value would be missing.
    with pytest.raises(DataError, match="column mapping"):
        data.to_mds(uri, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()
    source, why = plain_scan_source(spark.read.format("delta").load(uri).select("id"))
    assert source is None and "column mapping" in why
