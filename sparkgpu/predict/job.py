"""``spark.gpu.predict`` on the client: checks, the scoring stage, metering, the Delta commit.

Scoring is a plain (non-barrier) ``mapInArrow`` stage: unlike training, its tasks need not
start together nor talk to each other, and Spark may re-run any one of them alone. What it
shares with training is everything around the stage: the GPU type is checked against the
session's capacity probe, the job against the usage policy (and the pool's) before anything
runs, each task asks for its GPUs through a task-level ResourceProfile as training's barrier
tasks do, and the run is metered in the usage ledger by the same :class:`~sparkgpu.usage.meter.UsageMeter`, as
``gpus`` x its running time.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import secrets
import time
from typing import Any, Callable, Sequence

from sparkgpu._util.report import report
from sparkgpu.callbacks import AttemptOutcome, JobCallback
from sparkgpu.errors import CapacityError, ConfigurationError
from sparkgpu.predict.executor.generation import GenerationConfig
from sparkgpu.predict.executor.scoring import MANIFEST_FIELDS, ScoringPlan, score_partition
from sparkgpu.predict.models import ModelSource, resolve_model
from sparkgpu.rundir.states import AttemptStatus
from sparkgpu.spec import JobSpec, Resources, RunPolicy, new_job_id

__all__ = ["PredictionResult", "predict", "RESULT_TYPES"]

_logger = logging.getLogger(__name__)

#: Seconds a session's capacity probe is reused for scoring calls.
CAPACITY_MAX_AGE = 3600.0

#: ``result_type=`` names: Spark type name -> (Spark DDL, Arrow type name).
RESULT_TYPES = {
    "double": "double",
    "float": "float",
    "int": "int",
    "long": "bigint",
    "bigint": "bigint",
    "string": "string",
    "array<float>": "array<float>",
    "array<double>": "array<double>",
}


@dataclasses.dataclass(frozen=True)
class PredictionResult:
    """What a scoring run with ``output=`` wrote.

    Attributes:
        table: The Delta table's URI.
        version: The table version holding the run's rows (``None`` for an empty input).
        committed: ``False`` when an earlier call of the same ``run_id`` had committed them.
        run_id: The scoring run; pass it again to finish an interrupted run without duplicates.
        job_id: The job id its usage is metered under.
        rows: Rows written.
        chunks: Chunk files written.
        chunks_reused: Chunks a re-run task found finished and did not score again.
        model_loads: Model loads in the executors' Python workers during this run.
        seconds: Wall time of the scoring stage.
        metrics: Evaluation metrics (empty without ``metric=``).
        mlflow_run_id: The MLflow run the metrics were logged to.
    """

    table: str
    version: int | None
    committed: bool
    run_id: str
    job_id: str
    rows: int
    chunks: int
    chunks_reused: int
    model_loads: int
    seconds: float
    metrics: dict = dataclasses.field(default_factory=dict)
    mlflow_run_id: str | None = None


def _arrow_type(spark_ddl: str):
    import pyarrow as pa

    return {
        "double": pa.float64(),
        "float": pa.float32(),
        "int": pa.int32(),
        "bigint": pa.int64(),
        "string": pa.string(),
        "array<float>": pa.list_(pa.float32()),
        "array<double>": pa.list_(pa.float64()),
    }[spark_ddl]


def _check_capacity(spark, gpu_type: str, gpus: int, gpus_per_task: int):
    """The session's capacity; raises when the pool can never run this scoring job."""
    from sparkgpu.spec.catalog import lookup_gpu_type

    from sparkgpu.config import settings
    from sparkgpu.launch.backends.spark.capacity import discover_capacity

    # Scoring tasks ask Spark for their GPUs one by one: the session's last probe (up to
    # CAPACITY_MAX_AGE old) is enough to refuse a wrong type, and a probe job per call is not.
    capacity = discover_capacity(spark, wait_timeout=settings().spark_wait_timeout, max_age=CAPACITY_MAX_AGE)
    if gpu_type.lower() == "cpu":
        return capacity, "cpu"
    canonical = lookup_gpu_type(gpu_type).name
    if capacity.local_mode:
        return capacity, canonical
    if capacity.gpu_type is not None and capacity.gpu_type != canonical:
        raise CapacityError(
            f"gpu_type={gpu_type!r} is not what this session's executors have ({capacity.gpu_type}); "
            f"pass gpu_type={capacity.gpu_type!r} or connect to a pool of {canonical} GPUs"
        )
    if capacity.gpus_per_executor < gpus_per_task:
        raise CapacityError(
            f"gpus_per_task={gpus_per_task} exceeds the {capacity.gpus_per_executor} GPU(s) of each executor; "
            "a task runs on one executor"
        )
    if capacity.total_gpus < gpus_per_task:
        raise CapacityError(f"this session's executors have {capacity.total_gpus} GPUs; a task needs {gpus_per_task}")
    return capacity, canonical


