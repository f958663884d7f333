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
import types

import pytest

from sparkgpu.launch.client.attempt_report import AttemptReport
from sparkgpu.launch.backends.spark.backend import SparkAttempt, SparkBackend
from sparkgpu.launch.backends.spark.capacity import RankPlacement
from sparkgpu.launch.backends.spark.executor.hub import HubLink
from sparkgpu.launch.backends.spark.executor.node import NodeLaunch, NodeLink, NodeZero, _watch, open_hub
from sparkgpu.rundir.serialization import serialize_payload
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.spec import JobSpec, Resources, RunPolicy
from tests.fakes.spark_session import BlockingFrame, TaggedSession


class BrokenStream:
    """A frame whose action fails the way a reset Spark Connect stream does."""

    def collect(self):
        raise ConnectionError("<_MultiThreadedRendezvous: StatusCode.UNAVAILABLE: Connection reset>")


@pytest.fixture
def attempt(tmp_path):
    job = JobSpec(
        job_id="job-1",
        name="train",
        resources=Resources(2, "cpu"),
        backend="spark",
        policy=RunPolicy(shutdown_grace=0.5),
    )
    rd = RunDir(tmp_path / "job-1")
    rd.create(job.to_dict(), serialize_payload(lambda: 1, (), {}, []), b"k" * 32, [])  # sets rd.key
    rd.prepare_attempt(0)
    rd.file(RunLayout.spark(0)).mkdir(parents=True)
    return SparkAttempt(
        attempt=0,
        job=job,
        run_dir=rd,
        placement=RankPlacement(2, 1, 0),
        tag="sparkgpu-job-1-0",
        submitted_at=time.monotonic(),
        submitted_wall=time.time(),
    )


def start_marker(attempt, node, started_at):
    """The node's start marker, sealed under the job key as the node writes it."""
    rd = attempt.run_dir
    assert rd.create_control(
        rd.file(RunLayout.node_marker(attempt.attempt, node, "started")),
        json.dumps({"node": node, "started_at": started_at}).encode(),
    )


class RunningNode:
    """One node of the attempt: an agent process watched by spark_node's loop in a thread; node 0
    serves the hub that the others beat to (``hub`` is node 0's RunningNode for them)."""

    def __init__(self, attempt, node, peer_timeout=None, hub=None):
        start_marker(attempt, node, time.time())
        self.agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        launch = NodeLaunch(
            run_dir=str(attempt.run_dir.path),
            attempt=attempt.attempt,
            nnodes=2,
            nproc=1,
            env={},
            key=b"k" * 32,
            shutdown_grace=attempt.job.policy.shutdown_grace,
            client_timeout=None,
            peer_timeout=peer_timeout,
            control_interval=0.5,
        )
        if node == 0:
            self.channel = NodeZero(open_hub(launch, "127.0.0.1"), attempt.run_dir, launch)
        else:
            link = HubLink(launch.key, attempt.attempt, node, ("127.0.0.1", hub.channel.hub.port), 10.0)
            self.channel = NodeLink(link, attempt.run_dir, launch)
        args = (self.agent, attempt.run_dir, launch, node, self.channel)
        self.thread = threading.Thread(target=_watch, args=args, daemon=True)
        self.thread.start()

    def stop(self):
        self.agent.kill()
        self.agent.wait()
        self.thread.join(10)


def two_nodes(attempt):
    first = RunningNode(attempt, 0)
    return [first, RunningNode(attempt, 1, hub=first)]


def test_ranks_that_outlive_a_broken_stream_are_stopped_before_the_attempt_ends(attempt):
    session = TaggedSession()
    backend = SparkBackend(spark=session, client_timeout=None, control_interval=0.5)
    nodes = two_nodes(attempt)
    try:
        backend._run_action(attempt, BrokenStream())  # the action thread's work, in this thread
        assert backend.poll(attempt) == 1
        sdir = attempt.run_dir.file(RunLayout.spark(0))
        # By the time the supervisor hears "failed" (and may restart), the old ranks are gone.
        assert [n.agent.poll() for n in nodes] == [-15, -15]
        assert sorted(p.name for p in sdir.glob("node-*.ended")) == ["node-0.ended", "node-1.ended"]
        assert attempt.run_dir.read_control_json(sdir / "node-0.ended")["state"] == "cancelled"
        assert (sdir / "CANCEL").exists() and session.interrupted == ["sparkgpu-job-1-0"]
        notes = "\n".join(AttemptReport.read(attempt.run_dir.file(RunLayout.attempt(0))).notes)
        assert "the Spark job of this attempt failed: ConnectionError" in notes and "did not confirm" not in notes
    finally:
        for node in reversed(nodes):
            node.stop()


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """The Spark backend's clock, moved only by its own pauses: ``clock[0]`` is now."""
    from sparkgpu.launch.backends.spark import attempt as spark_attempt
    from sparkgpu.launch.backends.spark import backend as spark_backend

    now = [1000.0]
    fake = types.SimpleNamespace(
        monotonic=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s), time=time.time
    )
    monkeypatch.setattr(spark_attempt, "time", fake)
    monkeypatch.setattr(spark_backend, "time", fake)
    return now


