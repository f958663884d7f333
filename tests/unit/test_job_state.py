"""The job's state file: its one owner (JobBook), its one writer of the status (the supervisor),
the run dir states' transition tables, and the supervisor's step table."""

import ast
import itertools
import json
from pathlib import Path

import pytest

import sparkgpu
from sparkgpu.launch.client.attempt_verdict import StoppedBy
from sparkgpu.launch.client.job_state import IllegalTransition, JobBook
from sparkgpu.launch.client.supervisor import JobStep, cancel_abandoned, fail_unsupervisable, next_step
from sparkgpu.rundir.states import ATTEMPT_TRANSITIONS, JOB_TRANSITIONS, AttemptStatus, JobStatus

PACKAGE = Path(sparkgpu.__file__).resolve().parent


@pytest.fixture
def book(tmp_path):
    return JobBook.new(tmp_path / "state.json", "job-1", "fake")


def on_disk(book):
    return json.loads(book.path.read_text())


def test_every_status_has_its_row_and_only_succeeded_is_final():
    assert set(JOB_TRANSITIONS) == set(JobStatus) and set(ATTEMPT_TRANSITIONS) == set(AttemptStatus)
    assert [s for s, to in JOB_TRANSITIONS.items() if not to] == [JobStatus.SUCCEEDED]
    assert [s for s, to in ATTEMPT_TRANSITIONS.items() if to] == [AttemptStatus.RUNNING]
    for status in JobStatus:
        if status.is_terminal and status is not JobStatus.SUCCEEDED:
            assert JobStatus.RUNNING in JOB_TRANSITIONS[status]  # `sparkgpu resume` continues it


def test_the_table_draws_every_legal_step_and_refuses_the_rest(book):
    S = JobStatus
    assert JOB_TRANSITIONS[S.PENDING] == {S.RUNNING, S.FAILED, S.CANCELLED}  # it may end before its first attempt
    assert JOB_TRANSITIONS[S.RUNNING] == set(S) - {S.PENDING}
    for source, target in itertools.product(JobStatus, JobStatus):
        fresh = JobBook(book.path, {**JobBook.new(book.path, "job-1", "fake").state, "status": source.value})
        if target in JOB_TRANSITIONS[source]:
            fresh.set_status(target)
            assert on_disk(fresh)["status"] == target.value
        else:
            with pytest.raises(IllegalTransition, match=f"job job-1 cannot go from {source} to {target}"):
                fresh.set_status(target)
    assert all(JobStatus.PENDING not in to for to in JOB_TRANSITIONS.values())  # nothing goes back to staged


