"""Submitted jobs on a real Spark standalone cluster, driven from two processes: a client submits
two jobs that hold every GPU at once, one detached (the default of ``submit``) and one it
supervises itself (``detach=False``); another process cancels the first while the client lives,
and takes the other over once the client is killed. A detached job outlives its client's whole
process group and restarts after a lost rank with no client alive.

Named ``test_spark_cluster_*`` so the session orders it with the other cluster tests (before
the in-process Connect server exists).
"""

from __future__ import annotations

import json
import os
import signal
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

    @distributed(gpus=2, gpu_type="A10", remote=True, detach=False)  # supervised by this client
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
        assert (cancelled_dir / "supervision.json").exists() and not (resumable_dir / "supervision.json").exists()
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


#: A script that submits a job to the cluster and is then killed with its whole process group.
DETACHED_CLIENT = textwrap.dedent("""
    import sys, time

    import cloudpickle

    from sparkgpu import distributed
    from tests.integration import test_spark_cluster_async as here
    from tests.integration.test_spark_cluster_async import lose_a_rank_once

    cloudpickle.register_pickle_by_value(here)  # the executors cannot import the tests

    call = distributed(gpus=2, gpu_type="A10", remote=True, max_restarts=1)(lose_a_rank_once).submit(sys.argv[1])
    print(call.job_id, flush=True)
    time.sleep(600)
""")


def lose_a_rank_once(marks: str):
    """Attempt 0: once the test says its client is gone, rank 1 dies by SIGKILL (a lost machine).
    The attempt after it returns where it resumed."""
    import os
    import signal
    import time

    from sparkgpu import runtime

    rank = runtime.get_global_rank()
    open(os.path.join(marks, f"a{runtime.attempt()}-rank{rank}"), "w").close()
    if runtime.attempt() == 0:
        while not os.path.exists(os.path.join(marks, "client-gone")):
            time.sleep(0.1)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)  # rank 0 waits for its peer, as in a collective; the node stops it
    return ("resumed", runtime.attempt(), rank)


@pytest.mark.usefixtures("no_tracking")
def test_a_detached_job_outlives_its_clients_process_group_and_restarts_with_no_client(
    spark_cluster, tmp_path, _isolated_sparkgpu_home
):
    script, marks = tmp_path / "client.py", tmp_path / "marks"
    script.write_text(DETACHED_CLIENT)
    marks.mkdir()
    env = {
        **os.environ,
        "SPARKGPU_HOME": str(_isolated_sparkgpu_home),
        "PYTHONPATH": os.getcwd(),
        "SPARKGPU_SPARK_REMOTE": spark_cluster.connect_url,
    }
    client = subprocess.Popen(
        [sys.executable, str(script), str(marks)], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        job_id = client.stdout.readline().strip()
        assert job_id, "the client printed no job id"
        run_dir = settings().staging_root / job_id
        assert wait_for(lambda: all((marks / f"a0-rank{r}").exists() for r in (0, 1)), within=240), "never started"
    finally:
        os.killpg(client.pid, signal.SIGKILL)  # the notebook's whole process group, as a culled pod
        client.wait()
    (
        marks / "client-gone"
    ).touch()  # only now does attempt 0 lose its rank: nobody but the job's own supervisor is left

    call = attach(job_id)
    assert call._thread is None  # observed: its keeper still supervises it
    assert call.result(timeout=240) == [("resumed", 1, 0), ("resumed", 1, 1)]
    state = json.loads(call.run_dir.state_file.read_text())
    assert [a["status"] for a in state["attempts"]] == ["failed", "succeeded"]
    assert "restarting" in (run_dir / "supervisor.log").read_text()
    assert_no_orphans(run_dir, within=15)