def predict(
    spark,
    df,
    model,
    *,
    gpus: int,
    gpu_type: str,
    task: str = "predict",
    input_cols: Sequence[str] | None = None,
    output_col: str | None = None,
    result_type: str = "double",
    batch_size: int | None = None,
    chunk_rows: int | None = None,
    gpus_per_task: int = 1,
    output: str | None = None,
    mode: str = "append",
    run_id: str | None = None,
    prompt_col: str = "prompt",
    key_col: str | None = None,
    generation: GenerationConfig | dict | None = None,
    base_model: str | None = None,
    tokenizer: str | None = None,
    metric: str | Callable | None = None,
    label_col: str | None = None,
    experiment: str | None = None,
    name: str | None = None,
    tags: dict | None = None,
    priority: str | None = None,
    callbacks: Sequence[JobCallback] | None = None,
    ship_environment: bool = True,
    tracking_uri: str | None = None,
    registry_uri: str | None = None,
):
    """Scores ``df`` with ``model`` on the session's GPU executors (``spark.gpu.predict``).

    Args:
        spark: The session.
        df: The rows to score.
        model: A registry reference (``"main.ml.ctr@champion"``), an MLflow model URI, a
            transformers or PEFT adapter directory, or a function returning a predict function
            (see :mod:`sparkgpu.predict.models`).
        gpus: GPUs used at once; ``gpus // gpus_per_task`` tasks run together.
        gpu_type: GPU type, checked against the executors', or ``"cpu"``.
        task: ``"predict"`` or ``"generate"`` (a prompt column in, a completion column out).
        input_cols: Columns handed to the model (default: all but ``label_col`` and ``key_col``).
        output_col: Output column (``"prediction"``, or ``"completion"`` when generating).
        result_type: ``"double"``, ``"float"``, ``"int"``, ``"long"``, ``"string"``,
            ``"array<float>"`` or ``"array<double>"``.
        batch_size: Rows per model call (1024; for generation, the config's).
        chunk_rows: Rows per chunk, the unit a re-run task skips (8 batches by default).
        gpus_per_task: GPUs of one task (one model replica).
        output: A Delta table path or URL: written exactly once, and a
            :class:`PredictionResult` is returned instead of a DataFrame.
        mode: ``"append"`` or ``"overwrite"`` for ``output``.
        run_id: Names the run's chunk files and Delta transaction; pass a previous result's
            ``run_id`` to finish an interrupted run without duplicates.
        prompt_col: Prompt column (generation).
        key_col: Column whose value seeds each row's sampling (default: the prompt).
        generation: A :class:`GenerationConfig` or a dict of its fields.
        base_model: Base model directory of a PEFT adapter whose config names none.
        tokenizer: Tokenizer directory of a language model that has none with it (a registry
            version, a module).
        metric: ``"accuracy"`` or ``fn(table) -> number | dict``, computed over the written
            rows and logged to MLflow (needs ``output``).
        label_col: Label column for ``metric``.
        experiment: MLflow experiment of the evaluation run (default: the model's training run's).
        name: Job name in the usage ledger.
        tags: Tags for cost attribution and budgets.
        priority: Priority class, recorded on the job.
        callbacks: Job callbacks; a :class:`~sparkgpu.usage.meter.UsageMeter` by default.
        ship_environment: Snapshot this Python environment and rehydrate it in the executors'
            Python workers before scoring, as training jobs do (``SPARKGPU_ENV_*`` settings);
            ``False`` to use the executors' own packages.
        tracking_uri: Tracking store of the registry's model files.
        registry_uri: Registry.

    Returns:
        A lazy DataFrame of ``df``'s columns and ``output_col``; with ``output``, a
        :class:`PredictionResult`.

    Raises:
        CapacityError: the executors have another GPU type, or fewer GPUs than a task needs.
        ConfigurationError: bad arguments, or a model that is none of the accepted forms.
        PolicyViolationError: the usage policy refuses the job.
    """
    from sparkgpu.spec.priority import Priority
    from sparkgpu.usage.meter import UsageMeter, enforce_policy, enforce_pool_policy

    if task not in ("predict", "generate"):
        raise ConfigurationError(f"task={task!r} must be 'predict' or 'generate'")
    if mode not in ("append", "overwrite"):
        raise ConfigurationError(f"mode={mode!r} must be 'append' or 'overwrite'")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ConfigurationError(f"gpus={gpus!r} must be a positive number of GPUs (tasks at once x gpus_per_task)")
    if gpus_per_task < 1 or gpus % gpus_per_task:
        raise ConfigurationError(f"gpus={gpus} must be a whole number of tasks of gpus_per_task={gpus_per_task}")
    if metric is not None and output is None:
        raise ConfigurationError("metric= evaluates the rows written to output=; pass output= (a Delta table path)")
    columns = list(df.columns)
    if task == "generate":
        if prompt_col not in columns:
            raise ConfigurationError(f"prompt_col={prompt_col!r} is not a column of the DataFrame ({columns})")
        output_col = output_col or "completion"
        result_ddl = "string"
        config = generation if isinstance(generation, GenerationConfig) else GenerationConfig(**(generation or {}))
        if batch_size is not None:
            config = dataclasses.replace(config, batch_size=batch_size)
        batch = config.batch_size
    else:
        output_col = output_col or "prediction"
        if result_type not in RESULT_TYPES:
            raise ConfigurationError(f"result_type={result_type!r} must be one of {sorted(RESULT_TYPES)}")
        result_ddl = RESULT_TYPES[result_type]
        config = None
        batch = batch_size or 1024
    if output_col in columns:
        raise ConfigurationError(f"output_col={output_col!r} is already a column; pass another output_col=")
    wanted = list(input_cols) if input_cols else [c for c in columns if c not in (label_col, key_col)]
    missing = [c for c in wanted + [c for c in (label_col, key_col) if c] if c not in columns]
    if missing:
        raise ConfigurationError(f"columns {missing} are not in the DataFrame ({columns})")
    chunk = chunk_rows or batch * 8
    if chunk % batch:
        raise ConfigurationError(f"chunk_rows={chunk} must be a multiple of the batch size {batch}")

    source: ModelSource = resolve_model(
        model, base_model=base_model, tokenizer=tokenizer, tracking_uri=tracking_uri, registry_uri=registry_uri
    )
    capacity, canonical = _check_capacity(spark, gpu_type, gpus, gpus_per_task)
    job = JobSpec(
        job_id=new_job_id(name or f"predict-{source.name or source.kind}"),
        name=name or f"predict {source.name or source.uri}",
        resources=Resources(gpus=gpus, gpu_type=canonical, remote=True),
        policy=RunPolicy(priority=Priority.parse(priority)),
        backend="spark",
        tags={**(tags or {}), "sparkgpu.task": task},
        simulated=bool(capacity.simulated),
    )
    callbacks = list(callbacks) if callbacks is not None else [UsageMeter()]
    enforce_policy(job, callbacks)
    enforce_pool_policy(job)

    run = run_id or f"{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(4)}"
    plan = ScoringPlan(
        source=source,
        task=task,
        input_cols=tuple(wanted),
        output_col=output_col,
        result_type=_arrow_type(result_ddl),
        batch_size=batch,
        chunk_rows=chunk,
        output_uri=output,
        run_id=run,
        generation=config,
        prompt_col=prompt_col if task == "generate" else None,
        key_col=key_col,
        use_cuda=canonical != "cpu" and not capacity.simulated,
    )
    tasks_at_once = gpus // gpus_per_task
    shipped = _shipped(plan, ship_environment)
    scored = _scoring_stage(
        df.coalesce(tasks_at_once), plan, shipped, capacity, canonical, gpus_per_task, output_col, result_ddl
    )
    if output is None:
        return scored
    return _run_to_delta(scored, plan, job, callbacks, mode, metric, label_col, experiment, source)