def _status_writers() -> dict[str, int]:
    """Per module of the package, its calls of ``.set_status(...)``."""
    writers: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        calls = [
            node
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "set_status"
        ]
        if calls:
            writers[".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)] = len(calls)
    return writers


def test_the_supervisor_is_the_one_writer_of_the_jobs_status():
    # The attempt runner, the detached keeper and the book itself hand what happened to the
    # supervisor module, which applies it: no other module moves a job's status.
    assert list(_status_writers()) == ["sparkgpu.launch.client.supervisor"]


def test_a_job_no_supervisor_can_run_ends_failed_with_why_once(book):
    fail_unsupervisable(book, "JobStateError: no key")
    state = on_disk(book)
    assert state["status"] == "failed" and state["cause"] == "JobStateError: no key" and book.finished
    fail_unsupervisable(book, "again")  # it ended already: nothing changes
    assert on_disk(book)["cause"] == "JobStateError: no key"


def test_an_illegal_job_transition_is_refused_before_anything_is_written(book):
    book.set_status(JobStatus.RUNNING)
    book.set_status(JobStatus.SUCCEEDED)
    with pytest.raises(IllegalTransition, match="job job-1 cannot go from succeeded to running"):
        book.set_status(JobStatus.RUNNING)
    assert book.status is JobStatus.SUCCEEDED and on_disk(book)["status"] == "succeeded"
    fresh = JobBook.new(book.path, "job-2", "fake")
    with pytest.raises(IllegalTransition, match="from pending to stopped"):
        fresh.set_status(JobStatus.STOPPED)  # a policy stops a running job only


def test_an_attempt_ends_once(book):
    record = book.begin_attempt(0, 100.0, 2)
    book.set_status(JobStatus.RUNNING)  # the supervisor's, which writes the new attempt with it
    assert on_disk(book)["status"] == "running" and on_disk(book)["attempts"][0]["gpus"] == 2
    book.ranks_started(record, 101.0)
    started, ended = book.end_attempt(record, AttemptStatus.FAILED, 1, cause=[f"c{i}" for i in range(10)])
    assert started == 101.0 and ended >= started
    (saved,) = on_disk(book)["attempts"]
    assert saved["status"] == "failed" and saved["exit_code"] == 1 and len(saved["cause"]) == 8
    with pytest.raises(IllegalTransition, match="attempt 0 cannot go from failed to succeeded"):
        book.end_attempt(record, AttemptStatus.SUCCEEDED, 0)


def test_an_attempt_whose_ranks_never_started_is_billed_nothing(book):
    record = book.begin_attempt(0, 100.0, 2)
    started, ended = book.end_attempt(record, AttemptStatus.RESIZED, None)
    assert started == ended == record["started_at"] == record["ended_at"]


def test_taking_a_job_over_marks_its_running_attempts_lost_and_drops_an_old_policy_stop(book):
    book.begin_attempt(0, 1.0, 2)
    book.set_status(JobStatus.RUNNING)
    book.set_stop_reason("budget spent")
    assert on_disk(book)["stop_reason"] == "budget spent"
    again = JobBook.read(book.path)
    assert again is not None and again.mark_lost_attempts() == [0]
    assert again.state["attempts"][0]["status"] == "lost" and again.stop_reason is None
    assert on_disk(book)["attempts"][0]["status"] == "running"  # in memory until the next change
    assert JobBook.read(book.path.parent / "missing.json") is None


def test_an_abandoned_job_whose_cancel_was_asked_ends_cancelled(book):
    book.begin_attempt(0, 1.0, 2)
    book.set_status(JobStatus.RUNNING)
    cancel_abandoned(book)
    state = on_disk(book)
    assert state["status"] == "cancelled"
    assert state["attempts"][0]["status"] == "cancelled" and state["attempts"][0]["started_at"] is not None


def test_waiting_after_giving_way_is_recorded_and_cleared(book):
    book.start_waiting("critical job urgent-1")
    assert on_disk(book)["waiting"]["reason"] == "critical job urgent-1"
    book.stop_waiting()
    assert "waiting" not in on_disk(book)
    book.count_preemption()
    assert book.count_restart() == 1 and (on_disk(book)["preemptions"], on_disk(book)["restarts"]) == (1, 1)


@pytest.mark.parametrize(
    "status, asked, usage_stopped, step",
    [
        (AttemptStatus.SUCCEEDED, None, False, JobStep.FINISH),
        (AttemptStatus.SUCCEEDED, StoppedBy.USAGE_POLICY, True, JobStep.FINISH),
        (AttemptStatus.PREEMPTED, StoppedBy.USAGE_POLICY, True, JobStep.STOP),
        (AttemptStatus.FAILED, StoppedBy.USAGE_POLICY, True, JobStep.STOP),
        (AttemptStatus.STOPPED, StoppedBy.USAGE_POLICY, True, JobStep.STOP),
        (AttemptStatus.RESIZED, None, False, JobStep.RESIZE),
        (AttemptStatus.PREEMPTED, StoppedBy.PRIORITY, False, JobStep.WAIT_FOR_GPUS),
        (AttemptStatus.PREEMPTED, StoppedBy.RESIZE, False, JobStep.RESUME),
        (AttemptStatus.PREEMPTED, None, False, JobStep.RESUME),
        (AttemptStatus.FAILED, StoppedBy.PRIORITY, False, JobStep.RESTART_OR_FAIL),
        (AttemptStatus.FAILED, None, False, JobStep.RESTART_OR_FAIL),
    ],
)
def test_how_an_attempt_ended_decides_the_jobs_next_step(status, asked, usage_stopped, step):
    assert next_step(status, asked, usage_stopped) is step
