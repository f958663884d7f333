"""The supervisor's state machine, driven by a scripted backend (no processes)."""

import io
import json
import pickle
import time

import pytest

from sparkgpu.errors import CapacityError, JobTimeoutError, NodeLostError, WorkerFailedError
from sparkgpu.launch.client.attempt_report import AttemptReport, NodeReport
from sparkgpu.launch.client.attempt_verdict import read_attempt
from sparkgpu.callbacks import JobCallback
from sparkgpu.rundir.exit_codes import EXIT_PREEMPTED
from sparkgpu.rundir.serialization import serialize_payload
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.launch.client.supervisor import Supervisor
from sparkgpu.spec import JobSpec, Resources, RunPolicy
from sparkgpu.rundir.keyring import derive_key
from sparkgpu.train._checkpoint_signing import Manifest
from sparkgpu.train.checkpoint_directory import MARKER_NAME, CheckpointInfo, CheckpointDirectory, SigningKey
from tests.fakes.backend import FakeAttempt, ScriptedBackend


class RecordingCallback(JobCallback):
    def __init__(self):
        self.events = []

    def before_job(self, job, run_dir):
        self.events.append("before_job")

    def before_attempt(self, job, attempt):
        self.events.append(f"before_attempt:{attempt}")
        return {"TRACKING_RUN": "run-1"}

    def on_ranks_started(self, job, attempt, started_at):
        self.events.append(f"ranks_started:{attempt}")

    def after_attempt(self, job, outcome):
        self.events.append(f"after_attempt:{outcome.attempt}:{outcome.status}")

    def after_job(self, job, results, error):
        self.events.append(f"after_job:{type(error).__name__ if error else 'ok'}")


def run_job(tmp_path, script, **policy):
    job = JobSpec(job_id="job-1", name="job", resources=Resources(2, "cpu"), policy=RunPolicy(**policy))
    rd = RunDir(tmp_path / "job-1")
    rd.create(job.to_dict(), serialize_payload(lambda: 1, (), {}, []), b"k" * 32, [])
    backend = ScriptedBackend(script)
    callback = RecordingCallback()
    out = io.StringIO()
    sup = Supervisor(job, rd, backend, b"k" * 32, [callback], out=out)
    return sup, backend, callback, rd, out


def test_success_returns_results_in_rank_order_and_records_state(tmp_path):
    sup, backend, cb, rd, out = run_job(tmp_path, ["ok"])
    assert sup.run() == [{"rank": 0, "attempt": 0}, {"rank": 1, "attempt": 0}]
    state = json.loads(rd.state_file.read_text())
    assert state["status"] == "succeeded" and [a["status"] for a in state["attempts"]] == ["succeeded"]
    assert cb.events == [
        "before_job",
        "before_attempt:0",
        "ranks_started:0",
        "after_attempt:0:succeeded",
        "after_job:ok",
    ]
    env = backend.submitted_env[0]
    assert env["SPARKGPU_ATTEMPT"] == "0" and env["TRACKING_RUN"] == "run-1"
    assert env["SPARKGPU_CHECKPOINT_DIR"] == str(rd.checkpoints)
    assert "[rank0] attempt 0 rank 0" in out.getvalue() and "[rank1]" not in out.getvalue()


def test_failures_restart_until_restarts_run_out_then_raise(tmp_path):
    sup, backend, cb, rd, out = run_job(tmp_path, ["raise", "segv", "raise"], max_restarts=2)
    with pytest.raises(WorkerFailedError) as err:
        sup.run()
    assert err.value.ranks == [0, 1]
    assert "ranks 0, 1: ValueError: bad batch at attempt 2" in str(err.value)
    assert isinstance(err.value.__cause__, ValueError)
    state = json.loads(rd.state_file.read_text())
    assert state["status"] == "failed" and state["restarts"] == 2
    assert [a["status"] for a in state["attempts"]] == ["failed"] * 3
    assert "SIGSEGV" in state["attempts"][1]["cause"][0]
    assert "restart 2 of 2" in out.getvalue()


