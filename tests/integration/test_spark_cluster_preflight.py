"""A Spark node that fails its pre-flight check is named, starts no rank, and is left out.

On the real standalone cluster, whose workers each have a cache disk of their own
(``SPARKGPU_CACHE_DIR`` of their executors): worker 1's becomes a file, as a cache disk that is
not mounted where the node expects it.

* A 2-node job (one node per worker) starts no rank: the attempt fails as ``bad_node``, naming
  worker 1's executor, its host and the check; its restart finds the cluster one executor short
  without it, waits its ``capacity_wait`` for capacity, and raises naming the executor and the fix.
* A 1-node job of the same client then runs with a spare task: the task on worker 1's executor
  stands aside and the job's ranks run on worker 0.

Named ``test_spark_cluster_*`` so the session orders it with the other cluster tests.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from sparkgpu.config import settings
from sparkgpu.errors import PreflightError
from sparkgpu.launch.backends.spark import exclusions
from tests.integration.test_spark_cluster import no_tracking  # noqa: F401 (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("no_tracking")]


def _cache_dir() -> str:
    return os.environ["SPARKGPU_CACHE_DIR"]  # the executor's own: it tells the worker apart


@pytest.fixture
def worker_1_without_its_cache_disk(spark_cluster):
    disk = spark_cluster.cache_dir(1)
    shutil.rmtree(disk, ignore_errors=True)
    disk.write_text("not a folder: the cache disk is not mounted here\n")
    exclusions.forget()
    yield disk
    disk.unlink()
    disk.mkdir()
    exclusions.forget()


def test_a_node_that_fails_its_preflight_check_is_named_starts_nothing_and_is_left_out(
    cluster_spark, spark_cluster, worker_1_without_its_cache_disk, capfd
):
    executors = spark_cluster.executor_pids()
    bad = next(executor for executor, (_, worker) in executors.items() if worker == 1)
    train = cluster_spark.gpu.train

    with pytest.raises(PreflightError) as err:
        train(_cache_dir, gpus=4, gpu_type="A10", max_restarts=2, capacity_wait="3s", timeout=300)
    message = str(err.value)
    assert (
        f"executor {bad} on host 127.0.0.1 failed it: cache_disk: {worker_1_without_its_cache_disk} is a file"
        in message
    )
    assert "1 node slot(s) for the job's 2" in message and "sparkgpu resume" in message
    assert message.endswith("(waited 3s for capacity: capacity_wait=)")
    said = capfd.readouterr()
    said = said.out + said.err
    assert f"attempt 0 failed (bad_node: executor {bad} on host 127.0.0.1 failed its pre-flight check" in said
    assert "waiting up to 3s for capacity (capacity_wait=; not billed): without the executors" in said
    job_dir = max(settings().staging_root.iterdir(), key=lambda p: p.stat().st_mtime)
    state = json.loads((job_dir / "state.json").read_text())
    # The restart was refused at its submit, as bad_node too.
    assert [a["failure_class"] for a in state["attempts"]] == ["bad_node"] * 2
    assert not list((job_dir / "attempts" / "0").glob("logs/rank-*"))  # no rank started anywhere
    report = json.loads((job_dir / "attempts" / "0" / "report.json").read_text())
    assert [(b["executor"], b["state"]) for b in report["bad"]] == [(bad, "bad-node")]

    # The same client's next job leaves the executor out: a spare task stands in for it.
    assert train(_cache_dir, gpus=2, gpu_type="A10", timeout=300) == [str(spark_cluster.cache_dir(0))] * 2
    said = capfd.readouterr()
    assert f"leaves out executor(s) {bad}, which failed their pre-flight check; 1 spare task(s) stand in" in (
        said.out + said.err
    )
