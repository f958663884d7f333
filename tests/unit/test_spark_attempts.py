"""The Spark backend's bookkeeping of one attempt, without a cluster: when its ranks started,
and what happens to ranks that outlive a failed Spark job.

The nodes are spark_node's own watch loop over a real "agent" process, as in a barrier task;
only the Spark session is a stand-in (tests/fakes/spark_session.py).
"""

import json
import subprocess
import sys
import threading
import time

import pytest

from sparkgpu.launch.backends.spark import SparkAttempt, SparkBackend
from sparkgpu.launch.backends.spark_capacity import NodeLayout
from sparkgpu.launch.backends.spark_node import CANCEL_FILE, NodeLaunch, _watch, spark_dir
from sparkgpu.launch.payload import RunDir, serialize_payload
from sparkgpu.spec import JobSpec, Resources, RunPolicy
from tests.fakes.spark_session import TaggedSession


class BrokenStream:
    """A frame whose action fails the way a reset Spark Connect stream does."""

    def collect(self):
        raise ConnectionError("<_MultiThreadedRendezvous: StatusCode.UNAVAILABLE: Connection reset>")


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


class RunningNode:
    """One node of the attempt: an agent process watched by spark_node's loop in a thread."""

    def __init__(self, attempt, node):
        start_marker(attempt, node, time.time())
        self.agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        launch = NodeLaunch(run_dir=str(attempt.run_dir.path), attempt=attempt.attempt, nnodes=2, nproc=1, env={},
                            shutdown_grace=attempt.job.policy.shutdown_grace, client_timeout=None)
        self.thread = threading.Thread(target=_watch, args=(self.agent, attempt.run_dir, launch, node), daemon=True)
        self.thread.start()

    def stop(self):
        self.agent.kill()
        self.agent.wait()
        self.thread.join(10)


def test_ranks_that_outlive_a_broken_stream_are_stopped_before_the_attempt_ends(attempt):
    session = TaggedSession()
    backend = SparkBackend(spark=session, client_timeout=None)
    nodes = [RunningNode(attempt, n) for n in range(2)]
    try:
        backend._run_action(attempt, BrokenStream())  # the action thread's work, in this thread
        assert backend.poll(attempt) == 1
        sdir = spark_dir(attempt.run_dir, 0)
        # By the time the supervisor hears "failed" (and may restart), the old ranks are gone.
        assert [n.agent.poll() for n in nodes] == [-15, -15]
        assert sorted(p.name for p in sdir.glob("node-*.ended")) == ["node-0.ended", "node-1.ended"]
        assert json.loads((sdir / "node-0.ended").read_text())["state"] == "cancelled"
        assert (sdir / CANCEL_FILE).exists() and session.interrupted == ["sparkgpu-job-1-0"]
        log = attempt.run_dir.agent_log(0, 0).read_text()
        assert "the Spark job of this attempt failed: ConnectionError" in log and "did not confirm" not in log
    finally:
        for node in nodes:
            node.stop()


def test_nodes_that_never_confirm_are_waited_for_a_bounded_time(attempt):
    backend = SparkBackend(spark=TaggedSession(), client_timeout=None)
    backend.node_stop_margin = 0.5
    start_marker(attempt, 0, time.time())  # a node whose executor is gone: it never writes its end
    backend._run_action(attempt, BrokenStream())
    started = time.monotonic()
    assert backend.poll(attempt) == 1
    assert 1.0 <= time.monotonic() - started < 5  # shutdown_grace 0.5 + margin 0.5
    assert "node(s) 0 did not confirm within 1s that their ranks stopped" in attempt.run_dir.agent_log(0, 0).read_text()


def test_a_cancelled_attempt_does_not_wait_again(attempt):
    backend = SparkBackend(spark=TaggedSession(), client_timeout=None)
    start_marker(attempt, 0, time.time())
    attempt.cancelled = True  # cancel() already stopped the nodes and waited
    backend._run_action(attempt, BrokenStream())
    started = time.monotonic()
    assert backend.poll(attempt) == 1 and time.monotonic() - started < 1


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


def test_the_spark_backend_says_its_ranks_wait_for_gpus():
    # The supervisor bills and caps an attempt from ranks_started_at only for such backends.
    from sparkgpu.launch.backends.local import LocalBackend
    from sparkgpu.launch.backends.spark import SparkBackend

    assert SparkBackend.waits_for_resources and not LocalBackend.waits_for_resources
