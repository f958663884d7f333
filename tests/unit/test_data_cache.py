"""The local shard cache: planned eviction, integrity, sharing between processes, housekeeping."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time

import numpy as np
import pytest

from sparkgpu import data
from sparkgpu.data.loaders import dataset as dataset_module, mds_loader
from sparkgpu.data.storage.cache import ShardCache, cache_entries, clear_cache, entry_dir_for, open_cache_entry
from sparkgpu.errors import ConfigurationError, DataError
from tests.unit.test_data_loader_support import CountingVolume, check_tabular_batch, collect_ids, write_tabular


@pytest.fixture
def volume_dir(tmp_path):
    """A "remote" volume: 400 samples in 8 shards of 50 (a local folder, read through fsspec)."""
    return write_tabular(tmp_path / "volume" / "ds", 400, size_limit=50 * 28 + 300, hashes=["sha1", "xxh64"])


def _open(volume_dir, cache_root, limit=None, corrupt=0, threads=1, lookahead=None):
    volume = CountingVolume(volume_dir, corrupt=corrupt)
    directory, index = open_cache_entry(cache_root, volume)
    return (
        ShardCache(directory, index, volume, limit, download_threads=threads, lookahead_shards=lookahead),
        volume,
        index,
    )


def _present(cache):
    return {i for i, p in enumerate(cache._paths) if p.exists()}


def test_eviction_follows_next_use_not_recency(volume_dir, tmp_path):
    cache, volume, index = _open(volume_dir, tmp_path / "cache")
    shard_bytes = max(s.raw_bytes for s in index.shards)
    cache.close()
    # Room for two shards; a one-shard lookahead leaves every fetch to the reader (no prefetch).
    cache, volume, index = _open(volume_dir, tmp_path / "cache", limit=2 * shard_bytes + shard_bytes // 2, lookahead=1)
    a, b, c = (np.array([i]) for i in range(3))
    # LRU would evict B at step 3 (A was used more recently); B is needed sooner than A.
    plan = [a, b, a, c, b, a]
    with cache:
        cache.set_plan(plan)
        for step, shards in enumerate(plan[:3]):
            cache.acquire(step, shards)
        assert cache.wait_idle(30)
        assert _present(cache) == {0, 1}
        cache.acquire(3, c)
        assert _present(cache) == {1, 2}, "A (next use: step 5) goes, B (next use: step 4) stays"
        cache.acquire(4, b)
        cache.acquire(5, a)
    assert volume.downloads == {"shard.00000.mds": 2, "shard.00001.mds": 1, "shard.00002.mds": 1}


def test_prefetch_fetches_upcoming_shards_before_they_are_read(volume_dir, tmp_path):
    cache, volume, index = _open(volume_dir, tmp_path / "cache", threads=2)
    plan = [np.array([i]) for i in range(8)]
    with cache:
        cache.set_plan(plan)
        cache.acquire(0, plan[0])
        assert cache.wait_idle(30)
        assert _present(cache) == {0, 1, 2, 3}, "two threads keep four shards ready ahead of the reader"
        cache.acquire(1, plan[1])
        cache.acquire(2, plan[2])
        assert cache.wait_idle(30)
        assert _present(cache) == set(range(6))
        assert sum(volume.downloads.values()) == 6


def test_prefetch_never_evicts_a_shard_needed_sooner(volume_dir, tmp_path):
    cache, volume, index = _open(volume_dir, tmp_path / "cache")
    shard_bytes = max(s.raw_bytes for s in index.shards)
    cache.close()
    cache, volume, index = _open(volume_dir, tmp_path / "cache", limit=3 * shard_bytes, lookahead=4)
    plan = [np.array([i]) for i in (0, 1, 2, 3, 0, 4)]
    with cache:
        cache.set_plan(plan)
        cache.acquire(0, plan[0])
        assert cache.wait_idle(30)
        assert _present(cache) == {0, 1, 2}
        cache.acquire(1, plan[1])
        cache.acquire(2, plan[2])
        assert cache.wait_idle(30)
        # Prefetching 3 (needed at step 3) may evict 1 (never needed again), never 0 (needed at step 4).
        assert 0 in _present(cache) and 1 not in _present(cache) and 3 in _present(cache)


def test_small_cache_limit_still_yields_every_sample(volume_dir, tmp_path):
    shard_bytes = max(s.raw_bytes for s in _open(volume_dir, tmp_path / "probe")[2].shards)
    ds = data.dataset(
        remote=volume_dir,
        local=tmp_path / "cache",
        batch_size=20,
        shuffle=True,
        seed=2,
        shuffle_block_size=60,
        cache_limit=4 * shard_bytes,
        download_threads=3,
    )
    for epoch in range(2):
        ids = np.concatenate(collect_ids(ds))
        assert sorted(ids.tolist()) == list(range(400)), f"epoch {epoch}"
        cached = sum(p.stat().st_size for p in (tmp_path / "cache").rglob("shard.*.mds"))
        assert cached <= 4 * shard_bytes
    ds.close()


def test_cache_limit_below_one_batch_is_refused_before_downloading(volume_dir, tmp_path):
    shard_bytes = max(s.raw_bytes for s in _open(volume_dir, tmp_path / "probe")[2].shards)
    with pytest.raises(ConfigurationError, match="cannot hold the largest shard"):
        _open(volume_dir, tmp_path / "c1", limit=shard_bytes // 2)
    ds = data.dataset(
        remote=volume_dir, local=tmp_path / "c2", batch_size=400, cache_limit=2 * shard_bytes, prefetch_batches=0
    )
    with pytest.raises(ConfigurationError, match="smaller than the .* bytes one batch reads at once"):
        next(iter(ds))
    assert not list((tmp_path / "c2").rglob("shard.*.mds"))


def test_a_shard_damaged_in_transit_is_fetched_again(volume_dir, tmp_path):
    cache, volume, _ = _open(volume_dir, tmp_path / "cache", corrupt=1)
    with cache:
        cache.set_plan([np.array([0])])
        path = cache.acquire(0, np.array([0]))[0]
    assert volume.downloads["shard.00000.mds"] == 2
    assert path.read_bytes() == (tmp_path / "volume" / "ds" / "shard.00000.mds").read_bytes()


def test_a_shard_damaged_on_the_volume_is_reported_with_its_name(volume_dir, tmp_path):
    remote_shard = os.path.join(volume_dir, "shard.00003.mds")
    raw = bytearray(open(remote_shard, "rb").read())
    raw[-5] ^= 0x55
    open(remote_shard, "wb").write(bytes(raw))
    ds = data.dataset(remote=volume_dir, local=tmp_path / "cache", batch_size=50)
    with pytest.raises(DataError, match=r"shard\.00003\.mds from volume .*ds failed its integrity check twice.*xxh64"):
        collect_ids(ds)
    assert not (entry_dir_for(tmp_path / "cache", volume_dir) / "shard.00003.mds").exists(), (
        "nothing half-checked is visible"
    )


def test_compressed_shards_are_verified_and_decompressed(tmp_path):
    remote = write_tabular(tmp_path / "zst", 300, size_limit=2000, compression="zstd", hashes=["xxh64"])
    assert any(name.endswith(".zstd") for name in os.listdir(remote))
    ds = data.dataset(remote=remote, local=tmp_path / "cache", batch_size=64, shuffle=True)
    assert sorted(np.concatenate(collect_ids(ds)).tolist()) == list(range(300))
    entry = entry_dir_for(tmp_path / "cache", remote)
    assert sorted(p.name for p in entry.glob("shard.*")) == sorted(
        n[: -len(".zstd")] for n in os.listdir(remote) if n.endswith(".zstd")
    )


def test_processes_sharing_a_cache_download_each_shard_once(volume_dir, tmp_path):
    # Two caches over one folder stand for two ranks of a node; each has its own threads and locks.
    caches = [_open(volume_dir, tmp_path / "shared", threads=4) for _ in range(2)]
    plan = [np.array([i, (i + 1) % 8]) for i in range(8)]
    errors = []

    def read(cache):
        try:
            cache.set_plan(plan)
            for step, shards in enumerate(plan):
                cache.acquire(step, shards)
        except Exception as exc:  # reported below, with the assertion
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(cache,)) for cache, _, _ in caches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for cache, _, _ in caches:
        cache.close()
    assert not errors
    downloads = {}
    for _, volume, _ in caches:
        for name, count in volume.downloads.items():
            downloads[name] = downloads.get(name, 0) + count
    assert downloads == {f"shard.{i:05d}.mds": 1 for i in range(8)}
    assert not os.listdir(entry_dir_for(tmp_path / "shared", volume_dir) / ".sparkgpu" / "partial")


def test_a_shard_evicted_by_another_process_is_fetched_again(volume_dir, tmp_path):
    cache, volume, _ = _open(volume_dir, tmp_path / "cache")
    with cache:
        cache.set_plan([np.array([0]), np.array([0])])
        path = cache.acquire(0, np.array([0]))[0]
        path.unlink()  # what another rank's eviction looks like from here
        assert cache.refetch(0).exists()
    assert volume.downloads["shard.00000.mds"] == 2


def test_leftovers_of_a_crashed_download_are_removed(volume_dir, tmp_path):
    import socket

    shard_bytes = max(s.raw_bytes for s in _open(volume_dir, tmp_path / "probe")[2].shards)
    cache, _, _ = _open(volume_dir, tmp_path / "cache", limit=10 * shard_bytes)
    # A reservation left by a process of this host that no longer exists (pid far above pid_max).
    leftover = cache._partial / f"0.{socket.gethostname().replace('.', '_')}.999999999.dead.reserved"
    leftover.touch()
    with cache:
        cache.set_plan([np.array([0])])
        cache.acquire(0, np.array([0]))
    assert not leftover.exists()


def test_a_rewritten_dataset_replaces_the_cached_one(tmp_path):
    remote = write_tabular(tmp_path / "v" / "ds", 100, size_limit=1000)
    assert len(collect_ids(data.dataset(remote=remote, local=tmp_path / "cache", batch_size=100))[0]) == 100
    shutil.rmtree(remote)
    write_tabular(remote, 60, size_limit=1000)
    ids = np.concatenate(collect_ids(data.dataset(remote=remote, local=tmp_path / "cache", batch_size=100)))
    assert sorted(ids.tolist()) == list(range(60))


def test_cache_entries_and_clear_cache(volume_dir, tmp_path, monkeypatch):
    from sparkgpu.config import reset_settings

    monkeypatch.setenv("SPARKGPU_CACHE_DIR", str(tmp_path / "default-cache"))
    reset_settings()
    ds = data.dataset(remote=volume_dir, batch_size=50)  # local= defaults to SPARKGPU_CACHE_DIR
    collect_ids(ds)
    ds.close()
    [entry] = cache_entries()
    assert entry.remote == volume_dir.rstrip("/") and entry.shards_cached == entry.shards_total == 8
    assert (
        entry.bytes_cached
        == entry.bytes_total
        == sum(os.path.getsize(os.path.join(volume_dir, f"shard.{i:05d}.mds")) for i in range(8))
    )
    assert clear_cache(remote=volume_dir) == entry.bytes_total + os.path.getsize(os.path.join(volume_dir, "index.json"))
    assert cache_entries() == []


def test_missing_volume_and_missing_shard_name_the_fix(tmp_path, volume_dir):
    with pytest.raises(DataError, match="index.json is missing from volume"):
        data.dataset(remote=str(tmp_path / "nowhere"), local=tmp_path / "cache", batch_size=8)
    os.remove(os.path.join(volume_dir, "shard.00002.mds"))
    with pytest.raises(DataError, match="shard.00002.mds is missing from volume"):
        collect_ids(data.dataset(remote=volume_dir, local=tmp_path / "cache", batch_size=50))
    with pytest.raises(DataError, match="shard.00002.mds is missing from .*incomplete"):
        collect_ids(data.dataset(local=volume_dir, batch_size=50))


def test_unknown_volume_scheme_asks_for_the_right_package(tmp_path):
    from sparkgpu.errors import MissingDependencyError

    try:
        import s3fs  # noqa: F401
    except ImportError:
        with pytest.raises(MissingDependencyError, match="pip install s3fs"):
            data.dataset(remote="s3://bucket/ds", local=tmp_path, batch_size=8)
    with pytest.raises(ConfigurationError, match="the volume nosuchscheme://x/y: fsspec knows no filesystem"):
        data.dataset(remote="nosuchscheme://x/y", local=tmp_path, batch_size=8)


def test_loader_modules_document_their_public_names():
    assert set(dataset_module.__all__) == {"dataset"}
    assert set(mds_loader.__all__) == {"open_mds", "MDSLoader"}


def test_large_files_download_as_parallel_byte_ranges(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from sparkgpu.data.storage.volume import Volume

    (tmp_path / "vol").mkdir()
    payload = np.random.default_rng(0).integers(0, 255, size=100_003, dtype=np.uint8).tobytes()
    (tmp_path / "vol" / "blob.bin").write_bytes(payload)
    volume = Volume(str(tmp_path / "vol"))
    with ThreadPoolExecutor(4) as pool:
        volume.download("blob.bin", str(tmp_path / "copy.bin"), size=len(payload), pool=pool, part_bytes=7_000)
    assert volume.ranges_supported is True
    assert (tmp_path / "copy.bin").read_bytes() == payload


def _disk_use(entry, index) -> int:
    """Bytes the cache's shards really take: files present, plus evicted files this process still maps."""
    sizes = {s.basename.rsplit("/", 1)[-1]: s.raw_bytes for s in index.shards}
    present = {}
    for path in entry.rglob("shard.*"):
        with contextlib.suppress(FileNotFoundError):  # evicted while we look
            present[path.stat().st_ino] = sizes[path.name]
    mapped = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(str(entry)) and fields[5].rstrip().endswith("(deleted)"):
                name = fields[5].rstrip()[: -len("(deleted)")].strip().rsplit("/", 1)[-1]
                mapped[int(fields[4])] = sizes[name]
    return sum(present.values()) + sum(size for inode, size in mapped.items() if inode not in present)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc to see mapped files")
