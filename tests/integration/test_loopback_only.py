"""A local job listens on loopback only: its rendezvous store has no authentication, and
gloo/NCCL would otherwise pick the host's external address."""

from __future__ import annotations

import pytest

from sparkgpu import distributed
from sparkgpu.launch.backends.local import zygote_client
from sparkgpu.launch.backends.local.warm import WarmBackend
from sparkgpu.launch.backends.local.zygote_client import stop_warm_zygote

pytestmark = pytest.mark.integration


def _job_listeners():
    """Every TCP socket listening in this rank's job: its launcher and all the launcher's children.

    Ranks call it between two barriers, so every rank's process group is up and nobody has left.
    """
    import os

    import psutil
    import torch.distributed as dist

    dist.barrier()
    launcher = psutil.Process(os.getppid())
    found = []
    for process in [launcher, *launcher.children(recursive=True)]:
        try:
            for conn in process.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append((process.pid, process.name(), conn.laddr.ip, conn.laddr.port))
        except psutil.NoSuchProcess:
            continue
    dist.barrier()
    return found, os.environ.get("GLOO_SOCKET_IFNAME")


def _is_loopback(ip: str) -> bool:
    import ipaddress

    address = ipaddress.ip_address(ip.split("%")[0])
    if getattr(address, "ipv4_mapped", None):
        address = address.ipv4_mapped
    return address.is_loopback


def _assert_loopback_only(results):
    listeners, interfaces = results[0]
    assert listeners, "the job's rendezvous store was not found listening at all"
    exposed = [entry for entry in listeners if not _is_loopback(entry[2])]
    assert exposed == [], f"processes of a local job listen beyond loopback: {exposed}"
    assert {r[1] for r in results} == {"lo"}, "gloo would bind the ranks' pairs to the host's external address"


def test_a_local_job_listens_on_loopback_only():
    job = distributed(gpus=2, gpu_type="cpu")(_job_listeners)
    _assert_loopback_only(job.distributed())


def test_a_warm_pool_job_listens_on_loopback_only(monkeypatch):
    monkeypatch.setattr(zygote_client, "code_fingerprint", lambda: "l00pbac4")
    try:
        job = distributed(gpus=2, gpu_type="cpu", backend=WarmBackend(idle_timeout=60))(_job_listeners)
        _assert_loopback_only(job.distributed())
    finally:
        stop_warm_zygote()


def _ray_driver_view():
    """From the driver of a ``@ray_launch`` job: who listens where, and whether a client
    without the job's token gets in."""
    import os
    import subprocess
    import sys

    import psutil

    rank = psutil.Process()
    agent = rank.parent()
    listeners = []
    for process in [agent, rank, *rank.children(recursive=True)]:
        try:
            for conn in process.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:  # the rank is Ray's driver: its sockets are Ray's
                    listeners.append((process.pid, process.pid == agent.pid, conn.laddr.ip))
        except psutil.NoSuchProcess:
            continue
    stranger_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    stranger = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ray; ray.init(address=%r); print('IN', ray.cluster_resources())" % os.environ["RAY_ADDRESS"],
        ],
        env=stranger_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return listeners, os.environ.get("RAY_AUTH_MODE"), stranger.returncode, stranger.stdout + stranger.stderr[-2000:]


def test_a_ray_launch_cluster_admits_only_the_job():
    """Ray listens on the host's address whatever it is told (it resolves 127.0.0.1 to it), so
    the job's own processes stay on loopback and Ray's cluster demands the job's token."""
    pytest.importorskip("ray", reason="@ray_launch needs ray: pip install 'sparkgpu[ray]'")
    from sparkgpu.ray import ray_launch

    listeners, auth_mode, code, output = ray_launch(gpus=1, gpu_type="cpu")(_ray_driver_view).distributed()
    ours = [entry for entry in listeners if entry[1]]  # the node agent's: the job's rendezvous store
    assert ours and all(_is_loopback(ip) for _, _, ip in ours), f"the job's store listens beyond loopback: {ours}"
    assert auth_mode == "token"
    assert code != 0 and "IN {" not in output, f"a client without the job's token joined the Ray cluster:\n{output}"
    assert "auth" in output.lower() or "token" in output.lower(), output


def test_the_spark_servers_of_the_tests_listen_on_loopback_only(spark):
    """The shared in-process Connect server (and any other JVM this test session started): its
    gRPC port, driver RPC, block manager and Python workers; its web UI is off."""
    import psutil

    spark.range(4).selectExpr("id * 2 AS x").collect()  # the driver's block manager and RPC are up
    listeners = []
    for process in psutil.Process().children(recursive=True):
        try:
            if "java" not in process.name():
                continue
            listeners += [
                (process.pid, c.laddr.ip, c.laddr.port)
                for c in process.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN
            ]
        except psutil.NoSuchProcess:
            continue
    assert listeners, "no Spark server of this session was found listening at all"
    exposed = [entry for entry in listeners if not _is_loopback(entry[1])]
    assert exposed == [], f"Spark servers of the tests listen beyond loopback: {exposed}"
