"""A lost executor or worker on a real Spark standalone cluster: the other nodes' ranks stop, the
attempt ends as a lost node naming its executor and host (client error, state file, MLflow run,
usage row billed to when it was lost) and, with ``max_restarts``, the job waits for the worker to
come back and resumes from its last complete checkpoint.

These tests kill cluster processes, so they run on a cluster of their own, not the session's.
Named ``test_spark_cluster_*`` so the session orders it with the other cluster tests (before the
in-process Connect server exists).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from sparkgpu.cli import list_jobs
from sparkgpu.config import reset_settings, settings
from sparkgpu.errors import NodeLostError
from sparkgpu.usage import UsageLedger
from sparkgpu.usage.rates import billed_seconds
from tests.integration.spark_cluster import cluster_session
from tests.sealed import sealed_json

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("workers_share_this_image")]

#: Seconds from the fault to every surviving rank gone (node heartbeats time out after 10 s).
STOP_BOUND = 15.0
#: Seconds a step of these tests may take before the test gives up on it: a guard against a hang,
#: not a claim. The suite starts every cluster at once, and on two busy cores a job took 150 s to
#: reach its third step; what the tests claim in time is STOP_BOUND and the billing bounds.
GUARD = 600.0


@pytest.fixture(scope="module")
def fault_cluster(disposable_spark_cluster):
    """Two workers (GPUs 0,1 and 2,3) that are not the shared cluster's: these tests kill their processes."""
    return disposable_spark_cluster.repaired()


@pytest.fixture(scope="module")
def fault_spark(fault_cluster):
    with cluster_session(fault_cluster) as session:
        yield session


