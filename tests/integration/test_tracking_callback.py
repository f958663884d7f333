"""MLflowCallback driven hook by hook, as the supervisor and the workers call it, on a real store."""

from __future__ import annotations

import json
import threading
import time

import pytest

from sparkgpu.callbacks import AttemptOutcome, WorkerContext
from sparkgpu.spec import JobSpec, Resources
from sparkgpu.tracking.mlflow_run import MLflowCallback

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory):
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root}/mlflow.db"
    SqlAlchemyStore(uri, (root / "artifacts").as_uri())
    return uri


def make_job(name="train", **tags):
    return JobSpec(job_id=f"{name}-{time.time_ns()}", name=name, resources=Resources(gpus=2, gpu_type="cpu"), tags=tags)


def train_step(lr):
    return lr


def client_for(uri):
    from mlflow import MlflowClient

    return MlflowClient(uri)


def test_before_job_creates_the_run_with_spec_environment_source_and_data(tracking_uri, tmp_path):
    job = make_job(team="ads")
    callback = MLflowCallback(
        "/team/ctr", tracking_uri=tracking_uri, fn=train_step, data_source="/volumes/clicks", data_version=12
    )
    callback.before_job(job, str(tmp_path / job.job_id))
    callback.after_job(job, [1, 1], None)
    client = client_for(tracking_uri)
    run = client.get_run(callback.run_id)
    assert client.get_experiment(run.info.experiment_id).name == "/team/ctr"
    assert run.info.run_name == job.job_id and run.info.status == "FINISHED"
    assert {k: run.data.params[k] for k in ("gpus", "gpu_type", "backend", "policy.max_restarts")} == {
        "gpus": "2",
        "gpu_type": "cpu",
        "backend": "local",
        "policy.max_restarts": "0",
    }
    tags = run.data.tags
    assert tags["sparkgpu.job_id"] == job.job_id and tags["team"] == "ads"
    assert tags["sparkgpu.data.source"] == "/volumes/clicks" and tags["sparkgpu.data.version"] == "12"
    artifacts = {a.path for a in client.list_artifacts(callback.run_id)}
    assert {"environment", "code"} <= artifacts
    lock = client.download_artifacts(callback.run_id, "environment/requirements.txt", str(tmp_path))
    assert "torch==" in open(lock).read()
    source = client.download_artifacts(callback.run_id, "code/train_step.py", str(tmp_path))
    assert open(source).read().startswith("def train_step(lr):")
    assert [d.dataset.name for d in run.inputs.dataset_inputs] == ["clicks"]


def test_restarts_and_outcomes_are_recorded_on_one_run(tracking_uri, tmp_path):
    job = make_job()
    callback = MLflowCallback("/team/restarts", tracking_uri=tracking_uri)
    callback.before_job(job, str(tmp_path / job.job_id))
    env = callback.before_attempt(job, 0)
    assert env["MLFLOW_RUN_ID"] == callback.run_id
    # The job's spool wherever a node's copy of the run dir is: no client path travels.
    assert env["MLFLOW_TRACKING_URI"] == "sparkgpu-spool:" and env["SPARKGPU_TRACKING_SPOOL"] == "tracking"
    assert str(tmp_path) not in json.dumps(env)
    assert env["SPARKGPU_MLFLOW_TRACKING_URI"] == tracking_uri
    assert env["MLFLOW_REGISTRY_URI"] == tracking_uri
    assert env["MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING"] == "false"
    now = time.time()
    callback.after_attempt(job, AttemptOutcome(0, "failed", now - 3, now, 2, "cpu"))
    assert callback.before_attempt(job, 1)["MLFLOW_RUN_ID"] == callback.run_id  # same run for the retry
    callback.after_attempt(job, AttemptOutcome(1, "preempted", now, now + 5, 2, "cpu"))
    callback.before_attempt(job, 2)
    callback.after_attempt(job, AttemptOutcome(2, "succeeded", now + 5, now + 6, 2, "cpu"))
    callback.after_job(job, [0, 0], None)
    client = client_for(tracking_uri)
    run = client.get_run(callback.run_id)
    tags = run.data.tags
    assert tags["sparkgpu.attempt.0.status"] == "failed" and tags["sparkgpu.attempt.2.status"] == "succeeded"
    assert (tags["sparkgpu.attempts"], tags["sparkgpu.restarts"], tags["sparkgpu.resumes"]) == ("3", "1", "1")
    restarts = sorted((m.step, m.value) for m in client.get_metric_history(callback.run_id, "sparkgpu/restarts"))
    assert restarts == [(0, 0.0), (1, 1.0), (2, 1.0)]
    durations = sorted(
        (m.step, round(m.value)) for m in client.get_metric_history(callback.run_id, "sparkgpu/attempt_duration_s")
    )
    assert durations == [(0, 3), (1, 5), (2, 1)]
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_a_resumed_client_keeps_the_run_and_its_attempt_history(tracking_uri, tmp_path):
    job = make_job()
    run_dir = str(tmp_path / job.job_id)
    first = MLflowCallback("/team/resume", tracking_uri=tracking_uri)
    first.before_job(job, run_dir)
    first.before_attempt(job, 0)
    first.after_attempt(job, AttemptOutcome(0, "failed", time.time(), time.time(), 2, "cpu"))
    # The client dies here; `sparkgpu resume` builds a new callback on the same run dir.
    second = MLflowCallback("/team/resume", tracking_uri=tracking_uri)
    second.before_job(job, run_dir)
    assert second.run_id == first.run_id
    second.before_attempt(job, 1)
    second.after_job(job, [0, 0], None)
    tags = client_for(tracking_uri).get_run(second.run_id).data.tags
    assert tags["sparkgpu.restarts"] == "1"


