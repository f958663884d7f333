"""Conversion DataFrame / Delta / Parquet -> MDS: rows/s and MB/s, peers side by side.

The same data for every peer: ``--rows`` rows of 32 float32 columns and one int64 column,
generated once with numpy and written as Parquet (two files) and as a Delta table. The Spark
DataFrame is ``spark.read.parquet`` of those files through Spark Connect ``local[2]``.

Peers, in the same run, at each ``--rows`` size:
  * ``sparkgpu.data.to_mds(spark_df)``: the DataFrame is a plain scan, so its Parquet files are
    converted directly in this process (no row through a Spark Python worker)
  * the general path for DataFrames that are not plain scans, forced on the same DataFrame:
    the executors' ``mapInArrow`` writers; and the alternative it was chosen over: Spark's JVM
    writer materialises Parquet in a staging folder, then ``to_mds`` converts those files
  * ``streaming.base.converters.dataframe_to_mds(spark_df)``: the same DataFrame and session,
    no compression (its default is zstd; ours is none), index merged
  * ``streaming.MDSWriter`` in a Python loop over the rows; the row dicts are built before
    the clock starts (generous to it: ``dataframe_to_mds`` pays for ``to_dict('records')``)
  * ``sparkgpu.data.to_mds`` of the Parquet folder, of the Delta table, of the Arrow table
Floors and ceilings measured in the same run:
  * Spark passthrough: a ``mapInArrow`` that only counts rows, i.e. what reading the
    DataFrame into Python workers costs before any encoding or writing
  * encode only: the sparkgpu encoder over the in-memory table, nothing written
  * one sequential write of the same number of bytes from one buffer

Every path, peer, floor and ceiling runs ``--repeats`` times (the same count for all),
round-robin; rows_per_s and every ratio come from medians, the best run beside them.

    python benchmarks/bench_convert.py [--rows 200000 1000000] [--repeats 3]   # about 15 minutes on 2 cores

Writes benchmarks/results/convert.json and convert.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparkgpu import data  # noqa: E402
from sparkgpu.data.convert.conversion import _convert, data_fingerprint  # noqa: E402
from sparkgpu.data.convert.spark import SparkSource  # noqa: E402
from sparkgpu.data.mds.writer import ShardOptions  # noqa: E402
from sparkgpu.data.mds.encoding import encode_batch, plan_columns  # noqa: E402
from sparkgpu.store import Store  # noqa: E402

from common import load_seen, machine, method  # noqa: E402

RESULTS = Path(__file__).parent / "results"
FLOATS = 32
GENERAL_ARROW = "sparkgpu general path: mapInArrow writers"
STAGED_PARQUET = "JVM Parquet writer, then to_mds(parquet)"
FILES_ON_EXECUTORS = "plain scan's files converted on the executors"


def make_table(rows: int) -> pa.Table:
    rng = np.random.default_rng(0)
    columns = {f"f{i:02d}": rng.standard_normal(rows, dtype=np.float32) for i in range(FLOATS)}
    columns["id"] = np.arange(rows, dtype=np.int64)
    return pa.table(columns)


def samples_in(folder: str) -> int:
    with open(os.path.join(folder, "index.json")) as f:
        return sum(shard["samples"] for shard in json.load(f)["shards"])


def bytes_in(folder: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files if ".mds" in f
    )


class Case:
    """One peer: ``fn(out_dir)`` writes a dataset (or not, for floors and ceilings)."""

    def __init__(self, label: str, fn, repeats: int, *, writes_dataset: bool = True):
        self.label, self.fn, self.repeats, self.writes_dataset = label, fn, repeats, writes_dataset
        self.seconds: list[float] = []
        self.output_bytes = 0


def measure(cases: list[Case], rows: int, scratch: Path) -> dict:
    """Runs the cases round-robin (so a burst of load elsewhere hits every peer alike) and
    reports the median (rows_per_s) and the best run of each; checks every row was written."""
    for round_ in range(max(c.repeats for c in cases)):
        for case in cases:
            if round_ >= case.repeats:
                continue
            out = scratch / f"run-{round_}"
            start = time.perf_counter()
            case.fn(str(out))
            case.seconds.append(time.perf_counter() - start)
            if case.writes_dataset:
                assert samples_in(str(out)) == rows, f"{case.label} wrote {samples_in(str(out))} of {rows} rows"
                case.output_bytes = bytes_in(str(out))
            shutil.rmtree(out, ignore_errors=True)
    results = {}
    for case in cases:
        best, median = min(case.seconds), statistics.median(case.seconds)
        result = {
            "seconds": [round(x, 4) for x in case.seconds],
            "best_s": round(best, 4),
            "median_s": round(median, 4),
            "rows_per_s": round(rows / median),
            "rows_per_s_best": round(rows / best),
        }
        if case.output_bytes:
            result["output_bytes"] = case.output_bytes
            result["mb_per_s"] = round(case.output_bytes / median / 1e6, 1)
        results[case.label] = result
        print(
            f"{case.label:50s} median {median:8.3f} s  {rows / median:12,.0f} rows/s   best {best:8.3f} s", flush=True
        )
    return results


def spark_session():
    """A local Spark Connect server of 2 cores, listening on 127.0.0.1 only, without the UI."""
    from sparkgpu.testing.local_spark import local_session

    return local_session(cores=2)


def convert_files_on_executors(spark, parquet_dir: str, out: str) -> None:
    """The alternative to converting a plain scan's files in the client: one Spark job over
    the files' row groups (a small DataFrame of paths), each task reading its row groups with
    pyarrow and writing shards, the client committing the index."""
    import uuid

    from sparkgpu.data.convert.output import OutputFolder
    from sparkgpu.data.convert.spark import _shipped_by_value

    paths = sorted(str(p) for p in Path(parquet_dir).glob("*.parquet"))
    units = [
        (i, path, group)
        for i, (path, group) in enumerate(
            (path, g) for path in paths for g in range(pq.ParquetFile(path).num_row_groups)
        )
    ]
    schema = pq.read_schema(paths[0])
    volume, options = Store(out), ShardOptions.create(plan_columns(schema))
    folder = OutputFolder(volume, uuid.uuid4().hex)
    folder.begin(overwrite=False)

    def task(batches):
        import pyarrow.parquet as pq_
        from pyspark import TaskContext

        context = TaskContext.get()
        writer = options.writer(volume, f"part-{context.partitionId():05d}-{context.taskAttemptId()}")
        first = None
        for batch in batches:
            for unit, path, group in zip(*(batch.column(i).to_pylist() for i in range(3))):
                first = unit if first is None else min(first, unit)
                for piece in pq_.ParquetFile(path).iter_batches(row_groups=[group], batch_size=64 * 1024):
                    writer.write_batch(piece)
        yield pa.RecordBatch.from_pydict(
            {"unit": [first if first is not None else -1], "shards": [json.dumps(writer.finish())]}
        )

    frame = spark.createDataFrame(units, "unit int, path string, row_group int").repartition(min(len(units), 2))
    with _shipped_by_value():
        rows = frame.mapInArrow(task, "unit long, shards string").collect()
    shards = [s for row in sorted(rows, key=lambda r: r["unit"]) for s in json.loads(row["shards"])]
    folder.commit(shards, {"source": {"type": "parquet-on-executors"}})


def peers_on_spark(spark, parquet_dir: str, rows: int, repeats: int, peer_repeats: int, scratch: Path) -> dict:
    from streaming.base.converters import dataframe_to_mds

    df = spark.read.parquet(parquet_dir)
    columns = {name: ("int64" if name == "id" else "float32") for name in df.columns}

    def ours(out):
        result = data.to_mds(df, out, progress=False)
        assert result.source["via"] == "files", result.source

    def general(out):
        source = SparkSource(df)
        _convert(
            source,
            Store(out),
            ShardOptions.create(plan_columns(source.schema)),
            None,
            False,
            None,
            False,
            time.monotonic(),
            wait_s=0.0,  # a fresh folder: nobody else converts into it
            reusable=lambda _waited: None,
        )

    def on_executors(out):
        convert_files_on_executors(spark, parquet_dir, out)

    def staged(out):
        staging = f"{out}-staging"
        df.write.parquet(staging)
        data.to_mds(staging, out, progress=False)
        shutil.rmtree(staging)

    def theirs(out):
        dataframe_to_mds(df, merge_index=True, mds_kwargs={"out": out, "columns": columns, "compression": None})

    def passthrough(_out):
        def count(batches):
            total = 0
            for batch in batches:
                total += batch.num_rows
            yield pa.record_batch({"rows": [total]})

        got = sum(r["rows"] for r in df.mapInArrow(count, "rows long").collect())
        assert got == rows

    # Warm-up on every partition (a filter keeps both; limit() would leave one): each Python
    # worker starts and imports its modules once (streaming imports torch).
    from pyspark.sql import functions as F

    small = df.where(F.col("id") % 100 == 0)
    data.to_mds(small, str(scratch / "warm-ours"), progress=False)
    general(str(scratch / "warm-arrow"))
    staged(str(scratch / "warm-parquet"))
    on_executors(str(scratch / "warm-executors"))
    dataframe_to_mds(
        small,
        merge_index=True,
        mds_kwargs={"out": str(scratch / "warm-theirs"), "columns": columns, "compression": None},
    )
    passthrough_small = small.mapInArrow(
        lambda batches: iter([pa.record_batch({"rows": [sum(b.num_rows for b in batches)]})]), "rows long"
    )
    passthrough_small.collect()
    for warm in ("warm-ours", "warm-theirs", "warm-arrow", "warm-parquet", "warm-executors"):
        shutil.rmtree(scratch / warm)

    fingerprint_seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        data_fingerprint(df)
        fingerprint_seconds.append(time.perf_counter() - start)
    results = measure(
        [
            Case("sparkgpu to_mds(spark_df)", ours, repeats),
            Case(GENERAL_ARROW, general, repeats),
            Case(STAGED_PARQUET, staged, repeats),
            Case(FILES_ON_EXECUTORS, on_executors, repeats),
            Case("spark passthrough (mapInArrow, count only)", passthrough, repeats, writes_dataset=False),
            Case("streaming dataframe_to_mds(spark_df)", theirs, peer_repeats),
        ],
        rows,
        scratch,
    )
    results["sparkgpu to_mds(spark_df)"]["of_which_fingerprint_s"] = round(statistics.median(fingerprint_seconds), 4)
    return results


def local_peers(
    table: pa.Table, parquet_dir: str, delta_dir: str, repeats: int, peer_repeats: int, scratch: Path
) -> dict:
    from streaming import MDSWriter

    rows = table.num_rows
    columns = {name: ("int64" if name == "id" else "float32") for name in table.column_names}
    as_dicts = table.to_pylist()
    for row in as_dicts:  # numpy scalars as MDSWriter's scalar encodings expect them
        for name in table.column_names:
            row[name] = np.int64(row[name]) if name == "id" else np.float32(row[name])

    def writer_loop(out):
        with MDSWriter(out=out, columns=columns) as writer:
            for row in as_dicts:
                writer.write(row)

    specs = plan_columns(table.schema)
    batches = table.to_batches(max_chunksize=64 * 1024)

    def encode_only(_out):
        for batch in batches:
            encode_batch(batch, specs)

    results = measure(
        [
            Case("sparkgpu to_mds(parquet)", lambda out: data.to_mds(parquet_dir, out, progress=False), repeats),
            Case("sparkgpu to_mds(delta)", lambda out: data.to_mds(delta_dir, out, progress=False), repeats),
            Case("sparkgpu to_mds(arrow table)", lambda out: data.to_mds(table, out, progress=False), repeats),
            Case("sparkgpu encode only (no write)", encode_only, repeats, writes_dataset=False),
            Case("MDSWriter python loop", writer_loop, peer_repeats),
        ],
        rows,
        scratch,
    )
    as_dicts.clear()  # the rows' memory, before the next benchmark
    return results


def sequential_write(nbytes: int, repeats: int, rows: int, scratch: Path) -> dict:
    buffer = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)

    def write(out):
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "blob"), "wb") as f:
            f.write(buffer)

    label = "ceiling: one sequential write of the same bytes"
    result = measure([Case(label, write, repeats, writes_dataset=False)], rows, scratch)[label]
    result["output_bytes"] = nbytes
    result["mb_per_s"] = round(nbytes / result["median_s"] / 1e6, 1)
    return result


def plot(by_size: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    longest = max(len(results) for results in by_size.values())
    fig, axes = plt.subplots(len(by_size), 1, figsize=(9, (0.45 * longest + 1.2) * len(by_size)), squeeze=False)
    for ax, (rows, results) in zip(axes[:, 0], by_size.items()):
        names = list(results)
        values = [results[n]["rows_per_s"] for n in names]
        colors = [
            "tab:blue"
            if n.startswith("sparkgpu")
            else "tab:gray"
            if "passthrough" in n or "sequential" in n
            else "tab:orange"
            for n in names
        ]
        ax.barh(names, values, color=colors)
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_xlabel("rows per second (log scale)")
        ax.set_title(f"-> MDS, {int(rows):,} rows of 32 float32 + 1 int64")
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:,.0f}", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def one_size(spark, rows: int, args, runs: Path) -> dict:
    """Every peer at ``rows`` rows; returns results and ratios."""
    from deltalake import write_deltalake

    table = make_table(rows)
    source_dir = runs / f"source-{rows}"
    parquet_dir, delta_dir = source_dir / "parquet", source_dir / "delta"
    parquet_dir.mkdir(parents=True)
    half = rows // 2
    pq.write_table(table.slice(0, half), parquet_dir / "part-0.parquet")
    pq.write_table(table.slice(half), parquet_dir / "part-1.parquet")
    write_deltalake(str(delta_dir), table)
    results = {}
    if spark is not None:
        results.update(peers_on_spark(spark, str(parquet_dir), rows, args.repeats, args.repeats, runs))
    results.update(local_peers(table, str(parquet_dir), str(delta_dir), args.repeats, args.repeats, runs))
    output_bytes = results["sparkgpu to_mds(arrow table)"]["output_bytes"]
    results["ceiling: one sequential write of the same bytes"] = sequential_write(
        output_bytes, args.repeats, rows, runs
    )
    shutil.rmtree(source_dir, ignore_errors=True)

    def ratio(a, b):
        return round(results[a]["rows_per_s"] / results[b]["rows_per_s"], 2) if a in results and b in results else None

    ours_spark = "sparkgpu to_mds(spark_df)"
    theirs = "streaming dataframe_to_mds(spark_df)"
    report = {
        "results": results,
        "ratios": {
            "spark plain scan: sparkgpu / dataframe_to_mds": ratio(ours_spark, theirs),
            "spark general, mapInArrow: sparkgpu / dataframe_to_mds": ratio(GENERAL_ARROW, theirs),
            "spark general: staged JVM Parquet / mapInArrow": ratio(STAGED_PARQUET, GENERAL_ARROW),
            "spark plain scan: files on the executors / in the client": ratio(FILES_ON_EXECUTORS, ours_spark),
            "spark general, mapInArrow / passthrough floor": ratio(
                GENERAL_ARROW, "spark passthrough (mapInArrow, count only)"
            ),
            "parquet: sparkgpu / MDSWriter loop": ratio("sparkgpu to_mds(parquet)", "MDSWriter python loop"),
            "delta: sparkgpu / MDSWriter loop": ratio("sparkgpu to_mds(delta)", "MDSWriter python loop"),
            "arrow: sparkgpu / sequential-write ceiling": ratio(
                "sparkgpu to_mds(arrow table)", "ceiling: one sequential write of the same bytes"
            ),
        },
    }
    if ours_spark in results:
        report["fingerprint_rpcs_s"] = results[ours_spark]["of_which_fingerprint_s"]
    print(json.dumps(report["ratios"], indent=2), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[200_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=3, help="runs of every path, peer, floor and ceiling alike")
    parser.add_argument("--skip-spark", action="store_true")
    parser.add_argument("--output", default=str(RESULTS / "convert.json"))
    args = parser.parse_args()

    facts = machine()
    scratch = Path(tempfile.mkdtemp(prefix="bench-convert-"))
    spark = None if args.skip_spark else spark_session()
    sizes = {}
    try:
        for rows in args.rows:
            runs = scratch / f"runs-{rows}"
            runs.mkdir()
            sizes[str(rows)] = one_size(spark, rows, args, runs)
    finally:
        if spark is not None:
            spark.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    report = {
        "question": "conversion DataFrame / Delta / Parquet -> MDS, rows/s and MB/s",
        "config": {
            "rows": args.rows,
            "columns": f"{FLOATS} float32 + 1 int64 ({FLOATS * 4 + 8} bytes per row)",
            "spark": "Spark Connect local[2], DataFrame = spark.read.parquet of 2 files",
            "repeats": args.repeats,
            "workers": "Spark Connect local[2] (2 task slots) for every Spark path and peer; the local paths in this process",
        },
        "method": method(
            "one conversion, from the call to the dataset's last byte written (the index merged)",
            startup="inside: each run is a whole conversion",
            repeats=args.repeats,
            statistic="median; the best run beside it (rows_per_s_best)",
            order="round-robin: each round runs every case once",
        ),
        "machine": load_seen(facts),
        "sizes": sizes,
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    plot({rows: size["results"] for rows, size in sizes.items()}, output.with_suffix(".png"))


if __name__ == "__main__":
    main()