@pytest.fixture
def tracked(monkeypatch, mlflow_store):
    """Jobs tracked in the module's MLflow store: returns its client."""
    uri, client, _ = mlflow_store
    monkeypatch.setenv("SPARKGPU_TRACKING", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    reset_settings()
    return client


def train_until_stopped(marks, steps):
    """DDP on every rank, a checkpoint after each step; attempt 0 slows down after step 3 to be killed."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparkgpu import runtime
    from sparkgpu.train import Checkpointer

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = Checkpointer(every_steps=1, keep_last=2, async_save=False)
    step = start = ckpt.restore(model=model, optimizer=opt)
    attempt, rank = runtime.attempt(), runtime.get_global_rank()
    Path(marks, f"a{attempt}-rank{rank}.pid").write_text(str(os.getpid()))
    while step < steps:
        loss = (model(torch.ones(3, 4) / (step + 1)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.maybe_save(step, model=model, optimizer=opt)
        step += 1
        if rank == 0:
            Path(marks, f"a{attempt}.step").write_text(str(step))
        if attempt == 0 and step >= 3:
            time.sleep(1.0)  # waits for the fault
    ckpt.close()
    return start


def hang_in_a_collective(marks):
    """Every rank reports its pid, then waits as a rank blocked in a NCCL collective would (no TCP reset)."""
    from sparkgpu import runtime

    Path(marks, f"a{runtime.attempt()}-rank{runtime.get_global_rank()}.pid").write_text(str(os.getpid()))
    time.sleep(300)


def run_in_thread(call) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = call()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(0.2)
    return value


def rank_pids(marks: Path, attempt: int, world: int) -> dict[int, int] | None:
    files = {r: marks / f"a{attempt}-rank{r}.pid" for r in range(world)}
    if not all(f.exists() and f.read_text() for f in files.values()):
        return None
    return {r: int(f.read_text()) for r, f in files.items()}


def job_files(name: str) -> Path:
    (run_dir,) = settings().staging_root.glob(f"{name.replace('_', '-')}-*")
    return run_dir


def node_of(run_dir: Path, attempt: int, node: int) -> dict:
    return sealed_json(run_dir / "attempts" / str(attempt) / "spark" / f"node-{node}.started")


def alive(pids) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def mlflow_run_of(client, job_id: str):
    experiments = [e.experiment_id for e in client.search_experiments()]
    (run,) = client.search_runs(experiments, filter_string=f"tags.`sparkgpu.job_id` = '{job_id}'")
    return run


def test_a_killed_executor_stops_the_other_node_and_ends_the_attempt_naming_its_host(
    fault_cluster, fault_spark, tracked, tmp_path
):
    marks = tmp_path / "marks"
    marks.mkdir()
    ledger = UsageLedger(settings().usage_ledger_uri)  # the default callbacks: usage meter and MLflow run
    thread, outcome = run_in_thread(
        lambda: fault_spark.gpu.train(
            hang_in_a_collective, gpus=4, gpu_type="A10", args=(str(marks),), max_restarts=0, name="executor_lost"
        )
    )
    pids = wait_for(lambda: rank_pids(marks, 0, 4), GUARD, "the four ranks to start")
    run_dir = job_files("executor_lost")
    lost = node_of(run_dir, 0, 1)
    jvm_pid, _ = fault_cluster.executor_pids()[lost["executor"]]
    killed_at = time.time()
    os.kill(jvm_pid, signal.SIGKILL)

    # The surviving node's ranks (0 and 1) stop without waiting for a collective's timeout.
    wait_for(lambda: not alive([pids[0], pids[1]]), STOP_BOUND + 30, "the surviving ranks to stop")
    stopped_after = time.time() - killed_at
    thread.join(GUARD)
    assert not thread.is_alive()
    assert stopped_after < STOP_BOUND, f"the surviving ranks ran on for {stopped_after:.1f}s after the kill"

    error = outcome.get("error")
    assert isinstance(error, NodeLostError), outcome
    assert f"executor {lost['executor']} on host {lost['host']} was lost" in str(error)
    assert {2, 3} <= set(error.ranks) and error.first_failure.rank in (2, 3)  # the lost node's ranks, first

    state = json.loads((run_dir / "state.json").read_text())
    (attempt,) = state["attempts"]
    assert state["status"] == "failed" and attempt["status"] == "failed"
    assert [(n["node"], n["executor"], n["host"]) for n in attempt["lost"]] == [(1, lost["executor"], lost["host"])]
    assert f"executor {lost['executor']} on host {lost['host']} was lost" in attempt["cause"][0]
    # Billed to when the node was last seen alive, not to when the client noticed.
    assert attempt["ended_at"] <= killed_at + 5.0  # noticed 10 s after the kill

    (row,) = ledger.read().to_pylist()
    assert row["status"] == "failed"
    assert row["gpu_seconds"] == 4 * billed_seconds(attempt["started_at"], attempt["ended_at"])

    run = mlflow_run_of(tracked, state["job_id"])
    assert run.data.tags["sparkgpu.attempt.0.status"] == "failed"
    assert f"executor {lost['executor']} on host {lost['host']} was lost" in run.data.tags["sparkgpu.attempt.0.cause"]
    assert run.info.status == "FAILED"
    fault_cluster.wait_for_executors()  # the worker starts a new executor for the next test


def test_a_lost_worker_is_waited_for_and_the_job_resumes_from_its_checkpoint(
    fault_cluster, fault_spark, tracked, tmp_path, monkeypatch
):
    # The replacement takes longer than SPARKGPU_SPARK_WAIT_TIMEOUT (600 s by default, 5 s here
    # against a 12 s replacement): a job capped by max_runtime (7 days for remote jobs) waits for
    # it as a state, unbilled, instead of failing.
    monkeypatch.setenv("SPARKGPU_SPARK_WAIT_TIMEOUT", "5")
    reset_settings()
    marks = tmp_path / "marks"
    marks.mkdir()
    ledger = UsageLedger(settings().usage_ledger_uri)  # the default callbacks: usage meter and MLflow run
    thread, outcome = run_in_thread(
        lambda: fault_spark.gpu.train(
            train_until_stopped,
            gpus=4,
            gpu_type="A10",
            args=(str(marks), 8),
            max_restarts=1,
            name="worker_lost",
        )
    )
    wait_for(
        lambda: (
            not thread.is_alive() or (marks / "a0.step").exists() and int((marks / "a0.step").read_text() or 0) >= 3
        ),
        GUARD,
        "attempt 0 to checkpoint three steps",
    )
    assert thread.is_alive(), outcome
    run_dir = job_files("worker_lost")
    lost = node_of(run_dir, 0, 1)
    _, worker = fault_cluster.executor_pids()[lost["executor"]]
    killed_at = time.time()
    fault_cluster.kill_worker(worker)

    # Attempt 1 is submitted and waits for the worker's GPUs instead of failing.
    wait_for(lambda: (run_dir / "attempts" / "1" / "spark").is_dir(), GUARD, "the restart to be submitted")
    time.sleep(12)
    assert thread.is_alive() and not (run_dir / "attempts" / "1" / "spark" / "node-0.started").exists()
    (listed,) = [j for j in list_jobs() if j["job_id"] == run_dir.name]
    assert listed["status"] == "waiting"  # sparkgpu jobs says so
    waiting_run = mlflow_run_of(tracked, run_dir.name)
    assert waiting_run.data.tags["sparkgpu.attempt.1.status"] == "waiting"  # and so does the MLflow run
    fault_cluster.restart_worker(worker)
    thread.join(GUARD)
    assert not thread.is_alive()

    assert "error" not in outcome, outcome.get("error")
    starts = outcome["result"]
    assert len(set(starts)) == 1 and starts[0] >= 3  # resumed from a checkpoint of attempt 0, not step 0

    state = json.loads((run_dir / "state.json").read_text())
    first, second = state["attempts"]
    assert state["status"] == "succeeded" and (first["status"], second["status"]) == ("failed", "succeeded")
    assert [(n["executor"], n["host"]) for n in first["lost"]] == [(lost["executor"], lost["host"])]
    assert first["ended_at"] <= killed_at + 5.0
    assert second["started_at"] - second["submitted_at"] >= 12  # it waited for capacity, past the setting

    rows = sorted(ledger.read().to_pylist(), key=lambda r: r["attempt"])
    assert [(r["attempt"], r["status"]) for r in rows] == [(0, "failed"), (1, "succeeded")]
    assert rows[0]["gpu_seconds"] == 4 * billed_seconds(first["started_at"], first["ended_at"])

    run = mlflow_run_of(tracked, state["job_id"])
    assert run.data.tags["sparkgpu.attempt.0.status"] == "failed"
    assert "was lost" in run.data.tags["sparkgpu.attempt.0.cause"]
    assert run.data.tags["sparkgpu.attempt.1.status"] == "succeeded" and run.info.status == "FINISHED"