def test_a_restart_that_succeeds_returns_its_results(tmp_path):
    sup, *_ = run_job(tmp_path, ["segv", "ok"], max_restarts=1)
    assert sup.run()[0] == {"rank": 0, "attempt": 1}


def test_preemption_resumes_without_using_a_restart(tmp_path):
    sup, backend, cb, rd, out = run_job(tmp_path, ["preempt", "preempt", "ok"], max_restarts=0)
    assert sup.run()[1] == {"rank": 1, "attempt": 2}
    state = json.loads(rd.state_file.read_text())
    assert state["preemptions"] == 2 and state["restarts"] == 0
    assert "after_attempt:0:preempted" in cb.events


def test_timeout_cancels_the_attempt_and_raises(tmp_path):
    sup, backend, cb, rd, out = run_job(tmp_path, ["hang"], timeout=0.3)
    with pytest.raises(JobTimeoutError, match="timeout of 0.3s"):
        sup.run()
    assert backend.cancelled == [0]
    assert json.loads(rd.state_file.read_text())["status"] == "timed_out"
    assert cb.events[-1] == "after_job:JobTimeoutError"


class CapBackend(ScriptedBackend):
    """Adds hung attempts that leave what a checkpointing function leaves at the cap.

    ``"hang+checkpoint"`` commits a complete checkpoint while it runs, signed with the job's
    key as a rank's Checkpointer signs it; ``"hang+planted"`` has a writer of the checkpoint
    directory plant an unsigned marker instead; ``"hang+exit75"`` has its ranks exit with the
    "resume me" status (as after ``stop_for_restart``) but no marker.
    """

    def submit(self, job, run_dir, attempt, env, placement=None):
        action = self.script[attempt]
        self.script[attempt] = "hang" if action.startswith("hang") else action
        handle = super().submit(job, run_dir, attempt, env)
        if action in ("hang+checkpoint", "hang+planted"):
            step_dir = run_dir.checkpoints / "step-0000000007"
            step_dir.mkdir(parents=True)
            info = CheckpointInfo(step=7, path=str(step_dir), world_size=job.world_size, created=time.time())
            if action == "hang+planted":
                (step_dir / MARKER_NAME).write_text(json.dumps(info.to_json()))
            else:
                signing = SigningKey(derive_key(run_dir.key, "checkpoints"), job.job_id)
                CheckpointDirectory(run_dir.checkpoints, key=signing).commit(
                    info, Manifest({".metadata": (0, "blake3:" + "0" * 64)}, {}, job.job_id)
                )
        elif action == "hang+exit75":
            exits = {str(r): {"exitcode": EXIT_PREEMPTED, "pid": 1} for r in range(job.world_size)}
            run_dir.write_control(
                run_dir.file(RunLayout.node_exits(attempt, 0)), json.dumps({"failures": exits}).encode()
            )
        return handle


def cap_job(tmp_path, script, **policy):
    sup, _, cb, rd, out = run_job(tmp_path, ["ok"], max_runtime=0.5, checkpoint_grace=0.2, **policy)
    sup.backend = CapBackend(script)
    return sup, sup.backend, cb, rd, out


def test_a_function_that_never_checkpoints_fails_at_the_runtime_cap_instead_of_resuming_forever(tmp_path):
    sup, backend, cb, rd, out = cap_job(tmp_path, ["hang", "hang", "ok"], max_restarts=1)
    with pytest.raises(WorkerFailedError) as err:
        sup.run()
    message = str(err.value)
    assert "ranks 0, 1: the attempt reached its runtime cap (max_runtime=0.5s)" in message
    assert "did not checkpoint before it" in message
    assert "Checkpointer" in message and "runtime.stop_for_restart()" in message
    assert backend.cancelled == [0, 1]
    state = json.loads(rd.state_file.read_text())
    assert state["status"] == "failed" and state["restarts"] == 1 and state["preemptions"] == 0
    assert [a["status"] for a in state["attempts"]] == ["failed", "failed"]
    assert "after_attempt:0:failed" in cb.events
    deadline = float(backend.submitted_env[0]["SPARKGPU_CHECKPOINT_DEADLINE"])
    assert deadline > 0


