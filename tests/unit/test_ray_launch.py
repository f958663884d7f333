"""`@ray_launch` without a Ray cluster: decoration, the node plan, commands, and node teardown.

The teardown tests run real processes that behave like `ray start --block` (a session of
daemons, a worker in a process group of its own that ignores SIGTERM), so the kill logic is
exercised for real without paying for a Ray start.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import textwrap
import time

import tempfile
from pathlib import Path

import psutil
import pytest

from sparkgpu.errors import ConfigurationError, MissingDependencyError, SerializationError
from sparkgpu.ray import RankResources, RayClusterError, RayNodeSpec, plan_ray_nodes, ray_launch
from sparkgpu.ray.node import RayNode
from sparkgpu.ray.plan import ray_node_env, ray_start_command, short_temp_dir
from tests.fakes.backend import ScriptedBackend

GB = 1_000_000_000

# Decoration only asks whether ray is installed; these tests never start it, so they pretend
# it is where it is not.
PRETEND_RAY = """
import importlib.machinery, importlib.util
_real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: (
    importlib.machinery.ModuleSpec("ray", None) if name == "ray" and _real(name) is None else _real(name, *a, **k))
"""


@pytest.fixture(autouse=True)
def ray_installed(monkeypatch):
    real = importlib.util.find_spec
    if real("ray") is None:
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a, **k: importlib.machinery.ModuleSpec("ray", None) if name == "ray" else real(name, *a, **k),
        )


@pytest.fixture
def no_ray(monkeypatch, ray_installed):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "ray" or name.startswith("ray.") else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


# -- decoration --------------------------------------------------------------------------------
def test_missing_ray_is_reported_at_decoration_time_with_the_install_command(no_ray):
    with pytest.raises(MissingDependencyError) as err:

        @ray_launch(gpus=2, gpu_type="cpu")
        def job():
            return 1

    assert "pip install 'sparkgpu[ray]'" in str(err.value) and "@ray_launch" in str(err.value)
    with pytest.raises(MissingDependencyError):
        ray_launch(lambda: 1)  # bare use too
    assert isinstance(err.value, ImportError)  # `except ImportError` guards keep working


def test_decorating_does_not_import_ray_on_the_client():
    code = PRETEND_RAY + textwrap.dedent("""
        import sys
        from sparkgpu.ray import ray_launch

        @ray_launch(gpus=2, gpu_type="cpu")
        def job():
            return 1

        job.dryrun()
        assert "ray" not in sys.modules, "ray was imported"
        print("ok")
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_distributed_arguments_pass_through_and_are_validated_at_decoration():
    @ray_launch(gpus=3, gpu_type="cpu", timeout="1h", max_restarts=2, tags={"team": "ml"}, ray_nodes="per_rank")
    def job():
        return 1

    assert job.resources.gpus == 3 and job.resources.gpu_type == "cpu"
    assert job.policy.timeout == 3600 and job.policy.max_restarts == 2
    assert job.job.tags == {"team": "ml"} and job.job.name == "job" and job.__name__ == "job"
    assert "ray_nodes='per_rank'" in repr(job)
    with pytest.raises(ConfigurationError, match="unknown gpu_type 'T4'"):
        ray_launch(gpus=1, gpu_type="T4")
    with pytest.raises(ConfigurationError, match="remote=True needs a gpu_type"):
        ray_launch(gpus=2, remote=True)
    with pytest.raises(ConfigurationError, match="unknown argument.*num_workers.*gpu_type"):
        ray_launch(gpus=2, num_workers=4)
    with pytest.raises(ConfigurationError, match="ray_nodes='per_gpu'"):
        ray_launch(gpus=2, ray_nodes="per_gpu")
    with pytest.raises(ConfigurationError, match="ray_start_timeout"):
        ray_launch(gpus=2, ray_start_timeout="soon")
    positional = ray_launch(2, "cpu")(job.fn)  # databricks.air's positional num_accelerators, accelerator_type
    assert positional.num_accelerators == 2 and positional.resources.gpu_type == "cpu"


def test_distributed_returns_the_drivers_value_not_the_list_of_ranks():
    @ray_launch(gpus=2, gpu_type="cpu", backend=ScriptedBackend(["ok"]))
    def job():
        return 1

    assert job.distributed() == {"rank": 0, "attempt": 0}  # rank 0's result, as the scripted ranks wrote it
    assert job.last_job_id.startswith("job-") and job.last_run_dir.endswith(job.last_job_id)


def test_plain_call_runs_the_function_here():
    @ray_launch(gpus=2, gpu_type="cpu")
    def add(a, b):
        return a + b

    assert add(2, 3) == 5


def test_unpicklable_function_names_the_culprit_before_anything_starts(_isolated_sparkgpu_home):
    import threading

    lock = threading.Lock()

    @ray_launch(gpus=2, gpu_type="cpu")
    def job():
        with lock:
            return 1

    with pytest.raises(SerializationError, match="closure variable 'lock'"):
        job.distributed()
    assert not (_isolated_sparkgpu_home / "runs").exists()


