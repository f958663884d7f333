"""The Spark backend's bookkeeping of one attempt, without a cluster: when its ranks started."""

import json
import time

import pytest

from sparkgpu.launch.backends.spark import SparkAttempt, SparkBackend
from sparkgpu.launch.backends.spark_capacity import NodeLayout
from sparkgpu.launch.backends.spark_node import spark_dir
from sparkgpu.launch.payload import RunDir, serialize_payload
from sparkgpu.spec import JobSpec, Resources, RunPolicy
from tests.fakes.spark_session import TaggedSession


@pytest.fixture
def attempt(tmp_path):
    job = JobSpec(job_id="job-1", name="train", resources=Resources(2, "cpu"), backend="spark",
                  policy=RunPolicy(shutdown_grace=0.5))
    rd = RunDir(tmp_path / "job-1")
    rd.stage(job.to_dict(), serialize_payload(lambda: 1, (), {}, []), b"k" * 32, [])
    rd.prepare_attempt(0)
    spark_dir(rd, 0).mkdir(parents=True)
    return SparkAttempt(attempt=0, job=job, run_dir=rd, layout=NodeLayout(2, 1, 0), tag="sparkgpu-job-1-0",
                        submitted_at=time.monotonic(), submitted_wall=time.time())


def start_marker(attempt, node, started_at):
    path = spark_dir(attempt.run_dir, attempt.attempt) / f"node-{node}.started"
    path.write_text(json.dumps({"node": node, "started_at": started_at}) if started_at is not None else "")


def test_the_ranks_start_is_when_the_first_node_started(attempt):
    backend = SparkBackend(spark=TaggedSession(), client_timeout=None)
    attempt.submitted_wall = time.time() - 100  # submitted, then waited for busy GPUs
    assert backend.ranks_started_at(attempt) is None
    first = time.time() - 30
    start_marker(attempt, 1, first + 0.7)
    start_marker(attempt, 0, first)
    assert backend.ranks_started_at(attempt) == first


@pytest.mark.parametrize("skew, expected", [(+3600, "seen"), (-3600, "submitted")])
def test_an_executor_clock_off_by_an_hour_neither_bills_the_wait_nor_the_future(attempt, skew, expected):
    backend = SparkBackend(spark=TaggedSession(), client_timeout=None)
    attempt.submitted_wall = time.time() - 100
    start_marker(attempt, 0, time.time() + skew)
    before = time.time()
    started = backend.ranks_started_at(attempt)
    if expected == "seen":
        assert before <= started <= time.time()
    else:
        assert started == attempt.submitted_wall


def test_a_start_marker_still_being_written_counts_as_now(attempt):
    backend = SparkBackend(spark=TaggedSession(), client_timeout=None)
    attempt.submitted_wall = time.time() - 100
    start_marker(attempt, 0, None)  # created, content not written yet
    before = time.time()
    assert before <= backend.ranks_started_at(attempt) <= time.time()
