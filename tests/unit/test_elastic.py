"""Elastic jobs (``min_gpus=``): the request's checks, the size decisions, and the supervisor
withdrawing a waiting attempt to go on with fewer GPUs and growing back at a checkpoint.

The Spark cluster's run of the same (a worker lost and replaced, a transformer training every
block once) is ``tests/integration/test_spark_cluster_elastic.py``.
"""

import io
import json
import logging

import pytest

from sparkgpu.callbacks import JobCallback
from sparkgpu.api.decorator import distributed
from sparkgpu.errors import ConfigurationError
from sparkgpu.spec.jobfile import JobFile
from sparkgpu.launch.scheduling.elastic import ElasticPlan
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.rundir.serialization import serialize_payload
from sparkgpu.launch.client.supervisor import Supervisor
from sparkgpu.spec import ELASTIC_WAIT, JobSpec, Resources, RunPolicy, requested_resources
from tests.fakes.backend import ScriptedBackend

# -- the request -------------------------------------------------------------------------


def test_a_min_max_pair_asks_for_max_gpus_and_makes_the_job_elastic_down_to_min():
    r = requested_resources(num_accelerators=(8, 16), accelerator_type="GPU_8xH100", remote=True)
    assert (r.gpus, r.min_gpus, r.gpus_per_node, r.elastic) == (16, 8, 8, True)
    assert requested_resources(gpus=16, gpu_type="H100", remote=True, min_gpus=8) == Resources(
        16, "H100", True, None, 8
    )
    assert not requested_resources(gpus=8, gpu_type="H100", remote=True, min_gpus=8).elastic


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_accelerators=(8, 16, 32)), "a \\(min, max\\) pair"),
        (dict(num_accelerators=(8, 16), min_gpus=4), "disagree"),
        (dict(gpus=8, min_gpus=16), "from 1 to gpus=8"),
        (dict(gpus=8, min_gpus=0), "from 1 to gpus=8"),
        (dict(gpus=16, accelerator_type="GPU_8xH100", min_gpus=4), "whole number of 8-GPU nodes"),
        (dict(gpus=8, remote=False, min_gpus=4), "drop min_gpus=, or pass remote=True"),
    ],
)
def test_an_elastic_request_that_cannot_work_is_refused_with_its_fix(kwargs, message):
    kwargs = {"gpu_type": "H100", "remote": True, **kwargs}
    if "accelerator_type" in kwargs:
        kwargs.pop("gpu_type")
    with pytest.raises(ConfigurationError, match=message):
        requested_resources(**kwargs)


def test_elastic_wait_needs_an_elastic_job_and_defaults_to_a_quarter_hour():
    with pytest.raises(ConfigurationError, match="set min_gpus="):
        distributed(gpus=8, gpu_type="H100", remote=True, elastic_wait="5m")(lambda: None)
    fn = distributed(num_accelerators=(4, 8), gpu_type="H100", remote=True, elastic_wait="20m")(lambda: None)
    assert (fn.resources.min_gpus, fn.policy.elastic_wait) == (4, 1200)
    job = JobSpec("j", "j", fn.resources)
    assert job.elastic_wait == ELASTIC_WAIT == 900
    assert job.resized(4).resources == Resources(4, "H100", True, None, 4) and job.resized(8) is job


def test_a_job_file_gives_min_gpus_and_elastic_wait(tmp_path):
    (tmp_path / "train.py").write_text("")
    job = JobFile.from_dict(
        {"script": "train.py", "gpus": 16, "accelerator_type": "GPU_8xH100", "remote": True, "min_gpus": 8}
        | {"elastic_wait": "30m"},
        base_dir=tmp_path,
        source="job file 'x.yaml'",
    )
    fn = job.build()
    assert (fn.resources.gpus, fn.resources.min_gpus, fn.policy.elastic_wait) == (16, 8, 1800)


# -- the size decisions ------------------------------------------------------------------


def elastic_job(gpus=8, low=4, wait=10.0) -> JobSpec:
    return JobSpec("j", "j", Resources(gpus, "H100", True, 2, low), RunPolicy(elastic_wait=wait))


def test_a_waiting_attempt_shrinks_only_after_elastic_wait_to_what_is_free_and_not_below_min_gpus():
    free = [6]
    asked = []
    plan = ElasticPlan(elastic_job(), lambda job: asked.append(job.job_id) or free[0], check_seconds=5)
    assert plan.shrink_to(8, waited=9.0, now=0.0) is None and asked == []  # within elastic_wait
    assert plan.shrink_to(8, waited=10.0, now=1.0) == 6
    assert plan.shrink_to(8, waited=11.0, now=2.0) is None and len(asked) == 1  # asks once per check_seconds
    free[0] = 2
    assert plan.shrink_to(8, waited=20.0, now=7.0) is None  # below min_gpus: wait on for the replacement
    free[0] = 8
    assert plan.shrink_to(8, waited=30.0, now=13.0) is None  # all are free: the attempt starts as it is
    assert plan.shrink_to(4, waited=99.0, now=99.0) is None  # at min_gpus already


def test_a_smaller_attempt_grows_once_every_gpu_is_free_and_a_probe_that_fails_changes_nothing(caplog):
    free: list = [6]

    def available(job):
        if isinstance(free[0], Exception):
            raise free[0]
        return free[0]

    plan = ElasticPlan(elastic_job(), available, check_seconds=1)
    assert not plan.grows(6, now=0.0)
    free[0] = 8
    assert not plan.grows(6, now=0.5)  # not due yet
    assert plan.grows(6, now=1.0)
    assert not plan.grows(8, now=5.0)  # full size already
    free[0] = OSError("probe failed")
    with caplog.at_level(logging.WARNING, logger="sparkgpu.launch.scheduling.elastic"):
        assert not plan.grows(6, now=9.0)
    assert "keeping the job's size" in caplog.text