class UninterruptibleSession(TaggedSession):
    def interruptTag(self, tag: str) -> list[str]:
        raise ConnectionError("the session went with the stream")


def test_nodes_that_never_confirm_are_waited_for_a_bounded_time(attempt, clock):
    backend = SparkBackend(spark=UninterruptibleSession(), client_timeout=None, control_interval=0.5)
    backend.node_stop_margin = 0.5
    start_marker(attempt, 0, time.time())  # a node whose executor is gone: it never writes its end
    backend._run_action(attempt, BrokenStream())
    started = clock[0]
    assert backend.poll(attempt) == 1
    # shutdown_grace 0.5 + control interval 0.5 + margin 0.5, to the next look (every 0.2 s)
    assert 1.5 <= clock[0] - started <= 1.5 + 0.2 + 1e-9
    (note,) = [
        n for n in AttemptReport.read(attempt.run_dir.file(RunLayout.attempt(0))).notes if "did not confirm" in n
    ]
    assert "node(s) 0 did not confirm within 1.5s that their ranks stopped (their executor may be lost)" in note


def test_nodes_of_a_job_spark_interrupted_are_waited_for_only_the_shutdown_grace_and_the_kill(
    attempt, monkeypatch, clock
):
    # Spark kills the tasks of an interrupted job (their Python workers, and the agents and ranks
    # with them): they write no end marker, so waiting for the cancel marker's round trip and the
    # node timeout (50 s with the defaults) would only delay the restart.
    monkeypatch.setattr("sparkgpu.launch.backends.spark.attempt.KILLED_TASK_SECONDS", 0.5)
    backend = SparkBackend(spark=TaggedSession(), client_timeout=None, control_interval=30)
    start_marker(attempt, 0, time.time())
    backend._run_action(attempt, BrokenStream())
    started = clock[0]
    assert backend.poll(attempt) == 1
    assert 1.0 <= clock[0] - started <= 1.0 + 0.2 + 1e-9  # shutdown_grace 0.5 + 0.5, not 30 + 20
    (note,) = [
        n for n in AttemptReport.read(attempt.run_dir.file(RunLayout.attempt(0))).notes if "did not confirm" in n
    ]
    assert "within 1s that their ranks stopped (Spark killed their tasks when the job was interrupted)" in note


def test_a_cancelled_attempt_does_not_wait_again(attempt, clock):
    backend = SparkBackend(spark=TaggedSession(), client_timeout=None)
    start_marker(attempt, 0, time.time())
    attempt.cancelled = True  # cancel() already stopped the nodes and waited
    backend._run_action(attempt, BrokenStream())
    started = clock[0]
    assert backend.poll(attempt) == 1 and clock[0] == started  # no pause at all


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


def test_a_planted_start_marker_neither_starts_the_bill_nor_the_attempt(attempt):
    backend = SparkBackend(spark=TaggedSession(), client_timeout=None)
    attempt.submitted_wall = time.time() - 100
    planted = attempt.run_dir.file(RunLayout.node_marker(0, 0, "started"))  # by a writer of the run dir without the key
    planted.write_text(json.dumps({"node": 0, "started_at": attempt.submitted_wall}))
    assert backend.ranks_started_at(attempt) is None and not attempt.nodes_started
    planted.unlink()
    start_marker(attempt, 0, None)  # a genuine marker without a time: this client's clock stands in
    before = time.time()
    assert before <= backend.ranks_started_at(attempt) <= time.time()


def test_the_spark_backend_says_its_ranks_wait_for_gpus():
    # The supervisor bills and caps an attempt from ranks_started_at only for such backends.
    from sparkgpu.launch.backends.capabilities import DeferredStart
    from sparkgpu.launch.backends.local.backend import LocalBackend

    assert isinstance(SparkBackend(spark=TaggedSession()), DeferredStart)
    assert not issubclass(LocalBackend, DeferredStart)


