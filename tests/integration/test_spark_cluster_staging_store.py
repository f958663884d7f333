"""``spark.gpu.train`` on the real standalone cluster with a staging store instead of a shared
run dir: ``SPARKGPU_STAGING_ROOT=file:///<tmp>/store``. The executors download the payload into
scratch run dirs of their own and send everything back through the store; the client reads
results, tracebacks and output from its local mirror.

Named ``test_spark_cluster_*`` so the session orders it with the other cluster tests (before
the in-process Connect server exists).
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from sparkgpu import WorkerFailedError, runtime
from sparkgpu.config import reset_settings, settings
from tests.integration.processes import assert_no_orphans
from tests.sealed import sealed_json
from tests.integration.test_spark_cluster import (  # noqa: F401 (no_tracking: a fixture)
    assert_rank_two_is_named_with_its_traceback,
    corrupt_shard_on_rank_two,
    no_tracking,
)

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("workers_share_this_image")]


@pytest.fixture
def staging_store(monkeypatch, tmp_path):
    """A ``file://`` staging store, a folder the client's run dirs are never in; returns the
    user's prefix of it, which holds the jobs' folders."""
    store = tmp_path / "store"
    monkeypatch.setenv("SPARKGPU_STAGING_ROOT", store.as_uri())
    monkeypatch.setenv("SPARKGPU_USER", "ana")
    reset_settings()
    assert settings().staging_url == store.as_uri() and not settings().staging_root.is_relative_to(store)
    return store / "ana"


def say_where_and_sum(x):
    import torch
    import torch.distributed as dist

    rank = runtime.get_global_rank()
    print(f"hello from rank {rank}", flush=True)
    t = torch.tensor([x * (rank + 1)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "node": runtime.get_node_rank(),
        "sum": t.item(),
        "run_dir": os.environ[runtime.ENV_RUN_DIR],
        "checkpoints": runtime.checkpoint_dir(),
    }


def started_markers(job_id: str) -> list[dict]:
    spark = settings().staging_root / job_id / "attempts" / "0" / "spark"
    return [sealed_json(spark / f"node-{n}.started") for n in (0, 1)]


@pytest.mark.usefixtures("no_tracking")
def test_train_returns_every_ranks_result_and_output_through_the_store(cluster_spark, staging_store, capsys):
    results = cluster_spark.gpu.train(say_where_and_sum, gpus=4, gpu_type="A10", args=(10,), log_ranks="all")

    job_id = cluster_spark.gpu.last_job_id
    client_run_dir = settings().staging_root / job_id
    assert [r["rank"] for r in results] == [0, 1, 2, 3] and [r["node"] for r in results] == [0, 0, 1, 1]
    assert {r["sum"] for r in results} == {10 + 20 + 30 + 40}
    # The ranks ran in the executors' scratch copies, never in the client's run dir...
    node_dirs = {r["run_dir"] for r in results}
    assert len(node_dirs) == 2 and all(Path(d).name == job_id for d in node_dirs)
    assert not any(Path(d).resolve().is_relative_to(settings().staging_root.resolve()) for d in node_dirs)
    started = started_markers(job_id)
    assert {os.path.realpath(s["run_dir"]) for s in started} == {os.path.realpath(d) for d in node_dirs}
    assert len({s["executor"] for s in started}) == 2
    assert not any(Path(s["run_dir"]).exists() for s in started)  # each node removed its scratch copy
    # ...and checkpoints go to the store, which every attempt and node reaches.
    assert {r["checkpoints"] for r in results} == {f"{staging_store.as_uri()}/{job_id}/checkpoints"}

    # The ranks' output reached the client, live and in its local mirror.
    out = capsys.readouterr().out
    for rank in range(4):
        assert f"[rank{rank}] hello from rank {rank}" in out
        assert f"hello from rank {rank}" in (client_run_dir / "attempts/0/logs" / f"rank-{rank}.log").read_text()
    ended = [sealed_json(client_run_dir / "attempts/0/spark" / f"node-{n}.ended") for n in (0, 1)]
    assert [e["state"] for e in ended] == ["succeeded", "succeeded"]
    # The store holds the payload the client uploaded and the results the nodes uploaded.
    assert (staging_store / job_id / "payload.sig").exists()
    assert sorted(p.name for p in (staging_store / job_id / "attempts/0/results").iterdir()) == [
        f"rank-{r}.pkl" for r in range(4)
    ]


@pytest.mark.usefixtures("no_tracking")
def test_a_failing_rank_raises_with_its_remote_traceback_through_the_store(cluster_spark, staging_store):
    with pytest.raises(WorkerFailedError) as err:
        cluster_spark.gpu.train(corrupt_shard_on_rank_two, gpus=4, gpu_type="A10")
    assert_rank_two_is_named_with_its_traceback(err)
    job_id = cluster_spark.gpu.last_job_id
    assert (settings().staging_root / job_id / "attempts/0/results/rank-2.error.pkl").exists()
    for marker in started_markers(job_id):
        assert_no_orphans(marker["run_dir"], within=10.0)  # no agent or rank left in the scratch dirs


def log_a_metric():
    import mlflow

    if runtime.get_global_rank() == 0:
        mlflow.log_metric("loss", 0.25, step=3)
    return runtime.get_global_rank()


def test_a_tracked_job_sends_its_metrics_home_through_the_store(cluster_spark, staging_store, tmp_path):
    from mlflow import MlflowClient

    from sparkgpu.tracking import MLflowCallback

    tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"
    callback = MLflowCallback("/team/store", tracking_uri=tracking_uri, system_metrics=False, flush_interval=0.5)
    # Nobody reads the ranks' output live: the client syncs on its quiet clock, and the metrics
    # still come home (at the latest with the attempt's last sync).
    train = cluster_spark.gpu.train
    assert train(log_a_metric, gpus=2, gpu_type="A10", callbacks=[callback], log_ranks=None) == [0, 1]

    history = MlflowClient(tracking_uri).get_metric_history(callback.run_id, "loss")
    assert [(m.value, m.step) for m in history] == [(0.25, 3)]  # spooled on the executor, forwarded by the client


@pytest.mark.usefixtures("no_tracking")
def test_the_checkpoint_request_reaches_the_nodes_and_the_job_resumes_through_the_store(cluster_spark, staging_store):
    from tests.integration.test_spark_cluster_attempts import stop_when_asked

    assert (
        cluster_spark.gpu.train(
            stop_when_asked,
            gpus=2,
            gpu_type="A10",
            max_runtime=40,
            checkpoint_grace=30,
            name="capped",
            log_ranks=None,  # a quiet client still puts the stop request up at once
        )
        == ["resumed"] * 2
    )
    job_id = cluster_spark.gpu.last_job_id
    state = json.loads((settings().staging_root / job_id / "state.json").read_text())
    assert [a["status"] for a in state["attempts"]] == ["preempted", "succeeded"]
    first = state["attempts"][0]
    assert 10 <= first["ended_at"] - first["started_at"] < 40  # the STOP file reached the ranks before the cap
    # The client's control files travel as one object, which node 0 fetched and handed on.
    control = json.loads((staging_store / job_id / "attempts/0/spark/control").read_text())
    assert "runtime cap" in base64.b64decode(control["attempts/0/STOP"]).decode()
    # The ranks' markers came home through the store. Only the first rank to stop surely leaves
    # one: when it exits, torch's agent stops its node's other ranks (SIGTERM), which can reach
    # one a moment before it stops for the restart itself (read_attempt counts it preempted).
    results = settings().staging_root / job_id / "attempts/0/results"
    assert sorted(results.glob("rank-*.preempted")), sorted(p.name for p in results.glob("*"))
