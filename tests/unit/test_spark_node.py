"""The executor side of a node task: watching the agent and stopping it.

The agent here is a real process that behaves like one (traps SIGTERM, exits with a code);
the run dir is a real folder.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.launch.node.agent import strip_spark_secrets
from sparkgpu.launch.backends.spark.executor import node as spark_node
from sparkgpu.launch.backends.spark.executor.hub import HubLink
from sparkgpu.launch.backends.spark.executor.node import (
    Heartbeat,
    NodeLaunch,
    NodeLink,
    NodeZero,
    _claim,
    _watch,
    open_hub,
)
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.rundir.states import NodeState

FAKE_AGENT = textwrap.dedent("""
    import signal, sys, time
    def stop(*_):
        print(f"agent got SIGTERM at {time.time()}", flush=True)
        sys.exit(143)
    signal.signal(signal.SIGTERM, stop)
    print("agent up", flush=True)
    time.sleep(float(sys.argv[1]))
    sys.exit(int(sys.argv[2]))
""")


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(spark_node, "_POLL_SECONDS", 0.05)
    rd = RunDir(tmp_path / "job-1", key=b"k" * 32)
    rd.prepare_attempt(0)
    rd.file(RunLayout.spark(0)).mkdir(parents=True)
    return rd


def start_agent(tmp_path, seconds: float, code: int = 0) -> subprocess.Popen:
    script = tmp_path / "agent.py"
    script.write_text(FAKE_AGENT)
    proc = subprocess.Popen([sys.executable, str(script), str(seconds), str(code)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "agent up"  # its SIGTERM handler is in place
    return proc


def launch(rd: RunDir, client_timeout=None, nnodes=1) -> NodeLaunch:
    return NodeLaunch(
        run_dir=str(rd.path),
        attempt=0,
        nnodes=nnodes,
        nproc=2,
        env={},
        key=b"k" * 32,
        shutdown_grace=1,
        client_timeout=client_timeout,
        peer_timeout=3.0,
        control_interval=0.5,
    )


def zero(rd: RunDir, node_launch: NodeLaunch) -> NodeZero:
    """Node 0's channel, its hub on loopback."""
    return NodeZero(open_hub(node_launch, "127.0.0.1"), rd, node_launch)


def link(rd: RunDir, node_launch: NodeLaunch, hub_of: NodeZero, node: int = 1) -> NodeLink:
    address = ("127.0.0.1", hub_of.hub.port)
    return NodeLink(HubLink(node_launch.key, 0, node, address, node_launch.peer_timeout), rd, node_launch)


def watch_both(run_dir, tmp_path, seconds0, code0, seconds1, code1, *, peer_timeout=None, meanwhile=None, agents=None):
    """Node 0 and node 1 of one attempt, each watching its own agent; ``{node: (code, state)}``.

    ``peer_timeout`` replaces the launch's; ``meanwhile()`` runs once both watch; ``agents``
    (a dict) gets the agents' processes.
    """
    both = launch(run_dir, nnodes=2)
    if peer_timeout is not None:
        both = dataclasses.replace(both, peer_timeout=peer_timeout)
    first = zero(run_dir, both)
    second = link(run_dir, both, first)
    started = {0: start_agent(tmp_path, seconds0, code0), 1: start_agent(tmp_path, seconds1, code1)}
    if agents is not None:
        agents.update(started)
    ends = {}
    threads = [
        threading.Thread(target=lambda n=n, c=c: ends.__setitem__(n, _watch(started[n], run_dir, both, n, c)))
        for n, c in ((0, first), (1, second))
    ]
    for t in threads:
        t.start()
    if meanwhile is not None:
        meanwhile()
    for t in threads:
        t.join(60)
    return ends


