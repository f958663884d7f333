"""A "volume": where shards live, as any fsspec URL (a local folder, s3://, gs://, abfs://, http(s)://).

Object stores and HTTP servers are read through obstore (:mod:`sparkgpu.data.storage._object_store`);
listing, and every other scheme, through the fsspec filesystem of the URL's scheme. A scheme
whose package is missing fails at once with the exact ``pip install``.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

from sparkgpu._util.urls import scheme_of
from sparkgpu.data.storage._object_store import DIRECT_SCHEMES, ObjectStoreSource, usable_here
from sparkgpu.errors import DataError
from sparkgpu.store import Store

__all__ = ["Volume", "RangePool", "part_bytes_for", "MIN_PART_BYTES", "MAX_PART_BYTES"]

# A range costs a request: below 1 MiB the requests, not the bytes, set the pace; above
# 16 MiB one slow range holds up its file.
MIN_PART_BYTES = 1 << 20
MAX_PART_BYTES = 16 << 20
_ALIGN = 64 << 10
_CHUNK = 8 << 20

# A range at least this many times what a connection moves while it waits for the first byte
# spends at most 1/(1+this) of its time waiting: 20% at 4.
_LATENCY_FACTOR = 4


class Hasher(Protocol):
    """What :meth:`Volume.download` feeds a file's bytes to: a ``hashlib`` or ``xxhash`` object."""

    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


