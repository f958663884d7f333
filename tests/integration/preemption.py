"""What the preemption tests share: two simulated GPUs, a critical job's function, and the checks
that a preempted best-effort job gave way, waited first in line and was billed for none of its wait."""

from __future__ import annotations

import time

import pytest

from sparkgpu.cli import list_jobs
from sparkgpu.config import settings
from sparkgpu.usage.rates import billed_seconds


@pytest.fixture
def two_gpus(monkeypatch, tmp_path):
    """Two simulated H100s, and a host GPU queue of the test's own."""
    monkeypatch.setenv("SPARKGPU_SIMULATE_GPUS", "H100:2")
    monkeypatch.setenv("SPARKGPU_GPU_LOCK_DIR", str(tmp_path / "gpu-locks"))
    settings.cache_clear()
    yield
    settings.cache_clear()


def urgent(seconds: float) -> tuple[float, float]:
    """The critical job: holds its GPUs for ``seconds``; returns when it ran."""
    import time

    started = time.time()
    time.sleep(seconds)
    return started, time.time()


def steps_recorded(record) -> int:
    """Steps rank 0 of the job recording to ``record`` has done so far."""
    try:
        return sum(1 for _ in open(f"{record}.0"))
    except FileNotFoundError:
        return 0


def wait_until_it_waits_first_in_line(call, deadline: float) -> dict:
    """Waits until ``sparkgpu jobs`` shows the preempted job waiting, first in line (once the
    critical job took its GPUs and left the queue); returns its listing."""
    listed: dict = {}
    while (listed.get("status"), listed.get("queue_position")) != ("waiting", 1):
        assert time.monotonic() < deadline and not call.done(), f"the best-effort job never gave way: {listed}"
        time.sleep(0.2)
        listed = next(j for j in list_jobs() if j["job_id"] == call.job_id)
    return listed


def assert_billed_only_while_running(ledger, job_id: str, state: dict, ranks: int, urgent_span) -> None:
    """One usage row per attempt (preempted, then succeeded), each billed for its own span, and
    neither overlapping the critical job's run: nothing was billed while the job waited."""
    rows = sorted((r for r in ledger.read().to_pylist() if r["job_id"] == job_id), key=lambda r: r["attempt"])
    assert [(r["attempt"], r["status"]) for r in rows] == [(0, "preempted"), (1, "succeeded")]
    for row, attempt in zip(rows, state["attempts"]):
        assert row["gpu_seconds"] == ranks * billed_seconds(attempt["started_at"], attempt["ended_at"])
    urgent_started, urgent_ended = urgent_span
    assert rows[0]["ended_at"].timestamp() <= urgent_started and rows[1]["started_at"].timestamp() >= urgent_ended