# -- the supervisor ------------------------------------------------------------------------


class ElasticCluster(ScriptedBackend):
    """Attempts whose ranks may wait for GPUs: ``"wait"`` never starts them; ``"until_asked"``
    runs until the stop file asks it to checkpoint, then stops as ranks that saved do.
    ``free`` lists what :meth:`available_gpus` answers, the last answer repeating. It has the
    capabilities of a Spark cluster the supervisor uses here: ``DeferredStart`` and ``ElasticCapacity``."""

    def __init__(self, script, free):
        super().__init__(script)
        self.free = list(free)
        self.sizes: list[int] = []
        self.run_dir: RunDir | None = None

    def submit(self, job, run_dir, attempt, env, placement=None):
        self.sizes.append(job.world_size)
        self.run_dir = run_dir
        action = self.script[attempt]
        handle = super().submit(job, run_dir, attempt, env)
        handle.world = job.world_size
        if action in ("wait", "until_asked"):
            handle.polls_left = 10**9
        return handle

    def poll(self, handle):
        rd = self.run_dir
        if self.script[handle.attempt] == "until_asked" and rd.read_control(rd.file(RunLayout.stop(handle.attempt))):
            for rank in range(handle.world):
                rd.file(RunLayout.preempted(handle.attempt, rank)).write_text("x")
            return 1
        return super().poll(handle)

    def ranks_started_at(self, handle):
        return None if self.script[handle.attempt] == "wait" else 1.0

    def available_gpus(self, job):
        return self.free.pop(0) if len(self.free) > 1 else self.free[0]


class Bills(JobCallback):
    def __init__(self):
        self.gpus: list[tuple[int, str, int]] = []

    def after_attempt(self, job, outcome):
        self.gpus.append((outcome.attempt, outcome.status.value, outcome.gpus))
        assert job.resources.gpus == outcome.gpus  # the callbacks see the job as the attempt ran it


def test_a_waiting_attempt_is_withdrawn_unbilled_and_the_job_goes_on_with_fewer_gpus_then_grows_back(
    tmp_path, monkeypatch
):
    monkeypatch.setattr("sparkgpu.launch.scheduling.elastic.CHECK_SECONDS", 0.05)
    job = JobSpec(
        "job-1",
        "job",
        Resources(4, "A10", True, 2, 2),
        RunPolicy(elastic_wait=0.3, checkpoint_grace=5, timeout=60),
    )
    rd = RunDir(tmp_path / "job-1")
    rd.create(job.to_dict(), serialize_payload(lambda: 1, (), {}, []), b"k" * 32, [])
    backend = ElasticCluster(["wait", "until_asked", "ok"], free=[2, 2, 2, 4])
    bills, out = Bills(), io.StringIO()
    results = Supervisor(job, rd, backend, b"k" * 32, [bills], out=out).run()

    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert backend.sizes == [4, 2, 4]
    assert backend.cancelled[0] == 0  # the waiting barrier stage was withdrawn
    state = json.loads(rd.state_file.read_text())
    assert [(a["status"], a["gpus"]) for a in state["attempts"]] == [("resized", 4), ("preempted", 2), ("succeeded", 4)]
    assert (state["restarts"], state["preemptions"]) == (0, 1)
    withdrawn = state["attempts"][0]
    assert withdrawn["started_at"] == withdrawn["ended_at"]  # nothing ran: nothing billed
    assert bills.gpus == [(0, "resized", 4), (1, "preempted", 2), (2, "succeeded", 4)]
    assert b"growing back from 2" in rd.read_control(rd.file(RunLayout.stop(1)))
    text = out.getvalue()
    assert "going on from the latest checkpoint with the 2 free (min_gpus=2)" in text
    assert "resumes on 4 GPUs by itself, using no restart" in text


def test_a_fixed_size_job_never_asks_what_is_free(tmp_path):
    job = JobSpec("job-1", "job", Resources(4, "A10", True, 2), RunPolicy(timeout=60))
    rd = RunDir(tmp_path / "job-1")
    rd.create(job.to_dict(), serialize_payload(lambda: 1, (), {}, []), b"k" * 32, [])

    class Refuses(ElasticCluster):
        def available_gpus(self, job):
            raise AssertionError("asked")

    backend = Refuses(["ok"], free=[2])
    assert len(Supervisor(job, rd, backend, b"k" * 32, [], out=io.StringIO()).run()) == 4


def test_a_job_that_ends_on_fewer_gpus_returns_their_results_and_sparkgpu_jobs_shows_both_counts(monkeypatch, capsys):
    from sparkgpu import cli
    from sparkgpu.config import settings

    monkeypatch.setattr("sparkgpu.launch.scheduling.elastic.CHECK_SECONDS", 0.05)
    job = JobSpec("elastic-job", "train", Resources(4, "A10", True, 2, 2), RunPolicy(elastic_wait=0.2, timeout=60))
    rd = RunDir(settings().staging_root / "elastic-job")
    rd.create(job.to_dict(), serialize_payload(lambda: 1, (), {}, []), b"k" * 32, [])
    backend = ElasticCluster(["wait", "ok"], free=[2])  # the replacement never comes
    results = Supervisor(job, rd, backend, b"k" * 32, [], out=io.StringIO()).run()
    assert [r["rank"] for r in results] == [0, 1]

    assert cli.main(["jobs", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out.splitlines()[0])
    assert (listed["gpus"], listed["gpus_asked"], listed["status"]) == (2, 4, "succeeded")
    assert cli.main(["jobs"]) == 0
    assert "2/4 x A10" in capsys.readouterr().out
