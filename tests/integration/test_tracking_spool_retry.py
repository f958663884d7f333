"""The flusher against a real SQLite MLflow store that fails now and then: nothing is lost,
nothing is sent twice, and what a job leaves unsent can be forwarded after it ended."""

from __future__ import annotations

import json
import time

import pytest

from sparkgpu.tracking.spool import JobRunInfo, SpoolDir, SpoolFlusher, SpoolWriter

pytestmark = pytest.mark.integration


class FlakyClient:
    """A real ``MlflowClient`` whose calls number ``fail_calls`` (from 1) raise instead of
    running; it remembers every metric point of the ``log_batch`` calls that went through."""

    def __init__(self, client, fail_calls=(1,)):
        self._client = client
        self.fail_calls = set(fail_calls)
        self.calls = 0
        self.sent_metrics: list[tuple] = []

    def _call(self, name, *args, **kwargs):
        self.calls += 1
        if self.calls in self.fail_calls:
            raise ConnectionError(f"store unreachable (call {self.calls})")
        return getattr(self._client, name)(*args, **kwargs)

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        result = self._call("log_batch", run_id, metrics=list(metrics), params=list(params), tags=list(tags))
        self.sent_metrics.extend((m.key, m.step, m.value) for m in metrics)
        return result

    def log_text(self, *args, **kwargs):
        return self._call("log_text", *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from mlflow import MlflowClient
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root}/mlflow.db"
    SqlAlchemyStore(uri, (root / "artifacts").as_uri())
    client = MlflowClient(uri)
    experiment_id = client.create_experiment("spool-retry", artifact_location=(root / "artifacts").as_uri())
    return uri, client, experiment_id


@pytest.fixture
def job_run(store, tmp_path):
    uri, client, experiment_id = store
    run = client.create_run(experiment_id, run_name="job")
    spool = SpoolDir(tmp_path / "tracking")
    spool.write_run_info(JobRunInfo(
        run_id=run.info.run_id, experiment_id=experiment_id, experiment_name="spool-retry", tracking_uri=uri,
        registry_uri=uri, artifact_uri=run.info.artifact_uri, run_name="job", job_id="job-1", user_id="me",
        started_at=time.time(),
    ))
    return spool, run.info.run_id


def lineage(run):
    import mlflow.artifacts

    return json.loads(mlflow.artifacts.load_text(f"{run.info.artifact_uri}/lineage/checkpoints.json"))


@pytest.mark.parametrize("failing_call", [1, 2, 3, 4, 5])
def test_a_retry_by_the_same_flusher_loses_nothing(store, job_run, failing_call):
    # One pass makes five calls: params, tags, metrics, lineage artifact, checkpoint metrics.
    _, client, _ = store
    spool, run_id = job_run
    SpoolWriter(spool, attempt=0, rank=0).write(
        metrics=[("loss", 0.5, 0, 1000)], params=[("lr", "0.1")], tags=[("phase", "warmup")],
        checkpoints=[(99, "/ckpt/step-99", 1500)],
    )
    flaky = FlakyClient(client, fail_calls=[failing_call])
    flusher = SpoolFlusher(spool, flaky, run_id)
    assert flusher.drain() == 0  # failed, kept for the next pass
    assert flusher.drain() == 1
    run = client.get_run(run_id)
    assert run.data.params == {"lr": "0.1"}
    assert run.data.tags["phase"] == "warmup"
    assert run.data.tags["sparkgpu.checkpoint.latest_step"] == "99"
    assert [(c["step"], c["path"]) for c in lineage(run)] == [(99, "/ckpt/step-99")]
    assert sorted(flaky.sent_metrics) == [("checkpoint/step", 99, 99.0), ("loss", 0, 0.5)]
    assert flusher.drain() == 0 and flusher.checkpoints == [{"step": 99, "path": "/ckpt/step-99", "timestamp": 1500}]


def test_a_failure_part_way_does_not_resend_the_chunks_that_went_through(store, job_run):
    _, client, _ = store
    spool, run_id = job_run
    points = [("z", float(i), i, 1000 + i) for i in range(2500)]  # three log_batch calls of metrics
    SpoolWriter(spool, attempt=0, rank=0).write(metrics=points)
    flaky = FlakyClient(client, fail_calls=[2])  # the second chunk fails once
    flusher = SpoolFlusher(spool, flaky, run_id)
    assert flusher.drain() == 0
    assert flusher.drain() == 1
    assert sorted(flaky.sent_metrics) == sorted(("z", s, v) for _, v, s, _ in points)
    assert len(client.get_metric_history(run_id, "z")) == 2500


def test_a_resumed_client_continues_where_the_failed_pass_stopped(store, job_run):
    _, client, _ = store
    spool, run_id = job_run
    writer = SpoolWriter(spool, attempt=0, rank=0)
    writer.write(metrics=[("z", float(i), i, 1000 + i) for i in range(1500)], params=[("lr", "0.1")])
    flaky = FlakyClient(client, fail_calls=[3])  # params and the first metrics chunk went through
    assert SpoolFlusher(spool, flaky, run_id).drain() == 0
    writer.write(metrics=[("z", 1500.0, 1500, 9000)])
    resumed = FlakyClient(client, fail_calls=[])
    assert SpoolFlusher(spool, resumed, run_id).drain() == 2  # a client that restarted reads flusher.json
    assert sorted(resumed.sent_metrics) == sorted(("z", i, float(i)) for i in range(1000, 1501))
    assert client.get_run(run_id).data.params == {"lr": "0.1"}


def test_stop_retries_a_store_that_fails_for_a_moment(store, job_run):
    _, client, _ = store
    spool, run_id = job_run
    SpoolWriter(spool, attempt=0, rank=0).write(metrics=[("last", 1.0, 0, 1000)])
    flaky = FlakyClient(client, fail_calls=[1, 2])
    SpoolFlusher(spool, flaky, run_id, stop_backoff=0.01).stop()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "last")] == [(0, 1.0)]


def test_stop_gives_up_after_its_retries_and_leaves_the_records_in_the_spool(store, job_run):
    _, client, _ = store
    spool, run_id = job_run
    SpoolWriter(spool, attempt=0, rank=0).write(metrics=[("last", 1.0, 0, 1000)])
    flaky = FlakyClient(client, fail_calls=range(1, 100))
    with pytest.raises(ConnectionError):
        SpoolFlusher(spool, flaky, run_id, stop_attempts=3, stop_backoff=0.01).stop()
    assert flaky.calls == 3
    assert client.get_metric_history(run_id, "last") == []
    assert SpoolFlusher(spool, client, run_id).drain() == 1
