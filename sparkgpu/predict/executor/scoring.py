"""One scoring task: Arrow batches in, predictions out, in chunks a re-run task can skip.

Runs in a Spark Python worker. The model comes from a process-level cache, so a reused
worker (``spark.python.worker.reuse``, Spark's default) loads it once and keeps it across
tasks and stages. Input rows are cut into chunks of ``chunk_rows`` in the partition's order;
with a Delta output each chunk is written as its own Parquet file, named by run, partition
and chunk and moved into place only when whole, so a task re-run after its executor was lost
finds the chunks its earlier attempt finished and scores only the others.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from typing import Any, Iterator

from sparkgpu.predict.executor.generation import GenerationConfig, generate_completions, generate_with_vllm
from sparkgpu.predict.models import LoadedModel, ModelSource

__all__ = ["ScoringPlan", "MANIFEST_FIELDS", "score_partition", "chunk_name", "cached_model", "loads_in_process"]

_CACHE: dict[str, LoadedModel] = {}
_CACHE_SIZE = 2
_LOADS = 0

#: The columns of one manifest row (one per chunk) a scoring task returns with a Delta output.
MANIFEST_FIELDS = (
    ("partition", "int32"),
    ("chunk", "int32"),
    ("path", "string"),
    ("rows", "int64"),
    ("bytes", "int64"),
    ("reused", "bool"),
    ("loaded", "bool"),
    ("attempt", "int32"),
    ("worker_pid", "int64"),
    ("seconds", "float64"),
)


@dataclasses.dataclass(frozen=True)
class ScoringPlan:
    """Everything a scoring task needs, built on the client and shipped in the task closure.

    Attributes:
        source: The model, pinned to one version.
        task: ``"predict"`` or ``"generate"``.
        input_cols: Columns handed to the model (``predict``).
        output_col: Column the predictions or completions go to.
        result_type: Arrow type of ``output_col``.
        batch_size: Rows per model call.
        chunk_rows: Rows per chunk (a multiple of ``batch_size``).
        output_uri: Root of the Delta table chunks are written into; ``None`` to return rows.
        run_id: Names this run's chunk files; the same id re-runs skip finished chunks.
        generation: Generation settings (``generate``).
        prompt_col: Prompt column (``generate``).
        key_col: Column whose value seeds a row's sampling (default: the prompt).
        use_cuda: Score on the task's GPU (``False`` on CPU or simulated GPUs).
        storage_options: pyarrow filesystem options for ``output_uri`` (unused for local paths).
    """

    source: ModelSource
    task: str
    input_cols: tuple[str, ...]
    output_col: str
    result_type: Any
    batch_size: int
    chunk_rows: int
    output_uri: str | None = None
    run_id: str = ""
    generation: GenerationConfig | None = None
    prompt_col: str | None = None
    key_col: str | None = None
    use_cuda: bool = False


def chunk_name(run_id: str, partition: int, chunk: int) -> str:
    """The file of one chunk, relative to the table's root."""
    return f"sparkgpu-{run_id}/p{partition:05d}-c{chunk:06d}.parquet"


def loads_in_process() -> int:
    """How many models this process has loaded (a test's and a benchmark's probe)."""
    return _LOADS


def cached_model(source: ModelSource, device: str) -> tuple[LoadedModel, bool]:
    """The loaded model for ``source`` on ``device``, and whether this call loaded it."""
    global _LOADS
    key = f"{source.key}|{device}"
    model = _CACHE.pop(key, None)
    loaded = model is None
    if model is None:
        model = source.load(device)
        _LOADS += 1
    _CACHE[key] = model  # most recently used last
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    return model, loaded


def _device(plan: ScoringPlan, context) -> str:
    if not plan.use_cuda:
        return "cpu"
    if context is None:  # outside Spark (a benchmark, a test): the current CUDA device
        return "cuda"
    gpus = context.resources().get("gpu")
    if gpus is None or not gpus.addresses:
        return "cuda"
    return f"cuda:{gpus.addresses[0]}"


def _features(table, columns: tuple[str, ...]):
    """The input columns as one float32 matrix, without pandas: a vector column or numeric columns."""
    import numpy as np
    import pyarrow as pa

    if len(columns) == 1:
        column = table.column(columns[0]).combine_chunks()
        if pa.types.is_fixed_size_list(column.type):
            return (
                column.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(len(column), -1)
            )
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            values = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
            return values.reshape(len(column), -1)
    matrix = np.empty((table.num_rows, len(columns)), dtype=np.float32)
    for j, name in enumerate(columns):
        matrix[:, j] = table.column(name).to_numpy()
    return matrix


def _as_arrow(values, result_type):
    import numpy as np
    import pyarrow as pa

    if isinstance(values, pa.Array):
        return values.cast(result_type)
    values = np.asarray(values)
    if values.ndim == 2 and values.shape[1] == 1:
        values = values[:, 0]
    if values.ndim == 2:
        flat = pa.array(values.reshape(-1).astype(np.float64 if values.dtype.kind == "f" else values.dtype))
        return pa.FixedSizeListArray.from_arrays(flat, values.shape[1]).cast(result_type)
    return pa.array(values).cast(result_type)


