"""``spark.gpu.train(data=df, data_format="table")``: plain file scans are read in place by the ranks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkgpu.errors import ConfigurationError

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("workers_share_this_image")]


@pytest.fixture
def local_spark(spark):
    from sparkgpu.api.spark_gpu import attach

    attach()
    return spark


@pytest.fixture
def parquet_folder(tmp_path):
    folder = tmp_path / "clicks"
    folder.mkdir()
    ids = np.arange(400, dtype=np.int64)
    pq.write_table(
        pa.table({"id": ids, "y": ids * 2.0, "tag": [f"t{i % 4}" for i in ids]}),
        folder / "part-0.parquet",
        row_group_size=50,
    )
    return str(folder)


def ids_read_in_place(data_url):
    from sparkgpu import data
    from sparkgpu.data.tables.plan import TableRef

    if not isinstance(data_url, TableRef):
        return "converted", None
    rows = data.table_dataset(data_url, batch_size=32)
    return sorted(i for batch in rows for i in batch["id"].tolist()), sorted(next(iter(rows)).keys())


def test_plain_scan_with_projection_and_filter_is_read_in_place(local_spark, parquet_folder, tmp_path, capsys):
    from pyspark.sql import functions as F

    frame = (
        local_spark.read.parquet(parquet_folder)
        .select("id", "tag")
        .filter("id >= 104")
        .filter((F.col("tag") != "t3") & F.col("id").isNotNull())
    )
    results = local_spark.gpu.train(
        ids_read_in_place, gpus=2, gpu_type="cpu", data=frame, data_format="table", data_volume=str(tmp_path / "volume")
    )
    expected = [i for i in range(104, 400) if i % 4 != 3]  # 222 rows: even, none left out
    assert len(results[0][0]) == len(results[1][0]) and sorted(results[0][0] + results[1][0]) == expected
    assert results[0][1] == ["id", "tag"]
    assert "read in place" in capsys.readouterr().err
    assert not (tmp_path / "volume").exists()  # nothing converted


def test_only_plain_file_scans_are_read_in_place(local_spark, parquet_folder):
    from pyspark.sql import functions as F

    from sparkgpu import data
    from sparkgpu.data.tables.plan import TableRef, table_ref_of

    scan = local_spark.read.parquet(parquet_folder)
    reference, _ = table_ref_of(scan.select("id").filter(F.col("id").isin(1, 2) | (F.col("tag") == "it's")))
    assert reference == TableRef(parquet_folder, ("id",), """(("id" IN (1, 2)) OR ("tag" = 'it''s'))""")
    assert [i for b in data.table_dataset(reference, batch_size=8, rank=0, world_size=1) for i in b["id"].tolist()] == [
        1,
        2,
    ]
    for frame, why in [
        (scan.selectExpr("id", "y * 2 AS y2"), "computed columns"),
        (scan.groupBy("tag").count(), "aggregate"),
        (scan.join(scan, "id"), "join"),
        (local_spark.read.option("mergeSchema", "true").parquet(parquet_folder), "read options"),
        (local_spark.range(10), "range"),
    ]:
        reference, reason = table_ref_of(frame)
        assert reference is None and why in reason, reason


def test_unknown_data_format_is_refused_before_anything_runs(local_spark, parquet_folder):
    with pytest.raises(ConfigurationError, match="data_format='parquet' must be 'mds'"):
        local_spark.gpu.train(ids_read_in_place, gpus=1, gpu_type="cpu", data=parquet_folder, data_format="parquet")
