"""Evaluating a scoring run's output and logging it to MLflow beside the model version.

The metrics are computed on the client from the run's own chunk files (only the prediction
and label columns are read), logged to one MLflow run in the experiment of the run that
trained the model (else ``experiment=`` or the default one), tagged with the model's name,
version and training run; the model version gets the evaluation run's id and the metrics
as tags, so the registry shows how each version scored.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from sparkgpu.errors import ConfigurationError

__all__ = ["compute_metrics", "evaluate_chunks", "METRICS"]

_logger = logging.getLogger(__name__)


def _accuracy(table, prediction_col: str, label_col: str) -> dict[str, float]:
    import numpy as np
    import pyarrow as pa

    predictions, labels = table.column(prediction_col), table.column(label_col)
    if pa.types.is_list(predictions.type) or pa.types.is_fixed_size_list(predictions.type):
        predicted = np.array([int(np.argmax(p)) for p in predictions.to_pylist()])
    elif pa.types.is_floating(predictions.type) and pa.types.is_integer(labels.type):
        predicted = (predictions.to_numpy() >= 0.5).astype(np.int64)  # a binary classifier's probability
    elif pa.types.is_string(predictions.type):
        predicted = np.array([str(p).strip() for p in predictions.to_pylist()], dtype=object)
        actual = np.array([str(v).strip() for v in labels.to_pylist()], dtype=object)
        return {"accuracy": float((predicted == actual).mean()) if len(actual) else 0.0}
    else:
        predicted = predictions.to_numpy()
    actual = labels.to_numpy()
    return {"accuracy": float((predicted == actual).mean()) if len(actual) else 0.0}


#: Named metrics: ``metric="accuracy"`` (a probability is thresholded at 0.5, class scores
#: take their argmax, completions are compared stripped).
METRICS: dict[str, Callable] = {"accuracy": _accuracy}


def compute_metrics(table, metric, prediction_col: str, label_col: str | None) -> dict[str, float]:
    """``metric`` over an Arrow table of predictions: a name of :data:`METRICS` or ``fn(table)``.

    A function gets the table (the prediction column, the label column when given) and returns
    a number or a dict of numbers.
    """
    if isinstance(metric, str):
        if metric not in METRICS:
            raise ConfigurationError(f"metric={metric!r} is not one of {sorted(METRICS)}; or pass a function")
        if label_col is None:
            raise ConfigurationError(f"metric={metric!r} compares predictions with labels; pass label_col=")
        return METRICS[metric](table, prediction_col, label_col)
    value = metric(table)
    if isinstance(value, dict):
        return {str(k): float(v) for k, v in value.items()}
    return {getattr(metric, "__name__", "metric"): float(value)}


def _experiment_of(client, source, experiment: str | None, target) -> str:
    from sparkgpu.tracking.target import default_experiment_name, ensure_experiment

    if experiment is None and source is not None and source.run_id:
        try:
            return client.get_run(source.run_id).info.experiment_id
        except Exception as exc:  # the training run may live in a store this client cannot read
            _logger.info(
                "cannot read the model's training run %s (%s); using the default experiment", source.run_id, exc
            )
    return ensure_experiment(client, experiment or default_experiment_name(), target)


def evaluate_chunks(
    table_uri: str,
    paths: Sequence[str],
    metric,
    *,
    prediction_col: str,
    label_col: str | None,
    source=None,
    experiment: str | None = None,
    params: dict | None = None,
) -> tuple[dict[str, float], str]:
    """Computes ``metric`` over a run's chunk files and logs it to a new MLflow run.

    Returns:
        The metrics and the MLflow run's id.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag
    from pyarrow.fs import FileSystem

    from sparkgpu.tracking.target import resolve_target

    fs, root = FileSystem.from_uri(table_uri)
    wanted = [c for c in (prediction_col, label_col) if c]
    pieces = [pq.read_table(f"{root}/{p}", columns=wanted, filesystem=fs) for p in paths]
    table = pa.concat_tables(pieces) if pieces else pa.table({c: [] for c in wanted})
    metrics = compute_metrics(table, metric, prediction_col, label_col)

    target = resolve_target(getattr(source, "tracking_uri", None), getattr(source, "registry_uri", None))
    client = MlflowClient(target.tracking_uri, target.registry_uri)
    experiment_id = _experiment_of(client, source, experiment, target)
    tags: dict[str, Any] = {"sparkgpu.task": "evaluation"}
    label = "evaluate"
    if source is not None and source.kind == "registry":
        tags.update({"sparkgpu.model.name": source.name, "sparkgpu.model.version": str(source.version)})
        label = f"evaluate {source.name} v{source.version}"
        if source.run_id:
            tags["sparkgpu.model.run_id"] = source.run_id
    elif source is not None:
        tags["sparkgpu.model.uri"] = source.uri
    run = client.create_run(experiment_id, run_name=label, tags={k: str(v) for k, v in tags.items()})
    now = int(__import__("time").time() * 1000)
    client.log_batch(
        run.info.run_id,
        metrics=[Metric(k, v, now, 0) for k, v in metrics.items()],
        params=[Param(k, str(v)) for k, v in (params or {}).items()],
        tags=[RunTag("sparkgpu.evaluation.rows", str(table.num_rows))],
    )
    client.set_terminated(run.info.run_id)
    if source is not None and source.kind == "registry":
        from sparkgpu.tracking.registry import set_tags

        version_tags = {"sparkgpu.evaluation.run_id": run.info.run_id}
        version_tags.update({f"sparkgpu.evaluation.{k}": f"{v:.6g}" for k, v in metrics.items()})
        set_tags(
            f"{source.name}/{source.version}",
            version_tags,
            tracking_uri=target.tracking_uri,
            registry_uri=target.registry_uri,
        )
    return metrics, run.info.run_id