# -- the plan ----------------------------------------------------------------------------------
def ranks(n, *, per_node=None, gpus=True, host_cpus=16, memory=100 * GB, hosts=None):
    per_node = per_node or n
    return [
        RankResources(
            rank=r,
            node_rank=r // per_node,
            hostname=(hosts or {}).get(r // per_node, f"host{r // per_node}"),
            cpus=host_cpus,
            gpu=str(r % per_node) if gpus else None,
            memory_available=memory,
        )
        for r in range(n)
    ]


def test_per_node_gives_one_ray_node_all_of_its_gpus():
    plan = plan_ray_nodes(ranks(8), "per_node")
    assert list(plan) == [0]
    head = plan[0]
    assert head.head and head.num_gpus == 8 and head.devices == tuple("01234567") and head.num_cpus == 16
    assert head.object_store_memory is None and head.memory is None  # Ray's defaults: it owns the host


def test_per_node_on_two_nodes_starts_a_head_and_a_worker_led_by_each_nodes_first_rank():
    plan = plan_ray_nodes(ranks(8, per_node=4), "per_node")
    assert sorted(plan) == [0, 4]
    assert plan[0].head and not plan[4].head
    assert plan[4].devices == ("0", "1", "2", "3") and plan[4].num_cpus == 16


def test_per_rank_splits_the_host_between_its_ray_nodes():
    plan = plan_ray_nodes(ranks(4, host_cpus=16, memory=40 * GB), "per_rank")
    assert sorted(plan) == [0, 1, 2, 3]
    assert [p.head for p in plan.values()] == [True, False, False, False]
    assert all(p.num_gpus == 1 and p.num_cpus == 4 for p in plan.values())
    assert plan[2].devices == ("2",)
    assert plan[0].object_store_memory == 3 * GB and plan[0].memory == 7 * GB  # 30% / 70% of 40 GB, in 4


def test_two_job_nodes_on_one_host_share_it_and_cpu_ranks_get_no_gpus():
    plan = plan_ray_nodes(ranks(4, per_node=2, gpus=False, host_cpus=2, hosts={0: "box", 1: "box"}), "per_node")
    assert sorted(plan) == [0, 2]
    assert all(p.num_gpus == 0 and p.num_cpus == 1 and p.object_store_memory for p in plan.values())
    tiny = plan_ray_nodes(ranks(4, gpus=False, host_cpus=2), "per_rank")
    assert all(p.num_cpus == 1 for p in tiny.values())  # never zero CPUs


def test_unknown_layout_is_a_configuration_error():
    with pytest.raises(ConfigurationError, match="per_node"):
        plan_ray_nodes(ranks(2), "per_gpu")


# -- commands and environment ------------------------------------------------------------------
def test_head_and_worker_commands():
    head = ray_start_command(RayNodeSpec(0, True, 4, ("0", "1")), "/tmp/sgray-x")
    assert head[1:5] == ["-m", "ray.scripts.scripts", "start", "--block"]
    for flag in (
        "--head",
        "--port=0",
        "--disable-usage-stats",
        "--temp-dir=/tmp/sgray-x",
        "--num-cpus=4",
        "--num-gpus=2",
        "--include-dashboard=false",
    ):
        assert flag in head
    assert any(a.startswith("--dashboard-port=") for a in head)
    assert any(a.startswith("--ray-client-server-port=") for a in head)
    worker = ray_start_command(RayNodeSpec(1, False, 2, (), 5 * GB, 9 * GB), "/tmp/sgray-y", "10.0.0.1:6379")
    assert "--address=10.0.0.1:6379" in worker and "--head" not in worker
    assert f"--object-store-memory={5 * GB}" in worker and f"--memory={9 * GB}" in worker
    with pytest.raises(RayClusterError, match="no head address"):
        ray_start_command(RayNodeSpec(1, False, 2), "/tmp/sgray-z")


def test_temp_dir_is_short_even_under_a_long_tmpdir(monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    path = short_temp_dir()
    try:
        # Ray appends /session_<date>_<time>_<usec>_<pid>/sockets/plasma_store (about 63 bytes).
        assert len(path) + 63 <= 107 and os.path.isdir(path)
    finally:
        os.rmdir(path)


def test_raylet_environment_drops_the_rank_identity_and_carries_the_nodes_gpus():
    base = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
        "TORCHELASTIC_RUN_ID": "x",
        "SPARKGPU_GPU_ADDRESS": "1",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "SPARKGPU_NODE_DEVICES": "0,1,2,3",
        "SPARKGPU_JOB_ID": "job-1",
        "PYTHONPATH": "/opt/lib",
        "HOME": "/root",
    }
    env = ray_node_env(RayNodeSpec(0, True, 8, ("0", "1")), base, import_paths=["/srv/proj"])
    for gone in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "SPARKGPU_GPU_ADDRESS",
        "SPARKGPU_NODE_DEVICES",
    ):
        assert gone not in env
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["SPARKGPU_JOB_ID"] == "job-1"
    assert env["PYTHONPATH"] == os.pathsep.join(["/srv/proj", "/opt/lib"])
    assert env["RAY_USAGE_STATS_ENABLED"] == "0"
    assert ray_node_env(RayNodeSpec(1, False, 1), base, import_paths=[])["CUDA_VISIBLE_DEVICES"] == ""


