"""Each rank's loader reports its wait, step and cache figures to the job's MLflow run.

The dataset lives on a real S3-protocol server (moto on loopback) and every rank starts from an
empty cache of its own, so the cache figures describe real downloads: the first epoch fetches
every shard (its first read waits for a download), the second finds them all on disk.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.integration

BATCHES = 24  # per rank and epoch


def _train(remote, cache_root):
    import time

    from sparkgpu import data, runtime

    # A cache of its own per rank: its counters then count every shard this rank reads.
    ds = data.dataset(remote=remote, local=f"{cache_root}/rank_{runtime.get_global_rank()}", batch_size=8)
    handed, stats = [], []
    for _ in range(2):
        count = 0
        for _ in ds:
            time.sleep(0.02)  # the training step
            count += 1
        handed.append(count)
        stats.append(ds.stats())
    return handed, stats


def _upload(folder, url: str) -> int:
    """Copies the dataset folder to the volume; returns the bytes of its shard objects there."""
    import fsspec

    fs = fsspec.filesystem("s3")
    bucket_path = url[len("s3://") :]
    for path in sorted(folder.iterdir()):
        fs.pipe(f"{bucket_path}/{path.name}", path.read_bytes())
    fs.invalidate_cache()
    return sum(info["size"] for info in fs.ls(bucket_path, detail=True) if info["name"].endswith(".mds"))


def test_every_ranks_loader_metrics_reach_the_jobs_run_and_count_the_downloads(s3_bucket, tmp_path, monkeypatch):
    from mlflow import MlflowClient
    from streaming import MDSWriter

    from sparkgpu import distributed
    from sparkgpu.config import reset_settings
    from sparkgpu.tracking.mlflow_run import MLflowCallback

    folder = tmp_path / "mds"
    with MDSWriter(out=str(folder), columns={"x": "float32"}, size_limit=1 << 10) as writer:
        for i in range(BATCHES * 8 * 2):
            writer.write({"x": np.float32(i)})
    shard_files = sorted(p.name for p in folder.glob("*.mds"))
    assert len(shard_files) >= 4, "several shards, so the first epoch downloads more than once"
    remote = f"{s3_bucket}/feats/v1"
    server_bytes = _upload(folder, remote)
    assert server_bytes == sum((folder / name).stat().st_size for name in shard_files)
    monkeypatch.setenv("SPARKGPU_DATA_METRICS_INTERVAL", "0.1")
    reset_settings()
    tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"
    callback = MLflowCallback("/team/loader", tracking_uri=tracking_uri, fn=_train, flush_interval=0.3)
    train = distributed(gpus=2, gpu_type="cpu", callbacks=[callback], log_ranks=None)(_train)
    results = train.distributed(remote, str(tmp_path / "cache"))

    assert len(results) == 2, results  # one answer per rank
    for handed, (cold, warm) in results:
        assert handed == [BATCHES, BATCHES] and (cold["batches"], warm["batches"]) == (BATCHES, 2 * BATCHES)
        # Samples are dealt to ranks in turn, so each rank reads (and downloads) every shard, once.
        assert cold["downloaded_mb"] == server_bytes / 1e6
        assert warm["downloaded_mb"] == cold["downloaded_mb"], "the second epoch reads from the cache only"
        assert cold["cache_hit_ratio"] < 1.0, "an empty cache: at least the first shard read waits for its download"
        assert warm["cache_hit_ratio"] > cold["cache_hit_ratio"]  # the second epoch adds hits only
        assert cold["download_mbps"] > 0 and warm["download_mbps"] < cold["download_mbps"]

    client = MlflowClient(tracking_uri)
    run_id = callback.run_id
    for rank in (0, 1):
        wait = client.get_metric_history(run_id, f"data/wait_fraction/rank_{rank}")
        assert len(wait) >= 2, "a point every 0.1 s over about a second of steps"
        steps = client.get_metric_history(run_id, f"data/step_s/rank_{rank}")
        assert all(m.value >= 0.02 for m in steps) and [m.step for m in steps] == sorted(m.step for m in steps)
        assert 0 < max(m.step for m in steps) <= 2 * BATCHES  # keyed by batches handed out
        assert client.get_metric_history(run_id, f"data/wait_s/rank_{rank}")
        ratio = sorted(
            (m.step, m.value) for m in client.get_metric_history(run_id, f"data/cache_hit_ratio/rank_{rank}")
        )
        mbps = dict((m.step, m.value) for m in client.get_metric_history(run_id, f"data/download_mbps/rank_{rank}"))
        assert [s for s, _ in ratio] == sorted(mbps), "both figures of every interval"
        assert ratio[0][1] < 1.0 and mbps[ratio[0][0]] > 0, "the first interval read the first shard from the volume"
        # A miss waits for that shard's download, whose bytes count in the same interval.
        assert all(mbps[s] > 0 for s, value in ratio if value < 1.0)
        # Intervals wholly inside the second epoch: every shard read is a hit and nothing downloads.
        warm_points = [(s, v) for (before, _), (s, v) in zip(ratio, ratio[1:]) if before >= BATCHES]
        assert warm_points, "a point every 0.1 s over the half second of the second epoch"
        assert all(v == 1.0 and mbps[s] == 0.0 for s, v in warm_points)
