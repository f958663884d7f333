"""A real S3-protocol server on loopback for tests: moto in server mode.

Every ``s3://`` path of the project (volumes, staging store, environment store, checkpoints)
reaches it the way it reaches AWS: through the standard ``AWS_*`` environment variables, which
child processes (ranks, executors) inherit. Only the credentials are dummies.
"""

from __future__ import annotations

import contextlib
import uuid

import pytest

__all__ = ["S3Server", "s3_server", "s3_bucket"]

# Credentials the server accepts; tests that check secrets stay out of logs use their own.
ACCESS_KEY = "sparkgpu-test-key"
SECRET_KEY = "sparkgpu-test-secret"


class S3Server:
    """A running moto S3 server: its endpoint and the environment that points clients at it."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def environment(self, secret: str = SECRET_KEY) -> dict[str, str]:
        """The ``AWS_*`` variables botocore/s3fs and obstore read to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",  # obstore refuses plain http otherwise
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def create_bucket(self) -> str:
        """A fresh, empty bucket; returns its name."""
        import boto3

        name = f"t-{uuid.uuid4().hex[:12]}"
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="session")
def s3_server():
    """One moto S3 server per test session, on 127.0.0.1 and a free port."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield S3Server(f"http://{host}:{port}")
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch):
    """``s3://<fresh bucket>`` with this process's AWS_* variables pointing at the server.

    fsspec caches filesystem instances by their arguments; the cache is cleared so no client
    made for another endpoint or credential is reused.
    """
    for key, value in s3_server.environment().items():
        monkeypatch.setenv(key, value)
    _clear_fsspec_cache()
    yield f"s3://{s3_server.create_bucket()}"
    _clear_fsspec_cache()


def _clear_fsspec_cache() -> None:
    with contextlib.suppress(ImportError):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