def test_an_attempt_that_committed_a_checkpoint_before_the_cap_resumes_without_a_restart(tmp_path):
    sup, backend, cb, rd, out = cap_job(tmp_path, ["hang+checkpoint", "ok"])
    assert sup.run()[0]["attempt"] == 1
    assert backend.cancelled == [0]
    state = json.loads(rd.state_file.read_text())
    assert state["preemptions"] == 1 and state["restarts"] == 0
    assert [a["status"] for a in state["attempts"]] == ["preempted", "succeeded"]


def test_ranks_that_exit_with_the_resume_status_at_the_cap_count_as_preempted(tmp_path):
    sup, backend, cb, rd, out = cap_job(tmp_path, ["hang+exit75", "ok"])
    assert sup.run()[0]["attempt"] == 1
    assert json.loads(rd.state_file.read_text())["preemptions"] == 1


def test_a_planted_checkpoint_marker_does_not_make_a_capped_attempt_a_preemption(tmp_path):
    sup, backend, cb, rd, out = cap_job(tmp_path, ["hang+planted", "ok"])
    with pytest.raises(WorkerFailedError, match="did not checkpoint before it"):
        sup.run()  # a preemption uses up no restart: a planted marker would keep a job looping
    assert json.loads(rd.state_file.read_text())["preemptions"] == 0


def test_an_old_checkpoint_does_not_make_a_capped_attempt_a_preemption(tmp_path):
    sup, backend, cb, rd, out = cap_job(tmp_path, ["hang+checkpoint", "hang", "ok"])
    with pytest.raises(WorkerFailedError, match="did not checkpoint before it"):
        sup.run()  # attempt 1 saved nothing new: step 7 was attempt 0's
    assert json.loads(rd.state_file.read_text())["preemptions"] == 1


class BudgetSpent(JobCallback):
    def stop_reason(self, job, attempt, attempt_seconds):
        return "budget team=ml is spent (100.0 of 100.0 GPU-hours)"


def test_a_policy_stop_asks_ranks_to_checkpoint_then_ends_without_resuming(tmp_path):
    from sparkgpu.errors import PolicyViolationError

    sup, backend, cb, rd, out = run_job(tmp_path, ["hang", "ok"], max_runtime=1.5, checkpoint_grace=0.5)
    sup.callbacks.append(BudgetSpent())
    with pytest.raises(PolicyViolationError, match="budget team=ml is spent.*sparkgpu resume job-1"):
        sup.run()
    assert (rd.file(RunLayout.attempt(0)) / "STOP").read_text().startswith("budget team=ml")
    state = json.loads(rd.state_file.read_text())
    assert state["status"] == "stopped" and len(state["attempts"]) == 1


class PollRaises(ScriptedBackend):
    """Like the Spark backend giving up on busy GPUs: ``poll`` raises on its third call."""

    def __init__(self, script, error):
        super().__init__(script)
        self.error, self.polls = error, 0

    def poll(self, handle):
        self.polls += 1
        if self.polls == 3:
            raise self.error
        return super().poll(handle)


