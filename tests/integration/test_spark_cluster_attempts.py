"""Attempt bookkeeping on a real Spark standalone cluster: the time spent waiting for busy GPUs
is not billed, and a job that gives up waiting in the cluster's queue ends failed, having
submitted nothing.

Named ``test_spark_cluster_*`` so the session orders it with the other cluster tests (before
the in-process Connect server exists).
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from sparkgpu import CapacityError
from sparkgpu.config import settings
from sparkgpu.launch.scheduling.cluster_queue import cluster_waiting_jobs, queue_root
from sparkgpu.usage import UsageLedger, UsageMeter
from sparkgpu.usage.rates import billed_seconds
from tests.integration.spark_cluster import every_gpu_held
from tests.integration.test_spark_cluster import no_tracking  # noqa: F401 (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("workers_share_this_image")]


def rank_of_this_node():
    from sparkgpu import runtime

    return runtime.get_global_rank()


def state_of(job_name: str) -> dict:
    (state_file,) = settings().staging_root.glob(f"{job_name.replace('_', '-')}-*/state.json")
    return json.loads(state_file.read_text())


@pytest.mark.usefixtures("no_tracking")
def test_waiting_for_busy_gpus_is_not_billed_and_giving_up_ends_the_job(cluster_spark, tmp_path):
    ledger = UsageLedger(str(tmp_path / "ledger"))
    meter = UsageMeter(ledger, policy=False)
    release = tmp_path / "release"
    with every_gpu_held(cluster_spark, release):
        # 1. Gives up in the cluster's queue: the job ends failed (not left "running"), no attempt
        #    was submitted, nothing is billed, and it leaves the line.
        started = time.monotonic()
        with pytest.raises(CapacityError, match="gave up after waiting .* the queued jobs hold 4 of the cluster's 4"):
            cluster_spark.gpu.train(
                rank_of_this_node, gpus=2, gpu_type="A10", wait_timeout=5, callbacks=[meter], name="gives_up"
            )
        assert time.monotonic() - started >= 5
        gave_up = state_of("gives_up")
        assert gave_up["status"] == "failed" and gave_up["attempts"] == []
        assert ledger.read().to_pylist() == []  # no attempt ran: no row
        assert not list(meter.journal.directory.glob("*.json"))  # nothing for a later client_lost row
        assert "gives-up" not in str(cluster_waiting_jobs(queue_root(None)))

        # 2. Waits, then gets the GPUs: billed from when its nodes started, not from submit.
        waiter: dict = {}

        def wait_for_gpus():
            waiter["result"] = cluster_spark.gpu.train(
                rank_of_this_node, gpus=2, gpu_type="A10", wait_timeout=120, callbacks=[meter], name="waits"
            )

        asked_at = time.time()
        second = threading.Thread(target=wait_for_gpus)
        second.start()
        time.sleep(8)
        release.write_text("go")  # the first job ends; its GPUs go to the waiting one
        second.join(120)
        assert waiter.get("result") == [0, 1]

    (attempt,) = state_of("waits")["attempts"]
    assert attempt["started_at"] - asked_at >= 6  # it waited for the first job (in the queue, before submitting)
    row = next(r for r in ledger.read().to_pylist() if r["job_name"] == "waits")
    assert row["started_at"].timestamp() == pytest.approx(attempt["started_at"], abs=1e-5)
    assert row["gpu_seconds"] == 2 * billed_seconds(attempt["started_at"], attempt["ended_at"])
    assert row["gpu_seconds"] < 2 * (attempt["ended_at"] - asked_at - 5)


def stop_when_asked():
    import time as _t

    from sparkgpu import runtime

    if runtime.attempt() > 0:
        return "resumed"
    while not runtime.should_checkpoint():  # no Checkpointer: only the supervisor's signal counts
        _t.sleep(0.1)
    runtime.stop_for_restart()


@pytest.mark.usefixtures("no_tracking")
def test_ranks_on_spark_are_asked_to_checkpoint_before_the_cap_and_resume(cluster_spark):
    assert (
        cluster_spark.gpu.train(
            stop_when_asked, gpus=2, gpu_type="A10", max_runtime=40, checkpoint_grace=30, name="capped"
        )
        == ["resumed"] * 2
    )
    state = state_of("capped")
    assert [a["status"] for a in state["attempts"]] == ["preempted", "succeeded"]
    assert state["preemptions"] == 1 and state["restarts"] == 0
    first = state["attempts"][0]
    assert 10 <= first["ended_at"] - first["started_at"] < 40  # stopped on the signal, not killed at the cap
    (stop_file,) = settings().staging_root.glob("capped-*/attempts/0/STOP")
    assert "runtime cap" in stop_file.read_text()
