"""`@ray_launch` on real processes: real `ray start` nodes on the ranks of a gloo job.

Ray starts slowly on a small machine (10-20 s per cluster), so this module starts three
clusters in all: a task graph over two Ray nodes, a failing task on one Ray node, and a
driver that dies hard.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time
import uuid

import psutil
import pytest

from sparkgpu import WorkerFailedError, runtime
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.ray import ray_launch, read_cluster_info

pytest.importorskip("ray", reason="@ray_launch needs ray: pip install 'sparkgpu[ray]'")

# One worker runs the Ray tests: they look for Ray processes and temp dirs machine-wide.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(420), pytest.mark.xdist_group("ray")]

_RAY_NAMES = ("raylet", "gcs_server")
#: Set in the test's environment, whence every rank, raylet and Ray worker the job starts inherits
#: it: Ray processes of other tests running beside these (other xdist workers) do not carry it.
_TAG = "SPARKGPU_TEST_RAY_TAG"


@pytest.fixture(autouse=True)
def ray_tag(monkeypatch):
    """Tags this test's Ray processes and gives its Ray nodes a temp root of their own."""
    tag = uuid.uuid4().hex
    root = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths stay under 108 bytes
    monkeypatch.setenv(_TAG, tag)
    monkeypatch.setenv("TMPDIR", root)
    yield tag, root
    shutil.rmtree(root, ignore_errors=True)


def _is_ray(proc) -> bool:
    name = proc.info["name"] or ""
    cmdline = " ".join(proc.info["cmdline"] or ())
    return (
        name in _RAY_NAMES
        or cmdline.startswith("ray::")
        or "ray.scripts.scripts" in cmdline
        or "site-packages/ray/" in cmdline
    )


def ray_processes() -> set[tuple[int, float]]:
    """Ray's processes on this host started by this test: daemons, `ray start`, agents, workers."""
    tag = os.environ[_TAG]
    found = set()
    for proc in psutil.process_iter(["name", "cmdline", "create_time"]):
        try:
            if _is_ray(proc) and proc.environ().get(_TAG) == tag:
                found.add((proc.pid, proc.info["create_time"]))
        except psutil.Error:
            continue
    return found


def ray_temp_dirs() -> set[str]:
    return set(glob.glob(os.path.join(os.environ["TMPDIR"], "sgray-*")))


def assert_no_new_ray_process(before: set, temp_dirs_before: set, within: float = 15.0) -> None:
    """No Ray process and no Ray temp dir the call started is left (after a short grace)."""
    deadline = time.monotonic() + within
    while (ray_processes() - before or ray_temp_dirs() - temp_dirs_before) and time.monotonic() < deadline:
        time.sleep(0.2)
    described = []
    for pid, _ in ray_processes() - before:
        try:
            described.append(" ".join(psutil.Process(pid).cmdline())[:160])
        except psutil.Error:
            continue
    assert not described, f"Ray processes survived the call: {described}"
    assert not ray_temp_dirs() - temp_dirs_before, "Ray temp dirs survived the call"


def squares_on_every_node(n, hold=0.0):
    import os

    import ray

    from sparkgpu import ray_init

    joined = ray_init()  # what databricks.air code calls first: here it returns the job's cluster

    @ray.remote(num_cpus=1)
    def square(x):
        time.sleep(0.5)  # both nodes' single CPU stay busy, so the tasks cannot pile up on one
        return x * x, ray.get_runtime_context().get_node_id()

    @ray.remote(num_cpus=1)
    def total(*parts):
        return sum(value for value, _ in parts)

    refs = [square.options(scheduling_strategy="SPREAD").remote(i) for i in range(n)]
    parts = ray.get(refs)
    result = ray.get(total.remote(*refs))
    time.sleep(hold)  # Ray's agents export what happened, the driver samples it
    return {
        "total": result,
        "task_nodes": sorted({node for _, node in parts}),
        "cluster_nodes": sorted(node["NodeID"] for node in ray.nodes() if node["Alive"]),
        "cpus": ray.cluster_resources().get("CPU"),
        "gpus": ray.cluster_resources().get("GPU", 0),
        "ray_address": os.environ.get("RAY_ADDRESS"),
        "ray_init_address": joined.address_info["gcs_address"],
        "rank": runtime.get_global_rank(),
    }


