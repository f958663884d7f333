"""Spark DataFrames -> MDS on the executors of a real Spark Connect server (local[2])."""

from __future__ import annotations

import decimal
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from sparkgpu import data
from sparkgpu.data.convert.conversion import data_fingerprint, ensure_mds
from sparkgpu.data.convert.output import INDEX_NAME, MARKER_NAME
from sparkgpu.errors import ConfigurationError, DataError
from tests.mosaic import streaming_dataset

pytestmark = [pytest.mark.integration, pytest.mark.spark]


def typed_frame(spark, rows: int = 3000, partitions: int = 3):
    from pyspark.sql import functions as F

    id_ = F.col("id")
    return spark.range(0, rows, numPartitions=partitions).select(
        "id",
        (id_ % 100).cast("tinyint").alias("i8"),
        (id_ % 1000).cast("smallint").alias("i16"),
        id_.cast("int").alias("i32"),
        (id_ / 3).cast("float").alias("f32"),
        (id_ / 7).alias("f64"),
        (id_ % 2 == 0).alias("flag"),
        F.concat(F.lit("user-"), id_.cast("string")).alias("name"),
        F.encode(id_.cast("string"), "utf-8").alias("raw"),
        F.array(*[(id_ + k).cast("float") for k in range(4)]).alias("emb"),
        F.sequence(F.lit(0), (id_ % 5).cast("int")).alias("seq"),
        (id_ / 100).cast("decimal(10,2)").alias("price"),
    )


def streamed(url: str) -> list[dict]:
    dataset = streaming_dataset(local=url, shuffle=False, batch_size=1)
    return [dataset[i] for i in range(len(dataset))]


def files_under(folder) -> set[str]:
    return {os.path.relpath(os.path.join(root, f), folder) for root, _, names in os.walk(folder) for f in names}


def test_every_type_reads_back_row_for_row(spark, tmp_path):
    df = typed_frame(spark)
    result = data.to_mds(df, str(tmp_path / "out"), size_limit="32kb", progress=False)
    assert result.columns == {
        "id": "int64",
        "i8": "int8",
        "i16": "int16",
        "i32": "int32",
        "f32": "float32",
        "f64": "float64",
        "flag": "uint8",
        "name": "str",
        "raw": "bytes",
        "emb": "ndarray:float32",
        "seq": "ndarray:int32",
        "price": "str_decimal",
    }
    assert result.source["type"] == "spark" and result.shards > 3
    expected = df.collect()
    got = streamed(result.url)
    assert len(got) == len(expected) == 3000
    for row, sample in zip(expected, got):
        assert (
            sample["id"] == row.id and sample["i8"] == row.i8 and sample["i16"] == row.i16 and sample["i32"] == row.i32
        )
        assert sample["f32"] == np.float32(row.f32) and sample["f64"] == row.f64
        assert bool(sample["flag"]) == row.flag and sample["name"] == row.name and sample["raw"] == bytes(row.raw)
        np.testing.assert_array_equal(sample["emb"], np.asarray(row.emb, np.float32))
        np.testing.assert_array_equal(sample["seq"], np.asarray(row.seq, np.int32))
        assert sample["price"] == row.price and isinstance(sample["price"], decimal.Decimal)
    # One folder per task, only tiny metadata came back to the client.
    assert sorted(name.split("-")[1] for name in os.listdir(result.url) if name.startswith("part-")) == [
        "00000",
        "00001",
        "00002",
    ]


def test_fixed_shape_encoding_and_compression_through_spark_keep_the_other_columns(spark, tmp_path):
    from pyspark.sql import functions as F

    df = typed_frame(spark, rows=1000, partitions=2).select("id", "emb", "name", (F.col("id") * 2).alias("x.y"))
    result = data.to_mds(
        df,
        str(tmp_path / "out"),
        columns={"emb": "ndarray:float32:2,2"},  # names one column's encoding; the others keep theirs
        compression="zstd",
        hashes=["sha1"],
        progress=False,
    )
    assert result.columns == {"id": "int64", "emb": "ndarray:float32:2,2", "name": "str", "x.y": "int64"}
    for i, sample in enumerate(streamed(result.url)):
        assert sorted(sample) == ["emb", "id", "name", "x.y"] and sample["x.y"] == 2 * i
        assert sample["name"] == f"user-{i}"
        np.testing.assert_array_equal(sample["emb"], np.arange(i, i + 4, dtype=np.float32).reshape(2, 2))


