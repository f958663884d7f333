"""An object store's link, simulated on loopback: latency before each request, a per-connection rate cap.

``sparkgpu data bench --profile s3-like`` and ``benchmarks/bench_volume.py --profile s3-like``
put this in front of a volume to see what a training node sees of S3: tens of milliseconds to
the first byte and about 100 MB/s per connection. A local folder is served over HTTP (with
byte ranges, as object stores answer them) behind a TCP proxy; both run in processes of their
own on 127.0.0.1 and stop when the context ends.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import urllib.parse
from pathlib import Path

from sparkgpu._util.urls import is_url, scheme_of
from sparkgpu.errors import ConfigurationError

__all__ = ["PROFILES", "simulated_link", "start_proxy", "start_counted_proxy", "link_counts", "serve_folder"]

PROFILES: dict[str, dict | None] = {
    "loopback": None,
    "s3-like": {"latency_s": 0.030, "mb_per_s_per_connection": 100.0},
}

# Each request from the client waits LATENCY before it reaches the server; each connection's
# answers flow back no faster than RATE bytes/s. A connection to the control port gets one JSON
# line of what passed since the start (a first line "peak" resets the most-open count first).
_PROXY = """
import asyncio, json, sys, time
upstream, latency, rate = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
state = {"bytes_down": 0, "bytes_up": 0, "connections": 0, "open": 0, "peak_open": 0}

async def requests(reader, writer):
    while data := await reader.read(1 << 16):
        state["bytes_up"] += len(data)
        await asyncio.sleep(latency)
        writer.write(data)
        await writer.drain()
    writer.close()

async def answers(reader, writer):
    free_at = time.monotonic()  # when this connection's link is free again
    while data := await reader.read(1 << 18):
        free_at = max(free_at, time.monotonic()) + len(data) / rate
        await asyncio.sleep(max(0.0, free_at - time.monotonic()))
        writer.write(data)
        await writer.drain()
        state["bytes_down"] += len(data)
    writer.close()

async def connection(client_reader, client_writer):
    state["connections"] += 1
    state["open"] += 1
    state["peak_open"] = max(state["peak_open"], state["open"])
    try:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", upstream)
        await asyncio.gather(requests(client_reader, server_writer), answers(server_reader, client_writer),
                             return_exceptions=True)
    finally:
        state["open"] -= 1

async def control(reader, writer):
    if (await reader.readline()).strip() == b"peak":
        state["peak_open"] = state["open"]
    writer.write((json.dumps(state) + "\\n").encode())
    await writer.drain()
    writer.close()

async def main():
    server = await asyncio.start_server(connection, "127.0.0.1", 0, backlog=1024)
    control_server = await asyncio.start_server(control, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], control_server.sockets[0].getsockname()[1], flush=True)
    await asyncio.gather(server.serve_forever(), control_server.serve_forever())

asyncio.run(main())
"""

# A folder over HTTP/1.1 keep-alive with byte ranges (SimpleHTTPRequestHandler ignores them).
_SERVER = """
import functools, http.server, os, re, sys

class Handler(http.server.SimpleHTTPRequestHandler):
    def send_head(self):
        match = re.fullmatch(r"bytes=(\\d+)-(\\d*)", self.headers.get("Range", ""))
        if not match:
            self._left = None
            return super().send_head()
        try:
            source = open(self.translate_path(self.path), "rb")
        except OSError:
            self.send_error(404)
            return None
        size = os.fstat(source.fileno()).st_size
        start, end = int(match[1]), min(int(match[2] or size - 1), size - 1)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        source.seek(start)
        self._left = end - start + 1
        return source

    def copyfile(self, source, output):
        if self._left is None:
            return super().copyfile(source, output)
        while self._left > 0:
            chunk = source.read(min(1 << 20, self._left))
            if not chunk:
                break
            output.write(chunk)
            self._left -= len(chunk)

    def log_message(self, *args):
        pass

Handler.protocol_version = "HTTP/1.1"
http.server.ThreadingHTTPServer.daemon_threads = True
http.server.ThreadingHTTPServer.request_queue_size = 1024
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=sys.argv[1]))
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def _start(script: str, *args: str) -> tuple[subprocess.Popen, list[int]]:
    """Starts ``script``; returns the process and the ports it prints on its first line."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert proc.stdout is not None  # a pipe
    ports = proc.stdout.readline().split()
    if not ports or not all(port.isdigit() for port in ports):
        proc.kill()
        proc.wait()
        raise RuntimeError("the loopback server of the simulated link did not start")
    return proc, [int(port) for port in ports]


def serve_folder(folder: str | Path) -> tuple[subprocess.Popen, str]:
    """Serves ``folder`` over HTTP with byte ranges on 127.0.0.1; returns the process and its URL."""
    proc, (port,) = _start(_SERVER, str(folder))
    return proc, f"http://127.0.0.1:{port}"


def start_counted_proxy(
    server_url: str, latency_s: float, mb_per_s_per_connection: float
) -> tuple[subprocess.Popen, str, int]:
    """The simulated link in front of the loopback server ``server_url``: the process, its URL, and
    the control port :func:`link_counts` asks what passed through it."""
    proc, (port, control) = _start(
        _PROXY, str(urllib.parse.urlsplit(server_url).port), str(latency_s), str(mb_per_s_per_connection * 1e6)
    )
    return proc, f"http://127.0.0.1:{port}", control


def start_proxy(server_url: str, latency_s: float, mb_per_s_per_connection: float) -> tuple[subprocess.Popen, str]:
    """The simulated link in front of the loopback HTTP server ``server_url``; returns the process and its URL."""
    proc, url, _ = start_counted_proxy(server_url, latency_s, mb_per_s_per_connection)
    return proc, url


def link_counts(control: int, reset_peak: bool = False) -> dict:
    """What passed through the link since it started: ``bytes_down``, ``bytes_up``,
    ``connections``, ``open`` and ``peak_open`` (reset to ``open`` first with ``reset_peak``)."""
    import json
    import socket

    with socket.create_connection(("127.0.0.1", control)) as sock:
        sock.sendall(b"peak\n" if reset_peak else b"count\n")
        return json.loads(sock.makefile().readline())


@contextlib.contextmanager
def simulated_link(remote: str, profile: str):
    """Yields the URL under which ``remote`` is read through ``profile``'s link.

    Args:
        remote: A local dataset folder (or ``file://`` URL).
        profile: A name in :data:`PROFILES`; ``"loopback"`` yields ``remote`` unchanged.

    Raises:
        ConfigurationError: An unknown profile, or a remote that is not a local folder.
    """
    if profile not in PROFILES:
        raise ConfigurationError(f"unknown profile {profile!r}; use one of {', '.join(PROFILES)}")
    link = PROFILES[profile]
    if link is None:
        yield remote
        return
    if is_url(remote) and scheme_of(remote) != "file":
        raise ConfigurationError(
            f"--profile {profile} simulates an object store in front of a local dataset folder; {remote} is "
            "already remote: measure it as it is (leave out --profile)"
        )
    folder = Path(urllib.parse.urlsplit(remote).path if is_url(remote) else remote).resolve()
    server, url = serve_folder(folder.parent)
    proxy = None
    try:
        proxy, url = start_proxy(url, **link)
        yield f"{url}/{urllib.parse.quote(folder.name)}"
    finally:
        for proc in (proxy, server):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=10)
