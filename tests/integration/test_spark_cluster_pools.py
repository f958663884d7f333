"""GPU pools chosen by type, on two real standalone clusters: simulated A10s and simulated H100s.

Each cluster is as small as one gets (one worker, one core, two fake GPUs); they are started
side by side once for this module and stopped after it. The pools file also names a third
pool whose Connect port nobody listens on.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import yaml

from sparkgpu import runtime
from sparkgpu.cli import main
from sparkgpu.config import reset_settings, settings
from sparkgpu.api.decorator import distributed
from sparkgpu.errors import CapacityError, ConfigurationError, PolicyViolationError
from tests.integration.spark_cluster import NO_JAVA, LocalSparkCluster, _free_port, java_available

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("workers_share_this_image")]


@pytest.fixture(scope="module")
def pool_clusters(tmp_path_factory):
    """``{"a10": cluster, "h100": cluster}``, started in parallel."""
    if not java_available():
        pytest.skip(NO_JAVA)
    clusters = {
        kind: LocalSparkCluster(
            tmp_path_factory.mktemp(f"pool-{kind}"),
            workers=1,
            gpus_per_worker=2,
            cores_per_worker=1,
            gpu_type=kind.upper(),
            simulated=True,
            name=f"pool-{kind}",
        )
        for kind in ("a10", "h100")
    }
    errors: list[BaseException] = []

    def start(cluster):
        try:
            cluster.start(timeout=400)  # two clusters starting at once on a busy 2-core machine
        except BaseException as exc:  # re-raised below, after both attempts ended
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(c,)) for c in clusters.values()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        if errors:
            raise errors[0]
        yield clusters
    finally:
        from sparkgpu.launch.backends.spark.sessions import close_sessions

        close_sessions()  # before their servers go: a client of a stopped server retries at exit
        for cluster in clusters.values():
            cluster.stop()
    left = [p for c in clusters.values() for p in c.leftover_processes()]
    assert not left, "processes of the pool clusters survived their shutdown:\n" + "\n".join(left)


@pytest.fixture
def pools_file(pool_clusters, tmp_path, monkeypatch):
    """``SPARKGPU_POOLS`` naming both clusters (the A10 pool with a policy of at most one GPU
    per job) and a pool nobody answers for."""
    policy = tmp_path / "a10-policy.yaml"
    policy.write_text("name: a10-pool\nmax_gpus_per_job: 1\n")
    pools = {
        "a10": pool_clusters["a10"].pool_entry(usage_policy=str(policy)),
        "h100": pool_clusters["h100"].pool_entry(id="0415-h100"),
        "l4-down": {"url": f"sc://127.0.0.1:{_free_port()}", "gpu_type": "L4", "gpus_per_node": 8},
    }
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump({"pools": pools}, sort_keys=False))
    monkeypatch.setenv("SPARKGPU_POOLS", str(path))
    reset_settings()
    return path


def where_am_i():
    return runtime.get_global_rank(), os.environ.get("TEST_SPARK_CLUSTER")


def test_each_gpu_type_runs_on_its_pool_and_the_callers_session_stays_its_own(pools_file):
    from pyspark.sql.connect.session import SparkSession

    h100 = distributed(where_am_i, gpus=2, gpu_type="H100", remote=True)
    assert h100.distributed() == [(0, "pool-h100"), (1, "pool-h100")]
    a10 = distributed(where_am_i, gpus=1, gpu_type="A10", remote=True)
    assert a10.distributed() == [(0, "pool-a10")]
    # The run records its pool, for usage reports and for `sparkgpu resume`.
    spec = json.loads((settings().staging_root / h100.last_job_id / "spec.json").read_text())
    assert spec["tags"]["sparkgpu.pool"] == "h100", spec
    # Pool sessions are the backend's own: none became the caller's default or active session.
    assert SparkSession.getActiveSession() is None and SparkSession._default_session is None


def test_a_pool_named_by_its_databricks_id_and_a_type_no_pool_has(pools_file, monkeypatch):
    monkeypatch.setenv("DATABRICKS_REMOTE_GPU_POOL_ID", "0415-h100")
    reset_settings()
    assert distributed(where_am_i, gpus=1, gpu_type="H100", remote=True).distributed() == [(0, "pool-h100")]
    with pytest.raises(ConfigurationError, match="pool 'h100' has H100 GPUs and the job asks for gpu_type='A10'"):
        distributed(where_am_i, gpus=1, gpu_type="A10", remote=True).distributed()

    monkeypatch.delenv("DATABRICKS_REMOTE_GPU_POOL_ID")
    reset_settings()
    staged = set(settings().staging_root.glob("where-am-i-*"))
    started = time.monotonic()
    with pytest.raises(CapacityError) as info:
        distributed(where_am_i, gpus=2, gpu_type="H200", remote=True).distributed()
    assert time.monotonic() - started < 20  # no session is opened, nothing probed
    message = str(info.value)
    assert "no pool has H200 GPUs" in message
    assert "a10 (A10, 2 per node, shared)" in message and "h100 (H100, 2 per node, shared)" in message
    assert set(settings().staging_root.glob("where-am-i-*")) == staged  # nothing staged for the refused job


def test_the_pools_usage_policy_refuses_a_job_before_it_starts(pools_file):
    job = distributed(where_am_i, gpus=2, gpu_type="A10", remote=True, pool="a10")
    with pytest.raises(PolicyViolationError, match="2 GPUs asked for, at most 1 per job"):
        job.distributed()
    assert job.last_job_id is None and not list(settings().staging_root.glob("where-am-i-*"))


def test_sparkgpu_pools_lists_live_capacity_and_the_unreachable_pool(pools_file, capsys):
    started = time.monotonic()
    assert main(["pools", "--timeout", "60", "--json"]) == 0
    assert time.monotonic() - started < 90
    listed = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert {k: (v["gpu_type"], v["reachable"], v["gpus_total"], v["gpus_free"]) for k, v in listed.items()} == {
        "a10": ("A10", True, 2, 2),
        "h100": ("H100", True, 2, 2),
        "l4-down": ("L4", False, None, None),
    }
    assert "Connection refused" in listed["l4-down"]["problem"]

    assert main(["pools", "--timeout", "60"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:6] == ["POOL", "GPU", "TYPE", "PER", "NODE", "KIND"]
    rows = {line.split()[0]: line for line in table[1:]}
    assert rows["h100"].split()[1:6] == ["H100", "2", "shared", "2", "2"]
    assert "unreachable" in rows["l4-down"]