def test_evicted_shards_give_their_disk_space_back(volume_dir, tmp_path):
    # Two ranks sharing one cache folder (each with its own cache, as two processes would);
    # each evicts shards the other has read. What is on disk, mapped files included, stays
    # within the limit plus the shards the current batches read.
    probe, _, index = _open(volume_dir, tmp_path / "probe")
    probe.close()
    shard_bytes = max(s.raw_bytes for s in index.shards)
    limit = 3 * shard_bytes
    loaders = [
        data.dataset(
            remote=volume_dir,
            local=tmp_path / "cache",
            batch_size=10,
            cache_limit=limit,
            download_threads=2,
            rank=rank,
            world_size=2,
        )
        for rank in range(2)
    ]
    entry = entry_dir_for(tmp_path / "cache", volume_dir)
    for epoch in range(2):
        seen = []
        for batches in zip(*loaders):
            ids = np.concatenate([check_tabular_batch(batch) for batch in batches])
            seen.append(ids)
            in_use = sum(index.shards[s].raw_bytes for s in np.unique(ids // 50).tolist())  # 50 samples a shard
            used = _disk_use(entry, index)
            assert used <= limit + in_use, f"epoch {epoch}: {used} bytes on disk, over cache_limit + shards in use"
        assert sorted(np.concatenate(seen).tolist()) == list(range(400))
    for loader in loaders:
        loader.close()
    assert _disk_use(entry, index) <= limit


def test_the_prefetcher_stops_quietly_when_its_download_threads_are_shut_down(volume_dir, tmp_path, monkeypatch):
    # At interpreter exit concurrent.futures shuts every executor down, also under an iterator
    # a script still holds (`batches = iter(ds)`): the prefetcher's next submit must end it,
    # not print a traceback.
    errors = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    cache, _, _ = _open(volume_dir, tmp_path / "cache", threads=1)
    cache._pool.shutdown(wait=True)  # what the interpreter's exit does to it
    cache.set_plan([np.array([i]) for i in range(8)])  # shards to prefetch
    cache._planner.join(10)
    assert not cache._planner.is_alive() and errors == []
    cache.close()


class _HeldVolume(CountingVolume):
    """A volume whose download of ``held`` waits until the test lets it go (or fail)."""

    def __init__(self, url, held: str):
        super().__init__(url)
        self.held, self.started, self.go = held, threading.Event(), threading.Event()
        self.fail = False

    def download(self, relative, local_path, *args, **kwargs):
        if relative == self.held:
            self.started.set()
            assert self.go.wait(60), "the test never let the held download go"
            if self.fail:
                raise DataError(f"{relative}: the other process's download failed")
        return super().download(relative, local_path, *args, **kwargs)


def _wait_for(condition, seconds=30.0) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class _OtherProcess:
    """Another rank or DataLoader worker of the node, downloading shard 0 into the same cache
    (holding the shard's lock) until the test lets it go: its own ShardCache, on a thread."""

    def __init__(self, volume_dir, root):
        self.volume = _HeldVolume(volume_dir, held="shard.00000.mds")
        entry, index = open_cache_entry(root, self.volume)
        self.cache = ShardCache(entry, index, self.volume, download_threads=1)
        self.errors: list[DataError] = []
        self.thread = threading.Thread(target=self._read)

    def _read(self):
        try:
            self.cache.acquire(0, np.array([0]))
        except DataError as exc:
            self.errors.append(exc)

    def __enter__(self):
        self.thread.start()
        assert self.volume.started.wait(30)
        return self

    def let_go(self, fail: bool = False) -> None:
        """Ends its download of shard 0 (landed, or failed) and waits for it."""
        self.volume.fail = fail
        self.volume.go.set()
        self.thread.join(30)

    def __exit__(self, *exc):
        self.volume.go.set()
        self.thread.join(30)
        self.cache.close()


@pytest.mark.parametrize("other_fails", [False, True], ids=["other-lands-it", "other-fails"])
def test_prefetch_passes_over_a_shard_another_process_is_downloading(volume_dir, tmp_path, other_fails):
    # Another rank or DataLoader worker on the node is downloading shard 0 (it holds the shard's
    # lock). With one download thread, this cache's prefetch must fetch the next shards
    # meanwhile instead of waiting on that lock; only the reader, needing shard 0 now, waits.
    root = tmp_path / "cache"
    with _OtherProcess(volume_dir, root) as other:
        cache, volume, _ = _open(volume_dir, root, threads=1, lookahead=4)
        plan = [np.array([i]) for i in range(8)]
        with cache:
            cache.set_plan(plan)
            if not other_fails:  # the reader needs shard 0 now: it waits for the other's download
                first = threading.Thread(target=cache.acquire, args=(0, plan[0]))
                first.start()
            # Shards 1-3 land while shard 0's download (the other's) has not moved: nothing but
            # the reader waited for it. Without the skip, the one download thread sits on shard
            # 0's lock; with the reader's wait taking that thread, nothing is prefetched either.
            assert _wait_for(lambda: {1, 2, 3} <= _present(cache)), (
                f"prefetch fetched {sorted(_present(cache))} while another process held shard 0"
            )
            assert 0 not in _present(cache) and "shard.00000.mds" not in volume.downloads
            other.let_go(fail=other_fails)
            if not other_fails:
                first.join(30)
                assert not first.is_alive()
            # Fetched once in all: by the other process, or (its download failed) by this cache's
            # prefetcher coming back to the shard it passed over, before the reader asks.
            assert cache.wait_idle(30)
            assert 0 in _present(cache)
            for step, shards in enumerate(plan):
                cache.acquire(step, shards)
    assert bool(other.errors) == other_fails
    downloads = dict(volume.downloads)
    for name, count in other.volume.downloads.items():
        downloads[name] = downloads.get(name, 0) + count
    assert downloads == {f"shard.{i:05d}.mds": 1 for i in range(8)}
    assert ("shard.00000.mds" in volume.downloads) == other_fails


def test_a_shard_the_reader_waits_for_another_process_to_fetch_is_not_counted_in_the_lookahead(volume_dir, tmp_path):
    # The reader asks for shard 0 before the prefetcher ever tries it, and waits on the lock of
    # the other process fetching it. Like a shard the prefetcher found held, it does not count:
    # a lookahead of 2 fetches shards 1 and 2 meanwhile, and not 3.
    root = tmp_path / "cache"
    with _OtherProcess(volume_dir, root) as other:
        cache, volume, _ = _open(volume_dir, root, threads=1, lookahead=2)
        plan = [np.array([i]) for i in range(8)]
        with cache:
            reader = threading.Thread(target=cache.acquire, args=(0, plan[0]))
            reader.start()
            assert _wait_for(lambda: 0 in cache._inflight)  # the reader's own fetch, waiting on the lock
            cache.set_plan(plan)
            assert _wait_for(lambda: {1, 2} <= _present(cache)), (
                f"prefetch fetched {sorted(_present(cache))} while the reader waited for shard 0"
            )
            # Not idle (the reader's fetch is still waiting): the prefetcher has nothing running
            # and, given time for another pass, still holds the lookahead to shards 1 and 2.
            assert _wait_for(lambda: cache._prefetching == 0)
            time.sleep(0.5)
            assert _present(cache) == {1, 2} and cache._prefetching == 0
            other.let_go()
            reader.join(30)
            assert not reader.is_alive() and 0 in _present(cache)
    assert "shard.00000.mds" not in volume.downloads


def test_a_shard_our_prefetch_put_in_place_is_read_once_its_download_is_counted(volume_dir, tmp_path, monkeypatch):
    """A prefetch renames a shard into place, then counts it: a reader finding the file in that
    moment waits for the count (the file is this cache's own download, not another process's),
    so the loader's ``downloaded_mb`` after its last batch holds every shard."""
    import threading
    import time

    from sparkgpu.data.storage import _fetch

    fetch_shard = _fetch.fetch_shard

    def lands_then_counts_late(*args, **kwargs):
        fetch_shard(*args, **kwargs)
        if threading.current_thread().name.startswith("sparkgpu-download"):  # a prefetch
            time.sleep(0.5)

    monkeypatch.setattr(_fetch, "fetch_shard", lands_then_counts_late)
    cache, volume, index = _open(volume_dir, tmp_path / "cache", threads=2)
    plan = [np.array([i]) for i in range(8)]
    with cache:
        cache.set_plan(plan)
        cache.acquire(0, plan[0])  # on this thread: counted at once
        assert _wait_for(lambda: cache._paths[1].exists()), "the prefetch never put shard 1 in place"
        cache.acquire(1, plan[1])
        assert cache.downloaded_bytes >= index.shards[0].raw_bytes + index.shards[1].raw_bytes
