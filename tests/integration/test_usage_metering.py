"""Metering and policies on real jobs: torch elastic ranks on gloo, a real Delta ledger, real processes."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from sparkgpu import distributed, runtime
from sparkgpu.config import settings
from sparkgpu.errors import PolicyViolationError
from tests.integration.processes import assert_no_orphans
from sparkgpu.usage import UsageLedger, UsageMeter, UsagePolicy
from sparkgpu.usage.rates import billed_seconds

pytestmark = pytest.mark.integration


def test_a_two_rank_job_leaves_one_priced_row_per_attempt(tmp_path):
    ledger = UsageLedger(str(tmp_path / "ledger"))
    meter = UsageMeter(ledger, rates={"cpu": 0.36}, user="ana")  # priced, so the cost path is exercised

    @distributed(gpus=2, gpu_type="cpu", tags={"team": "ml", "project": "ctr"}, callbacks=[meter])
    def step():
        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        return int(t.item())

    assert step.distributed() == [2, 2]
    rows = ledger.read().to_pylist()
    assert len(rows) == 1
    row = rows[0]
    attempt = json.loads((settings().staging_root / step.last_job_id / "state.json").read_text())["attempts"][0]
    assert row["job_id"] == step.last_job_id and row["job_name"] == "step" and row["attempt"] == 0
    assert row["user"] == "ana" and dict(row["tags"]) == {"team": "ml", "project": "ctr"}
    assert (row["backend"], row["gpu_type"], row["gpus"], row["status"]) == ("local", "cpu", 2, "succeeded")
    assert row["started_at"].timestamp() == pytest.approx(attempt["started_at"], abs=1e-5)
    assert row["ended_at"].timestamp() == pytest.approx(attempt["ended_at"], abs=1e-5)
    assert row["gpu_seconds"] == 2 * billed_seconds(attempt["started_at"], attempt["ended_at"])
    assert row["cost_usd"] == pytest.approx(row["gpu_seconds"] * 0.36 / 3600, abs=1e-4)


def test_an_exhausted_budget_checkpoints_and_stops_the_job(tmp_path):
    ledger = UsageLedger(str(tmp_path / "ledger"))
    # 0.002 GPU-hours = 7.2 GPU-seconds: two ranks spend it in under 4 s of running time.
    policy = UsagePolicy.from_dict({"name": "tiny", "budgets": {"team=ml": "0.002 GPU-hours per 1d"}})
    meter = UsageMeter(ledger, policy=policy)

    @distributed(gpus=2, gpu_type="cpu", tags={"team": "ml"}, callbacks=[meter])
    def train():
        import os

        deadline = time.monotonic() + 120
        steps = 0
        while not runtime.should_checkpoint():
            if time.monotonic() > deadline:
                return "never asked to stop"
            steps += 1
            time.sleep(0.05)
        marker = os.path.join(runtime.checkpoint_dir(), f"rank-{runtime.get_global_rank()}.ckpt")
        with open(marker, "w") as f:
            f.write(str(steps))
        runtime.stop_for_restart()

    with pytest.raises(PolicyViolationError, match=r"budget 'team=ml: 0.002 GPU-hours per 1d' is spent.*'tiny'"):
        train.distributed()
    run_dir = settings().staging_root / train.last_job_id
    state = json.loads((run_dir / "state.json").read_text())
    assert state["status"] == "stopped" and len(state["attempts"]) == 1
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["rank-0.ckpt", "rank-1.ckpt"]
    rows = ledger.read().to_pylist()
    assert [r["status"] for r in rows] == ["preempted"]
    assert rows[0]["gpu_seconds"] >= 7.2  # the running attempt's spend is what tripped the budget


def test_a_job_the_policy_refuses_starts_no_process(tmp_path, monkeypatch):
    meter = UsageMeter(str(tmp_path / "ledger"), policy=UsagePolicy(name="small-jobs", max_gpus_per_job=1))

    @distributed(gpus=2, gpu_type="cpu", callbacks=[meter])
    def never():
        raise AssertionError("a refused job must not run")

    def no_process(*args, **kwargs):
        raise AssertionError(f"a refused job started a process: {args[:1]}")

    # Refused before anything starts: no rank, no agent, no helper process of any kind.
    with monkeypatch.context() as starts:
        starts.setattr(subprocess, "Popen", no_process)
        starts.setattr(os, "fork", no_process)
        with pytest.raises(PolicyViolationError, match="(?s)'small-jobs'.*2 GPUs asked for, at most 1 per job"):
            never.distributed()
    assert not list(settings().staging_root.glob("*/attempts"))
    assert UsageLedger(str(tmp_path / "ledger")).version() is None


WRITER = textwrap.dedent("""
    import sys, time
    from sparkgpu.usage.ledger import UsageLedger, UsageRecord
    from sparkgpu.usage.rates import RateCard
    uri, name, count, start_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    ledger = UsageLedger(uri)
    time.sleep(max(0.0, start_at - time.time()))  # both writers begin at the same moment
    for i in range(count):
        now = time.time()
        ledger.append([UsageRecord.priced(
            job_id=f"{name}-{i}", job_name=name, attempt=0, user=name, tags={"writer": name}, backend="local",
            gpu_type="A10", gpus=1, simulated=False, status="succeeded", started_at=now - 10, ended_at=now,
            rates=RateCard())])
