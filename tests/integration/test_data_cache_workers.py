"""DataLoader workers sharing one rank's cache of an S3 volume behind an S3-like link.

The volume is a bucket of a real S3-protocol server (moto) on loopback, reached through the
simulated link (30 ms before each request, 100 MB/s per connection) that counts the bytes it
answers. The workers of one rank read the same shards (their batches interleave): each shard
must cross the link once, and no worker's prefetch may wait for a shard another process is
downloading; only a worker that needs the shard now waits for it.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pyarrow as pa
import pytest

from sparkgpu import data
from sparkgpu.data.storage.cache import ShardCache, entry_dir_for, open_cache_entry
from sparkgpu.data.storage.volume import Volume
from sparkgpu.testing.simulated_link import PROFILES, link_counts, start_counted_proxy

pytestmark = pytest.mark.integration

SAMPLES, SAMPLE_BYTES = 256, 32 << 10
SHARD_BYTES = 32 * SAMPLE_BYTES + (64 << 10)  # 8 shards of 32 samples, 1 MB each


def _payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, SAMPLE_BYTES, dtype=np.uint8).tobytes()


@pytest.fixture
def linked_volume(s3_bucket, s3_server, tmp_path, monkeypatch):
    """``(url, control port, shard bytes)``: the dataset on S3, every client reaching it through the counted link."""
    import fsspec

    table = pa.table({"x": pa.array([_payload(i) for i in range(SAMPLES)], pa.binary()), "id": np.arange(SAMPLES)})
    folder = tmp_path / "written"
    data.to_mds(table, str(folder), size_limit=SHARD_BYTES, progress=False)
    url = f"{s3_bucket}/ds"
    fs = fsspec.filesystem("s3")
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    for path in files:
        fs.pipe(f"{url.removeprefix('s3://')}/{path.relative_to(folder).as_posix()}", path.read_bytes())
    shard_bytes = [p.stat().st_size for p in files if p.name.startswith("shard.")]
    assert len(shard_bytes) == 8
    proxy, endpoint, control = start_counted_proxy(s3_server.endpoint, **PROFILES["s3-like"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # DataLoader workers inherit it
    fs.clear_instance_cache()
    try:
        yield url, control, shard_bytes
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
        fs.clear_instance_cache()


class _HeldVolume(Volume):
    """The volume as another process on the node reads it: its download of file ``held`` waits for the test."""

    def __init__(self, url: str):
        super().__init__(url)
        self.held, self.started, self.go = "", threading.Event(), threading.Event()

    def download(self, relative, local_path, *args, **kwargs):
        if relative == self.held:
            self.started.set()
            assert self.go.wait(120), "the test never let the held download go"
        return super().download(relative, local_path, *args, **kwargs)


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_workers_prefetch_past_a_shard_in_flight_elsewhere_and_fetch_each_shard_once(linked_volume, tmp_path):
    url, control, shard_bytes = linked_volume
    root = tmp_path / "cache"
    # Another rank of the node is downloading shard 0 into the same cache (it holds the shard's lock).
    other_volume = _HeldVolume(url)
    entry, index = open_cache_entry(root, other_volume)
    other_volume.held = index.shards[0].basename
    other = ShardCache(entry, index, other_volume, download_threads=1)
    holder = threading.Thread(target=other.acquire, args=(0, np.array([0])))
    holder.start()
    loader = None
    try:
        assert other_volume.started.wait(60)
        before = link_counts(control)
        # One download thread per worker: a prefetch waiting on shard 0's lock would stop the worker's downloads.
        loader = data.dataset(remote=url, local=root, batch_size=8, num_workers=2, download_threads=1)
        read: list = []
        # The epoch's first batch waits for shard 0, so the epoch is read on a thread of its own.
        reader = threading.Thread(target=lambda: read.extend(batch["id"].numpy() for batch in loader), daemon=True)
        reader.start()
        shards = [entry_dir_for(root, url) / s.basename for s in index.shards]
        # Both workers' first batches read shard 0; their prefetchers go on to shards 1 and 2 (the
        # lookahead of one download thread) while the other rank still holds shard 0.
        assert _wait_for(lambda: shards[1].exists() and shards[2].exists(), 90), (
            f"while another process held shard 0 the workers fetched {[p.name for p in shards if p.exists()]}"
        )
        assert not shards[0].exists()
        other_volume.go.set()
        reader.join(120)
        assert not reader.is_alive()
        ids = np.concatenate(read)
        holder.join(60)
        after = link_counts(control)
    finally:
        other_volume.go.set()
        holder.join(60)
        other.close()
        if loader is not None:
            loader.close()
    assert sorted(ids.tolist()) == list(range(SAMPLES)), "every sample once"
    # Every shard crossed the link once (a second download of any would add at least the smallest shard).
    down = after["bytes_down"] - before["bytes_down"]
    assert sum(shard_bytes) <= down < sum(shard_bytes) + min(shard_bytes), (down, shard_bytes)


def test_workers_under_a_cache_limit_read_every_sample_once_per_epoch(linked_volume, tmp_path):
    url, control, shard_bytes = linked_volume
    root = tmp_path / "cache"
    limit = 4 * max(shard_bytes)
    loader = data.dataset(
        remote=url,
        local=root,
        batch_size=8,
        shuffle=True,
        seed=5,
        shuffle_block_size=64,
        num_workers=2,
        download_threads=2,
        cache_limit=limit,
    )
    try:
        for epoch in range(2):
            ids = np.concatenate([batch["id"].numpy() for batch in loader])
            assert sorted(ids.tolist()) == list(range(SAMPLES)), f"epoch {epoch}"
            cached = sum(p.stat().st_size for p in entry_dir_for(root, url).glob("shard.*"))
            assert cached <= limit, f"epoch {epoch}: {cached} bytes cached over cache_limit={limit}"
    finally:
        loader.close()
