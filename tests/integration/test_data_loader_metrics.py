"""Each rank's loader reports its wait, step and cache figures to the job's MLflow run."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.integration

BATCHES = 24


def _train(folder):
    import time

    from sparkgpu import data

    ds = data.dataset(local=folder, batch_size=8)
    handed = 0
    for _ in ds:
        time.sleep(0.02)  # the training step: the loader should be waited on for a small part of it
        handed += 1
    return handed, ds.stats()["batches"]


def test_every_ranks_loader_metrics_reach_the_jobs_run(tmp_path, monkeypatch):
    from mlflow import MlflowClient
    from streaming import MDSWriter

    from sparkgpu import distributed
    from sparkgpu.config import reset_settings
    from sparkgpu.tracking.mlflow_run import MLflowCallback

    folder = tmp_path / "mds"
    with MDSWriter(out=str(folder), columns={"x": "float32"}, size_limit=1 << 10) as writer:
        for i in range(BATCHES * 8 * 2):
            writer.write({"x": np.float32(i)})
    monkeypatch.setenv("SPARKGPU_DATA_METRICS_INTERVAL", "0.1")
    reset_settings()
    tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"
    callback = MLflowCallback("/team/loader", tracking_uri=tracking_uri, fn=_train, flush_interval=0.3)
    train = distributed(gpus=2, gpu_type="cpu", callbacks=[callback], log_ranks=None)(_train)
    assert train.distributed(str(folder)) == [(BATCHES, BATCHES)] * 2

    client = MlflowClient(tracking_uri)
    run_id = callback.run_id
    for rank in (0, 1):
        wait = client.get_metric_history(run_id, f"data/wait_fraction/rank_{rank}")
        assert len(wait) >= 2, "a point every 0.1 s over about half a second of steps"
        assert all(0 <= m.value < 0.5 for m in wait), "a local folder of small shards keeps well ahead of a 20 ms step"
        steps = client.get_metric_history(run_id, f"data/step_s/rank_{rank}")
        assert all(m.value >= 0.02 for m in steps) and [m.step for m in steps] == sorted(m.step for m in steps)
        assert 0 < max(m.step for m in steps) <= BATCHES  # keyed by batches handed out
        for name in ("wait_s", "cache_hit_ratio", "download_mbps"):
            assert client.get_metric_history(run_id, f"data/{name}/rank_{rank}"), name
