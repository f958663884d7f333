"""Reads from object stores and HTTP servers through obstore (the Rust ``object_store`` client).

Volumes on ``s3://``, ``gs://``, ``az://`` / ``abfs://`` and ``http(s)://`` read through it
rather than fsspec: its requests run outside the GIL on a pool of connections, where fsspec's
filesystems (s3fs, gcsfs, HTTP) run every request of a process on their one event-loop thread
(``benchmarks/bench_object_store.py``). Credentials and endpoints come from the usual
environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS``,
``AZURE_STORAGE_ACCOUNT_NAME``, ...). A volume given ``storage_options`` goes through fsspec,
which understands them.
"""

from __future__ import annotations

import os

from sparkgpu._urls import scheme_of

__all__ = ["DIRECT_SCHEMES", "ObjectStoreSource"]

# Schemes obstore reads; any other goes through fsspec.
DIRECT_SCHEMES = frozenset({"s3", "s3a", "gs", "az", "abfs", "abfss", "http", "https"})
_CHUNK = 8 << 20


class ObjectStoreSource:
    """Reads files and byte ranges under one folder URL.

    Args:
        url: Folder URL; paths given to the methods are relative to it.
    """

    def __init__(self, url: str):
        from obstore.store import from_url

        scheme = scheme_of(url)
        # A plain-HTTP endpoint is one the user named (an http:// volume, an S3-compatible
        # server in AWS_ENDPOINT_URL); https URLs stay https.
        options = {"client_options": {"allow_http": True}}
        if scheme in ("s3", "s3a"):
            options["config"] = _s3_config()
        self.store = from_url(url, **options)

    def cat(self, relative: str, start: int | None = None, end: int | None = None) -> bytes:
        """The file, or its bytes ``[start, end)``.

        A server that ignores ranges gets the answer ``b""``: the caller sees a range of the
        wrong length and falls back to whole-file downloads.

        Raises:
            FileNotFoundError: There is no such file.
            Exception: obstore's errors for anything else (network, permissions).
        """
        import obstore
        from obstore.exceptions import NotSupportedError

        if start is None and end is None:
            return bytes(obstore.get(self.store, relative).bytes())
        if end is None:
            end = obstore.head(self.store, relative)["size"]
        try:
            return bytes(obstore.get_range(self.store, relative, start=start or 0, end=end))
        except NotSupportedError:  # "range request not supported": the body was not read
            return b""

    def download(self, relative: str, local_path: str) -> None:
        """Streams the file into ``local_path`` (created or truncated)."""
        import obstore

        result = obstore.get(self.store, relative)
        with open(local_path, "wb") as out:
            for chunk in result.stream(min_chunk_size=_CHUNK):
                out.write(memoryview(chunk))


def _s3_config() -> dict:
    """obstore reads AWS_ENDPOINT; the AWS SDKs' name for it is AWS_ENDPOINT_URL: both work."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return {"endpoint": endpoint} if endpoint and not os.environ.get("AWS_ENDPOINT") else {}