def test_an_error_from_the_backend_ends_the_attempt_and_runs_the_callbacks(tmp_path):
    from sparkgpu.errors import CapacityError

    sup, _, cb, rd, out = run_job(tmp_path, ["hang"], max_restarts=2)
    sup.backend = PollRaises(["hang"], CapacityError("gave up after waiting 600s for 1 node(s) x 2 A10"))
    with pytest.raises(CapacityError, match="gave up after waiting"):
        sup.run()
    assert sup.backend.cancelled == [0]  # its ranks are stopped, whatever they were doing
    state = json.loads(rd.state_file.read_text())
    assert state["status"] == "failed" and state["restarts"] == 0  # not restarted: the error is raised
    (attempt,) = state["attempts"]
    assert attempt["status"] == "failed" and attempt["ended_at"] >= attempt["started_at"]
    assert attempt["cause"] == ["CapacityError: gave up after waiting 600s for 1 node(s) x 2 A10"]
    assert cb.events == [
        "before_job",
        "before_attempt:0",
        "ranks_started:0",
        "after_attempt:0:failed",
        "after_job:CapacityError",
    ]
    assert "attempt 0 rank 0" in out.getvalue()  # the log streamer was drained, not dropped


def test_an_error_from_the_backend_closes_the_usage_journal(tmp_path):
    from sparkgpu.errors import CapacityError
    from sparkgpu.usage.ledger import UsageLedger
    from sparkgpu.usage.meter import UsageMeter

    ledger = UsageLedger(str(tmp_path / "ledger"))
    meter = UsageMeter(ledger, policy=False)
    sup, *_ = run_job(tmp_path, ["hang"])
    sup.callbacks.append(meter)
    sup.backend = PollRaises(["hang"], CapacityError("no GPUs"))
    with pytest.raises(CapacityError):
        sup.run()
    assert [r["status"] for r in ledger.read().to_pylist()] == ["failed"]
    assert not list(meter.journal.directory.glob("*.json"))  # nothing left to be billed as client_lost


class CheckpointOnSigterm(ScriptedBackend):
    """Ranks that ignore the stop file but checkpoint on SIGTERM, as a Checkpointer's ranks do."""

    def cancel(self, handle, grace):
        super().cancel(handle, grace)
        self.grace = grace
        for rank in range(2):
            self.run_dir.file(RunLayout.preempted(handle.attempt, rank)).write_text("x")

    def submit(self, job, run_dir, attempt, env, placement=None):
        self.run_dir = run_dir
        return super().submit(job, run_dir, attempt, env)


def test_ranks_that_ignore_a_policy_stop_are_stopped_after_checkpoint_grace(tmp_path):
    from sparkgpu.errors import PolicyViolationError

    # No runtime cap: without the fallback only the job timeout would ever end this attempt.
    sup, backend, cb, rd, out = run_job(tmp_path, ["hang", "ok"], checkpoint_grace=0.5, timeout=20)
    sup.callbacks.append(BudgetSpent())
    started = time.monotonic()
    with pytest.raises(PolicyViolationError, match="stopped [(]its ranks did not checkpoint when asked") as err:
        sup.run()
    assert 0.5 <= time.monotonic() - started < 15  # the fallback after checkpoint_grace, not the 20 s timeout
    assert "budget team=ml is spent" in str(err.value) and "sparkgpu resume job-1" in str(err.value)
    assert backend.cancelled == [0]
    assert "did not stop within checkpoint_grace (0.5s)" in out.getvalue()
    state = json.loads(rd.state_file.read_text())
    assert state["status"] == "stopped" and [a["status"] for a in state["attempts"]] == ["stopped"]
    assert cb.events[-2:] == ["after_attempt:0:stopped", "after_job:PolicyViolationError"]


def test_ranks_that_checkpoint_on_sigterm_after_a_policy_stop_end_preempted(tmp_path):
    from sparkgpu.errors import PolicyViolationError

    sup, _, cb, rd, out = run_job(tmp_path, ["hang", "ok"], checkpoint_grace=0.3, shutdown_grace=7, timeout=20)
    sup.backend = backend = CheckpointOnSigterm(["hang", "ok"])
    sup.callbacks.append(BudgetSpent())
    with pytest.raises(PolicyViolationError, match="checkpointed and stopped: budget team=ml is spent"):
        sup.run()
    assert backend.grace == 7  # SIGTERM first: the ranks get shutdown_grace to save
    state = json.loads(rd.state_file.read_text())
    assert state["status"] == "stopped" and [a["status"] for a in state["attempts"]] == ["preempted"]


