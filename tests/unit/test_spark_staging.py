"""The Spark backend with a staging store, without a cluster: the client and two nodes share
nothing but a real ``file://`` store, and the nodes are spark_node's own watch loop over a
real "agent" process each, with their mirrors syncing in the background as in a barrier task.
"""

import subprocess
import sys
import threading
import time

import pytest

from sparkgpu.config import reset_settings
from sparkgpu.launch.backends.spark.executor import node as spark_node
from sparkgpu.launch.client.attempt_report import AttemptReport
from sparkgpu.launch.backends.spark.backend import SparkAttempt, SparkBackend
from sparkgpu.launch.backends.spark.capacity import RankPlacement
from sparkgpu.launch.backends.spark.executor.hub import HubLink
from sparkgpu.launch.backends.spark.executor.node import NodeLaunch, NodeLink, NodeZero, _claim, _watch, open_hub
from sparkgpu.rundir.serialization import serialize_payload
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.launch.staging.mirror import NodeMirror, StagingStore
from sparkgpu.spec import JobSpec, Resources, RunPolicy
from tests.fakes.spark_session import TaggedSession
from tests.unit.test_spark_attempts import BrokenStream


@pytest.fixture
def job(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKGPU_USER", "ana")  # the job's folder is <store>/ana/job-1
    reset_settings()
    job = JobSpec(
        job_id="job-1",
        name="train",
        resources=Resources(2, "cpu"),
        backend="spark",
        policy=RunPolicy(shutdown_grace=0.5),
    )
    rd = RunDir(tmp_path / "client" / "job-1")
    rd.create(job.to_dict(), serialize_payload(lambda: 1, (), {}, []), b"k" * 32, [])
    rd.prepare_attempt(0)
    rd.file(RunLayout.spark(0)).mkdir(parents=True)
    return job, rd, (tmp_path / "store").as_uri()


class NodeOnItsOwnExecutor:
    """One node in its own scratch dir: the payload comes from the store, markers go back to it."""

    def __init__(self, tmp_path, url, node, hub=None):
        self.rd = RunDir(tmp_path / f"executor-{node}" / "job-1", key=b"k" * 32)  # as the node's check sets it
        self.mirror = NodeMirror(
            StagingStore(f"{url}/ana", "job-1"), self.rd, 0, node, log_interval=0.0, control_interval=0.5
        )
        self.mirror.download_payload()
        assert _claim(
            self.rd, self.rd.file(RunLayout.node_marker(0, node, "started")), {"node": node, "started_at": time.time()}
        )
        self.mirror.start(interval=0.1)
        self.agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        launch = NodeLaunch(
            run_dir="/client/only/job-1",
            attempt=0,
            nnodes=2,
            nproc=1,
            env={},
            key=b"k" * 32,
            shutdown_grace=0.5,
            client_timeout=None,
            store_url=f"{url}/ana",
            control_interval=0.5,
        )
        if node == 0:  # node 0 serves the hub; the other node beats to it
            self.channel = NodeZero(open_hub(launch, "127.0.0.1"), self.rd, launch, self.mirror.clock)
        else:
            link = HubLink(launch.key, 0, node, ("127.0.0.1", hub.channel.hub.port), 10.0)
            self.channel = NodeLink(link, self.rd, launch)

        def run():
            _watch(self.agent, self.rd, launch, node, self.channel)
            self.mirror.finish()  # as run_node does: the end marker goes up last

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self):
        self.agent.kill()
        self.agent.wait()
        self.thread.join(10)


def staged_attempt(job, rd, url):
    """A Spark backend with a staging store and attempt 0 of ``job`` on 2 nodes of 1 rank, its
    client mirror made (not started)."""
    backend = SparkBackend(spark=TaggedSession(), client_timeout=None, staging_url=url, control_interval=0.5)
    handle = SparkAttempt(
        attempt=0,
        job=job,
        run_dir=rd,
        placement=RankPlacement(2, 1, 0),
        tag="sparkgpu-job-1-0",
        submitted_at=time.monotonic(),
        submitted_wall=time.time(),
        mirror=backend._mirror(rd),
    )
    return backend, handle