def test_an_agent_that_finishes_is_reported_with_its_exit_code(run_dir, tmp_path):
    alone = launch(run_dir)
    agent = start_agent(tmp_path, 0.2, code=0)
    assert _watch(agent, run_dir, alone, 0, zero(run_dir, alone)) == (0, "succeeded")
    ended = run_dir.read_control_json(run_dir.file(RunLayout.node_marker(0, 0, "ended")))
    assert ended["state"] == "succeeded" and ended["exit_code"] == 0
    state = run_dir.read_control_json(run_dir.file("attempts/0/spark/state"))
    assert state["ended"]["0"]["state"] == "succeeded" and state["lost"] == {} and state["stop"] is None


def test_the_cancel_marker_stops_the_agent_with_sigterm(run_dir, tmp_path):
    alone = launch(run_dir)
    agent = start_agent(tmp_path, 60)
    run_dir.write_control(run_dir.file(RunLayout.spark_cancel(0)), b"x")
    # 143 and the handler's line: stopped by SIGTERM, not waited for (it would exit 0 after 60 s).
    assert _watch(agent, run_dir, alone, 0, zero(run_dir, alone)) == (143, "cancelled")
    assert "agent got SIGTERM" in agent.stdout.read()


def test_the_cancel_marker_reaches_every_node_through_node_0(run_dir, tmp_path):
    run_dir.write_control(run_dir.file(RunLayout.spark_cancel(0)), b"cancelled by the client\n")
    assert watch_both(run_dir, tmp_path, 60, 0, 60, 0) == {0: (143, "cancelled"), 1: (143, "cancelled")}


def test_a_stop_for_everyone_reaches_every_nodes_agent(run_dir, tmp_path):
    def cancel_once_both_beat():
        time.sleep(1.0)
        run_dir.write_control(run_dir.file(RunLayout.spark_cancel(0)), b"cancelled by the client\n")

    agents: dict = {}
    ends = watch_both(
        run_dir, tmp_path, 60, 0, 60, 0, peer_timeout=10.0, meanwhile=cancel_once_both_beat, agents=agents
    )
    assert ends == {0: (143, "cancelled"), 1: (143, "cancelled")}
    assert all("agent got SIGTERM at " in agents[n].stdout.read() for n in (0, 1))


def test_a_stop_for_everyone_applies_on_every_node_at_the_moment_node_0_set_not_when_heard(run_dir, monkeypatch):
    # Node 1 hears node 0 only when it beats (every 2.5 s for a 10 s node timeout): applied on
    # hearing, the agents would get SIGTERM up to 2.5 s apart, and ranks that left their loop
    # first would wait in a collective for peers still stepping until the grace kills them.
    # One clock for both nodes (they share it on one machine), moved by the test alone.
    from sparkgpu.launch.backends.spark.executor import channel
    from sparkgpu.launch.backends.spark.executor import hub as spark_hub

    now = [1000.0]
    clock = types.SimpleNamespace(monotonic=lambda: now[0], time=time.time, sleep=time.sleep)
    monkeypatch.setattr(spark_hub, "time", clock)
    monkeypatch.setattr(channel, "time", clock)
    both = dataclasses.replace(launch(run_dir, nnodes=2), peer_timeout=10.0)
    first = zero(run_dir, both)
    second = link(run_dir, both, first)
    try:
        began = now[0]
        assert first.step(now[0]) is None and second.step(now[0]) is None  # node 1 beat: the next is 2.5 s away
        run_dir.write_control(run_dir.file(RunLayout.spark_cancel(0)), b"cancelled by the client\n")
        while first.hub.stop is None:  # node 0 reads the marker at its next look at the client's files
            now[0] += 0.05
            assert now[0] - began < 2.0, "node 0 never read the cancel marker"
            assert first.step(now[0]) is None
        moment = first.hub.stop_at
        assert moment == pytest.approx(now[0] + spark_hub.together_delay(10.0))
        while second.stop is None:  # node 1 hears it at its next beat, and stops later, with node 0
            now[0] += 0.05
            assert now[0] < moment, "node 1 never heard the stop before it was due"
            assert second.step(now[0]) is None and first.step(now[0]) is None
        assert second.stop == (NodeState.CANCELLED, "cancelled by the client")
        assert second.stop_at == pytest.approx(moment, abs=1e-3)  # "stop_in" is said to the millisecond
        now[0] = moment - 2e-3
        assert first.step(now[0]) is None and second.step(now[0]) is None
        now[0] = moment + 1e-3
        assert first.step(now[0]) == second.step(now[0]) == (NodeState.CANCELLED, "cancelled by the client")
    finally:
        second.link.close()
        first.hub.close()


