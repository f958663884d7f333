"""The flusher against a real SQLite MLflow store that fails now and then: nothing is lost,
nothing is sent twice, and what a job leaves unsent can be forwarded after it ended."""

from __future__ import annotations

import json
import time

import pytest

from sparkgpu.tracking.flusher import SpoolFlusher
from sparkgpu.tracking.spool import SpoolDir, SpoolWriter
from tests.fakes.flaky_mlflow import FlakyClient

pytestmark = pytest.mark.integration


def lineage(run):
    import mlflow.artifacts

    return json.loads(mlflow.artifacts.load_text(f"{run.info.artifact_uri}/lineage/checkpoints.json"))


@pytest.mark.parametrize("failing_call", [1, 2, 3, 4, 5])
def test_a_retry_by_the_same_flusher_loses_nothing(mlflow_store, job_run, failing_call):
    # One pass makes five calls: params, tags, metrics, lineage artifact, checkpoint metrics.
    _, client, _ = mlflow_store
    spool, run_id = job_run
    SpoolWriter(spool, attempt=0, rank=0).write(
        metrics=[("loss", 0.5, 0, 1000)],
        params=[("lr", "0.1")],
        tags=[("phase", "warmup")],
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


def test_a_failure_part_way_does_not_resend_the_chunks_that_went_through(mlflow_store, job_run):
    _, client, _ = mlflow_store
    spool, run_id = job_run
    points = [("z", float(i), i, 1000 + i) for i in range(2500)]  # three log_batch calls of metrics
    SpoolWriter(spool, attempt=0, rank=0).write(metrics=points)
    flaky = FlakyClient(client, fail_calls=[2])  # the second chunk fails once
    flusher = SpoolFlusher(spool, flaky, run_id)
    assert flusher.drain() == 0
    assert flusher.drain() == 1
    assert sorted(flaky.sent_metrics) == sorted(("z", s, v) for _, v, s, _ in points)
    assert len(client.get_metric_history(run_id, "z")) == 2500


def test_a_resumed_client_continues_where_the_failed_pass_stopped(mlflow_store, job_run):
    _, client, _ = mlflow_store
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


def test_stop_retries_a_store_that_fails_for_a_moment(mlflow_store, job_run):
    _, client, _ = mlflow_store
    spool, run_id = job_run
    SpoolWriter(spool, attempt=0, rank=0).write(metrics=[("last", 1.0, 0, 1000)])
    flaky = FlakyClient(client, fail_calls=[1, 2])
    SpoolFlusher(spool, flaky, run_id, stop_backoff=0.01).stop()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "last")] == [(0, 1.0)]


def test_stop_gives_up_after_its_retries_and_leaves_the_records_in_the_spool(mlflow_store, job_run):
    _, client, _ = mlflow_store
    spool, run_id = job_run
    SpoolWriter(spool, attempt=0, rank=0).write(metrics=[("last", 1.0, 0, 1000)])
    flaky = FlakyClient(client, fail_calls=range(1, 100))
    with pytest.raises(ConnectionError):
        SpoolFlusher(spool, flaky, run_id, stop_attempts=3, stop_backoff=0.01).stop()
    assert flaky.calls == 3
    assert client.get_metric_history(run_id, "last") == []
    assert SpoolFlusher(spool, client, run_id).drain() == 1


# -- what a job leaves unsent ----------------------------------------------------------------


def ended_job_with_unsent_records(uri, tmp_path, *, store_down_for_client: bool, error=None):
    """Runs MLflowCallback's client hooks for a job whose flusher cannot reach the store at
    the end (nor, with ``store_down_for_client``, anything else the client sends)."""
    from sparkgpu.spec import JobSpec, Resources
    from sparkgpu.tracking.mlflow_run import MLflowCallback

    job = JobSpec(job_id=f"leftover-{time.time_ns()}", name="train", resources=Resources(gpus=2, gpu_type="cpu"))
    run_dir = tmp_path / job.job_id
    callback = MLflowCallback("/team/leftover", tracking_uri=uri, flush_interval=3600)  # only stop() flushes
    callback.before_job(job, str(run_dir))
    SpoolWriter(SpoolDir(run_dir / "tracking"), attempt=0, rank=0).write(
        metrics=[("loss", 0.25, 7, 1000)], params=[("lr", "0.1")]
    )
    down = FlakyClient(callback._client, fail_calls=range(1, 10**9))
    callback._flusher.client = down
    callback._flusher.stop_backoff = 0.01
    if store_down_for_client:
        callback._client = down
    callback.after_job(job, None if error else [0, 0], error)
    return job, run_dir, callback.run_id


