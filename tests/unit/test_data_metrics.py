"""LoaderMetrics: the figures of each interval, and where they go inside and outside a job."""

from __future__ import annotations

import json
import time

import pytest

from sparkgpu.data.loaders.metrics import LoaderMetrics


class _Cache:
    """The counters a ShardCache keeps, moved by hand."""

    def __init__(self):
        self.hits = self.misses = self.downloaded_bytes = 0


def _slow_batches(cache, count, wait):
    for _ in range(count):
        time.sleep(wait)
        cache.hits += 3
        cache.misses += 1
        cache.downloaded_bytes += 2_000_000
        yield object()


def test_a_job_ranks_loader_appends_its_figures_to_its_spool_file(tmp_path, monkeypatch):
    from sparkgpu.tracking.spool import SPOOL_ENV

    monkeypatch.setenv(SPOOL_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    cache = _Cache()
    metrics = LoaderMetrics(rank=3, interval=0.0)  # a point after every batch
    for _ in metrics.timed(_slow_batches(cache, 4, 0.01), cache):
        time.sleep(0.03)  # the step: three times the wait
    records = [json.loads(line) for f in (tmp_path / "records").iterdir() for line in f.read_text().splitlines()]
    points = [m for r in records for m in r["m"]]
    by_key = {}
    for key, value, step, _ in points:
        by_key.setdefault(key, []).append((step, value))
    assert sorted(by_key) == [
        f"data/{n}/rank_3" for n in ("cache_hit_ratio", "download_mbps", "step_s", "wait_fraction", "wait_s")
    ]
    assert [s for s, _ in by_key["data/wait_fraction/rank_3"]] == [1, 2, 3, 4]
    assert all(v == 0.75 for _, v in by_key["data/cache_hit_ratio/rank_3"])
    assert all(
        0.02 < v < 0.8 for _, v in by_key["data/wait_fraction/rank_3"]
    )  # about 0.25, with room for a loaded machine
    stats = metrics.snapshot(cache)
    assert stats["batches"] == 4 and stats["downloaded_mb"] == 8.0 and stats["cache_hit_ratio"] == 0.75
    assert stats["step_s"] >= 0.04 and stats["wait_s"] >= 0.01


def test_outside_a_job_reports_are_skipped_and_stats_still_count(monkeypatch):
    from sparkgpu.tracking.spool import SPOOL_ENV

    monkeypatch.delenv(SPOOL_ENV, raising=False)
    cache = _Cache()
    metrics = LoaderMetrics(rank=0, interval=0.0)
    assert sum(1 for _ in metrics.timed(_slow_batches(cache, 2, 0.0), [cache])) == 2
    assert metrics.snapshot([cache])["batches"] == 2


@pytest.mark.parametrize("value", ["30", "0.5"])
def test_the_interval_is_a_setting(monkeypatch, value):
    from sparkgpu.config import reset_settings

    monkeypatch.setenv("SPARKGPU_DATA_METRICS_INTERVAL", value)
    reset_settings()
    assert LoaderMetrics(rank=0).interval == float(value)
    monkeypatch.delenv("SPARKGPU_DATA_METRICS_INTERVAL")
    reset_settings()


def test_compressed_shards_count_the_bytes_fetched_from_the_volume_not_the_bytes_unpacked(tmp_path):
    import numpy as np
    from streaming import MDSWriter

    from sparkgpu import data

    with MDSWriter(
        out=str(tmp_path / "volume"), columns={"x": "int64"}, size_limit=1 << 12, compression="zstd"
    ) as writer:
        for i in range(2000):
            writer.write({"x": np.int64(i % 7)})  # compresses several times over
    fetched = sum(p.stat().st_size for p in (tmp_path / "volume").glob("*.mds.zstd"))
    ds = data.dataset(
        remote=str(tmp_path / "volume"), local=str(tmp_path / "cache"), batch_size=50, rank=0, world_size=1
    )
    assert sum(1 for _ in ds) == 40
    assert ds.stats()["downloaded_mb"] == fetched / 1e6  # download_mbps is a network rate
    ds.close()