""")


def test_two_clients_appending_at_once_lose_nothing(tmp_path):
    uri = str(tmp_path / "ledger")  # created by whichever writer commits first
    start_at = time.time() + 4.0
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, uri, name, "15", str(start_at)], stderr=subprocess.PIPE, text=True
        )
        for name in ("a", "b")
    ]
    errors = [w.communicate(timeout=120)[1] for w in writers]
    assert [w.returncode for w in writers] == [0, 0], errors
    ledger = UsageLedger(uri)
    ids = ledger.read()["job_id"].to_pylist()
    assert sorted(ids) == sorted([f"a-{i}" for i in range(15)] + [f"b-{i}" for i in range(15)])
    assert ledger.version() == 29  # 30 commits, one per row


def test_an_attempt_whose_client_is_killed_is_billed_by_the_next_client(tmp_path):
    import os
    import signal

    script = tmp_path / "long.py"
    script.write_text("import time\nprint('training', flush=True)\ntime.sleep(120)\n")
    client = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sparkgpu.cli",
            "run",
            str(script),
            "--gpus",
            "2",
            "--gpu-type",
            "cpu",
            "--tag",
            "team=ml",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        journal = settings().home / "usage" / "open"
        # Until the journal holds a heartbeat 5 s past the start: what the next client bills.
        while _beat_past(journal) < 5 or "training" not in _logs(settings().staging_root):
            assert client.poll() is None and time.monotonic() < deadline, (
                client.stdout.read() if client.poll() else "timeout"
            )
            time.sleep(0.2)
    finally:
        os.kill(client.pid, signal.SIGKILL)  # no after_attempt, no ledger row from this client
        client.wait()
        _wait_for_ranks_to_die_with_their_client(settings().staging_root)
    ledger = UsageLedger(settings().usage_ledger_uri)
    assert ledger.version() is None

    report = subprocess.run(
        [sys.executable, "-m", "sparkgpu.cli", "usage", "--by", "status", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    assert "recorded 1 attempt(s) whose client stopped" in report.stderr
    rows = ledger.read().to_pylist()
    assert [(r["status"], r["gpus"], dict(r["tags"])) for r in rows] == [("client_lost", 2, {"team": "ml"})]
    assert rows[0]["gpu_seconds"] >= 2 * 5
    assert json.loads(report.stdout.splitlines()[0])["status"] == "client_lost"


def _beat_past(journal) -> float:
    """Seconds from the journaled attempt's start to its last heartbeat; -1 before it is journaled."""
    for path in journal.glob("*/*.json"):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):  # replaced between the listing and the read
            continue
        return entry["heartbeat"] - entry["record"]["started_at"]
    return -1.0


def _logs(staging_root) -> str:
    return "".join(p.read_text(errors="replace") for p in staging_root.glob("*/attempts/*/logs/rank-0.log"))


def _wait_for_ranks_to_die_with_their_client(staging_root, within: float = 15.0):
    assert_no_orphans(staging_root, within=within)
