"""Fixtures of the integration tests: one real Spark standalone cluster per test session."""

from __future__ import annotations

import pytest

from tests.integration.spark_cluster import DISPOSABLE_CLUSTER, LocalSparkCluster, NO_JAVA, java_available


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory):
    """A standalone master, two workers declaring fake GPUs (0,1 and 2,3) and a Connect server.

    Started once (about 30 s, more on a busy machine); at the end every JVM and Python worker
    it started must be gone.
    """
    if not java_available():
        pytest.skip(NO_JAVA)
    cluster = LocalSparkCluster(
        tmp_path_factory.mktemp("spark-cluster"),
        workers=2,
        gpus_per_worker=2,
        cores_per_worker=2,
        gpu_type="A10",
        simulated=True,
    )
    cluster.start()
    exposed = cluster.exposed_listeners()
    if exposed:
        cluster.stop()
    assert not exposed, f"the test Spark cluster listens beyond loopback: {exposed}"
    yield cluster
    cluster.stop()
    left = cluster.leftover_processes()
    assert not left, "processes of the test Spark cluster survived its shutdown:\n" + "\n".join(left)


@pytest.fixture(scope="session")
def disposable_spark_cluster(tmp_path_factory):
    """A second cluster of the same shape for the tests that kill or restart its processes
    (workers, executors, the Connect server): never the shared :func:`spark_cluster`.

    One per session (a start costs 40-60 s on a busy machine); each module that uses it
    takes it through :meth:`LocalSparkCluster.repaired`, so a fault one test left behind
    is mended before the next module starts.
    """
    from tests.integration.spark_cluster import disposable_cluster

    with disposable_cluster(tmp_path_factory.mktemp("disposable-cluster"), DISPOSABLE_CLUSTER) as cluster:
        yield cluster


@pytest.fixture
def workers_share_this_image(monkeypatch, tmp_path):
    """Remote jobs of the test ship only what the workers lack (this checkout), not the whole venv,
    and rehydrate into a node cache of the test's own.

    The workers' image is this venv: every test already has ``SPARKGPU_ENV_WORKER_LOCK`` set to
    its probe (``tests/conftest.py``).
    """
    import os

    from sparkgpu.config import reset_settings

    assert os.environ.get("SPARKGPU_ENV_WORKER_LOCK"), "tests/conftest.py sets the workers' image for every test"
    monkeypatch.setenv("SPARKGPU_CACHE_DIR", str(tmp_path / "node-cache"))
    reset_settings()


@pytest.fixture(scope="session")
def cluster_spark(spark_cluster):
    """A Spark Connect session to :func:`spark_cluster` with ``spark.gpu`` attached and warmed up."""
    from sparkgpu.api.spark_gpu import attach

    attach()
    session = spark_cluster.session()
    session.gpu.capacity()  # the first Python job of a session starts the executors' Python workers
    yield session
    session.stop()


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory, request):
    """One real SQLite MLflow store per test module (creating one takes about a second):
    ``(uri, client, experiment_id)``, the experiment named after the module."""
    from mlflow import MlflowClient
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root}/mlflow.db"
    SqlAlchemyStore(uri, (root / "artifacts").as_uri())
    client = MlflowClient(uri)
    name = request.module.__name__.rsplit(".", 1)[-1]
    experiment_id = client.create_experiment(name, artifact_location=(root / "artifacts").as_uri())
    return uri, client, experiment_id


@pytest.fixture
def job_run(mlflow_store, tmp_path):
    """A fresh run in :func:`mlflow_store` and the spool a job would have for it: ``(spool, run_id)``."""
    import time

    from sparkgpu.tracking.spool import JobRunInfo, SpoolDir

    uri, client, experiment_id = mlflow_store
    run = client.create_run(experiment_id, run_name="job")
    spool = SpoolDir(tmp_path / "tracking")
    spool.write_run_info(
        JobRunInfo(
            run_id=run.info.run_id,
            experiment_id=experiment_id,
            experiment_name=client.get_experiment(experiment_id).name,
            tracking_uri=uri,
            registry_uri=uri,
            artifact_uri=run.info.artifact_uri,
            run_name="job",
            job_id="job-1",
            user_id="me",
            started_at=time.time(),
        )
    )
    return spool, run.info.run_id


@pytest.fixture(scope="session")
def trainer_uninterrupted(tmp_path_factory):
    """The uninterrupted run of test_hf_trainer.py's plain Trainer (its ranks' states, its
    ``state.json``, every step's record) that its restarts and test_hf_trainer_stops.py's stops
    must equal bitwise; trained once a session, in a home of its own."""
    from tests.integration.homes import home_of_its_own
    from tests.integration.test_hf_trainer import run

    with home_of_its_own(tmp_path_factory, cwd=True):
        states, state, steps, _ = run(tmp_path_factory.mktemp("plain"), "plain")
    return states, state, steps