def test_a_failed_node_stops_the_others(run_dir, tmp_path):
    assert watch_both(run_dir, tmp_path, 60, 0, 0.3, 1) == {0: (143, "peer-failed"), 1: (1, "failed")}
    state = run_dir.read_control_json(run_dir.file("attempts/0/spark/state"))
    assert state["stop"][0] == "peer-failed" and state["ended"]["1"]["state"] == "failed"


def test_a_failed_node_0_stops_the_others(run_dir, tmp_path):
    assert watch_both(run_dir, tmp_path, 0.3, 1, 60, 0) == {0: (1, "failed"), 1: (143, "peer-failed")}


def test_a_node_that_succeeded_stops_nobody(run_dir, tmp_path):
    assert watch_both(run_dir, tmp_path, 1.0, 0, 0.2, 0) == {0: (0, "succeeded"), 1: (0, "succeeded")}
    state = run_dir.read_control_json(run_dir.file("attempts/0/spark/state"))
    assert state["stop"] is None and set(state["ended"]) == {"0", "1"}


def test_a_silent_client_stops_the_node_after_its_timeout(run_dir, tmp_path):
    run_dir.write_control(run_dir.file(RunLayout.client_heartbeat(0)), b"7\n")  # and never again: the client died
    alone = launch(run_dir, client_timeout=1.0)
    agent = start_agent(tmp_path, 60)
    started = time.monotonic()
    assert _watch(agent, run_dir, alone, 0, zero(run_dir, alone)) == (143, "client-lost")
    assert 1.0 <= time.monotonic() - started < 30  # the 1 s timeout stopped it, not the agent's own 60 s


def test_node_0_looks_at_a_shared_run_dirs_client_files_six_times_per_client_timeout(run_dir):
    # The client's silence is judged between two looks: a dead client's ranks stop within about
    # the timeout and a third. The defaults (20 s looks, a 120 s timeout) keep one look per 20 s.
    slow = dataclasses.replace(launch(run_dir, client_timeout=12.0), control_interval=20.0)
    looks = []
    for timeout in (12.0, 120.0, None):
        channel = zero(run_dir, dataclasses.replace(slow, client_timeout=timeout))
        looks.append(channel.check_every)
        channel.hub.close()
    assert looks == [pytest.approx(2.0), 20.0, 20.0]


def test_an_agent_that_ignores_sigterm_is_killed_after_the_grace(run_dir, tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text(
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)\n"
    )
    agent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    agent.stdout.readline()
    run_dir.write_control(run_dir.file(RunLayout.spark_cancel(0)), b"x")
    started = time.monotonic()
    alone = launch(run_dir)
    code, state = _watch(agent, run_dir, alone, 0, zero(run_dir, alone))  # grace 1 s + 5 s
    assert (code, state) == (-9, "cancelled") and time.monotonic() - started < 40  # killed, not its 60 s sleep


def test_heartbeat_counts_growing_sealed_counts_not_clocks(run_dir, monkeypatch):
    path = run_dir.file(RunLayout.client_heartbeat(0))
    now = [100.0]
    monkeypatch.setattr(spark_node.time, "monotonic", lambda: now[0])
    beat = Heartbeat(run_dir, path, timeout=10)
    run_dir.write_control(path, b"1\n")
    assert not beat.lost()
    now[0] += 9
    run_dir.write_control(path, b"2\n")  # a beat: the clock starts over
    assert not beat.lost()
    now[0] += 9
    assert not beat.lost()
    now[0] += 2
    assert beat.lost()
    assert not Heartbeat(run_dir, path, timeout=None).lost()


