"""The local NVMe cache: shards copied from a volume, bounded in size, fetched ahead of need.

Layout. One folder per volume URL under the cache root (``<root>/<name>-<hash of URL>/``),
holding ``index.json`` and the uncompressed shards under their index names, plus
``.sparkgpu/`` with the lock files, ``entry.json`` (which URL, which index) and ``partial/``
(downloads in progress). Shards appear under their final name only complete and verified.

Planning. The loader knows, for every batch of the epoch, which shards it reads. The cache
gets that plan and downloads shards ahead of consumption on a thread pool, in the order
they will first be needed. When the size limit is reached it evicts the cached shard whose
next use is furthest away or never (Belady's rule, exact here because the future is known);
it never evicts a shard needed sooner than the one it would fetch, and stops prefetching
instead.

Sharing. Every rank and loader worker on a node may use the same cache folder: a per-shard
file lock makes one process download a shard, and a cache-wide lock serialises the space
accounting (which counts in-flight downloads at their final size). Only a reader that needs a
shard now waits for another process's download of it; the prefetcher passes over a shard whose
lock another process holds and fetches the next ones, coming back to it later. DataLoader
workers of one rank read the same shards (their batches interleave), so their prefetchers
split the shards between them this way instead of queueing behind each other.
A process that finds a shard evicted under it fetches it again; shards already memory-mapped
stay readable after eviction (POSIX keeps an unlinked file's pages until the last mapping goes).
That space is outside ``limit_bytes``, so loaders map only the shards of the batch they read
(:class:`sparkgpu.data.loaders._pipeline.Producer`): disk use stays within the limit plus the shards
in use on the node.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import enum
import hashlib
import json
import os
import re
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.data.storage import _fetch
from sparkgpu.data.mds.reader import INDEX_NAME, DatasetIndex
from sparkgpu.data.storage.volume import RangePool, Volume
from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["ShardCache", "CacheEntry", "open_cache_entry", "cache_entries", "clear_cache", "entry_dir_for"]

_META = ".sparkgpu"
_LOCK_POLL = 0.005
# A prefetch that found a shard's lock held by another process tries it again after this long
# (the other's download may fail or give up for space), unless the shard appeared meanwhile.
_BUSY_RETRY_S = 0.2


class _Outcome(enum.Enum):
    """How one download attempt of a shard ended."""

    PRESENT = "present"  # the shard is on disk (fetched now, or by another process)
    NO_ROOM = "no room"  # no space without evicting shards needed sooner: the prefetch stops
    BUSY = "busy"  # a prefetch found another process downloading it: skipped, not waited for


def entry_dir_for(cache_root: str | os.PathLike, remote: str) -> Path:
    """The folder that caches volume ``remote`` under ``cache_root``."""
    remote = str(remote).rstrip("/")
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", remote.split("://")[-1])[-48:].strip("_") or "volume"
    return Path(cache_root) / f"{slug}-{hashlib.sha1(remote.encode()).hexdigest()[:12]}"


@contextlib.contextmanager
def _file_lock(path: Path):
    """Holds the lock at ``path``, waiting for it as long as another process holds it."""
    with _try_file_lock(path, wait=True):
        yield


@contextlib.contextmanager
def _try_file_lock(path: Path, wait: bool):
    """Holds the lock at ``path``; yields True, or False at once without ``wait`` when another holds it."""
    from filelock import FileLock, Timeout

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path), poll_interval=_LOCK_POLL)
    try:
        lock.acquire(timeout=-1 if wait else 0)
    except Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def open_cache_entry(
    cache_root: str | os.PathLike, volume: Volume, allow_unsafe_types: bool = False
) -> tuple[Path, DatasetIndex]:
    """Reads the volume's index and makes the cache entry match it.

    When the volume's ``index.json`` differs from the cached copy (the dataset was written
    again), the entry's shards are dropped before the new index is placed.

    Returns:
        The entry folder and the parsed index.

    Raises:
        DataError: The volume has no readable MDS index.
    """
    raw = volume.read_bytes(INDEX_NAME)
    index = DatasetIndex.parse(raw, f"{volume.url}/{INDEX_NAME}", allow_unsafe_types)
    entry = entry_dir_for(cache_root, volume.url)
    meta = entry / _META
    meta.mkdir(parents=True, exist_ok=True)
    with _file_lock(meta / "cache.lock"):
        cached = entry / INDEX_NAME
        if not cached.exists() or cached.read_bytes() != raw:
            if cached.exists():
                _remove_shards(entry)
            atomic_write_bytes(cached, raw, fsync=False)  # a cache: lost files are fetched again
        info = {
            "remote": volume.url,
            "fingerprint": index.fingerprint,
            "shards": len(index.shards),
            "bytes": sum(s.raw_bytes for s in index.shards),
        }
        atomic_write_bytes(meta / "entry.json", json.dumps(info).encode(), fsync=False)
    return entry, index


def _remove_shards(entry: Path) -> int:
    freed = 0
    for child in entry.iterdir():
        if child.name == _META:
            continue
        if child.is_dir():
            freed += sum(f.stat().st_size for f in child.rglob("*") if f.is_file())
            shutil.rmtree(child, ignore_errors=True)
        else:
            freed += child.stat().st_size
            child.unlink(missing_ok=True)
    return freed


class ShardCache:
    """The shards of one dataset on local disk, fetched ahead of a known plan.

    Args:
        directory: The dataset's folder: a cache entry (``volume`` given) or the dataset
            itself (``volume=None``: nothing is downloaded or evicted).
        index: The dataset's index.
        volume: Where missing shards come from, or ``None``.
        limit_bytes: Most bytes of shards kept, or ``None`` for no limit.
        download_threads: Parallel downloads.
        lookahead_shards: Most shards fetched ahead of the one being read, by this cache
            (shards it finds another process fetching are left to it and not counted).

    Raises:
        ConfigurationError: ``limit_bytes`` cannot hold the largest shard.
    """

    def __init__(
        self,
        directory,
        index: DatasetIndex,
        volume: Volume | None = None,
        limit_bytes: int | None = None,
        download_threads: int = 8,
        lookahead_shards: int | None = None,
    ):
        self.directory = Path(directory)
        self.index = index
        self.volume = volume
        self.limit_bytes = limit_bytes if volume is not None else None
        self._sizes = np.array([s.raw_bytes + (s.zip_bytes or 0) for s in index.shards], dtype=np.int64)
        self._raw_sizes = np.array([s.raw_bytes for s in index.shards], dtype=np.int64)
        if self.limit_bytes is not None and self.limit_bytes < self._sizes.max():
            raise ConfigurationError(
                f"cache_limit={self.limit_bytes} bytes cannot hold the largest shard ({int(self._sizes.max())} bytes "
                "while it downloads); raise cache_limit or write the dataset with smaller shards"
            )
        self._paths = [self.directory / s.basename for s in index.shards]
        self._meta = self.directory / _META
        self._partial = self._meta / "partial"
        self._lock = threading.RLock()  # guards the fields below
        self._wake = threading.Condition(self._lock)
        self._space = threading.Lock()  # one thread of this process in the space accounting at a time
        self._local = {i for i, p in enumerate(self._paths) if p.exists()}
        self._inflight: dict[int, Future] = {}  # downloads running: prefetches, and demand fetches
        self._prefetching = 0  # prefetches among them, at most download_threads
        # Shards a prefetch found another process downloading (their lock held), with when: the
        # prefetcher passes over them until they land or _BUSY_RETRY_S has gone by.
        self._elsewhere: dict[int, float] = {}
        # Shards this process's readers wait for while another process fetches them: like the
        # current shard, they are not counted in the lookahead, so prefetching goes on past them.
        self._awaited_elsewhere: set[int] = set()
        self._failed: dict[int, BaseException] = {}  # shards whose download failed: not retried in the background
        self._uses: list[np.ndarray] = []
        self._first_uses: list[tuple[int, int]] = []
        self._first_use_steps: list[int] = []
        self._position = 0
        self._last_shards = b""
        self._stalled_at = -1  # position at which a prefetch found no room; retried once it moves
        self._idle = False
        self._download_threads = download_threads
        self._lookahead = lookahead_shards or max(2, 2 * download_threads)
        self._closed = False
        self.downloaded_bytes = 0
        self.hits = self.misses = 0  # shards a step found on disk / had to wait for
        self._pool = self._parts = None
        self._planner = None
        if volume is not None:
            self._partial.mkdir(parents=True, exist_ok=True)
            self._pool = ThreadPoolExecutor(download_threads, thread_name_prefix="sparkgpu-download")
            # Byte ranges of the shards being downloaded, most urgent first (by the step that
            # first needs the shard): the shard needed first completes first (see Volume.download).
            self._parts = RangePool(download_threads)
            self._planner = threading.Thread(target=self._plan_loop, name="sparkgpu-prefetch", daemon=True)
            self._planner.start()

    # The plan: which shards each step (batch) reads.

    def set_plan(self, steps: list[np.ndarray]) -> None:
        """Sets the shards each coming step reads, and starts fetching for step 0.

        Args:
            steps: For each step in order, the positions of the shards it reads.

        Raises:
            ConfigurationError: One step alone needs more than ``limit_bytes``.
        """
        if self.volume is None:
            return  # the shards are all local: nothing to fetch or evict
        if self.limit_bytes is not None:
            worst = max(steps, key=lambda s: int(self._raw_sizes[s].sum()), default=None)
            needed = int(self._raw_sizes[worst].sum()) if worst is not None else 0
            # With no steps nothing is needed, and the limit is never negative (it holds the largest shard).
            if worst is not None and needed > self.limit_bytes:
                names = ", ".join(self.index.shards[i].basename for i in worst[:5])
                raise ConfigurationError(
                    f"cache_limit={self.limit_bytes} bytes is smaller than the {needed} bytes one batch reads at once "
                    f"(shards {names}...); raise cache_limit, or lower batch_size or shuffle_block_size"
                )
        uses: list[list[int]] = [[] for _ in self.index.shards]
        first_uses, previous = [], set()
        for step, shards in enumerate(steps):
            current = set(shards.tolist())
            for shard in current:
                uses[shard].append(step)
                if shard not in previous:
                    first_uses.append((step, shard))
            previous = current
        with self._lock:
            self._uses = [np.array(u, dtype=np.int64) for u in uses]
            self._first_uses = first_uses
            self._first_use_steps = [step for step, _ in first_uses]
            self._position = 0
            self._stalled_at = -1
            self._idle = False
            self._wake.notify_all()

    def next_use(self, shard: int, position: int | None = None) -> float:
        """First step at or after ``position`` that reads ``shard`` (``inf`` when none)."""
        position = self._position if position is None else position
        uses = self._uses[shard] if self._uses else np.empty(0, np.int64)
        at = np.searchsorted(uses, position)
        return float(uses[at]) if at < len(uses) else float("inf")

    # What the loader calls.

    def acquire(self, step: int, shards: np.ndarray) -> list[Path]:
        """Returns local paths of ``shards`` (those step ``step`` reads), fetching what is missing.

        Raises:
            DataError: A shard is missing (without a volume) or cannot be fetched.
        """
        key = shards.tobytes()
        with self._lock:
            self._position = step
            # The prefetcher's window changes only when the set of shards being read does.
            if key != self._last_shards:
                self._last_shards = key
                self._idle = False
                self._wake.notify_all()
        paths = []
        for shard in shards.tolist():
            path = self._paths[shard]
            if shard not in self._local and path.exists():
                with self._lock:
                    # Fetched by another process (a worker, a rank). A download of this cache's
                    # own that renamed the file but is not counted yet is waited for below.
                    if shard not in self._inflight:
                        self._local.add(shard)
                        self._elsewhere.pop(shard, None)
            if shard not in self._local:
                self.misses += 1
                self._ensure(shard, step)
            else:
                self.hits += 1
            paths.append(path)
        return paths

    def refetch(self, shard: int) -> Path:
        """Fetches ``shard`` again after it vanished (evicted by another process)."""
        with self._lock:
            self._local.discard(shard)
        self._ensure(shard, self._position)
        return self._paths[shard]

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Waits until the prefetcher has fetched all it may for now; returns False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not (self._idle or self.volume is None):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._wake.wait(remaining)
        return True

    def close(self) -> None:
        """Stops prefetching and waits for running downloads."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._parts is not None:  # made with the pool, above
            self._parts.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # Fetching.

    def _ensure(self, shard: int, needed_at: int) -> None:
        if self.volume is None:
            if not self._paths[shard].exists():
                raise DataError(
                    f"shard {self.index.shards[shard].basename} is missing from {self.directory}; "
                    "the dataset folder is incomplete: write it again, or pass remote= to fetch it"
                )
            with self._lock:
                self._local.add(shard)
            return
        deadline = time.monotonic() + 600
        while True:
            with self._lock:
                if shard in self._failed:
                    raise self._failed[shard]  # already reported by the fetch (after its retries)
                running = self._inflight.get(shard)
                demand = running is None
                future = Future() if running is None else running
                self._inflight[shard] = future
            if demand:
                # Fetched (or waited for, when another process is fetching it) on this thread,
                # which needs the shard now: never queued behind prefetches for a download slot.
                try:
                    outcome = self._download(shard, needed_at, True)
                except BaseException as exc:
                    future.set_exception(exc)
                    raise
                future.set_result(outcome)
            else:
                outcome = future.result()
            if outcome is _Outcome.PRESENT and (demand or self._paths[shard].exists()):
                return
            if demand:  # no room even for a demand fetch: shards other processes need now fill the cache
                if time.monotonic() > deadline:
                    raise DataError(
                        f"shard {self.index.shards[shard].basename} could not get cache space for 10 minutes; "
                        f"other processes fill cache_limit={self.limit_bytes}: raise it"
                    )
                time.sleep(0.05)
            # Otherwise a prefetch skipped the shard, found no room for it, or found it present before it
            # vanished (evicted by another process): again, as a demand fetch.

    def _download(self, shard: int, needed_at: int, demand: bool) -> _Outcome:
        outcome = None
        try:
            outcome = self._download_locked(shard, needed_at, demand)
            return outcome
        except BaseException as exc:
            with self._lock:
                self._failed[shard] = exc
            raise
        finally:
            with self._lock:
                self._inflight.pop(shard, None)
                if not demand:
                    self._prefetching -= 1
                if outcome is _Outcome.BUSY:
                    self._elsewhere[shard] = time.monotonic()
                else:
                    self._elsewhere.pop(shard, None)
                    if outcome is not _Outcome.PRESENT and not demand:
                        self._stalled_at = self._position
                self._wake.notify_all()

    def _download_locked(self, shard: int, needed_at: int, demand: bool) -> _Outcome:
        # A prefetch finding the shard's lock held by another process (which is fetching the
        # shard) leaves the shard to it and moves on. A demand fetch waits for the lock, and
        # meanwhile lets the prefetcher fetch past the shard.
        lock = self._meta / "locks" / f"{shard}.lock"
        with _try_file_lock(lock, wait=False) as held:
            if held:
                return self._download_holding_lock(shard, needed_at, demand)
        if not demand:
            return _Outcome.BUSY
        with self._lock:
            self._awaited_elsewhere.add(shard)
            self._wake.notify_all()
        try:
            with _try_file_lock(lock, wait=True):
                return self._download_holding_lock(shard, needed_at, demand)
        finally:
            with self._lock:
                self._awaited_elsewhere.discard(shard)

    def _download_holding_lock(self, shard: int, needed_at: int, demand: bool) -> _Outcome:
        info, final = self.index.shards[shard], self._paths[shard]
        if final.exists():  # another process fetched it before we took the lock
            with self._lock:
                self._local.add(shard)
            return _Outcome.PRESENT
        stem = self._partial / f"{shard}.{_fetch.partial_token()}"
        if not self._reserve(shard, needed_at, demand, stem):
            return _Outcome.NO_ROOM
        try:
            assert self.volume is not None  # only caches of a volume download
            _fetch.fetch_shard(self.volume, info, final, stem, self._parts, priority=needed_at)
        finally:
            Path(f"{stem}.reserved").unlink(missing_ok=True)
        with self._lock:
            self._local.add(shard)
            # What crossed the network: the compressed file, when there is one.
            self.downloaded_bytes += info.zip_bytes if info.zip_basename and info.zip_bytes else info.raw_bytes
        return _Outcome.PRESENT

    def _reserve(self, shard: int, needed_at: int, demand: bool, stem: Path) -> bool:
        """Makes room for ``shard`` (evicting by next use) and marks the space as taken."""
        need = int(self._sizes[shard])
        with self._space, _file_lock(self._meta / "cache.lock"):
            if self.limit_bytes is not None:
                usage = self._usage()
                if usage + need > self.limit_bytes and not self._evict(
                    usage + need - self.limit_bytes, shard, needed_at, demand
                ):
                    return False
            Path(f"{stem}.reserved").touch()
        return True

    def _usage(self) -> int:
        # Counted from the index, not from file sizes: an in-flight download counts at its
        # final size from the moment it is reserved, whichever process runs it.
        reserved = set()
        for entry in os.scandir(self._partial):
            shard_text = entry.name.split(".", 1)[0]
            if _fetch.is_stale_partial(entry.name):
                Path(entry.path).unlink(missing_ok=True)
            elif entry.name.endswith(".reserved") and shard_text.isdigit():
                reserved.add(int(shard_text))
        present = [i for i, p in enumerate(self._paths) if i not in reserved and p.exists()]
        return int(self._raw_sizes[present].sum()) + int(self._sizes[sorted(reserved)].sum())

    def _evict(self, excess: int, shard: int, needed_at: int, demand: bool) -> bool:
        # Belady: evict what is needed furthest in the future. A prefetch may evict only shards
        # needed later than the one it brings; a demand fetch (needed now) anything not needed now.
        limit_use = self._position if demand else needed_at
        candidates = []
        for other, path in enumerate(self._paths):
            if other != shard and path.exists():
                use = self.next_use(other)
                if use > limit_use:
                    candidates.append((use, other))
        candidates.sort(reverse=True)
        freed = 0
        for _, other in candidates:
            if freed >= excess:
                break
            with contextlib.suppress(FileNotFoundError):
                self._paths[other].unlink()
                freed += int(self._raw_sizes[other])
            with self._lock:
                self._local.discard(other)
        return freed >= excess

    def _plan_loop(self) -> None:
        # Keeps up to `lookahead` shards in flight or ready ahead of the reader, in first-use order.
        assert self._pool is not None  # the planner runs only in a cache of a volume, with the pool
        while True:
            with self._lock:
                if self._closed:
                    return
                retry = None
                if self._stalled_at != self._position:
                    wanted, retry = self._upcoming()
                    for shard, step in wanted:
                        # Demand fetches run on the readers' threads, beside these.
                        if self._prefetching >= self._download_threads:
                            break
                        if shard not in self._inflight and shard not in self._failed:
                            try:
                                self._inflight[shard] = self._pool.submit(self._download, shard, step, False)
                            except RuntimeError:  # the interpreter is exiting: its executors take no work
                                self._closed = True
                                self._wake.notify_all()
                                return
                            self._prefetching += 1
                self._idle = not self._inflight and retry is None
                self._wake.notify_all()  # for wait_idle
                # A skipped shard is tried again when its time comes, if a download slot is free
                # then; a slot that frees up wakes this loop anyway.
                timeout = 1.0
                if retry is not None and self._prefetching < self._download_threads:
                    timeout = min(timeout, max(0.01, retry))
                self._wake.wait(timeout=timeout)

    def _upcoming(self) -> tuple[list[tuple[int, int]], float | None]:
        """The shards to fetch next (with the step first needing each), in first-use order, and the
        seconds until a shard passed over now (another process is fetching it) is tried again."""
        if not self._first_uses or len(self._local) == len(self._paths):
            return [], None
        now = time.monotonic()
        seen: set[int] = set()
        wanted: list[tuple[int, int]] = []
        retry = None
        ahead = 0
        for i in range(bisect.bisect_left(self._first_use_steps, self._position), len(self._first_uses)):
            step, shard = self._first_uses[i]
            if shard in seen:
                continue
            seen.add(shard)
            if shard in self._awaited_elsewhere:
                continue
            tried = self._elsewhere.get(shard)
            if tried is not None and shard not in self._local:
                if self._paths[shard].exists():  # the other process's download landed
                    self._local.add(shard)
                    del self._elsewhere[shard]
                elif now - tried < _BUSY_RETRY_S:
                    # Another process's download, not counted in this one's lookahead: the shards
                    # after it are fetched here meanwhile.
                    left = tried + _BUSY_RETRY_S - now
                    retry = left if retry is None else min(retry, left)
                    continue
            if shard not in self._local:
                wanted.append((shard, step))
            ahead += 1
            if ahead >= self._lookahead:
                break
        return wanted, retry


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One cached volume, as ``sparkgpu cache ls`` shows it.

    Attributes:
        path: The entry's folder.
        remote: The volume URL it caches.
        shards_cached: Shards present.
        shards_total: Shards in the dataset.
        bytes_cached: Bytes of shards present.
        bytes_total: Bytes of the whole dataset, uncompressed.
        last_used: Unix time of the newest shard or index in it.
    """

    path: Path
    remote: str
    shards_cached: int
    shards_total: int
    bytes_cached: int
    bytes_total: int
    last_used: float


def cache_entries(cache_dir: str | os.PathLike | None = None) -> list[CacheEntry]:
    """Lists the cached volumes under a cache root (default: ``SPARKGPU_CACHE_DIR``)."""
    root = _cache_root(cache_dir)
    entries: list[CacheEntry] = []
    if not root.is_dir():
        return entries
    for folder in sorted(root.iterdir()):
        meta_file = folder / _META / "entry.json"
        if not meta_file.is_file():
            continue
        meta = json.loads(meta_file.read_text())
        try:
            index = DatasetIndex.parse((folder / INDEX_NAME).read_bytes(), str(folder), allow_unsafe_types=True)
        except (OSError, DataError):
            continue
        present = [s for s in index.shards if (folder / s.basename).exists()]
        times = [(folder / s.basename).stat().st_mtime for s in present] + [(folder / INDEX_NAME).stat().st_mtime]
        entries.append(
            CacheEntry(
                folder,
                meta.get("remote", ""),
                len(present),
                len(index.shards),
                sum(s.raw_bytes for s in present),
                sum(s.raw_bytes for s in index.shards),
                max(times),
            )
        )
    return entries


def clear_cache(cache_dir: str | os.PathLike | None = None, remote: str | None = None) -> int:
    """Deletes cached shards: every entry, or only the one caching ``remote``.

    Loaders reading the entry keep their memory-mapped shards and fetch the others again.

    Returns:
        Bytes freed.
    """
    root = _cache_root(cache_dir)
    folders = [entry_dir_for(root, remote)] if remote else [e.path for e in cache_entries(root)]
    freed = 0
    for folder in folders:
        if not (folder / _META).is_dir():
            continue
        with _file_lock(folder / _META / "cache.lock"):
            freed += _remove_shards(folder)
        shutil.rmtree(folder, ignore_errors=True)
    return freed


def _cache_root(cache_dir) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    from sparkgpu.config import settings

    return settings().cache_dir
