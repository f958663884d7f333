"""Clients on a real Spark standalone cluster: a client killed mid-job (its nodes stop their ranks
when its heartbeat stops, and ``sparkgpu resume`` continues the job from its checkpoint), a client
killed while its job waits for GPUs (``sparkgpu resume`` continues it once they free up), three
jobs competing for a cluster that fits two (they queue: none fails, none is half-scheduled, no GPU
serves two jobs at once), and every port of the cluster and of its jobs on loopback only.

These tests kill client processes and fill the cluster, so they run on a cluster of their own.
Named ``test_spark_cluster_*`` so the session orders it with the other cluster tests (before the
in-process Connect server exists).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from sparkgpu.config import settings
from tests.integration.processes import assert_no_orphans
from tests.integration.spark_cluster import DISPOSABLE_CLUSTER, cluster_session
from tests.sealed import sealed_json

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("workers_share_this_image")]

#: The client heartbeat timeout the killed client's jobs run with (120 s by default).
CLIENT_TIMEOUT = 8.0


def train_until_told(marks, steps, returns_when_told=True):
    """DDP with a checkpoint after every step; attempt 0 stops after step 3 until told to stop
    (SIGTERM asks a checkpointing rank for a checkpoint), as a job stuck until its fault. With
    ``returns_when_told=False`` it is not told: it stays stuck until its ranks are killed."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparkgpu import runtime
    from sparkgpu.train import Checkpointer

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = Checkpointer(every_steps=1, keep_last=2, async_save=False)
    step = start = ckpt.restore(model=model, optimizer=opt)
    attempt, rank = runtime.attempt(), runtime.get_global_rank()
    Path(marks, f"a{attempt}-rank{rank}.pid").write_text(str(os.getpid()))
    Path(marks, f"a{attempt}-rank{rank}.start").write_text(str(start))
    while step < steps:
        loss = (model(torch.ones(3, 4) / (step + 1)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.maybe_save(step, model=model, optimizer=opt)
        step += 1
        if rank == 0:
            Path(marks, f"a{attempt}.step").write_text(str(step))
        if attempt == 0 and step == 3:
            while not (returns_when_told and runtime.should_checkpoint()):
                time.sleep(0.2)
            ckpt.close()
            return "stopped"
    ckpt.close()
    return start


#: A client as a notebook drives a job: a session of its own, then spark.gpu.train.
CLIENT = textwrap.dedent("""
    import sys

    import cloudpickle
    from pyspark.sql import SparkSession

    import sparkgpu
    from tests.integration import test_spark_cluster_clients as here

    cloudpickle.register_pickle_by_value(here)  # the executors cannot import the tests
    spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
    print(spark.gpu.train(here.train_until_told, gpus=2, gpu_type="A10", args=(sys.argv[2], 8), name="client_died"))
""")


@pytest.fixture(scope="module")
def clients_cluster(disposable_spark_cluster):
    """Two workers (GPUs 0,1 and 2,3) that are not the shared cluster's: these tests kill clients,
    restart its Connect server and fill every GPU."""
    return disposable_spark_cluster.repaired()


@pytest.fixture(scope="module")
def clients_spark(clients_cluster):
    with cluster_session(clients_cluster) as session:
        yield session


def wait_for(check, timeout: float, what: str, process: subprocess.Popen | None = None, output: Path | None = None):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if process is not None and process.poll() is not None:
            said = output.read_text()[-3000:] if output is not None else ""
            pytest.fail(f"the client exited with {process.returncode} while waiting for {what}:\n{said}")
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(0.2)
    return value


def alive(pids) -> list[int]:
    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [p for p in pids if running(p)]


def client_env(**extra) -> dict[str, str]:
    """This test's environment (its SPARKGPU_HOME, the workers' image) for a client process,
    without what an in-process Connect server of this session may have left in it."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "SPARK_CONNECT_AUTHENTICATE_TOKEN",
            "SPARK_LOCAL_REMOTE",
            "SPARK_REMOTE",
            "SPARK_CONNECT_MODE_ENABLED",
            "SPARKGPU_SPARK_REMOTE",
        )
    }
    return {**env, "PYTHONPATH": os.getcwd(), **extra}


def resume_in_a_fresh_process(run_dir: Path) -> None:
    """``sparkgpu resume`` in a process with no session and no SPARKGPU_SPARK_REMOTE (the job says
    where it ran); it must finish the job."""
    resumed = subprocess.run(
        [sys.executable, "-m", "sparkgpu.cli", "resume", run_dir.name],
        env=client_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:] + resumed.stdout[-2000:]
    assert f"job {run_dir.name} succeeded on 2 ranks" in resumed.stdout


def test_a_killed_client_s_ranks_stop_on_its_heartbeat_and_resume_continues_on_spark(clients_cluster, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    output = tmp_path / "client.log"
    with open(output, "w") as log:
        client = subprocess.Popen(
            [sys.executable, str(script), clients_cluster.connect_url, str(marks)],
            env=client_env(SPARKGPU_SPARK_CLIENT_TIMEOUT=str(CLIENT_TIMEOUT)),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(
            lambda: (marks / "a0.step").exists() and (marks / "a0.step").read_text() == "3",
            240,
            "attempt 0 to checkpoint three steps",
            client,
            output,
        )
        pids = [int((marks / f"a0-rank{r}.pid").read_text()) for r in range(2)]
    finally:
        killed_at = time.monotonic()
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=30)
    assert alive(pids) == pids, "the ranks stopped with the client's process: nothing to check"

    # Nobody supervises the ranks now; their nodes stop them once the heartbeat stays away.
    wait_for(lambda: not alive(pids), CLIENT_TIMEOUT + 60, "the killed client's ranks to stop")
    stopped_after = time.monotonic() - killed_at
    assert CLIENT_TIMEOUT - 2 <= stopped_after <= CLIENT_TIMEOUT + 15, (
        f"the ranks stopped {stopped_after:.1f}s after their client died (timeout {CLIENT_TIMEOUT:g}s)"
    )
    (run_dir,) = settings().staging_root.glob("client-died-*")
    ended = wait_for(lambda: sorted(run_dir.glob("attempts/0/spark/node-*.ended")), 60, "the node to end")
    assert [sealed_json(p)["state"] for p in ended] == ["client-lost"]
    assert json.loads((run_dir / "state.json").read_text())["status"] == "running"  # left by the dead client

    resume_in_a_fresh_process(run_dir)

    state = json.loads((run_dir / "state.json").read_text())
    assert state["status"] == "succeeded"
    assert [a["status"] for a in state["attempts"]] == ["lost", "succeeded"]
    # Continued from the checkpoint of step 3 (saved as step index 2).
    assert [(marks / f"a1-rank{r}.start").read_text() for r in range(2)] == ["3", "3"]
    assert (marks / "a1.step").read_text() == "8"
    assert_no_orphans(run_dir, within=15)


def hold_a_gpu(seconds: float, release: str | None = None) -> dict:
    """A rank that holds its GPU for ``seconds`` (or until the file ``release`` exists, if sooner)
    and says which one, on which cluster, when."""
    import os
    import time

    from sparkgpu import runtime

    started = time.time()
    while time.time() - started < seconds and not (release and os.path.exists(release)):
        time.sleep(0.1)
    return {
        "job": runtime.job_id(),
        "rank": runtime.get_global_rank(),
        "gpu": runtime.gpu_address(),
        "visible": os.environ.get("SPARKGPU_NODE_DEVICES"),
        "cluster": os.environ.get("TEST_SPARK_CLUSTER"),
        "started": started,
        "ended": time.time(),
    }


def test_three_jobs_on_a_cluster_that_fits_two_queue_and_never_share_a_gpu(clients_cluster, clients_spark):
    # Two nodes of one GPU each: half of a job could run while its other half waited, so this
    # is where a barrier stage must not be half-scheduled.
    job = clients_spark.gpu.distributed(hold_a_gpu, gpus=2, gpu_type="A10", gpus_per_node=1, wait_timeout=300)
    calls = [job.submit(6.0) for _ in range(3)]
    exposed = []
    try:

        def two_jobs_run() -> bool:
            started = [list(c.run_dir.path.glob("attempts/0/spark/node-*.started")) for c in calls]
            return sum(len(s) == 2 for s in started) >= 2

        wait_for(two_jobs_run, 240, "two of the jobs to start")
        # While the cluster is full: the JVMs, Python workers, node agents and ranks.
        exposed = clients_cluster.exposed_listeners()
        results = [call.result(timeout=300) for call in calls]
    finally:
        for call in calls:
            call.cancel(timeout=60)
    assert not exposed, f"processes of the cluster or of its jobs listen beyond loopback: {exposed}"

    assert len(results) == len(calls) == 3
    ranks = [r for result in results for r in result]
    assert all(r["cluster"] == DISPOSABLE_CLUSTER for r in ranks)
    for call, result in zip(calls, results):
        assert [r["rank"] for r in result] == [0, 1]
        assert len({r["gpu"] for r in result}) == 2, f"two ranks of one job shared a GPU: {result}"
        assert all(r["visible"] == r["gpu"] for r in result)  # each node sees its own GPU only
        starts = [
            sealed_json(p)["started_at"] for p in sorted(call.run_dir.path.glob("attempts/0/spark/node-*.started"))
        ]
        assert len(starts) == 2 and max(starts) - min(starts) < 5, f"job {call.job_id}'s nodes started apart: {starts}"
        state = json.loads(call.run_dir.state_file.read_text())
        assert [a["status"] for a in state["attempts"]] == ["succeeded"]  # no job failed, none was retried

    by_gpu: dict[str, list[dict]] = {}
    for rank in ranks:
        by_gpu.setdefault(rank["gpu"], []).append(rank)
    # Six ranks on a cluster that fits two jobs' four: some GPU served a rank of two jobs, one after the other.
    assert sum(len(users) for users in by_gpu.values()) == 6 and max(len(users) for users in by_gpu.values()) >= 2
    for gpu, users in by_gpu.items():
        users.sort(key=lambda r: r["started"])
        for before, after in zip(users, users[1:]):
            assert after["started"] >= before["ended"], (
                f"GPU {gpu} served jobs {before['job']} and {after['job']} at once"
            )
    # The cluster fits two: the last job to start waited until one of the others ended.
    last = max(results, key=lambda result: min(r["started"] for r in result))
    first_end = min(max(r["ended"] for r in result) for result in results if result is not last)
    assert min(r["started"] for r in last) >= first_end


#: A client whose job must wait: every GPU of the cluster is held by another job.
WAITING_CLIENT = textwrap.dedent("""
    import sys

    from pyspark.sql import SparkSession

    import sparkgpu

    spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
    print(spark.gpu.train(sum, gpus=2, gpu_type="A10", args=([1, 2],), name="waited"))
""")


def test_a_client_killed_while_its_job_waits_for_gpus_is_continued_by_resume(clients_cluster, clients_spark, tmp_path):
    release = tmp_path / "release"
    holder = clients_spark.gpu.distributed(hold_a_gpu, gpus=4, gpu_type="A10").submit(240.0, str(release))
    script, output = tmp_path / "client.py", tmp_path / "client.log"
    script.write_text(WAITING_CLIENT)
    client = None
    try:
        wait_for(
            lambda: len(list(holder.run_dir.path.glob("attempts/0/spark/node-*.started"))) == 2,
            240,
            "the job holding every GPU to start",
        )
        with open(output, "w") as log:
            client = subprocess.Popen(
                [sys.executable, str(script), clients_cluster.connect_url],
                env=client_env(SPARKGPU_SPARK_CLIENT_TIMEOUT=str(CLIENT_TIMEOUT)),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_for(
            lambda: "waits for 2 GPUs" in output.read_text(), 120, "the client's job to queue for GPUs", client, output
        )
        (run_dir,) = settings().staging_root.glob("waited-*")
        client.send_signal(signal.SIGKILL)  # dies while its job waits: nobody runs it now
        client.wait(timeout=30)
        # It never got its GPUs: no attempt was recorded, or one that never started.
        state = json.loads((run_dir / "state.json").read_text()) if (run_dir / "state.json").exists() else None
        assert state is None or all(a["started_at"] is None for a in state["attempts"])
        release.touch()  # the GPUs come free only now: the job never ran while its client lived
        assert [r["rank"] for r in holder.result(timeout=240)] == [0, 1, 2, 3]
    finally:
        if client is not None and client.poll() is None:
            client.kill()
        holder.cancel(timeout=60)

    resume_in_a_fresh_process(run_dir)  # it waits its turn, then runs
    state = json.loads((run_dir / "state.json").read_text())
    assert state["status"] == "succeeded" and state["attempts"][-1]["status"] == "succeeded"
    assert_no_orphans(run_dir, within=15)


def test_a_restarted_connect_server_ends_the_attempt_and_the_job_resumes_on_a_new_session(clients_cluster, tmp_path):
    """Runs last in the module: the restart closes every session of the old server."""
    marks = tmp_path / "marks"
    marks.mkdir()
    session = clients_cluster.session()
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = session.gpu.train(
                train_until_told,
                gpus=2,
                gpu_type="A10",
                # Stuck until the application ends: a rank that returned when its teardown's
                # SIGTERM reached it would end the attempt as succeeded, with that result.
                args=(str(marks), 6, False),
                max_restarts=1,
                wait_timeout=240,
                name="connect_restart",
            )
        except BaseException as exc:  # surfaced by the assertions below
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(
        lambda: (marks / "a0.step").exists() and (marks / "a0.step").read_text() == "3",
        240,
        "attempt 0 to checkpoint three steps",
    )
    pids = [int((marks / f"a0-rank{r}.pid").read_text()) for r in range(2)]
    clients_cluster.restart_connect_server()

    # The application ended with its driver: executors, nodes and ranks are gone.
    wait_for(lambda: not alive(pids), 60, "the ranks of the old server's application to stop")
    thread.join(300)
    assert not thread.is_alive(), "the job never ended after the Connect server restarted"
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"] == [3, 3]  # attempt 1 resumed from the checkpoint of step 3

    (run_dir,) = settings().staging_root.glob("connect-restart-*")
    state = json.loads((run_dir / "state.json").read_text())
    assert [a["status"] for a in state["attempts"]] == ["failed", "succeeded"]
    notes = json.loads((run_dir / "attempts" / "0" / "report.json").read_text())["notes"]
    assert any(
        "restarted or closed this session" in note and f"sparkgpu resume {run_dir.name}" in note for note in notes
    ), notes
    assert_no_orphans(run_dir, within=15)
