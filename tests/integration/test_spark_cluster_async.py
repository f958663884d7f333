"""Submitted jobs on a real Spark standalone cluster, driven from two processes: a client submits
two jobs that hold every GPU at once; another process cancels one through the live client, and
takes the other over once the client is killed.

Named ``test_spark_cluster_*`` so the session orders it with the other cluster tests (before
the in-process Connect server exists).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sparkgpu import attach
from sparkgpu.config import settings
from sparkgpu.launch.client.supervisor import JobStatus
from tests.integration.processes import assert_no_orphans, wait_for
from tests.integration.test_spark_cluster import no_tracking  # noqa: F401 (fixture)
from tests.sealed import sealed_json

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("workers_share_this_image")]

CLIENT = textwrap.dedent("""
    import os, time
    from sparkgpu import distributed, runtime
    from sparkgpu.errors import JobCancelledError

    @distributed(gpus=2, gpu_type="A10", remote=True)
    def forever():
        print("started", flush=True)
        time.sleep(600)

    @distributed(gpus=2, gpu_type="A10", remote=True)
    def train():
        marker = os.path.join(runtime.checkpoint_dir(), f"progress-{runtime.get_global_rank()}")
        if os.path.exists(marker):
            return ("resumed", runtime.attempt(), runtime.get_global_rank())
        with open(marker, "w") as f:
            f.write("saved")
        time.sleep(600)

    cancelled, resumable = forever.submit(), train.submit()
    print(cancelled.job_id, resumable.job_id, flush=True)
    try:
        cancelled.result()
    except JobCancelledError:
        print("cancelled from elsewhere", flush=True)
    resumable.wait()
""")


def node_states(run_dir, attempt: int) -> list[str]:
    return [sealed_json(p)["state"] for p in sorted(run_dir.glob(f"attempts/{attempt}/spark/node-*.ended"))]


@pytest.mark.usefixtures("no_tracking")
def test_another_process_cancels_through_a_live_client_and_takes_over_from_a_killed_one(
    spark_cluster, cluster_spark, tmp_path, _isolated_sparkgpu_home
):
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    # os.environ carries this test's worker image lock and SPARKGPU_TRACKING=0.
    env = {
        **os.environ,
        "SPARKGPU_HOME": str(_isolated_sparkgpu_home),
        "PYTHONPATH": os.getcwd(),
        "SPARKGPU_SPARK_REMOTE": spark_cluster.connect_url,
    }
    client = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        cancelled_id, resumable_id = client.stdout.readline().split()
        cancelled_dir, resumable_dir = (settings().staging_root / i for i in (cancelled_id, resumable_id))
        cancelled = attach(cancelled_id)

        def both_jobs_run() -> bool:  # side by side: together they hold all four GPUs
            return (
                cancelled.logs().count("started") == 2 and len(list(resumable_dir.glob("checkpoints/progress-*"))) == 2
            )

        assert wait_for(both_jobs_run, within=240), "the two jobs never ran side by side"
        assert cancelled._thread is None and cancelled.status() is JobStatus.RUNNING  # observed, not driven
        assert cancelled.cancel(timeout=120) is JobStatus.CANCELLED
        assert node_states(cancelled_dir, 0) == ["cancelled"]  # one node of 2 GPUs, stopped politely by the client
        assert client.stdout.readline().strip() == "cancelled from elsewhere"
        assert client.poll() is None
    finally:
        client.kill()  # SIGKILL: its other job's nodes run on, with nobody supervising them
        client.wait()

    resumed = attach(resumable_id, backend=cluster_spark.gpu.backend())
    assert resumed._thread is not None  # taken over by this process
    assert resumed.result(timeout=240) == [("resumed", 1, 0), ("resumed", 1, 1)]
    state = json.loads(resumed.run_dir.state_file.read_text())
    assert [a["status"] for a in state["attempts"]] == ["lost", "succeeded"]
    # The lost attempt's nodes were stopped by the take-over, not left to notice the lost heartbeat.
    assert node_states(resumable_dir, 0) == ["cancelled"]
    assert_no_orphans(cancelled_dir, within=15)
    assert_no_orphans(resumable_dir, within=15)
