"""``spark.gpu`` on a real Spark standalone cluster through Spark Connect.

Two workers declare fake GPUs (worker 0: addresses 0,1; worker 1: 2,3) and the cluster says
they are simulated, so ranks run on CPU with gloo while scheduling, resource profiles,
barrier rendezvous and result collection are Spark's own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sparkgpu import CapacityError, WorkerFailedError, runtime
from sparkgpu.config import settings
from sparkgpu.launch.backends.spark.capacity import clear_capacity_cache
from tests.integration.processes import assert_no_orphans as _assert_no_orphans, ctrl_c_client, processes_of
from tests.integration.spark_cluster import every_gpu_held, hold_until
from tests.sealed import sealed_json

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("workers_share_this_image")]


@pytest.fixture
def no_tracking(monkeypatch):
    """These tests are about launching; one MLflow run per job would only slow them down."""
    from sparkgpu.config import reset_settings

    monkeypatch.setenv("SPARKGPU_TRACKING", "0")
    reset_settings()


def assert_no_orphans(run_dir, within: float = 10.0):
    _assert_no_orphans(run_dir, within=within)


def where_and_sum(x):
    import psutil
    import torch
    import torch.distributed as dist

    import sparkgpu

    t = torch.tensor([x * (runtime.get_global_rank() + 1)])
    dist.all_reduce(t)
    return {
        "rank": runtime.get_global_rank(),
        "node": runtime.get_node_rank(),
        "address": runtime.gpu_address(),
        "pid": os.getpid(),
        "sum": t.item(),
        "device": str(runtime.device()),
        "backend": dist.get_backend(),
        "forked": psutil.Process().cmdline() == psutil.Process(os.getppid()).cmdline(),
        "sparkgpu": sparkgpu.__file__,
    }


def test_train_all_reduces_across_four_ranks_on_both_workers(cluster_spark, spark_cluster):
    results = cluster_spark.gpu.train(where_and_sum, gpus=4, gpu_type="A10", args=(10,))

    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert {r["sum"] for r in results} == {10 + 20 + 30 + 40}
    assert {(r["device"], r["backend"]) for r in results} == {("cpu", "gloo")}  # simulated GPUs
    assert [r["node"] for r in results] == [0, 0, 1, 1]
    assert len({r["pid"] for r in results}) == 4
    # The executors run the client's image: the ranks are forked from their node's agent, and run
    # the shipped sparkgpu (docs/guides/launch.md, "How ranks start").
    assert all(r["forked"] and "/env/views/" in r["sparkgpu"] for r in results), results
    # Each node's ranks got the GPU addresses of the task Spark scheduled: one worker each.
    by_node = {n: sorted(r["address"] for r in results if r["node"] == n) for n in (0, 1)}
    assert sorted(by_node.values()) == [spark_cluster.worker_addresses(0), spark_cluster.worker_addresses(1)]

    spark_files = settings().staging_root / cluster_spark.gpu.last_job_id / "attempts" / "0" / "spark"
    ended = [sealed_json(spark_files / f"node-{n}.ended") for n in (0, 1)]
    assert [e["state"] for e in ended] == ["succeeded", "succeeded"]
    started = [sealed_json(spark_files / f"node-{n}.started") for n in (0, 1)]  # sealed, as every node marker
    assert len({s["executor"] for s in started}) == 2  # two executors, on two workers


@pytest.mark.usefixtures("no_tracking")
def test_the_signing_key_never_reaches_the_run_dir(cluster_spark):
    from sparkgpu.rundir.keyring import load_key

    assert cluster_spark.gpu.train(where_and_sum, gpus=2, gpu_type="A10", args=(1,))[0]["sum"] == 3
    key = load_key(cluster_spark.gpu.last_job_id).hex().encode()
    run_dir = settings().staging_root / cluster_spark.gpu.last_job_id
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert files and not any(key in p.read_bytes() for p in files)


def test_capacity_names_executors_addresses_and_type(cluster_spark):
    capacity = cluster_spark.gpu.capacity(refresh=True)

    assert capacity.master.startswith("spark://")
    assert capacity.gpu_type == "A10" and capacity.gpu_type_source == "conf" and capacity.simulated
    assert capacity.total_gpus == 4 and len(capacity.executors) == 2
    assert sorted(e.gpu_addresses for e in capacity.executors) == [("0", "1"), ("2", "3")]
    table = str(capacity)
    assert "2 executor(s), 4 GPU(s) of type A10" in table and "0,1" in table and "2,3" in table


def test_more_gpus_than_the_cluster_has_fails_within_seconds(cluster_spark):
    clear_capacity_cache()  # probe for real, as a new client would
    started = time.monotonic()
    with pytest.raises(CapacityError, match=r"asked for 6 x A10 .* reaches 4 x simulated A10 .*gpus<=4"):
        cluster_spark.gpu.train(where_and_sum, gpus=6, gpu_type="A10", args=(1,))
    assert time.monotonic() - started < 15
    with pytest.raises(CapacityError, match=r"gpu_type='H100' .* ask for gpu_type='A10'"):
        cluster_spark.gpu.train(where_and_sum, gpus=2, gpu_type="H100", args=(1,))
    assert not settings().staging_root.exists() or not any(settings().staging_root.iterdir())


def corrupt_shard_on_rank_two():
    import torch
    import torch.distributed as dist

    if runtime.get_global_rank() == 2:
        raise ValueError("shard 7 is corrupt")
    dist.all_reduce(torch.ones(1))  # the others wait on rank 2, which is gone


def assert_rank_two_is_named_with_its_traceback(err) -> None:
    """What a user reads when :func:`corrupt_shard_on_rank_two` ran: the first rank to fail, its
    message and remote source line, and the original exception chained."""
    text = str(err.value)
    assert "First to fail: rank 2 (ValueError)" in text
    assert "ValueError: shard 7 is corrupt" in text and 'raise ValueError("shard 7 is corrupt")' in text
    assert isinstance(err.value.__cause__, ValueError)


@pytest.mark.usefixtures("no_tracking")
def test_a_failing_rank_raises_with_its_remote_traceback(cluster_spark):
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as err:
        cluster_spark.gpu.train(corrupt_shard_on_rank_two, gpus=4, gpu_type="A10")
    assert_rank_two_is_named_with_its_traceback(err)
    assert time.monotonic() - started < 90
    assert_no_orphans(settings().staging_root / cluster_spark.gpu.last_job_id)


@pytest.mark.usefixtures("no_tracking")
def test_gpus_busy_outside_the_queue_make_the_barrier_stage_wait_then_give_up(
    cluster_spark, tmp_path, capsys, monkeypatch
):
    release = tmp_path / "release"
    with every_gpu_held(cluster_spark, release):
        # The holder's ticket is in another queue folder: to this client the GPUs are held by work
        # outside its queue (a plain Spark job, another tool), so it submits and Spark's barrier waits.
        monkeypatch.setenv("SPARKGPU_GPU_LOCK_DIR", str(tmp_path / "another-queue"))
        settings.cache_clear()
        started = time.monotonic()
        with pytest.raises(
            CapacityError, match=r"gave up after waiting \d+s for 1 node\(s\) x 2 A10.*raise capacity_wait= \(now 8s"
        ):
            cluster_spark.gpu.train(hold_until, gpus=2, gpu_type="A10", args=(str(release),), wait_timeout=8)
        assert 8 <= time.monotonic() - started < 60
        assert "waiting for 1 node(s) x 2 A10 on the Spark cluster" in capsys.readouterr().err


CLIENT = ctrl_c_client(
    '@distributed(gpus=4, gpu_type="A10", remote=True)',
    setup=textwrap.dedent("""
    @distributed(gpus=2, gpu_type="A10", remote=True)
    def where():
        return runtime.get_global_rank(), runtime.gpu_address()

    print("RESULTS", where.distributed(), flush=True)
