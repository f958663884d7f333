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
from sparkgpu.config import settings
from sparkgpu.usage import UsageLedger, UsageMeter
from tests.integration.preemption import (  # noqa: F401  (two_gpus: a fixture)
    assert_billed_only_while_running,
    steps_recorded,
    two_gpus,
    urgent,
    wait_until_it_waits_first_in_line,
)
from tests.integration.test_restart_exactness import (  # noqa: F401  (dataset_dir: a fixture)
    WORLD,
    assert_bitwise_equal,
    dataset_dir,
    train_exactly,
    trained_batches,
)

pytestmark = pytest.mark.integration


def _state(job_id: str) -> dict:
    return json.loads((settings().staging_root / job_id / "state.json").read_text())


def test_a_critical_job_preempts_a_best_effort_one_which_resumes_exactly_and_unbilled(dataset_dir, tmp_path, two_gpus):
    plain = distributed(gpus=WORLD, gpu_type="H100", callbacks=[])(train_exactly)
    expected = plain.distributed(dataset_dir, str(tmp_path / "plain.jsonl"))

    ledger = UsageLedger(str(tmp_path / "ledger"))
    meter = UsageMeter(ledger, rates={"H100": 3.6}, user="ana")
    background = distributed(gpus=WORLD, gpu_type="H100", priority="BEST_EFFORT", callbacks=[meter])(train_exactly)
    record = tmp_path / "background.jsonl"
    call = background.submit(dataset_dir, str(record), step_sleep=0.4, hold_from=5)
    deadline = time.monotonic() + 240  # a loaded machine starts agents slowly
    while steps_recorded(record) < 6:  # past its first checkpoint (every 4 steps), where it holds until asked to stop
        assert time.monotonic() < deadline and not call.done(), "the best-effort job never got going"
        time.sleep(0.1)

    critical = distributed(gpus=WORLD, gpu_type="H100", priority="critical", callbacks=[])(urgent)
    urgent_call = critical.submit(4.0)
    listed = wait_until_it_waits_first_in_line(call, deadline)
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

    assert_billed_only_while_running(ledger, call.job_id, state, WORLD, (urgent_started, urgent_ended))
