"""Priorities on one host's GPUs: a critical job preempts a best-effort one by checkpoint, and both finish.

Two simulated GPUs, real gloo ranks, the project's loader and checkpointer, a real Delta usage
ledger. The best-effort job is asked (through the host's GPU queue) to checkpoint and stop, the
critical job runs on its GPUs, and the best-effort job resumes by itself once they are free: it
ends bitwise equal to an uninterrupted run, uses no restart, and is billed for no second of the
wait.
"""

from __future__ import annotations

import json
import time

import pytest

from sparkgpu import distributed
from sparkgpu.cli import list_jobs
from sparkgpu.config import settings
from sparkgpu.usage import UsageLedger, UsageMeter
from sparkgpu.usage.rates import billed_seconds
from tests.integration.test_restart_exactness import (  # noqa: F401  (dataset_dir: a fixture)
    WORLD,
    assert_bitwise_equal,
    dataset_dir,
    train_exactly,
    trained_batches,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def two_gpus(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARKGPU_SIMULATE_GPUS", "H100:2")
    monkeypatch.setenv("SPARKGPU_GPU_LOCK_DIR", str(tmp_path / "gpu-locks"))  # this test's own host queue
    settings.cache_clear()
    yield
    settings.cache_clear()


def urgent(seconds: float) -> tuple[float, float]:
    import time

    started = time.time()
    time.sleep(seconds)
    return started, time.time()


def _state(job_id: str) -> dict:
    return json.loads((settings().staging_root / job_id / "state.json").read_text())


def _steps_recorded(record) -> int:
    try:
        return sum(1 for _ in open(f"{record}.0"))
    except FileNotFoundError:
        return 0


def test_a_critical_job_preempts_a_best_effort_one_which_resumes_exactly_and_unbilled(dataset_dir, tmp_path, two_gpus):
    plain = distributed(gpus=WORLD, gpu_type="H100", callbacks=[])(train_exactly)
    expected = plain.distributed(dataset_dir, str(tmp_path / "plain.jsonl"))

    ledger = UsageLedger(str(tmp_path / "ledger"))
    meter = UsageMeter(ledger, rates={"H100": 3.6}, user="ana")
    background = distributed(gpus=WORLD, gpu_type="H100", priority="BEST_EFFORT", callbacks=[meter])(train_exactly)
    record = tmp_path / "background.jsonl"
    call = background.submit(dataset_dir, str(record), step_sleep=0.4)
    deadline = time.monotonic() + 240  # a loaded machine starts agents slowly
    while _steps_recorded(record) < 6:  # past its first checkpoint (every 4 steps)
        assert time.monotonic() < deadline and not call.done(), "the best-effort job never got going"
        time.sleep(0.1)

    critical = distributed(gpus=WORLD, gpu_type="H100", priority="critical", callbacks=[])(urgent)
    urgent_call = critical.submit(4.0)
    listed: dict = {}
    # It gives way, then waits first in line (once the critical job took its GPUs and left the queue).
    while (listed.get("status"), listed.get("queue_position")) != ("waiting", 1):
        assert time.monotonic() < deadline and not call.done(), f"the best-effort job never gave way: {listed}"
        time.sleep(0.2)
        listed = next(j for j in list_jobs() if j["job_id"] == call.job_id)
    assert listed["priority"] == "best_effort"
    spans = urgent_call.result(timeout=120)
    urgent_started, urgent_ended = min(s for s, _ in spans), max(e for _, e in spans)

    weights = call.result(timeout=180)
    assert_bitwise_equal(weights[0], expected[0])
    assert_bitwise_equal(weights[1], weights[0])
    assert trained_batches(record) == trained_batches(tmp_path / "plain.jsonl")

    state = _state(call.job_id)
    assert [a["status"] for a in state["attempts"]] == ["preempted", "succeeded"]
    assert (state["restarts"], state["preemptions"]) == (0, 1)  # max_restarts=0: no restart was needed
    first, second = state["attempts"]
    assert first["ended_at"] <= urgent_started  # the critical job ran on GPUs it had left ...
    assert second["started_at"] >= urgent_ended  # ... and it resumed only once they were free

    rows = sorted((r for r in ledger.read().to_pylist() if r["job_id"] == call.job_id), key=lambda r: r["attempt"])
    assert [(r["attempt"], r["status"]) for r in rows] == [(0, "preempted"), (1, "succeeded")]
    for row, attempt in zip(rows, state["attempts"]):
        assert row["gpu_seconds"] == WORLD * billed_seconds(attempt["started_at"], attempt["ended_at"])
    # Nothing billed while it waited: its two attempts' spans leave the critical job's run out.
    assert rows[0]["ended_at"].timestamp() <= urgent_started and rows[1]["started_at"].timestamp() >= urgent_ended
