"""Tracking through the real launcher: one run per job across ranks and a restart; 8 writers at once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from sparkgpu.tracking.mlflow_run import MLflowCallback

pytestmark = pytest.mark.integration

STEPS = 6


def _train(steps):
    import mlflow
    import torch

    import sparkgpu.tracking as tracking
    from sparkgpu import runtime

    rank = runtime.get_global_rank()
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        tracking.log({"rank_plus_one": rank + 1.0}, reduce="mean")  # a collective on every rank
        mlflow.log_metric(f"rank{rank}/loss", loss.item(), step=step)  # plain MLflow on any rank
    if runtime.attempt() == 0:
        raise RuntimeError("the first attempt fails on purpose")
    tracking.log_checkpoint(steps, "/checkpoints/final")
    time.sleep(1.0)  # the node monitor samples every 0.3 s
    return rank


def test_a_restarted_two_rank_job_is_one_run_with_everything_in_it(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from sparkgpu import distributed

    tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"
    callback = MLflowCallback(
        "/team/job", tracking_uri=tracking_uri, fn=_train, system_metrics_interval=0.3, flush_interval=0.3
    )
    train = distributed(gpus=2, gpu_type="cpu", max_restarts=1, callbacks=[callback], log_ranks=None)(_train)
    assert train.distributed(STEPS) == [0, 1]

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("/team/job")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # not one per rank, not one per attempt
    run = runs[0]
    assert run.info.run_id == callback.run_id and run.info.status == "FINISHED"
    tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
    assert (tags["sparkgpu.attempt.0.status"], tags["sparkgpu.attempt.1.status"]) == ("failed", "succeeded")
    assert tags["sparkgpu.restarts"] == "1" and tags["sparkgpu.checkpoint.latest_step"] == str(STEPS)
    assert (params["gpus"], params["world_size"], params["optimizer"], params["optimizer.lr"]) == (
        "2",
        "2",
        "Adam",
        "0.01",
    )

    mean = client.get_metric_history(run.info.run_id, "rank_plus_one")
    assert len(mean) == 2 * STEPS and {m.value for m in mean} == {1.5}  # mean of ranks 0 and 1, both attempts
    for rank in (0, 1):
        assert len(client.get_metric_history(run.info.run_id, f"rank{rank}/loss")) == 2 * STEPS
    assert [m.step for m in client.get_metric_history(run.info.run_id, "world_size")] == [0, 1]
    assert "lr" in metrics and "system/node_0/cpu_utilization_percentage" in metrics


_WRITER = textwrap.dedent("""
    import os, sys, time
    import mlflow
    from sparkgpu.tracking.spool import register_spool_scheme

    register_spool_scheme()
    rank = int(os.environ["RANK"])
    while not os.path.exists(sys.argv[1]):   # all writers start together
        time.sleep(0.01)
    for step in range(int(sys.argv[2])):
        mlflow.log_metric(f"rank{rank}", float(step), step=step)
        mlflow.log_metrics({f"rank{rank}/a": 1.0, f"rank{rank}/b": 2.0}, step=step)
    mlflow.set_tag(f"done{rank}", "yes")
""")


def test_eight_processes_logging_at_once_into_the_embedded_store_all_land(tmp_path, monkeypatch):
    """Eight ranks log as fast as they can while the client flushes into the embedded SQLite
    store: no "database is locked", nothing lost."""
    from mlflow import MlflowClient

    from sparkgpu.spec import JobSpec, Resources

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    job = JobSpec(job_id=f"many-{time.time_ns()}", name="many", resources=Resources(gpus=8, gpu_type="cpu"))
    callback = MLflowCallback("/team/many", flush_interval=0.05, system_metrics=False)
    callback.before_job(job, str(tmp_path / job.job_id))
    env = {
        **os.environ,
        **callback.before_attempt(job, 0),
        "SPARKGPU_ATTEMPT": "0",
        "SPARKGPU_RUN_DIR": str(tmp_path / job.job_id),
    }  # as the node's launcher sets it
    go, steps = tmp_path / "go", 150
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(go), str(steps)],
            env={**env, "RANK": str(rank)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(8)
    ]
    time.sleep(1.0)
    go.touch()
    errors = [w.communicate(timeout=240)[1] for w in writers]
    assert [w.returncode for w in writers] == [0] * 8, errors
    assert not any("database is locked" in e for e in errors)
    callback.after_job(job, [0] * 8, None)

    client = MlflowClient(callback.run_info.tracking_uri)
    run = client.get_run(callback.run_id)
    assert run.info.status == "FINISHED"
    assert all(run.data.tags[f"done{rank}"] == "yes" for rank in range(8))
    for rank in range(8):
        for key in (f"rank{rank}", f"rank{rank}/a", f"rank{rank}/b"):
            assert len(client.get_metric_history(callback.run_id, key)) == steps, key