class WaitsForGPUs(ScriptedBackend):
    """Ranks start ``wait`` seconds after submit, as on a Spark cluster whose GPUs are busy
    (a :class:`~sparkgpu.launch.backends.capabilities.DeferredStart` backend)."""

    def __init__(self, script, wait, meter=None):
        super().__init__(script)
        self.wait, self.meter = wait, meter
        self.journaled_while_waiting = False

    def submit(self, job, run_dir, attempt, env, placement=None):
        self.submitted_at = time.time()
        handle = super().submit(job, run_dir, attempt, env)
        if self.script[attempt] == "ok":
            handle.polls_left = int((self.wait + 0.5) / 0.1)  # runs about 0.5 s once started
        return handle

    def ranks_started_at(self, handle):
        now = time.time()
        if now < self.submitted_at + self.wait:
            if self.meter is not None and any(self.meter.journal.directory.glob("*.json")):
                self.journaled_while_waiting = True
            return None
        return self.submitted_at + self.wait


def test_billing_starts_when_the_ranks_start_not_at_submit(tmp_path):
    from sparkgpu.usage.ledger import UsageLedger
    from sparkgpu.usage.meter import UsageMeter

    ledger = UsageLedger(str(tmp_path / "ledger"))
    meter = UsageMeter(ledger, policy=False)
    sup, *_, rd, out = run_job(tmp_path, ["ok"])
    sup.backend = backend = WaitsForGPUs(["ok"], wait=1.5, meter=meter)
    sup.callbacks.append(meter)
    sup.run()
    (attempt,) = json.loads(rd.state_file.read_text())["attempts"]
    assert attempt["submitted_at"] == pytest.approx(backend.submitted_at, abs=0.05)
    assert attempt["started_at"] == pytest.approx(backend.submitted_at + 1.5, abs=1e-6)
    (row,) = ledger.read().to_pylist()
    assert row["started_at"].timestamp() == pytest.approx(attempt["started_at"], abs=1e-5)
    assert row["gpu_seconds"] < 2 * 1.5  # about 0.5 s of running on 2 GPUs, not the wait
    assert not backend.journaled_while_waiting  # a client dying while it waits is billed nothing


def test_the_runtime_cap_counts_from_the_ranks_start(tmp_path):
    sup, *_, rd, out = run_job(tmp_path, ["ok"], max_runtime=1.0, checkpoint_grace=0.3)
    sup.backend = backend = WaitsForGPUs(["ok"], wait=1.5)  # waits longer than the cap, then runs 0.5 s
    assert sup.run()[0]["attempt"] == 0
    assert backend.cancelled == []
    # The ranks' deadline cannot be known at submit: the stop file says when it is near.
    assert "SPARKGPU_CHECKPOINT_DEADLINE" not in backend.submitted_env[0]


def test_ranks_that_started_late_are_asked_to_checkpoint_before_the_cap(tmp_path):
    sup, *_, rd, out = run_job(tmp_path, ["ok"], max_runtime=1.0, checkpoint_grace=0.5)
    sup.backend = WaitsForGPUs(["hang"], wait=1.0)
    with pytest.raises(WorkerFailedError, match="did not checkpoint"):
        sup.run()
    stop = rd.file(RunLayout.attempt(0)) / "STOP"
    assert "runtime cap" in stop.read_text()
    started = json.loads(rd.state_file.read_text())["attempts"][0]["started_at"]
    assert stop.stat().st_mtime - started == pytest.approx(0.5, abs=0.3)


class NeverStarts(PollRaises):
    """Ranks that wait for GPUs until ``poll`` raises: they never start."""

    def ranks_started_at(self, handle):
        return None


