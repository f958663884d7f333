"""``spark.gpu`` attachment and the checks ``spark.gpu.train`` makes before touching Spark."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from sparkgpu.errors import ConfigurationError
from sparkgpu.api.spark_gpu import GPUNamespace


def run_python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "SPARKGPU_SPARK_REMOTE"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_attach_does_not_import_pyspark_and_patches_both_sessions_when_it_is_imported():
    out = run_python("""
        import sys
        from sparkgpu.api.spark_gpu import attach
        attach()
        attach()  # idempotent
        print("pyspark loaded:", "pyspark" in sys.modules)
        from pyspark.sql import SparkSession
        from pyspark.sql.connect.session import SparkSession as ConnectSession
        print(type(SparkSession.gpu).__name__, type(ConnectSession.gpu).__name__)
    """)
    assert out.splitlines() == ["pyspark loaded: False", "property property"]


def test_attach_after_pyspark_was_imported_patches_at_once():
    out = run_python("""
        from pyspark.sql.connect.session import SparkSession as ConnectSession
        from sparkgpu.api.spark_gpu import attach
        attach()
        print(type(ConnectSession.gpu).__name__)
    """)
    assert out.strip() == "property"


def test_each_session_keeps_one_namespace():
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    from sparkgpu.api.spark_gpu import attach

    attach()
    session = object.__new__(ConnectSession)  # no server needed to look the property up
    assert isinstance(session.gpu, GPUNamespace) and session.gpu is session.gpu


def train(x):
    return x


def train_with_data(x, data_url):
    return data_url


def test_data_needs_a_data_url_parameter_before_anything_runs():
    namespace = GPUNamespace(spark=None)  # any use of the session would fail loudly
    with pytest.raises(ConfigurationError, match="keyword argument data_url"):
        namespace.train(train, gpus=2, gpu_type="A10", args=(1,), data="/data/table")
    with pytest.raises(ConfigurationError, match="either data= or"):
        namespace.train(train_with_data, gpus=2, gpu_type="A10", args=(1,), data="/t", kwargs={"data_url": "x"})


def test_train_refuses_another_backend():
    with pytest.raises(ConfigurationError, match="drop backend="):
        GPUNamespace(spark=None).train(train, gpus=1, gpu_type="A10", backend="local")


def test_remote_without_a_session_says_how_to_get_one():
    out = run_python("""
        from sparkgpu.launch.backends.spark.backend import active_spark_session
        from sparkgpu.errors import ConfigurationError
        try:
            active_spark_session()
        except ConfigurationError as exc:
            print(exc)
    """)
    assert "SPARKGPU_SPARK_REMOTE=sc://" in out and "SparkSession.builder.remote" in out


def test_the_connect_url_a_job_records_for_resume_never_holds_its_token(tmp_path):
    from types import SimpleNamespace

    from pyspark.sql.connect.client.core import DefaultChannelBuilder

    from sparkgpu.launch.backends.spark.sessions import connect_url, record_session, recorded_remote
    from sparkgpu.rundir.directory import RunDir

    def session(url):
        return SimpleNamespace(client=SimpleNamespace(_builder=DefaultChannelBuilder(url)))

    assert connect_url(session("sc://head:15002")) == "sc://head:15002"
    secret = session("sc://head:443/;use_ssl=true;token=s3cr3t;user_id=ana")
    assert connect_url(secret) == "sc://head:443/;use_ssl=true;user_id=ana"
    assert connect_url(object()) is None  # a classic session: its driver is this process

    run_dir = RunDir(tmp_path / "job-1")
    run_dir.path.mkdir()
    assert recorded_remote(run_dir) is None
    record_session(secret, run_dir)
    assert recorded_remote(run_dir) == "sc://head:443/;use_ssl=true;user_id=ana"
    assert "s3cr3t" not in "".join(p.read_text() for p in run_dir.path.iterdir())


def test_a_detached_supervisor_rebuilds_the_backend_with_its_settings_and_the_sealed_token(tmp_path):
    import os
    from types import SimpleNamespace

    from pyspark.sql.connect.client.core import DefaultChannelBuilder

    from sparkgpu.launch.backends.spark.backend import SparkBackend
    from sparkgpu.launch.backends.spark.sessions import record_session, recorded_remote
    from sparkgpu.rundir.directory import RunDir

    url = "sc://head:443/;use_ssl=true;token=s3cr3t;user_id=ana"
    spark = SimpleNamespace(client=SimpleNamespace(_builder=DefaultChannelBuilder(url)))
    backend = SparkBackend(spark, client_timeout=8.0, wait_timeout=300.0, gpus_per_node=1, staging_url="")
    assert backend.detach_refusal() is None
    key = os.urandom(32)
    run_dir = RunDir(tmp_path / "job-1", key)
    run_dir.path.mkdir()
    backend.job_written(None, run_dir)
    assert all(b"s3cr3t" not in p.read_bytes() for p in run_dir.path.iterdir())  # sealed, never in the clear
    assert recorded_remote(RunDir(run_dir.path)) == "sc://head:443/;use_ssl=true;user_id=ana"  # no key: no token
    assert recorded_remote(run_dir) == url  # the job's own processes open it

    record_session(spark, run_dir)  # an attempt records the URL again: the settings stay
    rebuilt = SparkBackend.reattach(run_dir)
    assert (rebuilt.remote, rebuilt.client_timeout, rebuilt.wait_timeout, rebuilt.gpus_per_node) == (url, 8.0, 300.0, 1)
    assert rebuilt.staging_url is None

    classic = SparkBackend(object())  # a classic session lives in this process only
    assert "classic SparkSession" in classic.detach_refusal()


def test_a_session_its_connect_server_closed_is_replaced_or_the_error_says_how_to_resume(monkeypatch):
    import io
    from types import SimpleNamespace

    from pyspark.sql.connect.client.core import DefaultChannelBuilder

    from sparkgpu.launch.backends.spark import backend as spark_backend

    def closed_session():  # what pyspark leaves after "[INVALID_HANDLE.SESSION_CHANGED] ... Please reconnect."
        return SimpleNamespace(
            is_stopped=True, client=SimpleNamespace(_builder=DefaultChannelBuilder("sc://head:15002/;token=s3cr3t"))
        )

    opened = []
    monkeypatch.setattr(spark_backend, "new_connect_session", lambda url: opened.append(url) or "the new session")
    out = io.StringIO()
    backend = spark_backend.SparkBackend(spark=closed_session(), client_timeout=None, staging_url="", out=out)
    backend._reconnect_if_closed()
    assert opened == ["sc://head:15002/;token=s3cr3t"]  # in memory only, credentials included
    assert backend.spark == "the new session"
    assert "sc://head:15002 closed this session" in out.getvalue() and "s3cr3t" not in out.getvalue()

    def server_down(url):
        raise ConnectionError("StatusCode.UNAVAILABLE: failed to connect to all addresses")

    monkeypatch.setattr(spark_backend, "new_connect_session", server_down)
    backend = spark_backend.SparkBackend(spark=closed_session(), client_timeout=None, staging_url="", out=out)
    with pytest.raises(
        ConfigurationError,
        match="cannot reconnect to the Spark Connect server at sc://head:15002 "
        r"\(ConnectionError.*`sparkgpu resume JOB_ID` continues the job",
    ):
        backend._reconnect_if_closed()


_EXITS = """
import socket, sys, time
from sparkgpu.launch.backends.spark.sessions import close_channels, session_for

with socket.socket() as s:  # a port nothing listens on: the cluster that was there is gone
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
session_for(f"sc://127.0.0.1:{port}")
if sys.argv[1] == "close":
    close_channels()
"""


def test_a_process_whose_spark_cluster_went_away_exits_at_once_once_its_channels_are_closed():
    """A detached supervisor or sweep driver ends after its job; pyspark's exit hook would call the
    gone Connect server to clean its ML cache, retrying for minutes, unless the channel was closed."""
    import time

    started = time.monotonic()
    subprocess.run([sys.executable, "-c", _EXITS, "close"], check=True, timeout=60)
    closed = time.monotonic() - started
    with pytest.raises(subprocess.TimeoutExpired):  # the hook's retries outlast any such exit
        subprocess.run([sys.executable, "-c", _EXITS, "keep"], timeout=closed + 8)
    assert closed < 8
