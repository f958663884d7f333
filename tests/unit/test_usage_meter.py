"""The metering callback driven by the real supervisor over a scripted backend (no processes)."""

import io
import json
import pickle
import time

import pytest

from sparkgpu.errors import PolicyViolationError
from sparkgpu.callbacks import AttemptOutcome
from sparkgpu.rundir.serialization import serialize_payload
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.launch.client.supervisor import Supervisor
from sparkgpu.spec import JobSpec, Resources, RunPolicy
from sparkgpu.usage.ledger import UsageLedger, UsageRecord
from sparkgpu.usage.meter import UsageMeter
from sparkgpu.usage.policy import UsagePolicy
from sparkgpu.usage.rates import RateCard, billed_seconds
from tests.fakes.backend import ScriptedBackend


def make_job(job_id="job-1", gpus=2, gpu_type="A10", tags=None, **policy):
    return JobSpec(
        job_id=job_id,
        name="train",
        resources=Resources(gpus, gpu_type),
        policy=RunPolicy(**policy),
        backend="fake",
        tags=tags if tags is not None else {"team": "ml"},
    )


def supervise(tmp_path, job, script, meter):
    rd = RunDir(tmp_path / "runs" / job.job_id)
    rd.create(job.to_dict(), serialize_payload(lambda: 1, (), {}, [meter]), b"k" * 32, [])
    return Supervisor(job, rd, ScriptedBackend(script), b"k" * 32, [meter], out=io.StringIO()), rd


def test_every_attempt_gets_a_priced_row_including_failed_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKGPU_USER", "ana")
    from sparkgpu.config import reset_settings

    reset_settings()
    ledger = UsageLedger(str(tmp_path / "ledger"))
    meter = UsageMeter(ledger, rates={"A10": 3.6})
    sup, rd = supervise(tmp_path, make_job(max_restarts=1), ["raise", "ok"], meter)
    sup.run()
    rows = sorted(ledger.read().to_pylist(), key=lambda r: r["attempt"])
    assert [(r["attempt"], r["status"]) for r in rows] == [(0, "failed"), (1, "succeeded")]
    state = json.loads(rd.state_file.read_text())
    for row, attempt in zip(rows, state["attempts"]):
        assert row["user"] == "ana" and dict(row["tags"]) == {"team": "ml"}
        assert row["gpu_type"] == "A10" and row["gpus"] == 2 and row["backend"] == "fake"
        assert row["started_at"].timestamp() == pytest.approx(attempt["started_at"], abs=1e-5)
        assert row["ended_at"].timestamp() == pytest.approx(attempt["ended_at"], abs=1e-5)
        assert row["gpu_seconds"] == 2 * billed_seconds(attempt["started_at"], attempt["ended_at"]) > 0
        assert row["cost_usd"] == pytest.approx(row["gpu_seconds"] * 3.6 / 3600, abs=1e-4)
    assert not any(meter.journal.directory.glob("*.json"))  # nothing left in flight


def test_a_budget_spent_mid_run_asks_ranks_to_checkpoint_and_stop(tmp_path):
    ledger = UsageLedger(str(tmp_path / "ledger"))
    # 1 GPU-hour budget, 0.999 already spent: 2 GPUs spend the rest in under 2 seconds.
    ledger.append(
        [
            UsageRecord.priced(
                job_id="earlier",
                job_name="x",
                attempt=0,
                user="ana",
                tags={"team": "ml"},
                backend="local",
                gpu_type="A10",
                gpus=1,
                simulated=False,
                status="succeeded",
                started_at=time.time() - 3600,
                ended_at=time.time() - 3.6,
                rates=RateCard(),
            )
        ]
    )
    policy = UsagePolicy.from_dict({"name": "ml-budget", "budgets": {"team=ml": "1 GPU-hours per 1d"}})
    meter = UsageMeter(ledger, policy=policy)
    sup, rd = supervise(tmp_path, make_job(max_runtime=4, checkpoint_grace=1), ["hang"], meter)
    with pytest.raises(PolicyViolationError, match=r"budget 'team=ml: 1 GPU-hours per 1d' is spent.*'ml-budget'"):
        sup.run()
    assert (rd.file(RunLayout.attempt(0)) / "STOP").exists()
    assert json.loads(rd.state_file.read_text())["status"] == "stopped"
    rows = ledger.read().to_pylist()
    # The stopped attempt is billed too; its ranks never checkpointed, so it is no preemption.
    assert sorted(r["status"] for r in rows) == ["stopped", "succeeded"]


