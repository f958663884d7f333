"""A content-addressed blob store on any fsspec URL.

Layout under the store's root::

    blobs/<h[:2]>/<sha256>.tar[.gz]    one blob per distribution or code tree
    manifests/<sha256>.json            one manifest per distinct environment

Objects are written under a temporary name and moved into place, so a reader sees a blob
complete or not at all; the same content always lands under the same name, so concurrent
writers of one blob are harmless.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid

import fsspec

__all__ = ["BlobStore"]

_BLOB_NAME = re.compile(r"^([0-9a-f]{64})\.tar(\.gz)?$")


class BlobStore:
    """Blobs and manifests of staged environments, addressed by sha256.

    Args:
        url: Root of the store: a local path or any fsspec URL (``s3://bucket/envstore``).
        storage_options: Passed to fsspec for that URL.
    """

    def __init__(self, url: str | os.PathLike, **storage_options):
        url = os.fspath(url)
        # Workers read the manifest's store URL: a relative path would resolve against their cwd.
        self.url = url if "://" in url else os.path.abspath(url)
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **storage_options)
        self.root = self.root.rstrip("/")

    def __repr__(self) -> str:
        return f"BlobStore({self.url!r})"

    @staticmethod
    def blob_name(digest: str, compression: str | None) -> str:
        """Object name of a blob, relative to the root."""
        return f"blobs/{digest[:2]}/{digest}.tar" + (".gz" if compression == "gzip" else "")

    def _full(self, name: str) -> str:
        return f"{self.root}/{name}"

    def list_blobs(self) -> dict[str, tuple[str, int]]:
        """``{sha256: (object name, stored bytes)}`` of every complete blob, in one listing."""
        base = self._full("blobs")
        if not self.fs.exists(base):
            return {}
        found: dict[str, tuple[str, int]] = {}
        for path, info in self.fs.find(base, detail=True).items():
            match = _BLOB_NAME.match(path.rsplit("/", 1)[-1])
            if match:  # temporary names of uploads in progress do not match
                found[match.group(1)] = (path[len(self.root) + 1:], int(info.get("size") or 0))
        return found

    def exists(self, name: str) -> bool:
        return self.fs.exists(self._full(name))

    @contextlib.contextmanager
    def writer(self, name: str):
        """Opens ``name`` for writing; it appears under that name only when the block succeeds."""
        final = self._full(name)
        tmp = f"{final}.{uuid.uuid4().hex}.partial"
        self.fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
        try:
            with self.fs.open(tmp, "wb") as f:
                yield f
            self.fs.mv(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(tmp)
            raise

    def put_blob(self, write, compression: str | None) -> tuple[str, str, int, int]:
        """Streams a blob into the store and names it after the hash of what was written.

        Args:
            write: ``write(file) -> (sha256, tar_bytes)`` writes the blob to the binary file.
            compression: How ``write`` compresses (``None`` or ``"gzip"``), for the name.

        Returns:
            ``(object name, sha256, tar_bytes, stored bytes)``.
        """
        parent = self._full("blobs")
        self.fs.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/{uuid.uuid4().hex}.partial"
        try:
            with self.fs.open(tmp, "wb") as f:
                digest, tar_bytes = write(f)
                stored = f.tell()
            name = self.blob_name(digest, compression)
            self.fs.makedirs(self._full(name).rsplit("/", 1)[0], exist_ok=True)
            self.fs.mv(tmp, self._full(name))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(tmp)
            raise
        return name, digest, tar_bytes, stored

    def write_bytes(self, name: str, data: bytes) -> None:
        with self.writer(name) as f:
            f.write(data)

    def read_bytes(self, name: str) -> bytes:
        with self.fs.open(self._full(name), "rb") as f:
            return f.read()

    def size(self, name: str) -> int:
        return int(self.fs.size(self._full(name)))