def part_bytes_for(size: int, threads: int, bytes_in_flight: int = 0) -> int:
    """The range size for a file of ``size`` bytes fetched by ``threads`` threads.

    One range per thread, so every thread works on the file needed first and it lands
    after ``size / (all threads' rate)``, within [``MIN_PART_BYTES``, ``MAX_PART_BYTES``].
    On a link with latency (``bytes_in_flight``: time to first byte x one connection's rate,
    30 ms x 100 MB/s = 3 MB on S3), ranges are at least ``4 x bytes_in_flight``, so waiting
    for first bytes takes at most a fifth of each connection's time: fewer, larger ranges
    keep the connections busy where many small ones would mostly wait.
    """
    per_thread = -(-size // max(1, threads))
    per_thread = max(per_thread, _LATENCY_FACTOR * bytes_in_flight)
    per_thread = -(-per_thread // _ALIGN) * _ALIGN
    return min(MAX_PART_BYTES, max(MIN_PART_BYTES, per_thread))


class RangePool(concurrent.futures.Executor):
    """The threads that fetch byte ranges for :meth:`Volume.download`, most urgent first.

    A range waits with the ``priority`` it was submitted with (the step at which its file is
    first needed; lower runs first) and, at equal priority, in submission order. Files whose
    downloads start together then still complete in the order they are needed, whichever
    thread queued its ranges first.

    Args:
        threads: Parallel range requests; ranges are sized so that one file keeps them all busy.
    """

    def __init__(self, threads: int):
        self.threads = threads
        self._queue: list = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._shutdown = False
        self._workers = [
            threading.Thread(target=self._work, name=f"sparkgpu-range-{i}", daemon=True) for i in range(threads)
        ]
        for worker in self._workers:
            worker.start()

    # Executor.submit passes every keyword on to fn; this one keeps `priority` for its queue
    # (only callers that know they hold a RangePool pass it: Volume._download_ranges), which
    # no signature compatible with the base class's can express.
    def submit(self, fn, /, *args, priority: float = 0.0, **kwargs) -> concurrent.futures.Future:  # type: ignore[override]
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            heapq.heappush(self._queue, (priority, next(self._order), future, fn, args, kwargs))
            self._cv.notify()
        return future

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._shutdown:
                    self._cv.wait()
                if not self._queue:
                    return
                _, _, future, fn, args, kwargs = heapq.heappop(self._queue)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cv:
            self._shutdown = True
            if cancel_futures:
                for item in self._queue:
                    item[2].cancel()
                self._queue.clear()
            self._cv.notify_all()
        if wait:
            for worker in self._workers:
                if worker is not threading.current_thread():
                    worker.join()


class _InOrder:
    """Feeds a hasher a file's parts in file order, whatever order they arrive in.

    Parts that arrive early wait in memory (a file's ranges are served in order of urgency and
    submission, so that is a few of them) and one thread at a time hashes, outside the lock.
    """

    def __init__(self, hasher: Hasher | None):
        self.hasher = hasher
        self.fed = 0
        self._pending: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self._busy = False

    def add(self, start: int, data: bytes) -> None:
        if self.hasher is None:
            return
        with self._lock:
            self._pending[start] = data
            if self._busy:
                return  # the hashing thread takes it when its turn comes
            self._busy = True
        while True:
            with self._lock:
                part = self._pending.pop(self.fed, None)
                if part is None:
                    self._busy = False
                    return
                self.fed += len(part)
            self.hasher.update(part)


class Volume:
    """Read access to a dataset folder on any fsspec filesystem.

    Args:
        url: Dataset folder URL (``s3://bucket/feats/v1``, ``/mnt/data/feats``, ...).
        storage_options: Extra options for the filesystem (credentials, endpoints).
        retries: Further tries of a failed download before it is reported.

    Raises:
        MissingDependencyError: The filesystem for the URL's scheme is not installed.
        ConfigurationError: The URL's scheme is unknown.
    """

    def __init__(self, url: str, storage_options: dict | None = None, retries: int = 2):
        self.url = str(url).rstrip("/")
        self.retries = retries
        scheme = scheme_of(self.url)
        # Listing and the schemes obstore does not read: fsspec, through the store.
        self._store = Store(self.url, storage_options, what="the volume")
        self.root = self._store.root
        # Object stores and HTTP without options: obstore's connection pool, outside the GIL,
        # instead of fsspec's single event-loop thread, which caps every thread's reads at one
        # core's rate. Options (credentials, headers) are fsspec's: those volumes stay on fsspec.
        self._object_store = ObjectStoreSource(self.url) if scheme in DIRECT_SCHEMES and not storage_options else None
        # Whether the store answers byte-range reads; None until the first ranged download.
        self.ranges_supported: bool | None = None
        self._probe = threading.Lock()

    def __repr__(self) -> str:
        return f"Volume({self.url!r})"

    @property
    def fs(self):
        """The fsspec filesystem, made again in a forked child (fsspec's async ones refuse to cross a fork)."""
        return self._store.fs

    @property
    def _direct(self) -> ObjectStoreSource | None:
        """obstore, unless this process was forked after its runtime started: then fsspec reads."""
        return self._object_store if self._object_store is not None and usable_here() else None

    def _path(self, relative: str) -> str:
        return f"{self.root}/{relative}"

    def read_bytes(self, relative: str, start: int | None = None, end: int | None = None) -> bytes:
        """Returns a (small) file, such as ``index.json``, or its bytes ``[start, end)``.

        Raises:
            DataError: The file does not exist or cannot be read after the retries.
        """
        if self._direct is not None:
            return self._retrying(relative, lambda: self._direct.cat(relative, start, end))
        return self._retrying(relative, lambda: self.fs.cat_file(self._path(relative), start=start, end=end))

    def download(
        self,
        relative: str,
        local_path: str,
        size: int | None = None,
        pool=None,
        part_bytes: int | None = None,
        new_hasher: Callable[[], Hasher] | None = None,
        priority: float = 0.0,
    ) -> Hasher | None:
        """Copies a file from the volume to a local path, hashing its bytes as they arrive.

        Given the file's ``size`` and a :class:`RangePool`, a file larger than one part is
        fetched as byte ranges on the pool, each written straight to its place in the file:
        files then complete one after another in the order they were asked for, at the speed
        of all the connections together, instead of all at once at the end. Stores that
        ignore ranges (some plain HTTP servers) get whole-file downloads from the first such
        answer on.

        Args:
            relative: Path of the file inside the dataset folder.
            local_path: Where to write it.
            size: The file's size in bytes, when known.
            pool: :class:`RangePool` (or any executor) for the ranges.
            part_bytes: Size of one range; default :func:`part_bytes_for` the size and the
                pool's threads.
            new_hasher: Makes a hash object (``update``/``hexdigest``) to feed the file's
                bytes, in order, while they arrive; ``None`` for no hash.
            priority: How urgent the file's ranges are on a :class:`RangePool` (lower first):
                the step at which the file is first needed.

        Returns:
            The hash object fed the whole file, or ``None`` without ``new_hasher``.

        Raises:
            DataError: The file does not exist or cannot be read after the retries.
        """
        fixed_parts = part_bytes is not None
        if part_bytes is None:
            part_bytes = self._part_bytes(size or 0, pool)
        if pool is not None and size is not None and size > part_bytes and self.ranges_supported is not False:
            ordered = _InOrder(new_hasher() if new_hasher else None)
            if self._download_ranges(relative, local_path, size, pool, part_bytes, ordered, priority, fixed_parts):
                return ordered.hasher
        hasher = new_hasher() if new_hasher else None
        if size is not None and size <= part_bytes:
            # One part: one request, hashed from memory.
            data = self.read_bytes(relative)
            _write_all(local_path, data)
            if hasher is not None:
                hasher.update(data)
            return hasher
        if self._direct is not None:
            self._retrying(relative, lambda: self._direct.download(relative, local_path))
        else:
            self._retrying(relative, lambda: self.fs.get_file(self._path(relative), local_path))
        if hasher is not None:  # a store without ranges or a file of unknown size: hash what landed
            with open(local_path, "rb") as handle:
                while chunk := handle.read(_CHUNK):
                    hasher.update(chunk)
        return hasher

    def _part_bytes(self, size: int, pool) -> int:
        in_flight = self._direct.link.bytes_in_flight() if self._direct is not None else 0
        return part_bytes_for(size, getattr(pool, "threads", 1), in_flight)

    def _download_ranges(
        self,
        relative: str,
        local_path: str,
        size: int,
        pool,
        part_bytes: int,
        ordered: _InOrder,
        priority: float,
        fixed_parts: bool,
    ) -> bool:
        """Fetches ``relative`` as ranges into ``local_path``; False when the store ignores ranges.

        Without ``fixed_parts``, the bytes after the volume's first range are split again once
        that range has measured the link: the downloads a loader starts together, before any
        answer came back, would otherwise all use ranges sized for a link without latency
        (2 MB ranges at 30 ms to the first byte spend half of each connection's time waiting).
        """
        with open(local_path, "wb") as handle:
            handle.truncate(size)
        fd = os.open(local_path, os.O_WRONLY)
        futures = []
        queued_to = 0  # bytes before this offset are fetched or queued

        urgency = {"priority": priority} if isinstance(pool, RangePool) else {}  # any executor works, unordered

        def submit_from(offset: int) -> list:
            step = part_bytes if fixed_parts else self._part_bytes(size, pool)
            return [
                pool.submit(self._part, relative, fd, begin, min(begin + step, size), ordered, **urgency)
                for begin in range(offset, size, step)
            ]

        try:
            if self.ranges_supported is None:
                with self._probe:  # one probe per volume: an ignoring server sends whole files
                    if self.ranges_supported is None:
                        first = min(part_bytes, size)
                        self.ranges_supported = self._part(relative, fd, 0, first, ordered)
                        # Queue the rest before other files waiting for the probe queue theirs.
                        futures = submit_from(first) if self.ranges_supported else []
                        queued_to = size
            if not self.ranges_supported:
                return False
            futures += submit_from(queued_to)
            concurrent.futures.wait(futures)  # all settle before the file closes
            # A short range from a store that answers ranges means the file is not the size
            # the caller expects: fetched whole, it fails the caller's size check.
            return all(future.result() for future in futures)
        finally:
            concurrent.futures.wait(futures)
            os.close(fd)

    def _part(self, relative: str, fd: int, start: int, end: int, ordered: _InOrder) -> bool:
        if self._direct is not None:  # a view of the client's buffer: written and hashed without a copy
            data = self._retrying(relative, lambda: self._direct.view(relative, start, end))
        else:
            data = self.read_bytes(relative, start, end)
        if len(data) != end - start:
            return False  # the store ignored the range and sent something else
        _pwrite_all(fd, data, start)
        ordered.add(start, data)
        return True

    def _retrying(self, relative, action):
        for attempt in range(self.retries + 1):
            try:
                return action()
            except FileNotFoundError:
                raise DataError(
                    f"{relative} is missing from volume {self.url}; is the URL the dataset's folder, and was the dataset written completely?"
                ) from None
            except Exception as exc:  # network clients raise their own types (obstore, aiohttp, botocore, ...)
                if attempt == self.retries:
                    raise DataError(
                        f"reading {relative} from volume {self.url} failed {attempt + 1} times: {type(exc).__name__}: {exc}"
                    ) from exc
                time.sleep(0.2 * 2**attempt)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _write_all(local_path: str, data: bytes) -> None:
    fd = os.open(local_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite_all(fd, data, 0)
    finally:
        os.close(fd)