def _shipped(plan: ScoringPlan, ship_environment: bool) -> dict:
    """What the tasks receive: the scoring function and plan, pickled, and the environment to activate first."""
    from pyspark import cloudpickle

    from sparkgpu.predict.executor import bootstrap

    # The bootstrap runs before the executor may import sparkgpu: it travels by value.
    cloudpickle.register_pickle_by_value(bootstrap)
    shipped: dict[str, Any] = {"manifest": None, "files": {}, "key": None}
    if ship_environment:
        from sparkgpu.env import stage_environment, worker_bootstrap_files

        staged = stage_environment()
        shipped["manifest"] = staged.manifest
        shipped["files"] = worker_bootstrap_files()
        shipped["key"] = hashlib.sha256(json.dumps(staged.manifest, sort_keys=True).encode()).hexdigest()
        _logger.info("environment staged for scoring: %s", staged.report)
    shipped["payload"] = cloudpickle.dumps((score_partition, plan))
    return shipped


def _scoring_stage(
    df, plan: ScoringPlan, shipped: dict, capacity, gpu_type: str, gpus_per_task: int, output_col: str, ddl: str
):
    """The lazy ``mapInArrow`` stage, with a task ResourceProfile asking each task for its GPUs."""
    from sparkgpu.predict.executor.bootstrap import score_shipped

    score = functools.partial(score_shipped, shipped)

    if plan.output_uri is None:
        schema = ", ".join(
            [f"`{f.name}` {f.dataType.simpleString()}" for f in df.schema.fields] + [f"`{output_col}` {ddl}"]
        )
    else:
        schema = ", ".join(f"`{n}` {_SPARK_OF_ARROW[t]}" for n, t in MANIFEST_FIELDS)
    if gpu_type == "cpu" or capacity.local_mode:
        return df.mapInArrow(score, schema)
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    from sparkgpu.launch.backends.spark.sessions import active

    requests = TaskResourceRequests().cpus(1).resource("gpu", float(gpus_per_task))
    profile = ResourceProfileBuilder().require(requests).build
    with active(df.sparkSession):
        _ = profile.id  # Connect registers the profile on the server now, from this thread
    return df.mapInArrow(score, schema, profile=profile)


