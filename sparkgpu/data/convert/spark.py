"""Spark DataFrames (Spark Connect or classic) -> MDS, written by the executors.

``mapInArrow`` hands each task its partition as Arrow record batches; the task encodes them
with :mod:`sparkgpu.data.mds.encoding` and writes its shards straight to the output volume in its own
sub-folder, yielding one tiny row (its shard entries as JSON). The client merges those rows,
in partition order, into one ``index.json``. No RDD API (Spark Connect has none), no data
through the client.

The task function and the modules it uses are pickled by value, so executors need only
numpy, pyarrow (which Spark's Arrow support already needs) and, for remote URLs, fsspec.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re

import pyarrow as pa

from sparkgpu.data.convert.spark_schema import arrow_schema
from sparkgpu.data.mds.writer import ShardOptions
from sparkgpu.data.tables.resolve import ResolvedSource, is_spark_dataframe, resolve_source
from sparkgpu.errors import ConfigurationError, DataError, SparkGPUError
from sparkgpu.store import Store

__all__ = ["SparkSource", "spark_source", "spark_resolved_source", "is_spark_dataframe"]

_logger = logging.getLogger(__name__)
_RESULT_SCHEMA = "partition int, shards string, summary string"
_MAX_TO_STRING_FIELDS = "spark.sql.debug.maxToStringFields"


def spark_source(df, storage_options: dict | None = None):
    """How ``df`` is converted: from its files when it is a plain scan of Parquet or Delta
    files this process can read (:mod:`sparkgpu.data.convert.scan`), else by Spark."""
    return spark_resolved_source(resolve_source(df, storage_options=storage_options))


def spark_resolved_source(resolved: ResolvedSource):
    """:func:`spark_source` of a resolved ``SPARK`` or ``SPARK_SCAN`` source."""
    from sparkgpu.data.convert.scan import scan_source

    source, why = scan_source(resolved)
    if source is not None:
        return source
    _logger.info("sparkgpu: to_mds converts the DataFrame through Spark (%s)", why)
    return SparkSource(resolved.data)


class SparkSource:
    """A Spark DataFrame to convert on the executors.

    The general path, for plans that are not plain file scans. Letting Spark's JVM writer
    materialise Parquet and converting those files instead was measured slower
    (``benchmarks/bench_convert.py``, "JVM Parquet writer, then to_mds(parquet)"): writing
    and reading the rows once more costs more than streaming them into the Python workers.

    Args:
        df: The DataFrame.

    Raises:
        DataError: A column's Spark type has no Arrow equivalent (user-defined types).
    """

    def __init__(self, df):
        self.df = df
        self.schema = arrow_schema(df.schema)
        self.description = {"type": "spark", "via": "mapInArrow", "columns": len(self.schema)}

    def fingerprint(self) -> str:
        """Hash of the optimized plan (expression ids removed), schema and input files.

        Spark's own ``semanticHash`` is added for plans that read no files: it covers local
        data the plan string leaves out, and it is stable across sessions for such plans
        (not for file scans, whose files are listed instead).
        """
        df = self.df
        parts = {
            "type": "spark",
            "plan": re.sub(r"#\d+", "", _optimized_plan(df)),
            "schema": df.schema.json(),
            "files": sorted(df.inputFiles()),
        }
        if not parts["files"]:
            parts["semantic_hash"] = df.semanticHash()
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()

    def write(
        self, volume: Store, options: ShardOptions, *, max_workers: int | None = None, progress=None, transform=None
    ) -> list[dict]:
        """Runs one Spark job writing every partition's shards; returns the index entries.

        Args:
            volume: Output folder, reachable from the executors under the same URL.
            options: Encodings and shard settings.
            max_workers: Ignored: Spark decides how many tasks run at once.
            progress: Optional object with ``update(completed, total)``.
            transform: Optional picklable callable run in every task on each record batch of its
                ``input_columns``, returning the batch written (``options`` describes its output);
                each task's ``transform.summary()`` is passed to ``transform.add()`` here.

        Raises:
            DataError: A task failed on the data (nulls, wrong array lengths...), with the
                executor's message.
        """
        from pyspark.sql import functions as F

        del max_workers
        names = list(transform.input_columns) if transform is not None else [spec.name for spec in options.specs]
        # mapInArrow resolves its input columns by name and trips over names such as "a.b";
        # plain positional aliases go in, the task puts the real names back.
        df = self.df.select(
            *[F.col("`" + name.replace("`", "``") + "`").alias(f"_c{i}") for i, name in enumerate(names)]
        )
        task = _PartitionTask(volume, options, names, transform)
        with _shipped_by_value(), _progress_handler(df.sparkSession, progress) as handler:
            try:
                rows = df.mapInArrow(task, _RESULT_SCHEMA).collect()
            except SparkGPUError:
                raise
            except Exception as exc:
                translated = _our_error_in(exc)
                if translated is not None:
                    raise translated from exc
                raise
            if handler is not None:
                handler.finished()
        shards = []
        for row in sorted(rows, key=lambda r: r["partition"]):
            shards.extend(json.loads(row["shards"]))
            if transform is not None:
                transform.add(json.loads(row["summary"]))
        return shards


class _PartitionTask:
    """What each Spark task runs: its record batches in, one metadata row out."""

    def __init__(self, volume: Store, options: ShardOptions, names: list[str], transform=None):
        self.volume = volume
        self.options = options
        self.names = names
        self.transform = transform

    def __call__(self, batches):
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId()
        # One folder per task attempt: a retried or speculative attempt never writes into the
        # files of another; the commit removes folders the index does not list.
        writer = self.options.writer(self.volume, f"part-{partition:05d}-{context.taskAttemptId()}")
        transform = self.transform
        for batch in batches:
            batch = pa.RecordBatch.from_arrays(batch.columns, names=self.names)
            writer.write_batch(transform(batch) if transform is not None else batch)
        shards = writer.finish()
        summary = json.dumps(transform.summary()) if transform is not None else "{}"
        yield pa.RecordBatch.from_pydict(
            {"partition": [partition], "shards": [json.dumps(shards)], "summary": [summary]},
            schema=pa.schema([("partition", pa.int32()), ("shards", pa.string()), ("summary", pa.string())]),
        )


def _optimized_plan(df) -> str:
    session = df.sparkSession
    previous = session.conf.get(_MAX_TO_STRING_FIELDS)
    # Plans print at most 25 fields per node by default; two frames differing in their 30th
    # column would otherwise look the same.
    session.conf.set(_MAX_TO_STRING_FIELDS, "1000000")
    try:
        if hasattr(df, "_explain_string"):  # Spark Connect
            text = df._explain_string(mode="extended")
        else:  # classic
            text = df._sc._jvm.PythonSQLUtils.explainString(df._jdf.queryExecution(), "extended")
    finally:
        session.conf.set(_MAX_TO_STRING_FIELDS, previous)
    match = re.search(r"== Optimized Logical Plan ==\n(.*?)\n== Physical Plan ==", text, re.S)
    return match.group(1) if match else text


@contextlib.contextmanager
def _shipped_by_value():
    """Pickles this package by value while the job is built, so executors need not have it."""
    import sparkgpu
    from pyspark import cloudpickle

    already = sparkgpu.__name__ in cloudpickle.list_registry_pickle_by_value()
    if not already:
        cloudpickle.register_pickle_by_value(sparkgpu)
    try:
        yield
    finally:
        if not already:
            cloudpickle.unregister_pickle_by_value(sparkgpu)


class _TaskProgress:
    """Spark Connect progress handler feeding ``progress.update(completed, total)``."""

    def __init__(self, progress):
        self.progress = progress
        self.total = 0

    def __call__(self, stages, inflight_tasks, operation_id, done):
        stages = list(stages or [])
        if stages:
            self.total = sum(s.num_tasks for s in stages)
            self.progress.update(sum(s.num_completed_tasks for s in stages), self.total)

    def finished(self) -> None:
        # The server reports progress every few hundred ms; its last report may predate the
        # last task, so a successful job is marked complete here.
        if self.total:
            self.progress.update(self.total, self.total)


@contextlib.contextmanager
def _progress_handler(session, progress):
    """Registers a :class:`_TaskProgress` for the duration of the job, where the session can."""
    if progress is None or not hasattr(session, "registerProgressHandler"):
        yield None
        return
    handler = _TaskProgress(progress)
    try:
        session.registerProgressHandler(handler)
    except Exception:  # classic sessions refuse; Spark's own console bar shows progress there
        yield None
        return
    try:
        yield handler
    finally:
        session.removeProgressHandler(handler)


_OUR_ERROR = re.compile(r"sparkgpu\.errors\.(\w+): (.+)")


def _our_error_in(exc: Exception) -> SparkGPUError | None:
    """The error of this package an executor raised, recovered from Spark's message."""
    match = _OUR_ERROR.search(str(exc))
    if match is None:
        return None
    kind, message = match.groups()
    error_type = {"DataError": DataError, "ConfigurationError": ConfigurationError}.get(kind, SparkGPUError)
    return error_type(f"{message.strip()} (raised on a Spark executor)")