@pytest.mark.parametrize("error, status", [(RuntimeError("boom"), "FAILED"), (KeyboardInterrupt(), "KILLED")])
def test_failed_and_cancelled_jobs_end_the_run_accordingly(tracking_uri, tmp_path, error, status):
    job = make_job()
    callback = MLflowCallback("/team/failures", tracking_uri=tracking_uri)
    callback.before_job(job, str(tmp_path / job.job_id))
    callback.after_job(job, None, error)
    run = client_for(tracking_uri).get_run(callback.run_id)
    assert run.info.status == status
    assert run.data.tags["sparkgpu.error"].startswith(type(error).__name__)


def test_an_unreachable_tracking_server_stops_the_job_before_it_starts(tmp_path, monkeypatch):
    from sparkgpu.errors import ConfigurationError

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    job = make_job()
    callback = MLflowCallback("/team/down", tracking_uri="http://127.0.0.1:9")
    with pytest.raises(ConfigurationError, match="http://127.0.0.1:9.*MLFLOW_TRACKING_URI"):
        callback.before_job(job, str(tmp_path / job.job_id))
    assert callback.run_id is None


def test_embedded_store_is_the_default(tmp_path, monkeypatch, _isolated_sparkgpu_home):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # MLflow's own default store would be written here; the suite's folder is shared with the
    # processes of other workers' tests.
    monkeypatch.chdir(tmp_path)
    job = make_job()
    callback = MLflowCallback("/team/embedded")
    callback.before_job(job, str(tmp_path / job.job_id))
    callback.after_job(job, [0, 0], None)
    db = _isolated_sparkgpu_home / "mlflow" / "mlflow.db"
    assert db.exists()
    run = client_for(f"sqlite:///{db}").get_run(callback.run_id)
    assert run.info.artifact_uri.startswith((_isolated_sparkgpu_home / "mlflow" / "artifacts").as_uri())
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlflow.db").exists()


class _Count:
    """Events counted from other threads; :meth:`wait_for` waits for them, not for a time."""

    def __init__(self):
        self.value = 0
        self._changed = threading.Condition()

    def add(self) -> None:
        with self._changed:
            self.value += 1
            self._changed.notify_all()

    def wait_for(self, count: int) -> None:
        with self._changed:  # 120 s only guards against a hang
            assert self._changed.wait_for(lambda: self.value >= count, timeout=120), f"{self.value} in 120 s"


def test_worker_side_logs_system_metrics_keyed_by_node(tracking_uri, tmp_path, monkeypatch):
    from sparkgpu.tracking.system_metrics import NodeMetricsMonitor

    published = _Count()
    publish = NodeMetricsMonitor.publish_metrics

    def counted(monitor, metrics):
        publish(monitor, metrics)
        published.add()

    monkeypatch.setattr(NodeMetricsMonitor, "publish_metrics", counted)
    job = make_job()
    callback = MLflowCallback(
        "/team/system", tracking_uri=tracking_uri, system_metrics_interval=0.2, flush_interval=0.2
    )
    callback.before_job(job, str(tmp_path / job.job_id))
    for key, value in callback.before_attempt(job, 0).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SPARKGPU_RUN_DIR", str(tmp_path / job.job_id))  # as the node's launcher sets it
    worker = MLflowCallback.__new__(MLflowCallback)  # the workers' copy, as unpickled from the payload
    worker.__setstate__(callback.__getstate__())
    ctx = WorkerContext(
        job.job_id, str(tmp_path), attempt=0, rank=0, local_rank=0, world_size=2, node_rank=1, device="cpu"
    )
    worker.on_worker_start(ctx)
    published.wait_for(2)  # two samples of the node's monitor, however long MLflow takes to import
    worker.on_worker_end(ctx, None)
    callback.after_job(job, [0, 0], None)
    client = client_for(tracking_uri)
    metrics = client.get_run(callback.run_id).data.metrics
    assert "system/node_1/cpu_utilization_percentage" in metrics
    assert "system/node_1/system_memory_usage_megabytes" in metrics
    assert not any(k.startswith("system/node_1/gpu") for k in metrics)  # CPU ranks: no GPU metrics
    assert metrics["world_size"] == 2
    assert len(client.get_metric_history(callback.run_id, "system/node_1/cpu_utilization_percentage")) >= 2
