"""An executor whose every core is busy never answers the capacity probe; a job that needs it waits.

Its own standalone cluster (two workers, 2 cores and fake GPUs 0,1 / 2,3 each) whose Connect
server declares ``spark.executor.instances=2``, as YARN and Kubernetes clusters do. A plain
Spark job of three long tasks fills one executor's two cores and one core of the other.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from sparkgpu import runtime
from sparkgpu.config import settings
from tests.integration.spark_cluster import LocalSparkCluster, NO_JAVA, java_available

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("workers_share_this_image")]


@pytest.fixture(scope="module")
def counted_cluster(tmp_path_factory):
    if not java_available():
        pytest.skip(NO_JAVA)
    cluster = LocalSparkCluster(
        tmp_path_factory.mktemp("counted-cluster"),
        workers=2,
        gpus_per_worker=2,
        cores_per_worker=2,
        gpu_type="A10",
        simulated=True,
        extra_conf={"spark.executor.instances": "2"},
    )
    cluster.start()
    try:
        from sparkgpu.api.spark_gpu import attach

        attach()
        session = cluster.session()
        yield cluster, session
        session.stop()
    finally:
        cluster.stop()
    left = cluster.leftover_processes()
    assert not left, "processes of the test Spark cluster survived its shutdown:\n" + "\n".join(left)


def rank_and_address():
    return runtime.get_global_rank(), runtime.gpu_address()


def test_a_job_that_needs_an_executor_with_every_core_busy_waits_for_it(counted_cluster, tmp_path):
    cluster, session = counted_cluster
    session.gpu.capacity()  # starts the executors' Python workers while every core is free
    release, markers = str(tmp_path / "release"), tmp_path / "markers"
    markers.mkdir()

    def hold_a_core(batches):  # nested, so Spark ships it by value: executors cannot import tests/
        import os
        import time as _t

        import pyarrow as pa

        from sparkgpu.launch.backends.spark.executor.probe import executor_identity

        for _ in batches:
            pass
        open(os.path.join(str(markers), f"{os.getpid()}-{executor_identity().executor_id}"), "w").close()
        while not os.path.exists(release):  # a plain Spark task that keeps its core until released
            _t.sleep(0.2)
        yield pa.RecordBatch.from_pydict({"n": [1]})

    hold = session.range(0, 3, 1, 3).mapInArrow(hold_a_core, "n long")
    holder = threading.Thread(target=hold.collect, daemon=True)
    holder.start()
    job: dict = {}
    trainer = None
    try:
        deadline = time.monotonic() + 120
        while len(list(markers.iterdir())) < 3:
            assert time.monotonic() < deadline, "the holding job never started its three tasks"
            time.sleep(0.2)
        per_executor = Counter(p.name.split("-", 1)[1] for p in markers.iterdir())
        assert sorted(per_executor.values()) == [1, 2]  # one executor has no free core left

        capacity = session.gpu.capacity(refresh=True)
        assert [e.busy for e in capacity.executors] == [False, True] and capacity.total_gpus == 4
        assert "1 executor(s) with every core busy: 2 x simulated A10 each" in capacity.describe()

        def train():
            try:
                job["result"] = session.gpu.train(rank_and_address, gpus=4, gpu_type="A10", wait_timeout=240)
            except BaseException as exc:  # surfaced by the assertions below
                job["error"] = exc

        trainer = threading.Thread(target=train)
        trainer.start()
        # The job is submitted and waits for the busy executor instead of failing at once.
        runs = settings().staging_root
        while not list(runs.glob("rank-and-address-*/attempts/0/spark")):
            assert "error" not in job, job.get("error")
            assert time.monotonic() < deadline + 120, "the job was never submitted"
            time.sleep(0.2)
        time.sleep(3)
        assert "error" not in job, job.get("error")
        assert not list(runs.glob("rank-and-address-*/attempts/0/spark/node-*.started"))
    finally:
        Path(release).write_text("go")
        holder.join(120)
    if trainer is not None:
        trainer.join(300)
    assert "error" not in job, job.get("error")
    results = job["result"]
    assert [rank for rank, _ in results] == [0, 1, 2, 3]
    assert sorted(address for _, address in results) == ["0", "1", "2", "3"]  # both executors' GPUs