def test_forged_or_replayed_beats_keep_no_lost_client_alive(run_dir, monkeypatch):
    path = run_dir.file(RunLayout.client_heartbeat(0))
    now = [100.0]
    monkeypatch.setattr(spark_node.time, "monotonic", lambda: now[0])
    beat = Heartbeat(run_dir, path, timeout=10)
    run_dir.write_control(path, b"5\n")
    genuine_old = path.read_bytes()
    assert not beat.lost()
    for step, forged in enumerate([b"6\n", b"7\n--sparkgpu-mac " + b"0" * 64 + b"\n", genuine_old]):
        now[0] += 4
        atomic_write_bytes(path, forged)  # a writer of the run dir without the key, or replaying an old beat
        assert not beat.lost() if step < 2 else beat.lost()


def test_the_start_marker_is_claimed_once_and_sealed(run_dir):
    marker = run_dir.file(RunLayout.node_marker(0, 0, "started"))
    assert _claim(run_dir, marker, {"node": 0, "started_at": 5.0})
    assert not _claim(run_dir, marker, {"node": 0, "started_at": 6.0})  # Spark re-running the stage
    assert run_dir.read_control_json(marker) == {"node": 0, "started_at": 5.0}
    assert [p.name for p in marker.parent.iterdir()] == ["node-0.started"]  # no temporary left


def test_a_planted_start_marker_is_no_started_node(run_dir):
    client = RunDir(run_dir.path, key=b"k" * 32)
    assert _claim(run_dir, run_dir.file(RunLayout.node_marker(0, 0, "started")), {"node": 0, "started_at": 5.0})
    # A writer of the run dir without the key: a node that never ran, and an earlier start to bill from.
    run_dir.file(RunLayout.node_marker(0, 1, "started")).write_text(json.dumps({"node": 1, "started_at": 1.0}))
    forged = b'{"node": 2, "started_at": 1.0}\n--sparkgpu-mac ' + b"0" * 64 + b"\n"
    run_dir.file(RunLayout.node_marker(0, 2, "started")).write_bytes(forged)
    assert client.started_nodes(0) == {0: {"node": 0, "started_at": 5.0}}
    assert client.nodes_without_end(0) == [0]  # no peer waits for a planted node's beats
    assert RunDir(run_dir.path, key=b"x" * 32).started_nodes(0) == {}  # another job's key verifies nothing


def test_the_job_key_stays_out_of_the_launch_repr(run_dir):
    assert "ab" * 32 not in repr(launch(run_dir))


def test_spark_secrets_are_stripped_and_nothing_else():
    env = {
        "_SPARK_AUTH_SECRET": "a",
        "PYTHON_WORKER_FACTORY_SECRET": "b",
        "PYSPARK_GATEWAY_SECRET": "c",
        "_SPARK_SSL_RPC_KEY_STORE_PASSWORD": "d",
        "_SPARK_SSL_RPC_TRUST_STORE_PASSWORD": "e",
        "SPARK_HOME": "/opt/spark",
        "PYTHON_WORKER_FACTORY_PORT": "1",
        "PATH": "/bin",
    }
    removed = strip_spark_secrets(env)
    assert removed == [
        "PYSPARK_GATEWAY_SECRET",
        "PYTHON_WORKER_FACTORY_SECRET",
        "_SPARK_AUTH_SECRET",
        "_SPARK_SSL_RPC_KEY_STORE_PASSWORD",
        "_SPARK_SSL_RPC_TRUST_STORE_PASSWORD",
    ]
    assert env == {
        "SPARK_HOME": "/opt/spark",
        "PYTHON_WORKER_FACTORY_PORT": "1",
        "PATH": "/bin",
    }
