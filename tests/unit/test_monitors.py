"""Each of the supervisor's attempt monitors, alone: given a view of the attempt, its decision."""

import pytest

from sparkgpu.callbacks import JobCallback
from sparkgpu.errors import JobCancelledError, JobTimeoutError
from sparkgpu.launch.client import monitors as m
from sparkgpu.launch.client.attempt_verdict import StoppedBy
from sparkgpu.launch.scheduling.elastic import ElasticPlan
from sparkgpu.rundir.states import AttemptStatus, JobStatus
from sparkgpu.spec import JobSpec, Resources, RunPolicy
from tests.fakes.backend import ScriptedBackend

JOB = JobSpec(job_id="job-1", name="job", resources=Resources(2, "cpu"))
ELASTIC = JobSpec(
    job_id="job-1", name="job", resources=Resources(4, "A10", True, 2, 2), policy=RunPolicy(elastic_wait=5.0)
)


def view(**kw):
    fields = dict(attempt=0, gpus=2, now=100.0, job_seconds=10.0, waited=10.0, ran=5.0)
    return m.AttemptView(**{**fields, **kw})


def test_cancel_ends_the_job_cancelled_once_asked():
    asked = []
    monitor = m.Cancelled(lambda: bool(asked), "job-1", "/logs")
    assert monitor.check(view()) is m.CONTINUE
    asked.append(1)
    decision = monitor.check(view(ran=None))  # also while the ranks wait for GPUs
    assert (decision.attempt_status, decision.job_status) == (AttemptStatus.CANCELLED, JobStatus.CANCELLED)
    assert isinstance(decision.error, JobCancelledError) and "Logs: /logs" in str(decision.error)


def test_timeout_ends_the_job_timed_out_past_the_jobs_timeout():
    assert m.Timeout(None, "job-1", "/logs").check(view(job_seconds=1e9)) is m.CONTINUE
    assert m.Timeout(10.0, "job-1", "/logs").check(view(job_seconds=10.0)) is m.CONTINUE
    decision = m.Timeout(10.0, "job-1", "/logs").check(view(job_seconds=10.5, ran=None))
    assert decision.job_status is JobStatus.TIMED_OUT and isinstance(decision.error, JobTimeoutError)
    assert "timeout of 10s" in str(decision.error)


def test_an_elastic_attempt_that_waited_elastic_wait_resizes_to_the_free_gpus():
    plan = ElasticPlan(ELASTIC, lambda job: 2, check_seconds=0)
    monitor = m.ElasticShrink(plan, ELASTIC.elastic_wait)
    assert monitor.check(view(gpus=4, ran=None, waited=1.0)) is m.CONTINUE  # elastic_wait not over
    assert monitor.check(view(gpus=4, ran=1.0, waited=9.0)) is m.CONTINUE  # started: nothing to withdraw
    decision = monitor.check(view(gpus=4, ran=None, waited=9.0))
    assert isinstance(decision, m.Resize) and decision.gpus == 2
    assert "waited 5s (elastic_wait) for 4 GPUs" in decision.why
    assert m.ElasticShrink(None, 5.0).check(view(ran=None, waited=9.0)) is m.CONTINUE  # a fixed-size job


class Budget(JobCallback):
    def __init__(self):
        self.asks = 0

    def stop_reason(self, job, attempt, attempt_seconds):
        self.asks += 1
        return "budget spent" if attempt_seconds > 3 else None


def test_a_policy_stop_asks_to_stop_once_the_ranks_run_at_most_once_a_second():
    budget = Budget()
    monitor = m.UsagePolicyStop([budget], JOB)
    assert monitor.check(view(ran=None)) is m.CONTINUE and budget.asks == 0  # not started: not asked
    assert monitor.check(view(now=100.0, ran=1.0)) is m.CONTINUE
    assert monitor.check(view(now=100.5, ran=4.0)) is m.CONTINUE and budget.asks == 1  # within the second
    decision = monitor.check(view(now=101.0, ran=4.0))
    assert decision == m.AskToStop(StoppedBy.USAGE_POLICY, "budget spent", ": budget spent")
    assert monitor.check(view(now=103.0, ran=4.0, asked=StoppedBy.USAGE_POLICY, asked_at=101.0)) is m.CONTINUE


class Urgent(ScriptedBackend):
    def preemption_request(self, job):
        return "critical job urgent-1"

    def give_way(self, job):
        pass

    def await_capacity(self, job, wait):
        pass


def test_preemption_asks_to_give_way_only_on_a_preemptible_backend():
    assert m.Preemption(ScriptedBackend([]), JOB).check(view()) is m.CONTINUE
    decision = m.Preemption(Urgent([]), JOB).check(view())
    assert decision.kind is StoppedBy.PRIORITY and decision.reason == "critical job urgent-1"
    assert "using no restart" in decision.said


def test_growth_asks_to_stop_once_all_the_jobs_gpus_are_free():
    free = [2]
    monitor = m.Growth(ElasticPlan(ELASTIC, lambda job: free[0], check_seconds=0))
    assert monitor.check(view(gpus=2)) is m.CONTINUE
    free[0] = 4
    decision = monitor.check(view(gpus=2, now=102.0))
    assert decision.kind is StoppedBy.RESIZE and "growing back from 2" in decision.reason
    assert m.Growth(ElasticPlan(ELASTIC, lambda job: 4, check_seconds=0)).check(view(gpus=4)) is m.CONTINUE


@pytest.mark.parametrize("kind", [StoppedBy.USAGE_POLICY, StoppedBy.PRIORITY, StoppedBy.RESIZE])
def test_ranks_asked_to_stop_are_stopped_after_checkpoint_grace_as_that_kind_of_stop(kind):
    monitor = m.GraceExpiry(checkpoint_grace=2.0, shutdown_grace=7.0)
    assert monitor.check(view()) is m.CONTINUE
    assert monitor.check(view(asked=kind, asked_at=99.0)) is m.CONTINUE
    decision = monitor.check(view(asked=kind, asked_at=97.0))
    assert decision.kind is kind and "checkpoint_grace (2s)" in decision.note and "SIGKILL after 7s" in decision.note


def test_near_the_cap_ranks_that_started_late_are_asked_to_checkpoint_once():
    assert m.CapNear(10.0, 2.0, deferred=False).check(view(ran=9.0)) is m.CONTINUE  # their env has the deadline
    monitor = m.CapNear(10.0, 2.0, deferred=True)
    assert monitor.check(view(ran=7.9)) is m.CONTINUE
    assert monitor.check(view(ran=8.0)) == m.AskToCheckpoint("the runtime cap of 10s is 2s away")
    assert monitor.check(view(ran=9.0)) is m.CONTINUE


def test_past_the_cap_the_ranks_are_stopped():
    assert m.CapReached(None).check(view(ran=1e9)) is m.CONTINUE
    assert m.CapReached(10.0).check(view(ran=10.0)) is m.CONTINUE
    assert m.CapReached(10.0).check(view(ran=10.1)) == m.StopNow(StoppedBy.CAP)


def test_the_monitors_come_in_their_documented_order():
    monitors = m.attempt_monitors(JOB, JOB, ScriptedBackend([]), [], None, lambda: False, "/logs")
    names = [type(monitor).__name__ for monitor in monitors]
    assert names == [
        "Cancelled",
        "Timeout",
        "ElasticShrink",
        "UsagePolicyStop",
        "Preemption",
        "Growth",
        "GraceExpiry",
        "CapNear",
        "CapReached",
    ]
    doc = m.__doc__ or ""
    assert [doc.index(f":class:`{name}`") for name in names] == sorted(doc.index(f":class:`{n}`") for n in names)