"""),
)


@pytest.mark.usefixtures("no_tracking")
def test_decorator_uses_sparkgpu_spark_remote_and_ctrl_c_stops_every_process(
    spark_cluster, tmp_path, _isolated_sparkgpu_home
):
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    # os.environ carries this test's worker image lock and SPARKGPU_TRACKING=0.
    env = {
        **os.environ,
        "SPARKGPU_HOME": str(_isolated_sparkgpu_home),
        "PYTHONPATH": os.getcwd(),
        "SPARKGPU_SPARK_REMOTE": spark_cluster.connect_url,
    }
    client = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    runs = _isolated_sparkgpu_home / "runs"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        logs = list(runs.glob("forever-*/attempts/0/logs/rank-*.log"))
        if len(logs) == 4 and all("started" in p.read_text() for p in logs):
            break
        assert client.poll() is None, "the client exited early"
        time.sleep(0.3)
    else:
        client.kill()
        pytest.fail("the ranks never started")
    run_dir = next(runs.glob("forever-*"))
    assert len(processes_of(run_dir)) >= 6  # two agents and four ranks

    client.send_signal(signal.SIGINT)
    try:
        out, _ = client.communicate(timeout=90)
    except subprocess.TimeoutExpired:  # a live client would keep its job's GPUs from the next tests
        client.kill()
        raise
    assert client.returncode == 130, out
    results = eval(out.split("RESULTS", 1)[1].splitlines()[0])
    assert [rank for rank, _ in results] == [0, 1] and len({address for _, address in results}) == 2
    assert_no_orphans(run_dir)
    assert json.loads((run_dir / "state.json").read_text())["status"] == "cancelled"
    states = [sealed_json(p)["state"] for p in sorted(run_dir.glob("attempts/0/spark/node-*.ended"))]
    assert states == ["cancelled", "cancelled"]  # stopped politely, before Spark had to kill anything


def gpu_tasks_on_every_ray_node(hold):
    import os

    import ray

    @ray.remote(num_gpus=1, num_cpus=0)  # each Ray node has one CPU here: two job nodes share this host
    class Holder:  # an actor keeps its GPU for life: four at once hold all four GPUs
        def where(self):
            return ray.get_runtime_context().get_node_id(), os.environ.get("CUDA_VISIBLE_DEVICES")

    holders = [Holder.remote() for _ in range(4)]
    claims = ray.get([h.where.remote() for h in holders])
    time.sleep(hold)  # Ray's agents export what happened, the driver samples it
    return {
        "claims": claims,
        "gpus": ray.cluster_resources().get("GPU"),
        "nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
        "rank": runtime.get_global_rank(),
    }


def test_ray_launch_spans_both_executors_with_sparks_gpu_addresses_and_logs_ray_metrics(
    cluster_spark, spark_cluster, tmp_path, monkeypatch
):
    pytest.importorskip("ray", reason="@ray_launch needs ray: pip install 'sparkgpu[ray]'")
    from mlflow import MlflowClient

    from sparkgpu.ray import ray_launch, read_cluster_info
    from sparkgpu.tracking import MLflowCallback

    monkeypatch.setenv("RAY_metrics_report_interval_ms", "500")  # exported sooner than every 10 s
    tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"
    callback = MLflowCallback("/team/ray-on-spark", tracking_uri=tracking_uri, system_metrics=False, flush_interval=0.5)
    job = ray_launch(
        gpus=4,
        gpu_type="A10",
        backend=cluster_spark.gpu.backend(),
        timeout="4m",
        metrics_interval=0.5,
        callbacks=[callback],
    )(gpu_tasks_on_every_ray_node)
    out = job.distributed(4.0)

    assert out["rank"] == 0 and out["gpus"] == 4
    assert len(out["nodes"]) == 2  # one Ray node per Spark executor
    by_node: dict[str, list[str]] = {}
    for node, visible in out["claims"]:
        by_node.setdefault(node, []).append(visible)
    # Ray hands out exactly the GPU addresses Spark gave each executor's barrier task.
    assert sorted(sorted(v) for v in by_node.values()) == [
        spark_cluster.worker_addresses(0),
        spark_cluster.worker_addresses(1),
    ]
    info = read_cluster_info(job.last_run_dir, 0)
    assert sorted(n["rank"] for n in info["nodes"]) == ["0", "2"]  # each node's first rank starts it

    client = MlflowClient(tracking_uri)
    metrics = client.get_run(callback.run_id).data.metrics

    def peak(key):
        return max(m.value for m in client.get_metric_history(callback.run_id, key))

    assert metrics["ray/resources/gpu_total"] == 4
    assert peak("ray/resources/gpu_used") == 4  # the four GPU holders, read from the driver
    assert "ray/node_0/cpu_utilization_percentage" in metrics and "ray/node_2/cpu_utilization_percentage" in metrics
    assert peak("ray/actors/alive") >= 1  # Ray's own counts, exported by its agents with a lag
    assert_no_orphans(job.last_run_dir)


def imported_from():
    import torch

    import sparkgpu

    return {"torch": torch.__file__, "sparkgpu": sparkgpu.__file__}


def test_without_a_worker_lock_the_executors_are_asked_what_they_have(cluster_spark, monkeypatch, capsys):
    # The executors run this very environment: only this checkout (editable) and the caller's
    # code travel; torch and the rest of the multi-GB site-packages stay where they are.
    from sparkgpu.config import reset_settings

    monkeypatch.delenv("SPARKGPU_ENV_WORKER_LOCK")
    reset_settings()
    clear_capacity_cache()
    results = cluster_spark.gpu.train(imported_from, gpus=2, gpu_type="A10", name="image-probe")

    staged = [line for line in capsys.readouterr().err.splitlines() if "environment staged" in line]
    assert staged, "the job shipped no environment"
    uploaded_mb = float(staged[0].split("uploaded ", 1)[1].split(" MB", 1)[0])
    assert uploaded_mb < 50, staged[0]
    import torch

    assert {r["torch"] for r in results} == {torch.__file__}  # the executors' own torch, not a shipped copy

    # The second launch of an unchanged environment uploads nothing.
    again_results = cluster_spark.gpu.train(imported_from, gpus=2, gpu_type="A10", name="image-probe")
    # Each worker rehydrates into its own cache disk, and a worker that ran both jobs reuses its copy.
    copies: dict[str, set[str]] = {}
    for r in results + again_results:
        worker = re.search(r"/(worker-\d+)/cache/", r["sparkgpu"])[1]
        copies.setdefault(worker, set()).add(r["sparkgpu"])
    assert copies and all(len(paths) == 1 for paths in copies.values()), copies
    (again,) = [line for line in capsys.readouterr().err.splitlines() if "environment staged" in line]
    assert "uploaded 0.0 MB (0 blobs)" in again, again