def test_an_attempt_whose_ranks_never_started_bills_nothing(tmp_path):
    from sparkgpu.errors import CapacityError

    sup, *_, rd, out = run_job(tmp_path, ["hang"])
    sup.backend = NeverStarts(["hang"], CapacityError("gave up"))
    with pytest.raises(CapacityError):
        sup.run()
    (attempt,) = json.loads(rd.state_file.read_text())["attempts"]
    assert attempt["started_at"] == attempt["ended_at"] > attempt["submitted_at"]


def test_files_of_the_users_own_in_the_checkpoint_dir_do_not_fail_the_job(tmp_path):
    sup, backend, cb, rd, out = cap_job(tmp_path, ["hang", "ok"], max_restarts=1)
    (rd.checkpoints / "step-1").write_text("my own progress marker, not a sparkgpu checkpoint")
    assert sup.run()[0]["attempt"] == 1  # the capped attempt is a failure (restart 1), not a crash
    assert "cannot read the checkpoints" not in out.getvalue()  # not a checkpoint: skipped, not an error
    assert (rd.checkpoints / "step-1").read_text().startswith("my own")


def test_a_failure_no_restart_can_fix_is_raised_at_once(tmp_path):
    # A tampered payload fails the same way on every attempt: restarting it only spends GPU time.
    from sparkgpu.env.hydrate import EnvironmentMismatchError as RaisedByHydration
    from sparkgpu.errors import PayloadSignatureError
    from sparkgpu.launch.client.supervisor import Decision, FailurePolicy

    policy = FailurePolicy(max_restarts=3)
    refused = {0: PayloadSignatureError("modified after it was staged")}
    mismatch = {1: RaisedByHydration("Python 3.12 vs 3.11"), 0: ValueError("a peer left")}
    flaky = {0: ValueError("bad batch")}
    assert policy.decide(0, refused) is Decision.RAISE
    assert policy.decide(0, mismatch) is Decision.RAISE
    assert policy.decide(0, flaky) is Decision.RESTART
    assert policy.decide(3, flaky) is Decision.RAISE


def test_callbacks_hear_when_ranks_start_only_once_they_run(tmp_path):
    # On Spark, ranks may wait for busy GPUs and never start: no start is announced then.
    from sparkgpu.errors import CapacityError

    sup, _, cb, rd, _ = run_job(tmp_path, ["hang"])
    sup.backend = NeverStarts(["hang"], CapacityError("gave up"))
    with pytest.raises(CapacityError):
        sup.run()
    assert "ranks_started:0" not in cb.events and "after_attempt:0:failed" in cb.events


class LosingBackend(ScriptedBackend):
    """Attempt k plays ``"lost"`` too: rank 0 raised after its peer left, node 1 (rank 1) was lost."""

    lost_at = time.time() - 3600  # long before the attempt ends: the bill must stop there, not at the end

    def submit(self, job, run_dir, attempt, env, placement=None):
        if self.script[attempt] != "lost":
            return super().submit(job, run_dir, attempt, env)
        self.script[attempt] = "raise"  # rank errors on both ranks; the report says why
        handle = super().submit(job, run_dir, attempt, env)
        run_dir.file(RunLayout.error(attempt, 1)).unlink()  # the lost node's rank never wrote how it ended
        AttemptReport(
            attempt,
            nodes=[NodeReport(1, "7", "10.0.0.7", "lost", [1], cause="no heartbeat for 10s")],
            notes=["a note"],
            lost_at=self.lost_at,
        ).write(run_dir.file(RunLayout.attempt(attempt)))
        return handle


