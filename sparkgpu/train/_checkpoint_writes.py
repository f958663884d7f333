"""How a checkpoint's files reach storage: hashed alongside the writes, fsynced once, timed by phase.

DCP writes each rank's files through its filesystem object's ``create_stream``.
:func:`attach_streams` puts :class:`SaveStreams` in its place, whose streams:

* hash what goes through them when the save is signed, on a helper thread *while* the same
  bytes are written (BLAKE3, :mod:`._digests`, hashes faster than a write to the page cache,
  and the hash and file writes both release the GIL): the hash costs no second pass over the
  data and, on two cores or more, next to no time of its own. Each large write waits for its
  hash before it returns, so DCP's buffers are never read after DCP reuses them;
* on local storage hand dirty pages to the disk as they go (``sync_file_range`` with
  ``SYNC_FILE_RANGE_WRITE`` every so many bytes, as databases do: it starts the writes and
  returns, with no journal commit and no cache flush of its own), so the fsync that makes the
  file durable, once, when it is closed, has little left to wait for. An ``fdatasync`` per
  stretch, which this used before, also commits the file system's journal and flushes the
  disk's cache each time (``bench_checkpoint.py`` times the three ways of writing the same
  bytes side by side). DCP's own per-file fsync is switched off for it: every
  file written for the checkpoint (data files and ``.metadata``) is fsynced before its stream
  is closed, and the completion marker, written last, fsyncs the folder;
* add their seconds to a :class:`SaveTimings`, which the Checkpointer keeps per save
  (``Checkpointer.last_save_phases``) to show where a save's time goes.

A signed save also writes its tensors without torch's CRC32 (:func:`without_torch_crc32`): DCP
writes each tensor with ``torch.save``, whose zip writer checksums every record on the writing
thread (half a second of CPU per GB here, most of a synchronous save's time beyond the write
itself), where the BLAKE3 digest of every byte, checked against the signed marker before
anything is loaded, already tells a changed or torn file. ``torch.load`` reads such records.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from sparkgpu.train._digests import Hasher, finish, new_hasher

__all__ = ["WRITEOUT_BYTES", "SaveTimings", "SaveStreams", "attach_streams", "start_writeout", "without_torch_crc32"]

# Writes at least this large are hashed on a helper thread while they are written; smaller
# ones (DCP's headers and pickles) are hashed in place, where a thread hop would cost more.
_OVERLAP_BYTES = 1 << 20
# Dirty pages of a local file are handed to the disk every this many bytes.
WRITEOUT_BYTES = 64 << 20


_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writing the range's dirty pages, do not wait


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or ``None`` where there is none."""
    name = ctypes.util.find_library("c")
    call = getattr(ctypes.CDLL(name, use_errno=True), "sync_file_range", None) if name else None
    if call is None:
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


def start_writeout(fd: int, offset: int, length: int) -> bool:
    """Starts writing ``length`` bytes of ``fd``'s dirty pages from ``offset`` to the disk and
    returns without waiting for them; ``False`` where the platform cannot (the final fsync
    then writes everything)."""
    call = _sync_file_range()
    if call is None:
        return False
    if call(fd, offset, length, _SYNC_FILE_RANGE_WRITE) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"sync_file_range: {os.strerror(number)}")
    return True


_crc32_lock = threading.Lock()
_crc32_holders = 0
_crc32_before = True


@contextlib.contextmanager
def without_torch_crc32() -> Iterator[None]:
    """``torch.save`` writes no CRC32 while any signed save is inside this block.

    torch keeps the setting per process (``torch.serialization.set_crc32_options``), so it is
    switched off when the first save enters and back to what it was when the last one leaves;
    a ``torch.save`` of other code in that window writes records that ``torch.load`` reads as
    usual (zip tools would report their checksums).
    """
    global _crc32_holders, _crc32_before
    import torch.serialization as serialization

    with _crc32_lock:
        if _crc32_holders == 0:
            _crc32_before = serialization.get_crc32_options()
            serialization.set_crc32_options(False)
        _crc32_holders += 1
    try:
        yield
    finally:
        with _crc32_lock:
            _crc32_holders -= 1
            if _crc32_holders == 0:
                serialization.set_crc32_options(_crc32_before)


@dataclasses.dataclass
class SaveTimings:
    """Seconds one save spent per phase on this rank (thread-safe to add to).

    The hash overlaps the writes: ``hash_s`` runs on a helper thread while ``write_s`` runs,
    and only ``hash_wait_s`` (the writer waiting for a hash that took longer than its write)
    adds to the save's time. ``writeback_s`` runs between the writes, on the writing thread.
    """

    write_s: float = 0.0  # copying into the file (the page cache, for a local disk)
    hash_s: float = 0.0  # the digest of the data, beside the writes
    hash_wait_s: float = 0.0  # writes held for their hash to finish
    fsync_s: float = 0.0  # the final fsync of every file (what early writeback left to do)
    writeback_s: float = 0.0  # handing dirty pages to the disk early, between the writes
    bytes: int = 0
    files: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **seconds: float) -> None:
        with self._lock:
            for name, value in seconds.items():
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}


