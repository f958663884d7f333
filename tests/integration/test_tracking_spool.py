"""The spool and its flusher against a real SQLite MLflow store; MLflow's API on a worker."""

from __future__ import annotations

import json

import pytest

from sparkgpu.tracking.flusher import SpoolFlusher
from sparkgpu.tracking.spool import SpoolDir, SpoolWriter, register_spool_scheme

pytestmark = pytest.mark.integration


def history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_records_of_every_writer_reach_the_run(mlflow_store, job_run):
    _, client, _ = mlflow_store
    spool, run_id = job_run
    for rank in range(3):
        writer = SpoolWriter(spool, attempt=0, rank=rank)
        writer.write(
            metrics=[(f"loss_{rank}", float(step), step, 1000 + step) for step in range(4)],
            params=[("lr", "0.1")],
            tags=[("phase", f"rank{rank}")],
        )
    flusher = SpoolFlusher(spool, client, run_id)
    assert flusher.drain() == 3
    run = client.get_run(run_id)
    assert run.data.params == {"lr": "0.1"}
    assert run.data.tags["phase"] in {"rank0", "rank1", "rank2"}
    for rank in range(3):
        assert history(client, run_id, f"loss_{rank}") == [(s, float(s)) for s in range(4)]


def test_a_partly_written_line_waits_until_it_is_complete(mlflow_store, job_run):
    _, client, _ = mlflow_store
    spool, run_id = job_run
    spool.records_dir.mkdir(parents=True, exist_ok=True)
    path = spool.records_dir / "a0.r0.p1.jsonl"
    line = json.dumps({"m": [["x", 1.0, 0, 1000]]})
    path.write_text(line[:10])
    flusher = SpoolFlusher(spool, client, run_id)
    assert flusher.drain() == 0
    with open(path, "a") as f:
        f.write(line[10:] + "\n")
    assert flusher.drain() == 1
    assert history(client, run_id, "x") == [(0, 1.0)]


def test_a_resumed_flusher_forwards_nothing_twice(mlflow_store, job_run):
    _, client, _ = mlflow_store
    spool, run_id = job_run
    writer = SpoolWriter(spool, attempt=0, rank=0)
    writer.write(metrics=[("x", 1.0, 0, 1000)])
    SpoolFlusher(spool, client, run_id).drain()
    resumed = SpoolFlusher(spool, client, run_id)  # a client that restarted reads flusher.json
    assert resumed.drain() == 0
    writer.write(metrics=[("x", 2.0, 1, 2000)])
    assert resumed.drain() == 1
    assert history(client, run_id, "x") == [(0, 1.0), (1, 2.0)]


def test_a_changed_param_is_dropped_with_a_warning(mlflow_store, job_run, caplog):
    _, client, _ = mlflow_store
    spool, run_id = job_run
    writer = SpoolWriter(spool, attempt=0, rank=0)
    writer.write(params=[("batch_size", "64")])
    writer.write(params=[("batch_size", "64"), ("batch_size", "128")], metrics=[("y", 1.0, 0, 1000)])
    SpoolFlusher(spool, client, run_id).drain()
    assert client.get_run(run_id).data.params == {"batch_size": "64"}
    assert history(client, run_id, "y") == [(0, 1.0)]  # the rest of the batch still lands
    assert "batch_size" in caplog.text and "cannot change" in caplog.text


def test_more_records_than_one_mlflow_batch_holds(mlflow_store, job_run):
    _, client, _ = mlflow_store
    spool, run_id = job_run
    SpoolWriter(spool, attempt=0, rank=0).write(
        metrics=[("z", float(i), i, 1000) for i in range(2500)], params=[(f"p{i}", str(i)) for i in range(150)]
    )
    SpoolFlusher(spool, client, run_id).drain()
    assert len(client.get_metric_history(run_id, "z")) == 2500
    assert len(client.get_run(run_id).data.params) == 150


def test_an_unreachable_store_keeps_the_records_for_later(mlflow_store, job_run, monkeypatch):
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    _, client, _ = mlflow_store
    spool, run_id = job_run
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    SpoolWriter(spool, attempt=0, rank=0).write(metrics=[("kept", 7.0, 0, 1000)])
    down = SpoolFlusher(spool, MlflowClient("http://127.0.0.1:9"), run_id)
    assert down.drain() == 0
    with pytest.raises(MlflowException, match="127.0.0.1:9"):
        down.drain(raise_errors=True)
    assert SpoolFlusher(spool, client, run_id).drain() == 1
    assert history(client, run_id, "kept") == [(0, 7.0)]


def test_checkpoint_lineage_from_several_ranks_is_merged(mlflow_store, job_run):
    import mlflow.artifacts

    _, client, _ = mlflow_store
    spool, run_id = job_run
    for rank in range(2):
        SpoolWriter(spool, attempt=0, rank=rank).write(checkpoints=[(100, "/ckpt/100", 1000), (200, "/ckpt/200", 2000)])
    SpoolFlusher(spool, client, run_id).drain()
    run = client.get_run(run_id)
    assert run.data.tags["sparkgpu.checkpoint.latest_step"] == "200"
    assert run.data.tags["sparkgpu.checkpoint.latest_path"] == "/ckpt/200"
    assert history(client, run_id, "checkpoint/step") == [(100, 100.0), (200, 200.0)]
    lineage = json.loads(mlflow.artifacts.load_text(f"{run.info.artifact_uri}/lineage/checkpoints.json"))
    assert [(c["step"], c["path"]) for c in lineage] == [(100, "/ckpt/100"), (200, "/ckpt/200")]


def test_mlflow_fluent_api_on_a_worker_writes_into_the_spool(mlflow_store, job_run, monkeypatch):
    import mlflow

    _, client, _ = mlflow_store
    spool, run_id = job_run
    register_spool_scheme()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", spool.uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    monkeypatch.setenv("RANK", "3")
    try:
        mlflow.log_metric("user_metric", 0.5, step=2)
        mlflow.log_param("user_param", "x")
        assert mlflow.active_run().info.run_id == run_id  # attached, no new run
    finally:
        mlflow.end_run()  # what MLflow's atexit does when a rank exits
    assert list(spool.records_dir.glob("a0.r3.*.jsonl"))
    SpoolFlusher(spool, client, run_id).drain()
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"  # a rank ending never ends the job's run
    assert run.data.params["user_param"] == "x"
    assert history(client, run_id, "user_metric") == [(2, 0.5)]


def test_other_runs_go_straight_to_the_real_store(mlflow_store, job_run):
    from mlflow import MlflowClient

    _, client, experiment_id = mlflow_store
    spool, _ = job_run
    register_spool_scheme()
    on_worker = MlflowClient(spool.uri)
    other = on_worker.create_run(experiment_id, run_name="side run")
    on_worker.log_metric(other.info.run_id, "m", 1.0)
    assert client.get_run(other.info.run_id).data.metrics == {"m": 1.0}


def test_spool_uri_without_a_job_run_names_the_problem(tmp_path):
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    register_spool_scheme()
    with pytest.raises(MlflowException, match="holds no job run"):
        MlflowClient(SpoolDir(tmp_path / "empty").uri).get_run("0" * 32)
