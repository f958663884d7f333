"""A local table on a simulated S3 link: an S3-protocol server on loopback behind the latency proxy.

``sparkgpu data bench --table --profile s3-like`` and ``benchmarks/bench_volume.py`` read a
table from S3 the way a training node does (``s3://`` through deltalake, pyarrow and the
object-store client), with :mod:`sparkgpu.testing.simulated_link`'s proxy putting 30 ms before
each request and 100 MB/s per connection in front of the server. The server is moto's, in a
process of its own on 127.0.0.1; the endpoint and dummy credentials reach every client through
the usual ``AWS_*`` variables, set for the duration of the context and restored afterwards.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import uuid
from pathlib import Path

from sparkgpu.testing.simulated_link import PROFILES, start_proxy
from sparkgpu.errors import ConfigurationError, MissingDependencyError

__all__ = ["simulated_s3", "start_s3_server"]

# moto reads an object's whole body for every GET, a ranged one too, under a per-object lock
# (moto 5.2: FakeKey.value, then a slice in S3Response._handle_range_header): 8 ranges of a 57 MB
# file cost it 8 whole reads, one after another (250 MB/s on loopback, against 1,000 MB/s for
# whole-file GETs). S3 serves a range at the cost of the range. The server below answers a GET
# from a read-only memory map of the object's file (moto keeps a body over 5 MB in a temporary
# file), so a ranged GET costs its slice, as on S3, and the bodies stay in the page cache, not the
# server's heap: the volume benchmark's real size (three copies of 6 GB) would not fit in memory.
# Smaller bodies are kept as bytes once read. Everything but GET (multipart assembly, copies)
# reads bodies as moto does.
_SERVER = """
import logging, mmap, sys, threading
from moto.s3.models import FakeKey
from moto.s3.responses import S3Response
from moto.server import ThreadedMotoServer

_read, _write = FakeKey.value.fget, FakeKey.value.fset
_serving = threading.local()

def _body(key):
    if not getattr(_serving, "get", False):
        return _read(key)
    body = key.__dict__.get("_body")
    if body is None:
        buffer = key._value_buffer
        if getattr(buffer, "_rolled", False) and key.contentsize:
            body = mmap.mmap(buffer.fileno(), 0, access=mmap.ACCESS_READ)
        else:
            body = _read(key)
        key.__dict__["_body"] = body
    return body

def _set_body(key, value):
    _write(key, value)
    key.__dict__.pop("_body", None)

_get_object, _key_response = S3Response.get_object, S3Response.key_response

def get_object(self):
    _serving.get = True
    try:
        return _get_object(self)
    finally:
        _serving.get = False

def key_response(self, request, full_url, headers):
    status, headers, body = _key_response(self, request, full_url, headers)
    return status, headers, body[:] if isinstance(body, mmap.mmap) else body

FakeKey.value = property(_body, _set_body)
S3Response.get_object, S3Response.key_response = get_object, key_response
logging.getLogger("werkzeug").setLevel(logging.WARNING)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
threading.Event().wait()
"""

_KEY, _SECRET = "sparkgpu-bench", "sparkgpu-bench-secret"


def _environment(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": _KEY,
        "AWS_SECRET_ACCESS_KEY": _SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@contextlib.contextmanager
def simulated_s3(folder: str | os.PathLike, profile: str):
    """Uploads a local table folder to a loopback S3 server and yields its ``s3://`` URL.

    Args:
        folder: A Delta table or a folder of Parquet files.
        profile: A name in :data:`~sparkgpu.testing.simulated_link.PROFILES`; ``"loopback"``
            reaches the server directly.

    Raises:
        ConfigurationError: ``folder`` is not a local folder, or an unknown profile.
        MissingDependencyError: moto is not installed.
    """
    if profile not in PROFILES:
        raise ConfigurationError(f"unknown profile {profile!r}; use one of {', '.join(PROFILES)}")
    local = Path(str(folder).removeprefix("file://"))
    if not local.is_dir():
        raise ConfigurationError(
            f"--profile {profile} serves a local table folder over S3; {folder} is not one "
            "(measure a remote table as it is: leave out --profile)"
        )
    server, endpoint = start_s3_server()
    proxy = None
    saved = {key: os.environ.get(key) for key in _environment("")}
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        _upload(endpoint, bucket, local)
        shape = PROFILES[profile]
        if shape is not None:
            proxy, endpoint = start_proxy(endpoint, **shape)
        os.environ.update(_environment(endpoint))
        _forget_clients()
        yield f"s3://{bucket}/{local.name}"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _forget_clients()
        for proc in (proxy, server):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=10)


def start_s3_server() -> tuple[subprocess.Popen, str]:
    """moto's S3 server, serving byte ranges at their own cost, in a process of its own on 127.0.0.1.

    Returns:
        The server process (the caller terminates it) and its endpoint URL.

    Raises:
        MissingDependencyError: moto is not installed.
        RuntimeError: The server did not start.
    """
    if importlib.util.find_spec("moto") is None:
        raise MissingDependencyError("The simulated S3 link (moto's S3 server)", "pip install 'moto[server]'")
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert server.stdout is not None  # a pipe
    port = server.stdout.readline().strip()
    if not port.isdigit():
        server.kill()
        server.wait()
        raise RuntimeError("the loopback S3 server did not start")
    return server, f"http://127.0.0.1:{port}"


def _upload(endpoint: str, bucket: str, folder: Path) -> None:
    import boto3

    client = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=_KEY, aws_secret_access_key=_SECRET, region_name="us-east-1"
    )
    client.create_bucket(Bucket=bucket)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        # Readable without a signature: the raw-download baseline is a plain HTTP client.
        client.upload_file(
            str(path), bucket, f"{folder.name}/{path.relative_to(folder).as_posix()}", ExtraArgs={"ACL": "public-read"}
        )


def _forget_clients() -> None:
    """Drops s3fs's cached clients, made for the endpoint before or during the context."""
    with contextlib.suppress(ImportError):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
