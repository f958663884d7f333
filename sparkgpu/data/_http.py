"""Plain HTTP(S) reads for volumes served over HTTP: one keep-alive connection per thread.

fsspec's HTTP filesystem runs every request of a process on its one asyncio thread, so
however many threads ask for ranges, the bytes arrive at what one core can read (about a
quarter of what the loopback benchmark's plain client reaches on two cores). The standard
library's ``http.client``, one connection per range thread, reads at the rate of all of
them. Used for ``http://`` and ``https://`` volumes without ``storage_options``; anything
else (credentials, headers, other schemes) goes through fsspec.
"""

from __future__ import annotations

import http.client
import threading
import urllib.parse

__all__ = ["HTTPSource", "HTTPRedirect"]

_TIMEOUT = 60.0
# Errors of a keep-alive connection the server closed between two requests: the request is
# sent once more on a new connection before it counts as a failure.
_STALE = (http.client.RemoteDisconnected, http.client.CannotSendRequest, ConnectionResetError, BrokenPipeError)
_CHUNK = 8 << 20


class HTTPRedirect(OSError):
    """The server answers with a redirect, which this reader does not follow (fsspec does)."""


class HTTPSource:
    """Reads files and byte ranges of one HTTP(S) server.

    Args:
        url: Any URL on the server; requests go to its scheme, host and port.
    """

    def __init__(self, url: str):
        parts = urllib.parse.urlsplit(url)
        self.scheme, self.netloc = parts.scheme, parts.netloc
        self._local = threading.local()

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            factory = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
            conn = self._local.conn = factory(self.netloc, timeout=_TIMEOUT)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def cat(self, url: str, start: int | None = None, end: int | None = None) -> bytes:
        """The file at ``url``, or its bytes ``[start, end)``.

        A server that ignores the range (it answers ``200`` with the whole file) gets its
        connection closed before the body is read, and the answer is ``b""``: the caller
        sees a range of the wrong length and falls back to whole-file downloads.

        Raises:
            FileNotFoundError: The server answers 404.
            HTTPRedirect: The server redirects (3xx).
            OSError: Any other status than 200 / 206, or a failed connection.
        """
        ranged = start is not None or end is not None
        headers = {"Range": f"bytes={start or 0}-{'' if end is None else end - 1}"} if ranged else {}
        response = self._get(url, headers)
        if ranged and response.status == 200:
            self._drop_connection()  # the whole file is on its way: do not read it
            return b""
        return self._read(response, response.read)

    def download(self, url: str, local_path: str) -> None:
        """Streams the file at ``url`` into ``local_path`` (created or truncated).

        Raises:
            FileNotFoundError, HTTPRedirect, OSError: as :meth:`cat`.
        """
        response = self._get(url, {})

        def stream():
            buffer = memoryview(bytearray(_CHUNK))
            with open(local_path, "wb") as out:
                while count := response.readinto(buffer):
                    out.write(buffer[:count])

        self._read(response, stream)

    def _get(self, url: str, headers: dict) -> http.client.HTTPResponse:
        """Sends a GET and returns its response once the status is 200 or 206, body unread."""
        path = urllib.parse.urlsplit(url)
        target = path.path + (f"?{path.query}" if path.query else "")
        for fresh in (False, True):
            conn = self._connection()
            try:
                conn.request("GET", target, headers=headers)
                response = conn.getresponse()
            except _STALE:
                self._drop_connection()
                if fresh:
                    raise
                continue
            except BaseException:
                self._drop_connection()
                raise
            if response.status in (200, 206):
                return response
            self._read(response, response.read)  # the connection stays usable for the next request
            if response.status == 404:
                raise FileNotFoundError(url)
            if 300 <= response.status < 400:
                raise HTTPRedirect(f"HTTP {response.status} for {url} to {response.getheader('Location')}")
            raise OSError(f"HTTP {response.status} {response.reason} for {url}")
        raise AssertionError("unreachable: the second try returns or raises")

    def _read(self, response, read):
        """Runs ``read`` on a response's body; a body cut off drops the connection."""
        try:
            return read()
        except BaseException:
            self._drop_connection()
            raise