def test_records_a_job_left_unsent_are_forwarded_later_and_the_run_ends_as_the_job_did(mlflow_store, tmp_path):
    from sparkgpu.tracking import flush_spool

    uri, client, _ = mlflow_store
    _, run_dir, run_id = ended_job_with_unsent_records(
        uri, tmp_path, store_down_for_client=True, error=RuntimeError("boom")
    )
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING" and "loss" not in run.data.metrics
    assert flush_spool(run_dir) == 1
    run = client.get_run(run_id)
    assert run.data.metrics["loss"] == 0.25 and run.data.params["lr"] == "0.1"
    assert run.info.status == "FAILED" and run.data.tags["sparkgpu.error"] == "RuntimeError: boom"
    assert flush_spool(run_dir) == 0  # nothing twice
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(7, 0.25)]


def test_a_run_with_unsent_records_says_so_until_they_are_forwarded(mlflow_store, tmp_path):
    from sparkgpu.tracking import flush_spool

    uri, client, _ = mlflow_store
    _, run_dir, run_id = ended_job_with_unsent_records(uri, tmp_path, store_down_for_client=False)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert f"flush_spool({str(run_dir)!r})" in run.data.tags["sparkgpu.tracking.unsent"]
    assert flush_spool(run_dir) == 1
    run = client.get_run(run_id)
    assert "sparkgpu.tracking.unsent" not in run.data.tags and run.data.metrics["loss"] == 0.25
    assert run.info.status == "FINISHED"


def test_flushing_a_store_that_is_still_down_keeps_the_records(mlflow_store, tmp_path, monkeypatch):
    from sparkgpu.errors import SparkGPUError
    from sparkgpu.tracking import flush_spool

    uri, client, _ = mlflow_store
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    _, run_dir, run_id = ended_job_with_unsent_records(uri, tmp_path, store_down_for_client=False)
    with pytest.raises(SparkGPUError, match="stay in .*call flush_spool again"):
        flush_spool(run_dir, tracking_uri="http://127.0.0.1:9")
    assert flush_spool(run_dir) == 1


def test_flush_refuses_a_job_that_has_not_ended_and_a_folder_without_one(mlflow_store, tmp_path):
    from sparkgpu.errors import ConfigurationError
    from sparkgpu.tracking import flush_spool
    from sparkgpu.tracking.mlflow_run import MLflowCallback

    uri, _, _ = mlflow_store
    with pytest.raises(ConfigurationError, match="holds no tracked job"):
        flush_spool(tmp_path / "nothing")
    job, run_dir, _ = ended_job_with_unsent_records(uri, tmp_path, store_down_for_client=False)
    resumed = MLflowCallback("/team/leftover", tracking_uri=uri, flush_interval=3600)
    resumed.before_job(job, str(run_dir))  # `sparkgpu resume`: the job runs again
    try:
        with pytest.raises(ConfigurationError, match="has not ended.*sparkgpu resume"):
            flush_spool(run_dir)
    finally:
        resumed.after_job(job, [0, 0], None)  # the resumed client forwards the leftover itself
    assert flush_spool(run_dir) == 0


def test_the_cli_forwards_what_a_job_left_unsent(mlflow_store, tmp_path, capsys):
    from sparkgpu import cli
    from sparkgpu.config import settings

    uri, client, _ = mlflow_store
    job, run_dir, run_id = ended_job_with_unsent_records(uri, settings().staging_root, store_down_for_client=False)
    (run_dir / "spec.json").write_text(json.dumps(job.to_dict()))  # what a staged job has
    assert cli.main(["tracking", "flush", job.job_id]) == 0
    assert f"forwarded 1 record of job {job.job_id}" in capsys.readouterr().out
    run = client.get_run(run_id)
    assert run.data.metrics["loss"] == 0.25 and "sparkgpu.tracking.unsent" not in run.data.tags