def test_ranks_that_outlive_a_broken_stream_are_stopped_through_the_store(job, tmp_path, monkeypatch):
    monkeypatch.setattr(spark_node, "_POLL_SECONDS", 0.05)
    job, rd, url = job
    backend, handle = staged_attempt(job, rd, url)
    handle.mirror.start(0, 0.1)
    first = NodeOnItsOwnExecutor(tmp_path, url, 0)
    nodes = [first, NodeOnItsOwnExecutor(tmp_path, url, 1, hub=first)]
    try:
        deadline = time.monotonic() + 10
        while backend.ranks_started_at(handle) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert backend.ranks_started_at(handle) is not None  # the start markers came through the store

        backend._run_action(handle, BrokenStream())
        assert backend.poll(handle) == 1
        # The cancel marker went up, the nodes stopped their agents, their end markers came down.
        assert [n.agent.poll() for n in nodes] == [-15, -15]
        assert [rd.read_control_json(rd.file(RunLayout.node_marker(0, n, "ended")))["state"] for n in (0, 1)] == [
            "cancelled"
        ] * 2
        # One object carries the client's control files; node 0 alone read it and told node 1.
        assert (tmp_path / "store" / "ana" / "job-1" / "attempts/0/spark/control").exists()
        assert "did not confirm" not in "\n".join(AttemptReport.read(rd.file(RunLayout.attempt(0))).notes)
    finally:
        for node in reversed(nodes):
            node.stop()


def test_checkpoints_live_on_the_store_and_the_dry_run_names_no_client_path(job):
    job, rd, url = job
    backend = SparkBackend(spark=TaggedSession(), client_timeout=None, staging_url=url)

    assert backend.checkpoint_dir(rd) == f"{url}/ana/job-1/checkpoints"
    plan = backend.plan(job, rd, 0, {}, placement=RankPlacement(2, 1, 0))
    assert str(rd.path) not in str(plan) and f"{url}/ana/job-1" in str(plan)
    assert SparkBackend(spark=TaggedSession(), staging_url="").checkpoint_dir(rd) == str(rd.checkpoints)


def test_a_quiet_client_lists_the_store_once_per_quiet_interval_and_sends_a_stop_request_at_once(
    job, tmp_path, monkeypatch
):
    """Nobody reads the ranks' output live (``log_ranks=None``): once every node has started, the
    client's mirror reads the store only every quiet interval, and a stop request still goes up
    within one round (node 0 reads it at its own pace)."""
    import json

    from sparkgpu.rundir.layout import RunLayout

    monkeypatch.setattr(spark_node, "_POLL_SECONDS", 0.05)
    job, rd, url = job
    _, handle = staged_attempt(job, rd, url)
    mirror = handle.mirror
    listings: list[float] = []
    real_list = mirror.store.list
    monkeypatch.setattr(mirror.store, "list", lambda *a, **k: listings.append(time.monotonic()) or real_list(*a, **k))
    mirror.start(0, 0.05, nodes=2, live=False, quiet_interval=60.0)
    first = NodeOnItsOwnExecutor(tmp_path, url, 0)
    nodes = [first, NodeOnItsOwnExecutor(tmp_path, url, 1, hub=first)]
    try:
        deadline = time.monotonic() + 10
        while len(rd.started_nodes(0)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(rd.started_nodes(0)) == 2, "until every node has started, the quiet client syncs every round"
        time.sleep(0.2)  # the round that brought the last start marker is over
        before = len(listings)
        time.sleep(1.5)  # 30 rounds
        assert len(listings) == before, f"{len(listings) - before} listings in 1.5 s of a 60 s quiet interval"

        rd.write_control(rd.file(RunLayout.stop(0)), b"the runtime cap is near\n")
        control = tmp_path / "store" / "ana" / "job-1" / "attempts" / "0" / "spark" / "control"
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and RunLayout.stop(0) not in json.loads(control.read_text()):
            time.sleep(0.05)
        assert RunLayout.stop(0) in json.loads(control.read_text()), "the stop request waited for the quiet clock"
    finally:
        mirror.finish(0)
        for node in nodes:
            node.stop()
