"""Two local jobs never share a GPU: the second takes other GPUs, or waits for the first's, or fails naming them."""

from __future__ import annotations

import time

import pytest

from sparkgpu import distributed
from sparkgpu.config import settings
from sparkgpu.errors import CapacityError
from sparkgpu.launch.scheduling.gpu_lease import waiting_jobs


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setenv("SPARKGPU_SIMULATE_GPUS", "H100:2")
    settings.cache_clear()


def hold(release: str) -> tuple[str | None, float, float]:
    """Runs until ``release`` exists; returns this rank's GPU and when it started and ended."""
    import os
    import time

    from sparkgpu import runtime

    started = time.time()
    deadline = time.monotonic() + 90
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)
    return runtime.gpu_address(), started, time.time()


def test_concurrent_local_jobs_get_different_gpus_or_wait_for_them(two_gpus, tmp_path, monkeypatch):
    one = distributed(gpus=1, gpu_type="H100")(hold)
    first, second = one.submit(str(tmp_path / "go")), one.submit(str(tmp_path / "go"))
    while not all(list((settings().staging_root / c.job_id).glob("attempts/0/logs/*")) for c in (first, second)):
        time.sleep(0.1)
    (tmp_path / "go").touch()
    (a, _, _), (b, _, _) = first.result(timeout=120)[0:1] + second.result(timeout=120)[0:1]
    assert {a, b} == {"0", "1"}  # not both on GPU 0, as every job took 0..n-1 before

    both = distributed(gpus=2, gpu_type="H100")(hold)
    calls = {"early": both.submit(str(tmp_path / "early")), "late": both.submit(str(tmp_path / "late"))}
    # Each job has its own supervisor, so either may take the GPUs first; the other must wait in
    # the host's queue for them (seen there, not guessed from a clock) while the first runs.
    deadline = time.monotonic() + 120
    while True:
        running = [n for n, c in calls.items() if list((settings().staging_root / c.job_id).glob("attempts/0/logs/*"))]
        queued = [n for n, c in calls.items() if c.job_id in waiting_jobs()]
        if len(running) == 1 and queued == [n for n in calls if n not in running]:
            break
        assert len(running) < 2, "both jobs started on the same two GPUs"
        assert time.monotonic() < deadline, f"running {running}, queued {queued}"
        time.sleep(0.1)
    (tmp_path / "early").touch()
    (tmp_path / "late").touch()
    first, waited = calls[running[0]], calls[queued[0]]
    first_ended = max(end for _, _, end in first.result(timeout=120))
    waited_started = min(start for _, start, _ in waited.result(timeout=120))
    assert waited_started >= first_ended  # never on the same GPUs at once


def test_a_job_that_cannot_get_gpus_in_time_names_the_busy_ones(two_gpus, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKGPU_SPARK_WAIT_TIMEOUT", "2")
    settings.cache_clear()
    both = distributed(gpus=2, gpu_type="H100")(hold)
    holder = both.submit(str(tmp_path / "release"))
    while not list((settings().staging_root / holder.job_id).glob("attempts/0/logs/*")):
        time.sleep(0.1)
    try:
        with pytest.raises(CapacityError, match=rf"(?s)busy: GPU 0: {holder.job_id} \(pid .*GPU 1: {holder.job_id}"):
            both.distributed(str(tmp_path / "never"))
    finally:
        (tmp_path / "release").touch()
    assert [gpu for gpu, _, _ in holder.result(timeout=120)] == ["0", "1"]
