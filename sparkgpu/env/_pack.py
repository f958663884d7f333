"""Deterministic tar streams: the same files always give the same bytes, hence the same hash.

Entries are sorted by name and carry no time, owner or permission noise (mtime 0, uid/gid 0,
mode 0644 or 0755). The hash of a blob is the sha256 of this uncompressed stream, whatever
compression the store applies on top.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import os
import tarfile


_COPY_BUFSIZE = 1 << 20


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One file of a blob.

    Attributes:
        source: Where the file is on this machine.
        arcname: Its path inside the blob (``site/...`` or ``path/<i>/...``).
        size: Its size when scanned.
        mtime_ns: Its modification time when scanned (only to notice changes, never stored).
        executable: Whether it keeps an executable bit.
    """

    source: str
    arcname: str
    size: int
    mtime_ns: int
    executable: bool


class DigestWriter:
    """A write-only file object that hashes and counts what passes through to ``inner``."""

    def __init__(self, inner=None):
        self.inner = inner
        self.sha = hashlib.sha256()
        self.count = 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.count += len(data)
        if self.inner is not None:
            self.inner.write(data)
        return len(data)

    def tell(self) -> int:
        return self.count

    def flush(self) -> None:
        if self.inner is not None:
            self.inner.flush()


def write_tar(files: tuple[FileEntry, ...], sink) -> None:
    """Writes ``files`` as a deterministic tar stream into ``sink`` (``write`` and ``tell``).

    A file edited or deleted since it was scanned goes in as it is now (or not at all): the
    blob's hash always describes the bytes actually written.
    """
    # Non-stream mode: stream mode ("w|") re-slices its buffer on every write, which is
    # quadratic in the copy buffer size.
    with tarfile.TarFile(fileobj=sink, mode="w", format=tarfile.PAX_FORMAT, copybufsize=_COPY_BUFSIZE) as tar:
        for entry in sorted(files, key=lambda f: f.arcname):
            try:
                f = open(entry.source, "rb")
            except FileNotFoundError:
                continue
            with f:
                info = tarfile.TarInfo(entry.arcname)
                info.size = os.fstat(f.fileno()).st_size
                info.mode = 0o755 if entry.executable else 0o644
                info.mtime = 0
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                tar.addfile(info, f)


def tar_digest(files: tuple[FileEntry, ...]) -> tuple[str, int]:
    """The sha256 and length of the tar stream of ``files``, without writing it anywhere."""
    sink = DigestWriter()
    write_tar(files, sink)
    return sink.sha.hexdigest(), sink.count


def write_blob(files: tuple[FileEntry, ...], out, compression: str | None) -> tuple[str, int]:
    """Writes the blob of ``files`` to the binary file ``out``.

    Args:
        files: The blob's files.
        out: Binary file object to write to.
        compression: ``None`` or ``"gzip"``.

    Returns:
        ``(sha256, length)`` of the uncompressed tar stream.
    """
    if compression == "gzip":
        with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=1) as gz:
            sink = DigestWriter(gz)
            write_tar(files, sink)
    else:
        sink = DigestWriter(out)
        write_tar(files, sink)
    return sink.sha.hexdigest(), sink.count
