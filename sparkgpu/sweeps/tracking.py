"""A sweep in MLflow: one parent run, and each trial's own job run as its child.

A trial job's run is created by its own supervisor, as for any job; the sweep only tags the job
with ``mlflow.parentRunId`` (job tags become run tags), so MLflow's UI nests it under the
sweep's run. Once a trial ended, the sweep adds to its child run what only the sweep knows: the
trial's parameters, every reported value (metric ``trial_value`` by step), its state and final
value; and to the parent the best trial so far. All from the sweep's side, with one batch per
trial: the ranks make no MLflow request for a report.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from sparkgpu.rundir.layout import RunLayout

__all__ = ["SweepRun", "child_run_id"]

logger = logging.getLogger(__name__)

#: The metric of a trial's reported values on its run.
VALUE_METRIC = "trial_value"


def child_run_id(run_dir: Path) -> str | None:
    """The MLflow run of the trial job in ``run_dir``, once its supervisor created it."""
    try:
        return json.loads((Path(run_dir) / RunLayout.TRACKING_RUN).read_text()).get("run_id")
    except (FileNotFoundError, ValueError):
        return None


class SweepRun:
    """The sweep's parent run (created once, found again on a resume).

    Args:
        run_id: The parent run.
        experiment: Its experiment's name (the trials' jobs log to the same one).
    """

    def __init__(self, run_id: str, experiment: str):
        self.run_id = run_id
        self.experiment = experiment
        self._client: Any = None

    @property
    def client(self):
        if self._client is None:
            from mlflow import MlflowClient

            from sparkgpu.tracking.target import resolve_target

            self._client = MlflowClient(resolve_target().tracking_uri)
        return self._client

    @classmethod
    def start(cls, sweep_id: str, experiment: str | None, settings: dict[str, Any]) -> "SweepRun":
        """Creates the parent run in ``experiment`` (the calling script's by default)."""
        from mlflow import MlflowClient
        from mlflow.entities import Param, RunTag

        from sparkgpu.tracking.target import default_experiment_name, ensure_experiment, resolve_target

        target = resolve_target()
        client = MlflowClient(target.tracking_uri)
        name = experiment or default_experiment_name()
        experiment_id = ensure_experiment(client, name, target)
        run = client.create_run(experiment_id, run_name=sweep_id, tags={"sparkgpu.sweep": sweep_id})
        params = [Param(f"sweep.{k}", str(v)) for k, v in sorted(settings.items()) if v is not None]
        client.log_batch(run.info.run_id, params=params, tags=[RunTag("sparkgpu.sweep.kind", "parent")])
        sweep_run = cls(run.info.run_id, name)
        sweep_run._client = client
        return sweep_run

    def record_trial(
        self,
        run_dir: Path,
        number: int,
        params: dict[str, Any],
        reports: list[tuple[int, float]],
        state: str,
        value: float | None,
    ) -> None:
        """Adds the trial's parameters, reports, state and value to its job's run (when it has one)."""
        from mlflow.entities import Metric, Param, RunTag

        run_id = child_run_id(run_dir)
        if run_id is None:
            logger.warning("trial %d has no MLflow run (its job ran untracked); nothing recorded for it", number)
            return
        now = int(time.time() * 1000)
        metrics = [Metric(VALUE_METRIC, v, now, step) for step, v in reports]
        tags = [RunTag("sparkgpu.trial.state", state), RunTag("sparkgpu.trial.number", str(number))]
        if value is not None:
            metrics.append(Metric("trial_final_value", float(value), now, reports[-1][0] if reports else 0))
        # Job params already on the run (its spec) use other names; trial params get a prefix.
        batch_params = [Param(f"trial.{k}", str(v)) for k, v in sorted(params.items())]
        for start in range(0, max(len(metrics), 1), 1000):
            self.client.log_batch(
                run_id,
                metrics=metrics[start : start + 1000],
                params=batch_params if start == 0 else [],
                tags=tags if start == 0 else [],
            )

    def record_best(self, params: dict[str, Any], value: float, number: int, counts: dict[str, int]) -> None:
        """The best trial so far (its parameters as ``best.<name>`` tags: they change as the sweep goes)."""
        from mlflow.entities import Metric, RunTag

        tags = [RunTag(f"best.{k}", str(v)) for k, v in sorted(params.items())]
        tags.append(RunTag("best.trial", str(number)))
        now = int(time.time() * 1000)
        metrics = [Metric("best_value", float(value), now, number)]
        metrics += [Metric(f"trials_{state.lower()}", n, now, 0) for state, n in sorted(counts.items())]
        self.client.log_batch(self.run_id, metrics=metrics, tags=tags)

    def end(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)
