"""Fixtures of the integration tests: one real Spark standalone cluster per test session."""

from __future__ import annotations

import pytest

from tests.integration.spark_cluster import LocalSparkCluster, java_available


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory):
    """A standalone master, two workers declaring fake GPUs (0,1 and 2,3) and a Connect server.

    Started once (about 30 s, more on a busy machine); at the end every JVM and Python worker
    it started must be gone.
    """
    if not java_available():
        pytest.skip("the Spark cluster tests need Java (a JRE 17): install openjdk-17-jre-headless or set JAVA_HOME")
    cluster = LocalSparkCluster(tmp_path_factory.mktemp("spark-cluster"), workers=2, gpus_per_worker=2,
                                cores_per_worker=2, gpu_type="A10", simulated=True)
    cluster.start()
    yield cluster
    cluster.stop()
    left = cluster.leftover_processes()
    assert not left, "processes of the test Spark cluster survived its shutdown:\n" + "\n".join(left)


@pytest.fixture(scope="session")
def worker_image_lock(tmp_path_factory):
    """What the executors' image holds (this venv), so remote jobs ship only what it lacks."""
    import subprocess
    import sys

    from sparkgpu.env import hydrate_module_path

    probe = subprocess.run([sys.executable, str(hydrate_module_path()), "--probe"], capture_output=True, text=True,
                           check=True).stdout
    path = tmp_path_factory.mktemp("worker-image") / "worker.json"
    path.write_text(probe)
    return path


@pytest.fixture
def workers_share_this_image(worker_image_lock, monkeypatch, tmp_path):
    """Remote jobs of the test ship only what the workers lack (this checkout), not the whole venv."""
    from sparkgpu.config import reset_settings

    monkeypatch.setenv("SPARKGPU_ENV_WORKER_LOCK", str(worker_image_lock))
    monkeypatch.setenv("SPARKGPU_CACHE_DIR", str(tmp_path / "node-cache"))
    reset_settings()


@pytest.fixture(scope="session")
def cluster_spark(spark_cluster):
    """A Spark Connect session to :func:`spark_cluster` with ``spark.gpu`` attached and warmed up."""
    from sparkgpu.session import attach

    attach()
    session = spark_cluster.session()
    session.gpu.capacity()  # the first Python job of a session starts the executors' Python workers
    yield session
    session.stop()
