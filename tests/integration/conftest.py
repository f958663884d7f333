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
def cluster_spark(spark_cluster):
    """A Spark Connect session to :func:`spark_cluster` with ``spark.gpu`` attached and warmed up."""
    from sparkgpu.session import attach

    attach()
    session = spark_cluster.session()
    session.gpu.capacity()  # the first Python job of a session starts the executors' Python workers
    yield session
    session.stop()