# -- a node's processes, with a stand-in for `ray start --block` --------------------------------
FAKE_RAY_START = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    temp_dir, mode = sys.argv[1], sys.argv[2]
    print("fake ray start", mode, flush=True)
    if mode == "fail":
        print("error: port 6379 is already in use", flush=True)
        sys.exit(3)
    logs = os.path.join(temp_dir, "session_latest", "logs")
    os.makedirs(logs)
    open(os.path.join(logs, "raylet.out"), "w").write("raylet up\\n")
    # Like a Ray worker: its own process group, deaf to SIGTERM, still in the session.
    worker = subprocess.Popen([sys.executable, "-c",
        "import os, signal, time; os.setpgid(0, 0); signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    open(os.path.join(temp_dir, "worker.pid"), "w").write(str(worker.pid))
    if mode != "never_up":
        open(os.path.join(temp_dir, "ray_current_cluster"), "w").write("10.1.2.3:6379")
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
""")


def fake_node(tmp_path, mode):
    temp_dir = short_temp_dir()
    return RayNode(
        [sys.executable, "-c", FAKE_RAY_START, temp_dir, mode],
        dict(os.environ),
        temp_dir,
        tmp_path / "ray" / "start-rank-0.log",
        keep_logs=tmp_path / "kept",
    )


def wait_for_pid_file(path, timeout=30):
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return int(path.read_text())


def test_node_start_returns_the_address_and_stop_kills_the_whole_session(tmp_path):
    node = fake_node(tmp_path, "stubborn")
    try:
        assert node.start(timeout=60) == "10.1.2.3:6379"
        worker = wait_for_pid_file(Path(node.temp_dir) / "worker.pid")
        members = {p.pid for p in node.session_processes()}
        assert node.process.pid in members and worker in members
    finally:
        node.stop(grace=0.5)
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
    assert node.session_processes() == []
    assert (tmp_path / "kept" / "raylet.out").read_text() == "raylet up\n"  # logs outlive the temp dir
    assert not os.path.exists(node.temp_dir)
    node.stop()  # a second stop is harmless


def test_a_failed_ray_start_is_an_error_with_its_output(tmp_path):
    node = fake_node(tmp_path, "fail")
    try:
        with pytest.raises(RayClusterError, match=r"exited with code 3(.|\n)*port 6379 is already in use"):
            node.start(timeout=60)
    finally:
        node.stop()


def test_a_node_that_never_comes_up_times_out_with_a_hint(tmp_path):
    node = fake_node(tmp_path, "never_up")
    try:
        with pytest.raises(RayClusterError, match="not up after 2s; raise ray_start_timeout="):
            node.start(timeout=2)
        worker = wait_for_pid_file(Path(node.temp_dir) / "worker.pid")
    finally:
        node.stop(grace=0.5)
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE


def test_the_watchdog_kills_the_session_when_the_rank_dies_without_cleanup(tmp_path):
    """A rank killed with SIGKILL runs no cleanup; its watchdog sweeps the node's session."""
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.getcwd()!r})
        from pathlib import Path
        from sparkgpu.ray.node import RayNode
        from sparkgpu.ray.plan import short_temp_dir
        from tests.unit.test_ray_launch import FAKE_RAY_START
        temp_dir = short_temp_dir()
        node = RayNode([sys.executable, "-c", FAKE_RAY_START, temp_dir, "stubborn"], dict(os.environ),
                       temp_dir, Path({str(tmp_path)!r}) / "start.log", keep_logs=Path({str(tmp_path)!r}) / "kept")
        node.start(timeout=60)
        worker_pid = Path(temp_dir) / "worker.pid"
        while not (worker_pid.exists() and worker_pid.read_text()):
            pass
        print(temp_dir, node.process.pid, worker_pid.read_text(), flush=True)
        os._exit(9)  # no finally, no stop()
    """)
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 9, out.stderr
    temp_dir, session, worker = out.stdout.split()
    worker = int(worker)
    deadline = time.monotonic() + 15
    alive = [worker]
    while alive and time.monotonic() < deadline:
        alive = [
            pid
            for pid in (worker, int(session))
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        ]
        time.sleep(0.1)
    assert alive == []
    deadline = time.monotonic() + 15
    while os.path.exists(temp_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(temp_dir)  # the watchdog removed the temp dir...
    assert (tmp_path / "kept" / "raylet.out").read_text() == "raylet up\n"  # ...after keeping the logs
