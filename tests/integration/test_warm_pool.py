"""The warm pool: ranks forked from a zygote that has torch imported."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time

import psutil
import pytest

from sparkgpu import JobTimeoutError, WorkerFailedError, distributed, runtime
from sparkgpu.config import settings
from sparkgpu.launch.backends.local import zygote_client
from sparkgpu.launch.backends.local import zygote
from sparkgpu.launch.backends.local.warm import WarmBackend
from sparkgpu.launch.backends.local.zygote_client import warm_zygote_status, stop_warm_zygote
from sparkgpu.rundir.layout import RunLayout
from tests.integration.processes import ctrl_c_client, start_client, wait_for

pytestmark = pytest.mark.integration


def assert_warm_pool_runs_no_ranks(within: float = 15.0) -> None:
    """Waits up to ``within`` seconds for the pool's ranks to end, then asserts none is left.

    Forked ranks keep the pool's command line, so they are found as its child processes, not
    by the run dir in their command line.
    """
    zygote = psutil.Process(warm_zygote_status()["pid"])
    wait_for(lambda: not zygote.children(recursive=True), within=within, interval=0.1)
    left = [f"{p.pid} {p.status()}" for p in zygote.children(recursive=True)]
    assert left == [], f"ranks of the pool still alive: {left}"


@pytest.fixture
def warm_pool(monkeypatch):
    # Other work may edit the checkout while a test runs; a pool is keyed by its code, so
    # these tests pin the key (test_a_pool_started_with_other_code_... covers a change).
    monkeypatch.setattr(zygote_client, "code_fingerprint", lambda: "c0dec0dec0de")
    backend = WarmBackend(idle_timeout=120)
    yield backend
    info = warm_zygote_status()
    stop_warm_zygote()
    if info:
        assert not psutil.pid_exists(info["pid"]) or psutil.Process(info["pid"]).status() == psutil.STATUS_ZOMBIE


def test_repeated_calls_reuse_the_pool_and_behave_like_cold_ones(warm_pool, capsys):
    @distributed(gpus=2, gpu_type="cpu", backend=warm_pool)
    def step(x):
        import torch
        import torch.distributed as dist

        t = torch.tensor([x * (runtime.get_global_rank() + 1)])
        dist.all_reduce(t)
        print(f"rank {runtime.get_global_rank()} of job {runtime.job_id()}", flush=True)
        return t.item(), runtime.get_world_size(), runtime.get_local_rank()

    assert step.distributed(10) == [(30, 2, 0), (30, 2, 1)]
    first_pid = warm_zygote_status()["pid"]
    started = time.monotonic()
    assert step.distributed(1) == [(3, 2, 0), (3, 2, 1)]
    warm_seconds = time.monotonic() - started
    assert warm_zygote_status()["pid"] == first_pid and warm_zygote_status()["jobs_run"] == 2
    assert f"[rank0] rank 0 of job {step.last_job_id}" in capsys.readouterr().out
    # Not a timing assertion of speed (see benchmarks/bench_launch.py), only that no new
    # interpreter was started: that alone takes seconds here.
    assert warm_seconds < 30


def test_a_ddp_rank_of_the_pool_finds_torch_dynamo_imported(warm_pool):
    """DDP imports torch._dynamo when it wraps a model: a second or more in every rank of every
    call (eleven where no byte code is cached), unless the pool imported it before it forked."""

    @distributed(gpus=2, gpu_type="cpu", backend=warm_pool)
    def wrap():
        import sys

        import torch

        imported_before = "torch._dynamo" in sys.modules
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        return imported_before, type(model).__name__

    assert wrap.distributed() == [(True, "DistributedDataParallel")] * 2


def test_failures_and_signals_are_reported_as_on_the_cold_path(warm_pool):
    @distributed(gpus=2, gpu_type="cpu", backend=warm_pool)
    def flaky():
        import ctypes

        if runtime.get_global_rank() == 1:
            raise ValueError("bad row 17")
        ctypes.string_at(0) if runtime.attempt() < 0 else time.sleep(60)

    with pytest.raises(WorkerFailedError, match="rank 1: ValueError: bad row 17") as err:
        flaky.distributed()
    assert err.value.ranks == [1]  # rank 0 was torn down, not failed
    assert_warm_pool_runs_no_ranks()

    @distributed(gpus=2, gpu_type="cpu", backend=warm_pool)
    def crash():
        import ctypes

        if runtime.get_global_rank() == 0:
            ctypes.string_at(0)
        time.sleep(60)

    with pytest.raises(WorkerFailedError) as err:
        crash.distributed()
    assert err.value.failures[0].exitcode == -signal.SIGSEGV and "SIGSEGV" in str(err.value)
    assert_warm_pool_runs_no_ranks()


def test_timeout_stops_the_ranks_but_keeps_the_pool(warm_pool):
    @distributed(gpus=2, gpu_type="cpu", backend=warm_pool, timeout=5)
    def sleepy():
        time.sleep(600)

    with pytest.raises(JobTimeoutError):
        sleepy.distributed()
    assert_warm_pool_runs_no_ranks()
    assert warm_zygote_status() is not None


def test_the_pool_stops_itself_when_idle():
    backend = WarmBackend(idle_timeout=2)

    @distributed(gpus=1, gpu_type="cpu", backend=backend)
    def one():
        return "done"

    assert one.distributed() == ["done"]
    deadline = time.monotonic() + 20
    while warm_zygote_status() is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert warm_zygote_status() is None
    assert stop_warm_zygote() is False


CTRL_C_CLIENT = ctrl_c_client(
    '@distributed(gpus=2, gpu_type="cpu", backend=WarmBackend(idle_timeout=120))',
    setup="from sparkgpu.launch.backends.local.warm import WarmBackend",
)


def _start_warm_pool_client(tmp_path, home):
    client = start_client(tmp_path, home, CTRL_C_CLIENT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def both_ranks_run() -> bool:
        logs = list((home / "runs").glob("*/attempts/0/logs/rank-*.log"))
        return len(logs) == 2 and all("started" in p.read_text() for p in logs)

    if not wait_for(both_ranks_run):
        client.kill()
        out, _ = client.communicate()
        pytest.fail(f"ranks never started:\n{out}")
    assert len(psutil.Process(warm_zygote_status()["pid"]).children()) == 3  # two ranks and the job's rendezvous store
    return client


def test_ctrl_c_in_the_caller_stops_the_pools_ranks(warm_pool, tmp_path, _isolated_sparkgpu_home):
    client = _start_warm_pool_client(tmp_path, _isolated_sparkgpu_home)
    client.send_signal(signal.SIGINT)
    out, _ = client.communicate(timeout=60)
    assert client.returncode == 130, out
    assert_warm_pool_runs_no_ranks()
    run_dir = next((_isolated_sparkgpu_home / "runs").iterdir())
    assert json.loads((run_dir / "state.json").read_text())["status"] == "cancelled"
    assert warm_zygote_status() is not None  # the pool outlives its client


def test_killed_client_leaves_no_ranks_in_the_pool(warm_pool, tmp_path, _isolated_sparkgpu_home):
    client = _start_warm_pool_client(tmp_path, _isolated_sparkgpu_home)
    client.kill()  # SIGKILL: no cleanup code runs in the client
    client.communicate()
    assert_warm_pool_runs_no_ranks()


def test_a_silent_or_malformed_client_holds_up_no_job(warm_pool):
    @distributed(gpus=2, gpu_type="cpu", backend=warm_pool, timeout=120)
    def step():
        return runtime.get_global_rank()

    assert step.distributed() == [0, 1]  # the pool runs
    info = warm_zygote_status()
    directory = zygote_client._warm_zygote_dir(settings().python)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(str(directory / "pool.sock"))  # and never sends a request
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as garbage:
            garbage.settimeout(30)
            garbage.connect(str(directory / "pool.sock"))
            garbage.sendall(b"not json\n")
            assert garbage.recv(64) == b""  # refused, not fatal to the pool
        outcome = []
        runner = threading.Thread(target=lambda: outcome.append(step.distributed()), daemon=True)
        runner.start()
        runner.join(timeout=90)
        assert outcome == [[0, 1]], "a client that sends nothing froze the pool"
        assert warm_zygote_status()["pid"] == info["pid"]
        silent.settimeout(zygote._REQUEST_TIMEOUT + 10)
        assert silent.recv(64) == b""  # dropped after the request timeout
    finally:
        silent.close()


def test_a_pool_started_with_other_code_is_not_reused_and_retires(warm_pool, monkeypatch):
    @distributed(gpus=1, gpu_type="cpu", backend=warm_pool)
    def which_pool():
        import os

        return os.getppid()

    monkeypatch.setattr(zygote_client, "code_fingerprint", lambda: "0ld0ld0ld0ld")
    old_pid = which_pool.distributed()[0]
    assert warm_zygote_status()["pid"] == old_pid and warm_zygote_status()["code"] == "0ld0ld0ld0ld"
    # What an upgrade of torch or an edit of sparkgpu looks like to the client.
    monkeypatch.setattr(zygote_client, "code_fingerprint", lambda: "ad0be0ad0be0")
    new_pid = which_pool.distributed()[0]
    assert new_pid != old_pid and warm_zygote_status()["code"] == "ad0be0ad0be0"
    assert wait_for(
        lambda: not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE, within=20
    )


def test_a_tampered_entrypoint_starts_no_rank_in_the_pool(warm_pool, tmp_path):
    # The pool checks the payload as the node agent does, and runs the text it checked.
    from sparkgpu.errors import PayloadSignatureError
    from sparkgpu.launch.client.supervisor import Supervisor

    @distributed(gpus=2, gpu_type="cpu", backend="warm_pool")
    def add_rank(x):
        return x + runtime.get_global_rank()

    prepared = add_rank.prepare((1,), {}).write()
    marker = tmp_path / "pwned"
    prepared.run_dir.air.write_text(f"open({str(marker)!r}, 'w').write('ran')\n" + prepared.run_dir.air.read_text())
    with pytest.raises(
        WorkerFailedError,
        match=r"ranks 0, 1: sparkgpu.errors.PayloadSignatureError: refusing to "
        r"run .*modified after it was staged",
    ) as err:
        Supervisor(prepared.job, prepared.run_dir, prepared.backend, prepared.key, []).run()
    assert isinstance(err.value.__cause__, PayloadSignatureError)
    assert not marker.exists()
    assert not list(prepared.run_dir.file(RunLayout.attempt(0)).glob("logs/rank-*.log"))
    assert add_rank.distributed(1) == [1, 2]  # the pool serves the next, untouched job


def test_a_pool_rank_that_exits_quietly_is_named_as_the_first_failure(warm_pool):
    # Stuck in the collective, the job would end at its timeout (JobTimeoutError), not as below.
    @distributed(gpus=2, gpu_type="cpu", backend=warm_pool, timeout=240)
    def leaves_early():
        import os

        import torch
        import torch.distributed as dist

        if runtime.get_global_rank() == 1:
            os._exit(0)
        t = torch.ones(1)
        dist.all_reduce(t)  # rank 0 waits for rank 1, which is gone
        return t.item()

    with pytest.raises(WorkerFailedError) as err:
        leaves_early.distributed()
    first = err.value.first_failure
    assert (first.rank, first.exitcode) == (1, 0)
    assert "rank 1: the process exited with code 0 without returning a result" in str(err.value)
    assert_warm_pool_runs_no_ranks()


def test_a_client_holding_more_than_1024_descriptors_still_gets_its_result(warm_pool):
    """A notebook or a long test session can hold descriptors past select()'s limit (1024)."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the descriptor limit ({hard}) is too low to hold 1100 open files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        assert distributed(gpus=2, gpu_type="cpu", backend=warm_pool, callbacks=[])(lambda: 7).distributed() == [7, 7]
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_crashed_rank_does_not_leave_a_checkpointing_peer_in_the_pool_to_sit_out_the_grace(warm_pool, tmp_path):
    from tests.integration.test_local_launch import assert_a_crashed_ranks_checkpointing_peer_is_killed_soon

    assert_a_crashed_ranks_checkpointing_peer_is_killed_soon(tmp_path, backend=warm_pool)