def test_a_list_of_columns_selects_them_through_spark(spark, tmp_path):
    from pyspark.sql import functions as F

    df = typed_frame(spark, rows=100, partitions=2).select("id", "name", (F.col("id") * 2).alias("x.y"))
    result = data.to_mds(df, str(tmp_path / "out"), columns=["id", "x.y"], progress=False)
    assert result.columns == {"id": "int64", "x.y": "int64"}
    assert [sorted(sample) for sample in streamed(result.url)] == [["id", "x.y"]] * 100


def test_unsupported_type_fails_on_the_client_before_any_job(spark, tmp_path):
    from pyspark.sql import functions as F

    df = spark.range(5).withColumn("seen_at", F.current_timestamp())
    with pytest.raises(DataError, match="'seen_at'.*timestamp.*cast"):
        data.to_mds(df, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigurationError, match="versionAsOf"):
        data.to_mds(df.select("id"), str(tmp_path / "out"), version=3)


def test_nulls_found_by_an_executor_come_back_as_data_error(spark, tmp_path):
    from pyspark.sql import functions as F

    df = spark.range(100).select(F.when(F.col("id") == 42, None).otherwise(F.col("id")).alias("x"))
    with pytest.raises(DataError, match=r"column 'x' has 1 null values.*raised on a Spark executor"):
        data.to_mds(df, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out" / INDEX_NAME).exists()


def test_job_failing_half_way_leaves_no_index_and_a_rerun_is_clean(spark, tmp_path):
    from pyspark.sql import functions as F

    good = spark.range(0, 3000, numPartitions=3).select("id", (F.col("id") * 0.5).alias("x"))
    broken = good.select(
        "id", F.when(F.col("id") == 2900, F.raise_error(F.lit("bad row 2900"))).otherwise(F.col("x")).alias("x")
    )
    out = tmp_path / "out"
    with pytest.raises(Exception, match="bad row 2900"):
        data.to_mds(broken, str(out), size_limit=2048, progress=False)
    assert not (out / INDEX_NAME).exists() and (out / MARKER_NAME).exists()

    result = data.to_mds(good, str(out), size_limit=2048, progress=False)
    assert [int(s["id"]) for s in streamed(result.url)] == list(range(3000))
    index = json.loads((out / INDEX_NAME).read_text())
    assert files_under(out) == {s["raw_data"]["basename"] for s in index["shards"]} | {INDEX_NAME}


def test_ensure_mds_skips_a_second_conversion_of_the_same_frame(spark, tmp_path):
    from pyspark.sql import functions as F

    def frame(threshold):
        return (
            spark.range(0, 2000, numPartitions=2)
            .where(F.col("id") >= threshold)
            .select("id", (F.col("id") / 3).alias("x"))
        )

    cache = str(tmp_path / "cache")
    first = ensure_mds(frame(10), cache, progress=False)
    assert not first.reused and first.samples == 1990
    mtimes = {f: os.stat(os.path.join(first.url, f)).st_mtime_ns for f in files_under(first.url)}

    again = ensure_mds(frame(10), cache, progress=False)  # a new DataFrame object, same query
    assert again.reused and again.url == first.url
    assert {f: os.stat(os.path.join(first.url, f)).st_mtime_ns for f in files_under(first.url)} == mtimes

    other = ensure_mds(frame(20), cache, progress=False)
    assert not other.reused and other.url != first.url and other.samples == 1980


def test_fingerprint_sees_every_column_and_local_data(spark):
    from pyspark.sql import functions as F

    def wide(factor):
        cols = [(F.col("id") * i).alias(f"c{i}") for i in range(39)] + [(F.col("id") * factor).alias("c39")]
        return spark.range(10).select(*cols)

    # Plans print 25 fields per node by default; the 40th column must still count.
    assert data_fingerprint(wide(2)) == data_fingerprint(wide(2))
    assert data_fingerprint(wide(2)) != data_fingerprint(wide(3))
    import pandas as pd

    one = spark.createDataFrame(pd.DataFrame({"x": [1, 2, 3]}))
    two = spark.createDataFrame(pd.DataFrame({"x": [1, 2, 4]}))
    assert data_fingerprint(one) != data_fingerprint(two)


def test_parquet_read_by_spark_fingerprints_its_files(spark, tmp_path):
    path = str(tmp_path / "pq")
    spark.range(100).write.parquet(path)
    before = data_fingerprint(spark.read.parquet(path))
    assert data_fingerprint(spark.read.parquet(path)) == before
    spark.range(101).write.mode("overwrite").parquet(path)
    assert data_fingerprint(spark.read.parquet(path)) != before


def test_spark_progress_reports_tasks(spark, tmp_path):
    from sparkgpu.store import Store
    from sparkgpu.data.convert.spark import SparkSource
    from sparkgpu.data.mds.encoding import plan_columns
    from sparkgpu.data.mds.writer import ShardOptions

    class Recorder:
        def __init__(self):
            self.updates = []

        def update(self, completed, total):
            self.updates.append((completed, total))

    source = SparkSource(spark.range(0, 20_000, numPartitions=4))
    recorder = Recorder()
    source.write(Store(str(tmp_path / "out")), ShardOptions.create(plan_columns(source.schema)), progress=recorder)
    assert recorder.updates and recorder.updates[-1] == (4, 4)


def test_executor_code_runs_where_this_package_is_not_installed(tmp_path):
    """The task is pickled by value: an interpreter without sparkgpu on its path can run it."""
    import pyarrow as pa
    from pyspark import cloudpickle

    from sparkgpu.store import Store
    from sparkgpu.data.convert.spark import _PartitionTask, _shipped_by_value
    from sparkgpu.data.mds.encoding import plan_columns
    from sparkgpu.data.mds.writer import ShardOptions

    schema = pa.schema([("id", pa.int64()), ("name", pa.string())])
    task = _PartitionTask(Store(str(tmp_path / "out")), ShardOptions.create(plan_columns(schema)), ["id", "name"])
    with _shipped_by_value():
        (tmp_path / "task.pkl").write_bytes(cloudpickle.dumps(task))
    script = textwrap.dedent(
        f"""
        import json, pickle, sys

        class NotInstalled:  # as if the package were missing from this interpreter
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "sparkgpu":
                    raise ModuleNotFoundError(f"No module named {{name!r}}")

        sys.meta_path.insert(0, NotInstalled())
        import pyarrow as pa
        from pyspark import TaskContext
        context = TaskContext()
        context._partitionId, context._taskAttemptId = 3, 17
        TaskContext._setTaskContext(context)
        task = pickle.loads(open({str(tmp_path / "task.pkl")!r}, "rb").read())
        batch = pa.record_batch({{"id": [1, 2], "name": ["a", "b"]}})
        (row,) = list(task(iter([batch])))
        assert not [m for m in sys.modules if m.startswith("sparkgpu")]
        print(json.dumps(row.to_pylist()))
        """
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", script], capture_output=True, text=True, timeout=120, cwd=str(tmp_path)
    )
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    shards = json.loads(row["shards"])
    assert row["partition"] == 3 and shards[0]["samples"] == 2
    assert (tmp_path / "out" / "part-00003-17" / "shard.00000.mds").exists()


def test_classic_spark_session_converts_too(tmp_path):
    """A classic (non-Connect) session: same mapInArrow path, plan read through py4j."""
    script = textwrap.dedent(
        f"""
        import json, os, sys
        os.environ["PYSPARK_PYTHON"] = sys.executable
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))!r})
        from pyspark.sql import SparkSession, functions as F
        from sparkgpu.data.convert.conversion import data_fingerprint, ensure_mds
        spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
        df = spark.range(0, 3000, numPartitions=3).select("id", (F.col("id") / 3).alias("x"))
        first = ensure_mds(df, {str(tmp_path / "cache")!r}, progress=False)
        again = ensure_mds(df, {str(tmp_path / "cache")!r}, progress=False)
        print(json.dumps([type(df).__module__, first.url, first.samples, first.reused, again.reused]))
        spark.stop()
        """
    )
    # The Connect fixture marks this process as a Connect client; the child must not inherit that.
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SPARK_REMOTE", "SPARK_CONNECT", "SPARK_LOCAL_REMOTE"))
    }
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=540, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    module, url, samples, first_reused, again_reused = json.loads(done.stdout.strip().splitlines()[-1])
    assert module.startswith("pyspark.sql.classic") and samples == 3000 and not first_reused and again_reused
    assert [int(s["id"]) for s in streamed(url)] == list(range(3000))
