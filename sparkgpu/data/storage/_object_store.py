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
import threading
import time
from typing import TYPE_CHECKING

from sparkgpu._util.urls import scheme_of

if TYPE_CHECKING:
    from obstore.store import ClientConfig, S3Config

__all__ = ["DIRECT_SCHEMES", "ObjectStoreSource", "LinkEstimate", "usable_here"]

# Schemes obstore reads; any other goes through fsspec.
DIRECT_SCHEMES = frozenset({"s3", "s3a", "gs", "az", "abfs", "abfss", "http", "https"})
_CHUNK = 8 << 20

# The process whose first request started obstore's runtime (None: not started in any ancestor).
_runtime_pid: int | None = None


def usable_here() -> bool:
    """Whether obstore works in this process: its runtime was not started by a process we forked from."""
    return _runtime_pid is None or _runtime_pid == os.getpid()


def _started() -> None:
    global _runtime_pid
    if _runtime_pid is None:
        _runtime_pid = os.getpid()


class LinkEstimate:
    """Running estimate of a store's time to first byte and per-connection rate, from ranged reads.

    Each ranged read reports when its answer began (the response head arrived) and when its
    body ended; averages of the last reads (exponentially weighted) give the latency and the
    rate of one connection.
    """

    _WEIGHT = 0.25

    def __init__(self) -> None:
        self.latency_s: float | None = None
        self.bytes_per_s: float | None = None
        self._lock = threading.Lock()

    def add(self, first_byte_s: float, body_s: float, size: int) -> None:
        if size < (256 << 10) or body_s <= 0:
            return  # too short to say anything about the rate
        rate = size / body_s
        with self._lock:
            if self.latency_s is None or self.bytes_per_s is None:  # both are set together
                self.latency_s, self.bytes_per_s = first_byte_s, rate
            else:
                self.latency_s += self._WEIGHT * (first_byte_s - self.latency_s)
                self.bytes_per_s += self._WEIGHT * (rate - self.bytes_per_s)

    def bytes_in_flight(self) -> int:
        """What one connection could have moved while waiting for a first byte (0 before any read)."""
        with self._lock:
            if self.latency_s is None or self.bytes_per_s is None:  # both are set together
                return 0
            return int(self.latency_s * self.bytes_per_s)


class ObjectStoreSource:
    """Reads files and byte ranges under one folder URL.

    Args:
        url: Folder URL; paths given to the methods are relative to it.

    Attributes:
        link: :class:`LinkEstimate` of the store, from the ranges read so far.
    """

    def __init__(self, url: str):
        from obstore.store import from_url

        self.link = LinkEstimate()

        scheme = scheme_of(url)
        # A plain-HTTP endpoint is one the user named (an http:// volume, an S3-compatible
        # server in AWS_ENDPOINT_URL); https URLs stay https.
        client_options: ClientConfig = {"allow_http": True}
        if scheme in ("s3", "s3a"):
            self.store = from_url(url, client_options=client_options, config=_s3_config())
        else:
            self.store = from_url(url, client_options=client_options)

    def cat(self, relative: str, start: int | None = None, end: int | None = None) -> bytes:
        """The file, or its bytes ``[start, end)``.

        A server that ignores ranges gets the answer ``b""``: the caller sees a range of the
        wrong length and falls back to whole-file downloads.

        Raises:
            FileNotFoundError: There is no such file.
            Exception: obstore's errors for anything else (network, permissions).
        """
        import obstore

        _started()
        if start is None and end is None:
            return bytes(obstore.get(self.store, relative).bytes())
        if end is None:
            end = obstore.head(self.store, relative)["size"]
        return bytes(self.view(relative, start or 0, end))

    def view(self, relative: str, start: int, end: int) -> memoryview:
        """The bytes ``[start, end)`` as a view of the client's buffer, without copying them.

        Range downloads write these straight to their file: copying each range into a Python
        ``bytes`` first cost obstore about 40% of its rate on loopback
        (``benchmarks/bench_object_store.py``). Same answers and errors as :meth:`cat`.
        """
        import obstore
        from obstore.exceptions import NotSupportedError

        _started()
        asked = time.perf_counter()
        try:
            result = obstore.get(self.store, relative, options={"range": (start, end)})
        except NotSupportedError:  # "range request not supported": the body was not read
            return memoryview(b"")
        answered = time.perf_counter()
        data = memoryview(result.bytes())
        self.link.add(answered - asked, time.perf_counter() - answered, len(data))
        return data

    def download(self, relative: str, local_path: str) -> None:
        """Streams the file into ``local_path`` (created or truncated)."""
        import obstore

        _started()
        result = obstore.get(self.store, relative)
        with open(local_path, "wb") as out:
            for chunk in result.stream(min_chunk_size=_CHUNK):
                out.write(memoryview(chunk))


def _s3_config() -> S3Config:
    """obstore reads AWS_ENDPOINT; the AWS SDKs' name for it is AWS_ENDPOINT_URL: both work."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return {"endpoint": endpoint} if endpoint and not os.environ.get("AWS_ENDPOINT") else {}
