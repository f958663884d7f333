"""Volumes over plain HTTP through obstore: ranges on keep-alive connections of a real server on loopback."""

from __future__ import annotations

import http.server
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from sparkgpu.data.storage._object_store import ObjectStoreSource
from sparkgpu.data.storage.volume import Volume
from sparkgpu.errors import DataError

FILE = bytes(range(256)) * 4096  # 1 MiB


class _Server:
    """Serves ``files`` over HTTP/1.1 keep-alive, answering ``Range`` as object stores do.

    ``ranges=False`` answers a range with the whole file (as Python's own server does);
    ``drop_idle=True`` closes every connection after one answer without saying so, as a server
    does with idle keep-alive connections.
    """

    def __init__(
        self,
        files: dict[str, bytes],
        ranges: bool = True,
        drop_idle: bool = False,
        redirects: dict[str, str] | None = None,
    ):
        server = self
        self.connections = 0
        self.requests = 0
        self.lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                with server.lock:
                    server.connections += 1

            def do_GET(self):  # noqa: N802 (http.server's naming)
                with server.lock:
                    server.requests += 1
                if self.path.lstrip("/") in (redirects or {}):
                    self.send_response(302)
                    self.send_header("Location", "/" + redirects[self.path.lstrip("/")])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = files.get(self.path.lstrip("/"))
                if data is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                status, body, content_range = 200, data, None
                wanted = self.headers.get("Range")
                if ranges and wanted:
                    first, last = wanted.removeprefix("bytes=").split("-")
                    body = data[int(first) : int(last) + 1 if last else None]
                    status, content_range = 206, f"bytes {first}-{int(first) + len(body) - 1}/{len(data)}"
                self.send_response(status)
                if content_range:
                    self.send_header("Content-Range", content_range)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                if drop_idle:
                    self.close_connection = True

            def log_message(self, *args):
                return

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_ranges_from_many_threads_arrive_whole_on_kept_alive_connections():
    with _Server({"ds/shard.mds": FILE}) as server:
        source = ObjectStoreSource(f"{server.url}/ds")
        parts = [(start, start + 65536) for start in range(0, len(FILE), 65536)]
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: source.cat("shard.mds", *p), parts))
        assert b"".join(got) == FILE
        assert source.cat("shard.mds") == FILE  # no range: the whole file
        # Kept alive: about one connection per thread (the client's pool may open one more when
        # a request races a connection's return), never one per request.
        assert server.requests == len(parts) + 1 and server.connections <= len(parts) // 2


def test_a_volume_over_http_reads_through_obstore_and_names_missing_files():
    with _Server({"ds/index.json": b"{}"}) as server:
        volume = Volume(f"{server.url}/ds")
        assert volume._direct is not None
        assert volume.read_bytes("index.json") == b"{}"
        with pytest.raises(DataError, match="shard.mds is missing from volume"):
            volume.read_bytes("shard.mds")
    with_options = Volume("http://127.0.0.1:9/ds", storage_options={"headers": {"Authorization": "Bearer x"}})
    assert with_options._direct is None  # fsspec's options (credentials, headers) go through fsspec


def test_a_connection_the_server_dropped_is_replaced():
    with _Server({"f": FILE}, drop_idle=True) as server:
        source = ObjectStoreSource(server.url)
        for start in range(0, 8 * 4096, 4096):
            assert source.cat("f", start, start + 4096) == FILE[start : start + 4096]
        assert server.connections == 8  # each request after the first found its connection gone


def test_a_server_that_ignores_ranges_answers_an_empty_range():
    with _Server({"f": FILE}, ranges=False) as server:
        assert ObjectStoreSource(server.url).cat("f", 0, 4096) == b""
        assert len(ObjectStoreSource(server.url).view("f", 0, 4096)) == 0


def test_a_range_view_is_the_range_without_a_copy(tmp_path):
    # What range downloads write and hash: the client's buffer itself, byte for byte.
    with _Server({"f": FILE}) as server:
        view = ObjectStoreSource(server.url).view("f", 4096, 4096 + 65536)
        assert isinstance(view, memoryview) and view.itemsize == 1 and view.readonly
        assert len(view) == 65536 and view == FILE[4096 : 4096 + 65536]
        target = tmp_path / "f"
        with ThreadPoolExecutor(4) as pool:
            Volume(server.url).download("f", str(target), size=len(FILE), pool=pool, part_bytes=65536)
        assert target.read_bytes() == FILE


