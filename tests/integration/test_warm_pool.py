"""The warm pool: ranks forked from a zygote that has torch imported."""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from sparkgpu import JobTimeoutError, WorkerFailedError, distributed, runtime
from sparkgpu.config import settings
from sparkgpu.launch.pool import PoolBackend, pool_status, stop_pool
from tests.integration.processes import assert_no_orphans

pytestmark = pytest.mark.integration


@pytest.fixture
def pool():
    backend = PoolBackend(idle_timeout=120)
    yield backend
    info = pool_status()
    stop_pool()
    if info:
        assert not psutil.pid_exists(info["pid"]) or psutil.Process(info["pid"]).status() == psutil.STATUS_ZOMBIE


def test_repeated_calls_reuse_the_pool_and_behave_like_cold_ones(pool, capsys):
    @distributed(gpus=2, gpu_type="cpu", backend=pool)
    def step(x):
        import torch
        import torch.distributed as dist

        t = torch.tensor([x * (runtime.get_global_rank() + 1)])
        dist.all_reduce(t)
        print(f"rank {runtime.get_global_rank()} of job {runtime.job_id()}", flush=True)
        return t.item(), runtime.get_world_size(), runtime.get_local_rank()

    assert step.distributed(10) == [(30, 2, 0), (30, 2, 1)]
    first_pid = pool_status()["pid"]
    started = time.monotonic()
    assert step.distributed(1) == [(3, 2, 0), (3, 2, 1)]
    warm_seconds = time.monotonic() - started
    assert pool_status()["pid"] == first_pid and pool_status()["jobs_run"] == 2
    assert f"[rank0] rank 0 of job {step.last_job_id}" in capsys.readouterr().out
    # Not a timing assertion of speed (see benchmarks/bench_launch.py), only that no new
    # interpreter was started: that alone takes seconds here.
    assert warm_seconds < 30


def test_failures_and_signals_are_reported_as_on_the_cold_path(pool):
    @distributed(gpus=2, gpu_type="cpu", backend=pool)
    def flaky():
        import ctypes

        if runtime.get_global_rank() == 1:
            raise ValueError("bad row 17")
        ctypes.string_at(0) if runtime.attempt() < 0 else time.sleep(60)

    with pytest.raises(WorkerFailedError, match="rank 1: ValueError: bad row 17") as err:
        flaky.distributed()
    assert err.value.ranks == [1]  # rank 0 was torn down, not failed
    assert_no_orphans(settings().staging_root / flaky.last_job_id)

    @distributed(gpus=2, gpu_type="cpu", backend=pool)
    def crash():
        import ctypes

        if runtime.get_global_rank() == 0:
            ctypes.string_at(0)
        time.sleep(60)

    with pytest.raises(WorkerFailedError) as err:
        crash.distributed()
    assert err.value.failures[0].exitcode == -signal.SIGSEGV and "SIGSEGV" in str(err.value)


def test_timeout_stops_the_ranks_but_keeps_the_pool(pool):
    @distributed(gpus=2, gpu_type="cpu", backend=pool, timeout=5)
    def sleepy():
        time.sleep(600)

    with pytest.raises(JobTimeoutError):
        sleepy.distributed()
    assert_no_orphans(settings().staging_root / sleepy.last_job_id)
    assert pool_status() is not None


def test_the_pool_stops_itself_when_idle():
    backend = PoolBackend(idle_timeout=2)

    @distributed(gpus=1, gpu_type="cpu", backend=backend)
    def one():
        return "done"

    assert one.distributed() == ["done"]
    deadline = time.monotonic() + 20
    while pool_status() is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pool_status() is None
    assert stop_pool() is False