_SPARK_OF_ARROW = {"int32": "int", "int64": "bigint", "string": "string", "bool": "boolean", "float64": "double"}


def _run_to_delta(scored, plan: ScoringPlan, job: JobSpec, callbacks, mode, metric, label_col, experiment, source):
    from sparkgpu.predict.delta_output import commit_chunks
    from sparkgpu.predict.evaluation import evaluate_chunks

    for callback in callbacks:
        callback.before_job(job, "")
        callback.before_attempt(job, 0)
    started = time.time()
    for callback in callbacks:
        callback.on_ranks_started(job, 0, started)
    status, error = AttemptStatus.FAILED, None
    try:
        manifest = scored.toArrow().to_pylist()
        status = AttemptStatus.SUCCEEDED
    except BaseException as exc:
        error = exc
        raise
    finally:
        ended = time.time()
        outcome = AttemptOutcome(0, status, started, ended, job.resources.gpus, job.resources.gpu_type or "", error)
        for callback in callbacks:
            callback.after_attempt(job, outcome)
            callback.after_job(job, None, error)
    chunks = {(row["partition"], row["chunk"]): row for row in manifest}
    files = sorted(chunks.values(), key=lambda r: r["path"])
    assert plan.output_uri is not None
    version, committed = None, False
    if files:
        import pyarrow.parquet as pq
        from pyarrow.fs import FileSystem

        fs, root = FileSystem.from_uri(plan.output_uri)
        schema = pq.read_schema(f"{root}/{files[0]['path']}", filesystem=fs)
        version, committed = commit_chunks(
            plan.output_uri, files, schema, plan.run_id, mode=mode, metadata={"sparkgpu.job_id": job.job_id}
        )
    rows = sum(r["rows"] for r in files)
    reused = sum(1 for r in files if r["reused"])
    loads = sum(1 for r in manifest if r["loaded"])
    report(
        f"scored {rows} rows in {ended - started:.1f}s into {plan.output_uri} "
        f"(version {version}{'' if committed else ', committed before'}; {len(files)} chunks, {reused} reused)"
    )
    metrics: dict[str, Any] = {}
    mlflow_run = None
    if metric is not None:
        metrics, mlflow_run = evaluate_chunks(
            plan.output_uri,
            [r["path"] for r in files],
            metric,
            prediction_col=plan.output_col,
            label_col=label_col,
            source=source,
            experiment=experiment,
            params={
                "sparkgpu.job_id": job.job_id,
                "sparkgpu.predict.run_id": plan.run_id,
                "table": plan.output_uri,
                "table_version": version,
                "rows": rows,
            },
        )
    return PredictionResult(
        table=plan.output_uri,
        version=version,
        committed=committed,
        run_id=plan.run_id,
        job_id=job.job_id,
        rows=rows,
        chunks=len(files),
        chunks_reused=reused,
        model_loads=loads,
        seconds=ended - started,
        metrics=metrics,
        mlflow_run_id=mlflow_run,
    )