@pytest.mark.parametrize("peer_marker", [True, False], ids=["marker", "exit-record-only"])
def test_a_rank_torn_down_as_its_peer_stops_for_a_restart_is_no_failure(tmp_path, peer_marker):
    """Rank 0 stops for a restart; torch's agent stops rank 1 with SIGTERM before it gets there."""
    sup, *_ = run_job(tmp_path, [])
    rd = sup.run_dir
    rd.prepare_attempt(0)
    if peer_marker:
        rd.file(RunLayout.preempted(0, 0)).write_text("stopped for a restart")
    exits = {"0": {"exitcode": EXIT_PREEMPTED, "pid": 1}, "1": {"exitcode": -15, "pid": 2}}
    rd.write_control(rd.file(RunLayout.node_exits(0, 0)), json.dumps({"status": 1, "failures": exits}).encode())
    assert read_attempt(rd, 0, 2, sup.job.policy).status.value == "preempted"
    # Without a peer stopping for a restart, the same SIGTERM is the rank's own end: a failure.
    alone = {"1": {"exitcode": -15, "pid": 2}}
    rd.file(RunLayout.preempted(0, 0)).unlink(missing_ok=True)
    rd.write_control(rd.file(RunLayout.node_exits(0, 0)), json.dumps({"status": 1, "failures": alone}).encode())
    failed = read_attempt(rd, 0, 2, sup.job.policy)
    assert failed.status.value == "failed" and [f.rank for f in failed.failures] == [1]


def test_a_lost_node_in_the_backends_report_fails_the_attempt_naming_its_host(tmp_path):
    sup, _, cb, rd, out = run_job(tmp_path, [], max_restarts=1)
    sup.backend = LosingBackend(["lost", "lost"])
    with pytest.raises(NodeLostError) as err:
        sup.run()
    assert str(err.value).startswith("executor 7 on host 10.0.0.7 was lost (no heartbeat for 10s)")
    assert [f.rank for f in err.value.failures] == [0, 1]
    assert err.value.first_failure.rank == 1  # the lost rank, before its peer's error
    assert pickle.loads(pickle.dumps(err.value)).lost == err.value.lost
    state = json.loads(rd.state_file.read_text())
    first, second = state["attempts"]
    assert [(n["node"], n["executor"], n["host"]) for n in first["lost"]] == [(1, "7", "10.0.0.7")]
    assert first["cause"][0] == "executor 7 on host 10.0.0.7 was lost (no heartbeat for 10s)"
    assert first["ended_at"] == first["started_at"]  # lost before it started here: nothing billed after the loss
    assert "attempt 0 failed (lost_node: executor 7 on host 10.0.0.7 was lost" in out.getvalue()
    # Read back later (attach(job_id).result()), the job raises the same error.
    again = read_attempt(rd, 1, 2, sup.job.policy).error("job-1", "logs")
    assert isinstance(again, NodeLostError) and again.lost == err.value.lost and again.ranks == err.value.ranks


class NotingBackend(ScriptedBackend):
    """Its nodes never started a launcher; the report's note says why."""

    def submit(self, job, run_dir, attempt, env, placement=None):
        run_dir.prepare_attempt(attempt)
        AttemptReport(attempt, notes=["executor 1 on h cannot see the run dir /x: set SPARKGPU_STAGING_ROOT"]).write(
            run_dir.file(RunLayout.attempt(attempt))
        )
        return FakeAttempt(attempt=attempt, code=1, polls_left=1)


def test_the_backends_notes_are_shown_when_no_launcher_recorded_anything(tmp_path):
    sup, *_ = run_job(tmp_path, [])
    sup.backend = NotingBackend([])
    with pytest.raises(WorkerFailedError) as err:
        sup.run()
    assert not isinstance(err.value, NodeLostError)
    assert "sparkgpu: executor 1 on h cannot see the run dir /x: set SPARKGPU_STAGING_ROOT" in str(err.value)


