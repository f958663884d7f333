"""Priorities on a Spark cluster: a critical job preempts a best-effort one by checkpoint, and both finish.

The shared standalone cluster (two workers of two simulated A10s). A best-effort transformer job
runs on one executor's two GPUs; a critical job asks for all four. Through the cluster's GPU
queue (:mod:`sparkgpu.launch.scheduling.cluster_queue`) the critical job asks the best-effort one to give
way; it checkpoints and stops, the critical job runs, and the best-effort job resumes by itself
once the GPUs are free, using no restart and billed for none of its wait, and ends bitwise
equal to an uninterrupted run.
"""

from __future__ import annotations

import json
import time

import pytest

from sparkgpu.config import settings
from sparkgpu.usage import UsageLedger, UsageMeter
from tests.integration.preemption import (
    assert_billed_only_while_running,
    steps_recorded,
    urgent,
    wait_until_it_waits_first_in_line,
)
from tests.integration.test_transformer_restart_exactness import (  # noqa: F401 - fixtures
    WORLD,
    all_blocks,
    assert_same_run,
    read_records,
    token_dir,
    train_transformer,
    uninterrupted,
)

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("workers_share_this_image")]


@pytest.fixture
def own_queue(monkeypatch, tmp_path):
    # Without a staging URL the cluster's queue lives beside this machine's GPU locks: the test's own.
    monkeypatch.setenv("SPARKGPU_GPU_LOCK_DIR", str(tmp_path / "gpu-locks"))
    settings.cache_clear()
    yield
    settings.cache_clear()


def test_a_critical_job_preempts_a_best_effort_one_on_the_cluster_which_resumes_exactly(
    cluster_spark, uninterrupted, token_dir, all_blocks, tmp_path, own_queue
):
    plain, plain_steps = uninterrupted("ddp")
    record = tmp_path / "background.jsonl"
    ledger = UsageLedger(str(tmp_path / "ledger"))
    meter = UsageMeter(ledger, rates={"A10": 1.0}, user="ana")
    background = cluster_spark.gpu.distributed(
        train_transformer, gpus=WORLD, gpu_type="A10", priority="best_effort", name="background", callbacks=[meter]
    )
    call = background.submit(token_dir, str(record), "ddp", step_sleep=0.5, hold_from=4)
    deadline = time.monotonic() + 300  # a loaded machine starts executors' ranks slowly
    while steps_recorded(record) < 4:  # past its first checkpoint (every 3 steps), where it holds until asked to stop
        assert time.monotonic() < deadline and not call.done(), "the best-effort job never got going"
        time.sleep(0.2)

    critical = cluster_spark.gpu.distributed(
        urgent, gpus=4, gpu_type="A10", priority="CRITICAL", name="urgent", callbacks=[]
    )
    urgent_call = critical.submit(3.0)
    listed = wait_until_it_waits_first_in_line(call, deadline)
    assert listed["priority"] == "best_effort"
    spans = urgent_call.result(timeout=240)
    assert len(spans) == 4
    urgent_started, urgent_ended = min(s for s, _ in spans), max(e for _, e in spans)

    states = call.result(timeout=300)
    note = "(Spark, preempted by a critical job)"
    assert_same_run(states, read_records(record), plain, plain_steps, all_blocks, note)
    state = json.loads((settings().staging_root / call.job_id / "state.json").read_text())
    assert [a["status"] for a in state["attempts"]] == ["preempted", "succeeded"]
    assert (state["restarts"], state["preemptions"]) == (0, 1)  # no restart was used
    first, second = state["attempts"]
    assert first["ended_at"] <= urgent_started  # the critical job ran on GPUs it had left ...
    assert second["started_at"] >= urgent_ended  # ... and it resumed only once they were free
    assert not list((tmp_path / "gpu-locks" / "spark-queue").glob("*/jobs/*.json"))  # both left the line

    assert_billed_only_while_running(ledger, call.job_id, state, WORLD, (urgent_started, urgent_ended))
