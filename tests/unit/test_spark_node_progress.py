"""The ranks' progress and trial reports ride a Spark attempt's beats to node 0's state; stacks come back on request.

Two nodes on real loopback sockets, each with its own run dir (as with a staging store) and one
real rank process each: a Python process that starts its progress record and its stacks on
request as a rank's entrypoint does, notes one step and sleeps. The client's side reads only
what node 0 wrote.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from sparkgpu.launch.backends.spark.executor.hub import Hub, HubLink
from sparkgpu.launch.backends.spark.executor.node import NodeLaunch, NodeLink, NodeZero
from sparkgpu.launch.backends.spark.progress import relayed_progress
from sparkgpu.launch.client.hang_diagnosis import parse_stacks
from sparkgpu.rundir import progress as _progress
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.keyring import save_key
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.sweeps.reports import read_attempt_reports

KEY = b"k" * 32

RANK = textwrap.dedent("""
    import sys, time
    from sparkgpu.launch.rank.progress import note, watch_rank
    from sparkgpu.rundir.directory import RunDir

    watch_rank(RunDir(sys.argv[1]), 0, int(sys.argv[2]), int(sys.argv[3]), nccl=False)
    note(step=3)
    time.sleep(120)
""")


def _until(done, what: str, limit: float = 20.0, step=None):
    deadline = time.monotonic() + limit
    while not done():
        assert time.monotonic() < deadline, f"{what} did not happen within {limit:g}s"
        if step is not None:
            step()
        time.sleep(0.05)


@pytest.fixture
def two_nodes(tmp_path):
    """Node 0 and node 1 of attempt 0, one rank each, in run dirs of their own; their rank processes."""
    dirs = [RunDir(tmp_path / f"n{n}" / "job-1", key=KEY) for n in (0, 1)]
    for rd in dirs:
        rd.prepare_attempt(0)
        rd.file(RunLayout.spark(0)).mkdir(parents=True)
    launch = NodeLaunch(str(dirs[0].path), 0, 2, 1, {}, KEY, 1, None, store_url="memory://x", peer_timeout=2.0)
    zero = NodeZero(Hub(KEY, 0, 2, "127.0.0.1", 2.0), dirs[0], launch)
    other = NodeLink(HubLink(KEY, 0, 1, ("127.0.0.1", zero.hub.port), 2.0), dirs[1], launch)
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(rd.path), str(n), str(n)]) for n, rd in enumerate(dirs)]
    try:
        paths = [rd.file(RunLayout.progress(0, n)) for n, rd in enumerate(dirs)]
        _until(lambda: all(getattr(_progress.read(p), "count", 0) == 1 for p in paths), "a note of each rank")
        yield zero, other, dirs
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
        zero.hub.close()
        other.link.close()


def _state(rd: RunDir) -> dict:
    return rd.read_control_json(rd.file(RunLayout.spark_state(0))) or {}


def _step(zero: NodeZero, other: NodeLink):
    def both():
        now = time.monotonic()
        other.step(now)
        zero.step(now)

    return both


def test_every_ranks_progress_and_rank_0s_reports_reach_node_0s_state_on_the_beats(two_nodes, tmp_path):
    zero, other, (zero_rd, _) = two_nodes
    reports = zero_rd.file(RunLayout.trial_reports(0))
    reports.write_text(json.dumps({"reports": [[0, 1.5, 1.0], [1, 1.25, 2.0]]}))  # as rank 0 writes them
    _until(
        lambda: set(relayed_progress(_state(zero_rd))) == {0, 1},
        "both ranks in node 0's state",
        step=_step(zero, other),
    )
    state = _state(zero_rd)
    progress = relayed_progress(state)
    assert [(r.node, r.count, r.step, r.done) for r in (progress[0], progress[1])] == [
        (0, 1, 3, False),
        (1, 1, 3, False),
    ]
    assert state["reports"] == [[0, 1.5], [1, 1.25]]
    # The client's copy holds node 0's state only (the reports file stays on node 0's executor).
    client = RunDir(tmp_path / "client" / "job-1")
    client.file(RunLayout.spark(0)).mkdir(parents=True)
    client.file(RunLayout.spark_state(0)).write_bytes(zero_rd.file(RunLayout.spark_state(0)).read_bytes())
    save_key("job-1", KEY)  # the client's keyring holds the job key
    assert read_attempt_reports(client.path, 0) == [(0, 1.5), (1, 1.25)]


def test_node_0_writes_its_state_again_only_when_a_ranks_progress_changed(two_nodes):
    zero, other, (zero_rd, _) = two_nodes
    _until(
        lambda: set(relayed_progress(_state(zero_rd))) == {0, 1},
        "both ranks in node 0's state",
        step=_step(zero, other),
    )
    written = zero_rd.file(RunLayout.spark_state(0)).stat().st_mtime_ns
    for _ in range(5):  # the ranks' rows do not change: nothing to write
        _step(zero, other)()
    assert zero_rd.file(RunLayout.spark_state(0)).stat().st_mtime_ns == written


def test_the_clients_stacks_request_makes_every_node_copy_its_ranks_stacks_into_the_spark_folder(two_nodes):
    zero, other, dirs = two_nodes
    _until(
        lambda: set(relayed_progress(_state(dirs[0]))) == {0, 1},
        "both ranks in node 0's state",
        step=_step(zero, other),
    )
    dirs[0].write_control(dirs[0].file(RunLayout.spark_dump(0)), b"the attempt hung\n")  # as the mirror fetched it
    copies = [rd.file(RunLayout.spark_stacks(0, n)) for n, rd in enumerate(dirs)]
    _until(lambda: all(c.exists() for c in copies), "both ranks' stacks copied", step=_step(zero, other))
    for n, copy in enumerate(copies):
        stacks = parse_stacks(copy.read_text())
        assert stacks is not None and (stacks.rank, stacks.node) == (n, n)
        assert "(most recent call first)" in stacks.text