class AskedToGiveWay(ScriptedBackend):
    """A best-effort job that a critical one asks to give way while its first attempt runs."""

    def __init__(self, script, queue_wait: float):
        super().__init__(script)
        self.queue_wait = queue_wait
        self.events: list[str] = []

    def submit(self, job, run_dir, attempt, env, placement=None):
        self.events.append(f"submit:{attempt}")
        return super().submit(job, run_dir, attempt, env)

    def preemption_request(self, job):
        attempt = len(self.submitted_env) - 1
        return "critical job urgent-1 needs 2 GPU(s) of this host" if attempt == 0 else None

    def give_way(self, job):
        self.events.append("give_way")

    def await_capacity(self, job, wait):
        self.events.append("await_capacity" if wait is None else f"await_capacity:{wait > 0}")
        if wait is not None:  # after giving way: the critical job runs meanwhile
            time.sleep(self.queue_wait)
        self.waited_until = time.time()


def test_a_job_asked_to_give_way_checkpoints_frees_its_gpus_and_resumes_unbilled_without_a_restart(tmp_path):
    sup, _, cb, rd, out = run_job(tmp_path, ["hang", "ok"], checkpoint_grace=0.3, timeout=30)
    sup.backend = backend = AskedToGiveWay(["hang", "ok"], queue_wait=1.0)
    outcomes = []
    cb.after_attempt = lambda job, outcome: outcomes.append(outcome)
    assert [r["attempt"] for r in sup.run()] == [1, 1]
    assert backend.events == ["await_capacity", "submit:0", "give_way", "await_capacity:True", "submit:1"]
    assert rd.read_control(rd.file(RunLayout.stop(0))) == b"critical job urgent-1 needs 2 GPU(s) of this host\n"
    state = json.loads(rd.state_file.read_text())
    assert [a["status"] for a in state["attempts"]] == ["preempted", "succeeded"]
    assert (state["restarts"], state["preemptions"]) == (0, 1)  # max_restarts=0, and nothing failed
    assert "waiting" not in state
    assert "gave way" in out.getvalue() and "using no restart" in out.getvalue()
    # Billed: the two attempts' spans only; the second starts after the wait in the queue.
    assert outcomes[0].ended_at < backend.waited_until - 0.9 and outcomes[1].started_at >= backend.waited_until


class NeverGetsItsGPUsBack(AskedToGiveWay):
    def __init__(self, script, queue_wait: float):
        super().__init__(script, queue_wait)
        self.waits: list[float] = []

    def await_capacity(self, job, wait):
        if wait is not None:
            self.waits.append(wait)
            raise CapacityError("busy: GPU 0: urgent-1")


def test_a_job_whose_timeout_runs_out_while_it_waits_after_giving_way_times_out_resumably(tmp_path):
    sup, _, cb, rd, out = run_job(tmp_path, ["hang", "ok"], checkpoint_grace=0.3, timeout=30)
    sup.backend = backend = NeverGetsItsGPUsBack(["hang", "ok"], queue_wait=0)
    with pytest.raises(JobTimeoutError, match="gave way to a critical job .* `sparkgpu resume job-1`"):
        sup.run()
    assert 20 < backend.waits[-1] < 30  # what was left of its timeout
    state = json.loads(rd.state_file.read_text())
    assert state["status"] == "timed_out" and [a["status"] for a in state["attempts"]] == ["preempted"]
    assert state["restarts"] == 0


def test_the_same_failure_after_a_supervisor_took_the_job_over_is_not_restarted_again(tmp_path):
    first, _, _, rd, _ = run_job(tmp_path / "a", ["raise", "ok"], max_restarts=3)
    assert first.run()[0] == {"rank": 0, "attempt": 1}
    remembered = json.loads(rd.state_file.read_text())["failed_before"]
    assert remembered and remembered[0]["exc_type"].endswith("ValueError")
    # A supervisor that takes the job over reads the failure policy's memory from the job's state.
    second, _, _, rd2, out = run_job(tmp_path / "b", ["raise", "ok"], max_restarts=3)
    second.book.state["failed_before"] = remembered
    with pytest.raises(WorkerFailedError):
        second.run()
    assert "again, as the attempt before it" in out.getvalue()
    assert json.loads(rd2.state_file.read_text())["restarts"] == 0