def lost_node(attempt, node):
    """A node that started, then vanished with its executor before its first beat: no end marker."""
    rd = attempt.run_dir
    info = {"node": node, "executor": "7", "host": "10.0.0.7", "started_at": time.time()}
    assert rd.create_control(
        rd.file(RunLayout.node_marker(attempt.attempt, node, "started")), json.dumps(info).encode()
    )


def test_node_0_stops_its_ranks_when_a_node_stops_beating_and_names_it(attempt):
    lost_node(attempt, 1)
    node = RunningNode(attempt, 0, peer_timeout=1.0)
    try:
        assert node.agent.wait(15) == -15  # SIGTERM, long before the agent's 120 s
        node.thread.join(10)
        ended = attempt.run_dir.read_control_json(attempt.run_dir.file(RunLayout.spark(0)) / "node-0.ended")
        assert ended["state"] == "peer-lost"
        state = attempt.run_dir.read_control_json(attempt.run_dir.file(RunLayout.spark(0)) / "state")
        assert list(state["lost"]) == ["1"] and state["stop"][0] == "peer-lost"
    finally:
        node.stop()


def test_the_client_names_the_node_that_node_0_lost_stops_the_others_and_reports_its_host(attempt):
    session = TaggedSession()
    backend = SparkBackend(spark=session, client_timeout=None, control_interval=0.5)
    lost_node(attempt, 1)
    survivor = RunningNode(attempt, 0, peer_timeout=3.0)  # a loaded machine must not make a node look lost
    try:
        deadline = time.monotonic() + 15
        while not session.interrupted and time.monotonic() < deadline:
            assert backend.poll(attempt) is None
            time.sleep(0.2)
        assert session.interrupted == ["sparkgpu-job-1-0"]
        assert survivor.agent.wait(10) == -15
        backend._run_action(attempt, BrokenStream())  # the interrupted Spark job ends
        assert backend.poll(attempt) == 1
        report = AttemptReport.read(attempt.run_dir.file(RunLayout.attempt(0)))
        assert [(n.node, n.executor, n.host, n.ranks) for n in report.lost] == [(1, "7", "10.0.0.7", [1])]
        assert report.lost_message().startswith("executor 7 on host 10.0.0.7 was lost (node 0 heard no beat from it")
        assert report.lost_at is not None and report.lost_at <= time.time()
        assert [n.state for n in report.nodes] == ["peer-lost", "lost"]
        assert not any("the Spark job of this attempt failed" in note for note in report.notes)
    finally:
        survivor.stop()


def test_the_client_names_node_0_lost_when_the_other_nodes_lost_it(attempt):
    session = TaggedSession()
    backend = SparkBackend(spark=session, client_timeout=None, control_interval=0.5)
    lost_node(attempt, 0)  # node 0 vanished: its hub answers nobody
    start_marker(attempt, 1, time.time())
    rd = attempt.run_dir
    ended = {"node": 1, "exit_code": -15, "state": "peer-lost", "lost": [0]}
    rd.write_control(rd.file(RunLayout.node_marker(0, 1, "ended")), json.dumps(ended).encode())
    assert backend.poll(attempt) is None
    assert session.interrupted == ["sparkgpu-job-1-0"]
    (lost,) = AttemptReport.read(rd.file(RunLayout.attempt(0))).lost
    assert lost.node == 0 and "node 1 heard nothing from it" in lost.cause


class SlowProbeSession(TaggedSession):
    """A standalone cluster of two one-core executors whose capacity probe answers only after
    ``seconds``, as the first tasks on a replacement executor do while it starts their Python worker."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds, self.probes = seconds, 0
        self.conf = types.SimpleNamespace(getAll={"spark.master": "spark://127.0.0.1:7077"})

    def range(self, *args):
        return self

    def mapInArrow(self, fn, schema):
        self.probes += 1
        rows = [
            types.SimpleNamespace(executor=str(i), host="127.0.0.1", cores=1, gpu_addresses="", gpu_names="")
            for i in range(2)
        ]
        return BlockingFrame(self, rows, self.seconds)


def test_after_a_lost_node_a_probe_slower_than_the_wait_timeout_still_sees_the_replacement(attempt):
    # A short wait_timeout (5 s in the faults test) bounds how long the job waits, not how long one
    # probe of the replacement may take: interrupting it killed the executor's fresh Python worker,
    # every probe paid that start again, and the attempt waited for slots it had.
    session = SlowProbeSession(seconds=0.6)
    backend = SparkBackend(spark=session, client_timeout=None, wait_timeout=0.2)
    assert backend._await_slots(attempt) is True
    assert session.probes == 1 and session.interrupted == []