class _Stream:
    """DCP's output stream of one file; see the module's notes."""

    def __init__(self, raw, timings: SaveTimings, hashed: bool, durable: bool):
        self._raw = raw
        self._timings = timings
        self._digest: Hasher | None = new_hasher() if hashed else None
        self._durable = durable
        self._helpers: concurrent.futures.ThreadPoolExecutor | None = None
        self._writeout = durable  # early writeback, until the platform says it has none
        self._handed = 0  # bytes from the start already handed to the disk
        self.size = 0
        self.closed = False

    def _helper(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._helpers is None:
            # The hash's thread: one job at a time, each waited for by the write it hashes.
            self._helpers = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sparkgpu-checkpoint-hash")
        return self._helpers

    def _hash(self, view: memoryview) -> float:
        started = time.perf_counter()
        assert self._digest is not None
        self._digest.update(view)
        return time.perf_counter() - started

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        hashing = None
        if self._digest is not None:
            if len(view) >= _OVERLAP_BYTES:
                hashing = self._helper().submit(self._hash, view)
            else:
                self._timings.add(hash_s=self._hash(view))
        started = time.perf_counter()
        try:
            written = self._raw.write(view)
        finally:
            wrote = time.perf_counter() - started
            if hashing is not None:
                # Never return while the hash still reads the caller's buffer.
                hashed = hashing.result()
                self._timings.add(hash_s=hashed, hash_wait_s=time.perf_counter() - started - wrote)
        if written is not None and written != len(view):
            raise OSError(f"short write: {written} of {len(view)} bytes")
        self.size += len(view)
        self._timings.add(write_s=wrote, bytes=len(view))
        if self._writeout and self.size - self._handed >= WRITEOUT_BYTES:
            self._start_writeback()
        return len(view)

    def _start_writeback(self) -> None:
        self._raw.flush()
        started = time.perf_counter()
        self._writeout = start_writeout(self._raw.fileno(), self._handed, self.size - self._handed)
        self._handed = self.size
        self._timings.add(writeback_s=time.perf_counter() - started)

    def digest(self) -> str:
        assert self._digest is not None
        return finish(self._digest)

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        """Flushes the file to storage (fsync on a local disk) and closes it."""
        if self.closed:
            return
        self.closed = True
        try:
            self._raw.flush()
            if self._durable:
                started = time.perf_counter()
                os.fsync(self._raw.fileno())
                self._timings.add(fsync_s=time.perf_counter() - started, files=1)
            else:
                self._timings.add(files=1)
        finally:
            self._shutdown()
            self._raw.close()

    def _shutdown(self) -> None:
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)
            self._helpers = None

    def __getattr__(self, name):
        return getattr(self._raw, name)


class SaveStreams:
    """DCP's filesystem object of one writer, writing its files through :class:`_Stream`.

    Args:
        fs: DCP's own filesystem object.
        timings: Where the streams add their seconds.
        hashed: Hash every file written (a signed save).
        durable: fsync every file before it is closed (a local disk).
        on_written: ``on_written(name, size, digest)`` once a hashed file is closed.
    """

    def __init__(
        self,
        fs,
        timings: SaveTimings,
        *,
        hashed: bool,
        durable: bool,
        on_written: Callable[[str, int, str], None] | None = None,
    ):
        self._fs = fs
        self._timings = timings
        self._hashed = hashed
        self._durable = durable
        self._on_written = on_written

    def __getattr__(self, name):
        return getattr(self._fs, name)

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator[Any]:
        with self._fs.create_stream(path, mode) as raw:
            if "w" not in mode and "a" not in mode:
                yield raw
                return
            stream = _Stream(raw, self._timings, self._hashed, self._durable)
            try:
                yield stream
                stream.close()  # DCP closes data files itself, .metadata on leaving this block
            finally:
                stream._shutdown()
            if self._hashed and self._on_written is not None:
                self._on_written(os.path.basename(os.fspath(path)), stream.size, stream.digest())


def attach_streams(
    writer,
    timings: SaveTimings,
    *,
    hashed: bool,
    on_written: Callable[[str, int, str], None] | None = None,
) -> None:
    """Makes the DCP ``StorageWriter`` write through :class:`SaveStreams`.

    A writer that fsyncs its files (``sync_files``, a local disk) leaves that to the streams,
    which fsync each file once, after early writeback.
    """
    durable = bool(getattr(writer, "sync_files", False))
    writer.fs = SaveStreams(writer.fs, timings, hashed=hashed, durable=durable, on_written=on_written)
    if durable:
        writer.sync_files = False  # the streams fsync every file before closing it