def test_jobs_that_start_the_warm_pool_at_once_share_one_zygote(warm_pool):
    # A sweep's concurrent trials find no pool at the same moment: one zygote starts, not one each
    # (the second one's socket hid the first, which then idled for its timeout with torch loaded).
    import threading

    import sys

    barrier = threading.Barrier(3)
    directories: list = []

    def start() -> None:
        barrier.wait()
        directories.append(zygote_client.ensure_warm_zygote(sys.executable, 120))

    threads = [threading.Thread(target=start) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(set(directories)) == 1 and len(directories) == 3
    (directory,) = set(directories)
    zygotes = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "sparkgpu.launch.backends.local.zygote" in " ".join(p.info["cmdline"] or ())
        and str(directory) in " ".join(p.info["cmdline"] or ())
    ]
    assert len(zygotes) == 1, [" ".join(p.info["cmdline"]) for p in zygotes]
    assert zygotes[0].pid == warm_zygote_status()["pid"]


def test_a_host_that_fails_its_preflight_check_starts_no_rank_in_the_pool(warm_pool, tmp_path, monkeypatch):
    # The pool runs the node's check as the node agent does, with its own cache disk (SPARKGPU_CACHE_DIR).
    from sparkgpu.config import reset_settings
    from sparkgpu.errors import PreflightError

    (tmp_path / "cache").write_text("the cache disk is not mounted here\n")
    monkeypatch.setenv("SPARKGPU_CACHE_DIR", str(tmp_path / "cache"))
    reset_settings()

    def add_rank(x):
        return x + runtime.get_global_rank()

    with pytest.raises(
        PreflightError, match=r"ranks 0, 1: sparkgpu.errors.PreflightError: node 0 on host .* is a file"
    ):
        distributed(gpus=2, gpu_type="cpu", backend="warm_pool", max_restarts=2)(add_rank).distributed(1)
    assert distributed(gpus=2, gpu_type="cpu", backend="warm_pool", preflight=False)(add_rank).distributed(1) == [1, 2]