def test_stop_reason_adds_the_running_attempt_to_the_ledger_spend(tmp_path):
    ledger = UsageLedger(str(tmp_path / "ledger"))
    policy = UsagePolicy.from_dict({"budgets": {"team=ml": "$10 per 1d"}})
    meter = UsageMeter(ledger, rates={"A10": 3600.0}, policy=policy)  # $1 per GPU-second
    job = make_job()
    meter.before_job(job, str(tmp_path))
    meter.before_attempt(job, 0)
    assert meter.stop_reason(job, 0, 4.9) is None  # 2 GPUs x 4.9 s = $9.80
    reason = meter.stop_reason(job, 0, 5.0)
    assert reason and "$10.00 of $10.00" in reason
    assert meter.stop_reason(make_job(job_id="other", tags={"team": "cv"}), 0, 1e6) is None  # never started here


def test_the_policy_runtime_limit_counts_every_attempt_of_the_job(tmp_path):
    meter = UsageMeter(str(tmp_path / "ledger"), policy=UsagePolicy(name="p", max_runtime="100s"))
    job = make_job()
    meter.before_job(job, str(tmp_path))
    meter.before_attempt(job, 0)
    now = time.time()
    meter.after_attempt(job, AttemptOutcome(0, "preempted", now - 60, now, 2, "A10"))
    meter.before_attempt(job, 1)
    assert meter.stop_reason(job, 1, 30) is None
    assert "runtime limit of 100s of 'p' (100s over 2 attempt(s))" in meter.stop_reason(job, 1, 40)


def test_a_refused_job_starts_no_attempt(tmp_path):
    meter = UsageMeter(str(tmp_path / "ledger"), policy=UsagePolicy(name="p", max_gpus_per_job=1))
    sup, rd = supervise(tmp_path, make_job(), ["ok"], meter)
    with pytest.raises(PolicyViolationError, match="2 GPUs asked for, at most 1 per job"):
        sup.run()
    assert not rd.file(RunLayout.attempt(0)).exists() and not sup.backend.submitted_env


def test_a_ledger_outage_does_not_fail_the_job_and_the_row_is_written_later(tmp_path, caplog):
    blocker = tmp_path / "ledger-parent"
    blocker.write_text("a file where the ledger's folder should be")
    meter = UsageMeter(str(blocker / "ledger"))
    sup, rd = supervise(tmp_path, make_job(), ["ok"], meter)
    with caplog.at_level("WARNING", logger="sparkgpu.usage"):
        assert len(sup.run()) == 2  # the job's outcome stands
    assert "could not write usage of attempt 0" in caplog.text  # logged for whoever runs the ledger
    assert len(list(meter.journal.directory.glob("*.json"))) == 1

    blocker.unlink()  # the store is back
    recovered = UsageMeter(str(blocker / "ledger")).recover()
    assert [r["status"] for r in recovered] == ["succeeded"]
    assert UsageLedger(str(blocker / "ledger")).read()["job_id"].to_pylist() == ["job-1"]


def test_the_meter_travels_to_workers_without_its_client_state(tmp_path):
    meter = UsageMeter(str(tmp_path / "ledger"), policy=UsagePolicy(max_gpus_per_job=4))
    job = make_job()
    meter.before_job(job, str(tmp_path))
    clone = pickle.loads(pickle.dumps(meter))
    assert clone._running == {} and clone.policy == meter.policy and clone.ledger.uri == meter.ledger.uri


def test_an_attempt_outcome_holds_its_status_as_the_protocol_state():
    from sparkgpu.rundir.states import AttemptStatus

    outcome = AttemptOutcome(0, "preempted", 0.0, 1.0, 2, "A10")
    assert outcome.status is AttemptStatus.PREEMPTED
    with pytest.raises(ValueError):
        AttemptOutcome(0, "half-done", 0.0, 1.0, 2, "A10")