def test_task_graph_runs_on_the_ray_nodes_of_both_ranks_and_leaves_no_ray_process(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from sparkgpu.tracking import MLflowCallback

    # Ray's agents export node metrics every 10 s by default; this short job needs them sooner.
    monkeypatch.setenv("RAY_metrics_report_interval_ms", "500")
    tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"
    callback = MLflowCallback("/team/ray", tracking_uri=tracking_uri, system_metrics=False, flush_interval=0.5)
    job = ray_launch(
        gpus=2, gpu_type="cpu", ray_nodes="per_rank", timeout="6m", metrics_interval=0.5, callbacks=[callback]
    )(squares_on_every_node)
    before, dirs_before = ray_processes(), ray_temp_dirs()
    out = job.distributed(6, hold=8.0)

    assert out["total"] == sum(i * i for i in range(6))
    assert len(out["cluster_nodes"]) == 2
    assert out["task_nodes"] == out["cluster_nodes"]  # both ranks' raylets ran tasks
    assert out["cpus"] == 2 and out["gpus"] == 0  # one CPU per rank on a 2-rank CPU job
    assert out["rank"] == 0 and out["ray_address"]  # the driver ran on rank 0, RAY_ADDRESS set
    assert out["ray_init_address"] == out["ray_address"]  # ray_init() joined that cluster, started none

    run_dir = RunDir(job.last_run_dir)
    assert run_dir.read_result(0, 1) is None  # the other ranks return None
    info = read_cluster_info(run_dir.path, 0)
    assert info["address"] == out["ray_address"]
    assert sorted(n["node_id"] for n in info["nodes"]) == out["cluster_nodes"]
    assert sorted(n["rank"] for n in info["nodes"]) == ["0", "1"]

    # Ray's system metrics are in the job's one run: logical resources, each node's hardware
    # (named by the rank that started it), and task counts.
    client = MlflowClient(tracking_uri)
    run = client.get_run(callback.run_id)
    metrics = run.data.metrics
    assert metrics["ray/resources/cpu_total"] == 2
    assert len(client.get_metric_history(run.info.run_id, "ray/resources/cpu_used")) >= 3
    for node in ("node_0", "node_1"):
        assert 0 <= metrics[f"ray/{node}/cpu_utilization_percentage"] <= 100
        assert metrics[f"ray/{node}/memory_used_megabytes"] > 0
    finished = client.get_metric_history(run.info.run_id, "ray/tasks/finished")
    assert max(m.value for m in finished) >= 7  # six squares and their total
    ray_dir = run_dir.file(RunLayout.attempt(0)) / "ray"
    for rank in (0, 1):  # each node's Ray logs outlive its temp dir
        assert (ray_dir / "logs" / f"rank-{rank}" / "raylet.out").is_file()
    assert_no_new_ray_process(before, dirs_before)


@ray_launch(gpus=2, gpu_type="cpu", timeout="6m")
def parse_shards():
    import ray

    @ray.remote(num_cpus=1)
    def parse(shard):
        if shard == 3:
            raise ValueError(f"shard {shard} has a corrupt header")
        return shard

    return ray.get([parse.remote(i) for i in range(5)])


def test_a_failing_ray_task_surfaces_its_traceback_and_releases_every_rank():
    before, dirs_before = ray_processes(), ray_temp_dirs()
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as err:
        parse_shards.distributed()
    assert time.monotonic() - started < 240
    text = str(err.value)
    assert err.value.ranks == [0]  # the driver's failure, not the waiting ranks'
    assert "RayTaskError" in text and "shard 3 has a corrupt header" in text
    assert 'raise ValueError(f"shard {shard} has a corrupt header")' in text  # the task's own frame
    assert isinstance(err.value.__cause__, ValueError)  # Ray's RayTaskError(ValueError), chained
    run_dir = RunDir(parse_shards.last_run_dir)
    assert run_dir.read_result(0, 1) is None  # rank 1 was released by the driver's failure
    info = read_cluster_info(run_dir.path, 0)
    assert len(info["nodes"]) == 1  # per_node: both ranks share one Ray node with the host's CPUs
    assert_no_new_ray_process(before, dirs_before)


@ray_launch(gpus=2, gpu_type="cpu", ray_nodes="per_rank", timeout="6m")
def driver_dies():
    import os

    import ray

    ray.get(ray.remote(lambda: 1).remote())  # a Ray worker process exists on the cluster
    os._exit(7)


def test_a_driver_that_dies_hard_leaves_no_ray_process():
    before, dirs_before = ray_processes(), ray_temp_dirs()
    with pytest.raises(WorkerFailedError, match="rank 0: the process exited with code 7") as err:
        driver_dies.distributed()
    first = err.value.first_failure
    assert first.rank == 0 and first.exitcode == 7
    # Rank 1 can only have been stopped by the launcher (SIGTERM), after it stopped its Ray node.
    assert all(f.exitcode == -15 for f in err.value.failures if f.rank != 0)
    assert_no_new_ray_process(before, dirs_before)
    logs = RunDir(driver_dies.last_run_dir).file(RunLayout.attempt(0)) / "ray" / "logs"
    for rank in (0, 1):  # kept by the watchdogs, since neither rank ran its own cleanup to the end
        assert (logs / f"rank-{rank}" / "raylet.out").is_file()