def _predict(model: LoadedModel, plan: ScoringPlan, table):
    import numpy as np
    import pyarrow as pa

    if plan.task == "generate":
        prompts = table.column(plan.prompt_col).to_pylist()
        keys = table.column(plan.key_col).to_pylist() if plan.key_col else prompts
        assert plan.generation is not None
        if model.vllm is None and (model.tokenizer is None or not model.generates):
            from sparkgpu.errors import ConfigurationError

            raise ConfigurationError(
                f"{plan.source.uri} cannot generate: it needs a causal LM with generate() and a tokenizer; "
                "pass tokenizer= (a tokenizer directory) for a registered model or a module"
            )
        if model.vllm is not None:
            completions = generate_with_vllm(model.vllm, prompts, keys, plan.generation, model.lora_request)
            return pa.array(completions, type=pa.string())
        completions = generate_completions(
            model.module, model.tokenizer, prompts, keys, plan.generation, device=model.device
        )
        return pa.array(completions, type=pa.string())
    step = plan.batch_size
    if model.predict_fn is not None:
        arrays = [table.column(c).to_numpy() for c in plan.input_cols]
        outputs = []
        for start in range(0, table.num_rows, step):
            out = model.predict_fn(*(a[start : start + step] for a in arrays))
            if isinstance(out, dict):
                out = out[plan.output_col] if plan.output_col in out else next(iter(out.values()))
            outputs.append(np.asarray(out))
        return _as_arrow(np.concatenate(outputs) if outputs else np.empty(0), plan.result_type)
    import torch

    features = torch.from_numpy(_features(table, plan.input_cols))
    outputs = []
    with torch.inference_mode():
        for start in range(0, table.num_rows, step):
            out = model.module(features[start : start + step].to(model.device))
            outputs.append(out.float().cpu().numpy())
    return _as_arrow(np.concatenate(outputs) if outputs else np.empty(0), plan.result_type)


def _chunks(batches, rows: int) -> Iterator:
    """Tables of ``rows`` rows (the last may be shorter) from a stream of record batches."""
    import pyarrow as pa

    pending: list = []
    count = 0
    for batch in batches:
        while batch.num_rows:
            take = min(rows - count, batch.num_rows)
            pending.append(batch.slice(0, take))
            batch = batch.slice(take)
            count += take
            if count == rows:
                yield pa.Table.from_batches(pending)
                pending, count = [], 0
    if count:
        yield pa.Table.from_batches(pending)


def _finished_chunks(fs, root: str, run_id: str, partition: int) -> dict[int, tuple[str, int]]:
    """Chunks of this partition an earlier attempt wrote: chunk -> (relative path, bytes)."""
    from pyarrow.fs import FileSelector, FileType

    folder = f"{root}/sparkgpu-{run_id}"
    prefix = f"p{partition:05d}-c"
    found = {}
    for info in fs.get_file_info(FileSelector(folder, allow_not_found=True)):
        name = info.base_name
        if info.type == FileType.File and name.startswith(prefix) and name.endswith(".parquet"):
            found[int(name[len(prefix) : -len(".parquet")])] = (f"sparkgpu-{run_id}/{name}", info.size)
    return found


def _write_chunk(fs, root: str, relative: str, table) -> int:
    """Writes a chunk's file whole: to a temporary name, then moved into place."""
    import pyarrow.parquet as pq

    final = f"{root}/{relative}"
    temporary = f"{final}.{uuid.uuid4().hex}.tmp"
    fs.create_dir(final.rsplit("/", 1)[0], recursive=True)
    pq.write_table(table, temporary, filesystem=fs, compression="zstd")
    fs.move(temporary, final)
    return fs.get_file_info(final).size


def _task_context():
    """The Spark task this runs in, or None outside Spark, where pyspark need not be installed."""
    try:
        from pyspark import TaskContext
    except ImportError:  # a benchmark or a GPU machine scoring without Spark: no task to ask
        return None
    return TaskContext.get()


def score_partition(plan: ScoringPlan, batches) -> Iterator:
    """Scores one partition: yields output record batches, or manifest rows with a Delta output."""
    import pyarrow as pa

    context = _task_context()
    partition = context.partitionId() if context is not None else 0
    attempt = context.attemptNumber() if context is not None else 0
    model: LoadedModel | None = None
    loaded = False
    if plan.output_uri is None:
        for chunk in _chunks(batches, plan.chunk_rows):
            if model is None:
                model, loaded = cached_model(plan.source, _device(plan, context))
            predictions = _predict(model, plan, chunk)
            yield from chunk.append_column(pa.field(plan.output_col, plan.result_type), predictions).to_batches()
        return

    from pyarrow.fs import FileSystem

    fs, root = FileSystem.from_uri(plan.output_uri)
    finished = _finished_chunks(fs, root, plan.run_id, partition)
    manifest_schema = pa.schema([pa.field(n, t) for n, t in MANIFEST_FIELDS])
    for index, chunk in enumerate(_chunks(batches, plan.chunk_rows)):
        started = time.perf_counter()
        if index in finished:
            relative, size = finished[index]
            reused, this_load = True, False
        else:
            this_load = False
            if model is None:
                model, this_load = cached_model(plan.source, _device(plan, context))
            predictions = _predict(model, plan, chunk)
            out = chunk.append_column(pa.field(plan.output_col, plan.result_type), predictions)
            relative = chunk_name(plan.run_id, partition, index)
            size = _write_chunk(fs, root, relative, out)
            reused = False
        row = [
            partition,
            index,
            relative,
            chunk.num_rows,
            size,
            reused,
            this_load,
            attempt,
            os.getpid(),
            time.perf_counter() - started,
        ]
        yield pa.RecordBatch.from_arrays(
            [pa.array([v], type=f.type) for v, f in zip(row, manifest_schema)], schema=manifest_schema
        )