def test_a_redirecting_server_is_followed():
    with _Server({"real/index.json": b'{"shards": []}'}, redirects={"ds/index.json": "real/index.json"}) as server:
        volume = Volume(f"{server.url}/ds")
        assert volume.read_bytes("index.json") == b'{"shards": []}'  # not the redirect's empty body
        assert volume._direct is not None


def test_whole_files_from_a_server_that_ignores_ranges_stream_outside_fsspec(tmp_path, monkeypatch):
    from sparkgpu.data.storage.volume import RangePool

    with _Server({"ds/shard.mds": FILE}, ranges=False) as server, RangePool(4) as pool:
        volume = Volume(f"{server.url}/ds")
        # fsspec's HTTP client reads on one event-loop thread: the fallback must not need it.
        monkeypatch.setattr(volume.fs, "get_file", lambda *a, **k: pytest.fail("went through fsspec"))
        volume.download("shard.mds", str(tmp_path / "shard"), size=len(FILE), pool=pool, part_bytes=65536)
        assert (tmp_path / "shard").read_bytes() == FILE
        assert volume.ranges_supported is False and volume._direct is not None


def test_ranges_grow_to_hide_the_latency_of_the_link():
    from sparkgpu.data.storage.volume import part_bytes_for

    assert part_bytes_for(16 << 20, 8) == 2 << 20  # loopback: one range per thread
    # 30 ms x 100 MB/s = 3 MB in flight: ranges of 4x that, so waiting is at most a fifth of the time.
    assert part_bytes_for(16 << 20, 8, bytes_in_flight=3_000_000) >= 12_000_000
    assert part_bytes_for(1 << 30, 8, bytes_in_flight=50_000_000) == 16 << 20  # still bounded


def test_the_volume_measures_the_latency_of_a_slow_link(tmp_path):
    from sparkgpu.testing.simulated_link import serve_folder, start_proxy
    from sparkgpu.data.storage.volume import RangePool

    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "shard.mds").write_bytes(FILE * 4)
    server, url = serve_folder(tmp_path)
    proxy = None
    try:
        proxy, url = start_proxy(url, latency_s=0.05, mb_per_s_per_connection=200.0)
        volume = Volume(f"{url}/ds")
        with RangePool(4) as pool:
            volume.download("shard.mds", str(tmp_path / "copy"), size=len(FILE) * 4, pool=pool)
        assert (tmp_path / "copy").read_bytes() == FILE * 4
        link = volume._direct.link
        assert link.latency_s >= 0.045, "every request waited 50 ms for its first byte"  # a floor under any load
        assert link.bytes_in_flight() == int(link.latency_s * link.bytes_per_s) > 0
    finally:
        for proc in (proxy, server):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=10)


def test_the_first_download_on_a_slow_link_resizes_its_ranges_after_the_first_answer(tmp_path):
    # Before any answer the volume knows nothing of the link and would cut 2 MB ranges; at
    # 50 ms to the first byte those wait more than they move. The rest of the file is cut
    # again once the first range has measured the link.
    from sparkgpu.testing.simulated_link import serve_folder, start_proxy
    from sparkgpu.data.storage.volume import RangePool, part_bytes_for

    payload = os.urandom(8 << 20)
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "shard.mds").write_bytes(payload)
    server, url = serve_folder(tmp_path)
    proxy = None
    try:
        proxy, url = start_proxy(url, latency_s=0.05, mb_per_s_per_connection=200.0)
        volume = Volume(f"{url}/ds")
        first_cut = part_bytes_for(len(payload), 4)
        ranges = []
        part = volume._part
        volume._part = lambda relative, fd, start, end, ordered: (
            ranges.append((start, end)) or part(relative, fd, start, end, ordered)
        )
        with RangePool(4) as pool:
            volume.download("shard.mds", str(tmp_path / "copy"), size=len(payload), pool=pool)
        assert (tmp_path / "copy").read_bytes() == payload
        assert ranges[0] == (0, first_cut) and first_cut == 2 << 20
        later = [end - start for start, end in ranges[1:]]
        assert len(later) < (len(payload) - first_cut) // first_cut, (
            f"the rest was cut as before the first answer: {ranges}"
        )
        assert sum(later) == len(payload) - first_cut
    finally:
        for proc in (proxy, server):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=10)
