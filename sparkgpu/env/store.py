"""A content-addressed blob store on a local folder or any fsspec URL.

Layout under the store's root::

    blobs/<h[:2]>/<sha256>.tar[.gz]    one blob per distribution or code tree
    manifests/<sha256>.json            one manifest per distinct environment

Writes go through :class:`~sparkgpu.store.Store`, so a reader sees a blob complete or not
at all; the same content always lands under the same name, so concurrent writers of one
blob are harmless.
"""

from __future__ import annotations

import os
import re

from sparkgpu._util.files import temporary_name
from sparkgpu.store import Store

__all__ = ["BlobStore"]

_BLOB_NAME = re.compile(r"^([0-9a-f]{64})\.tar(\.gz)?$")


class BlobStore(Store):
    """Blobs and manifests of staged environments, addressed by sha256.

    Args:
        url: Root of the store: a local path or any fsspec URL (``s3://bucket/envstore``).
        storage_options: Passed to fsspec for that URL.
    """

    def __init__(self, url: str | os.PathLike, **storage_options):
        # Workers read the manifest's store URL: a local path is made absolute, never left
        # to resolve against their working directory.
        super().__init__(url, storage_options, what="the environment store")

    def __repr__(self) -> str:
        return f"BlobStore({self.url!r})"

    @staticmethod
    def blob_name(digest: str, compression: str | None) -> str:
        """Object name of a blob, relative to the root."""
        return f"blobs/{digest[:2]}/{digest}.tar" + (".gz" if compression == "gzip" else "")

    def list_blobs(self) -> dict[str, tuple[str, int]]:
        """``{sha256: (object name, stored bytes)}`` of every complete blob, in one listing."""
        found: dict[str, tuple[str, int]] = {}
        for name, (size, _) in self.list("blobs").items():
            match = _BLOB_NAME.match(name.rsplit("/", 1)[-1])
            if match:
                found[match.group(1)] = (name, size)
        return found

    def put_blob(self, write, compression: str | None) -> tuple[str, str, int, int]:
        """Streams a blob into the store and names it after the hash of what was written.

        Args:
            write: ``write(file) -> (sha256, tar_bytes)`` writes the blob to the binary file.
            compression: How ``write`` compresses (``None`` or ``"gzip"``), for the name.

        Returns:
            ``(object name, sha256, tar_bytes, stored bytes)``.
        """
        pending = temporary_name("blobs/upload")  # named once its content's hash is known
        try:
            with self.writer(pending) as f:
                digest, tar_bytes = write(f)
                stored = f.tell()
            name = self.blob_name(digest, compression)
            self.rename(pending, name)
        except BaseException:
            self.remove(pending)
            raise
        return name, digest, tar_bytes, stored
