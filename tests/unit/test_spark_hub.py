"""Node 0's hub: the beats of a Spark attempt's nodes, over real loopback sockets, with the job key."""

from __future__ import annotations

import json
import socket
import time
import types

import pytest

from sparkgpu.launch.backends.spark.executor import channel
from sparkgpu.launch.backends.spark.executor import hub as spark_hub
from sparkgpu.launch.backends.spark.executor.hub import Hub, HubLink
from sparkgpu.launch.backends.spark.executor.node import NodeLaunch, NodeLink, NodeZero
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.rundir.states import NodeState

KEY = b"k" * 32


@pytest.fixture
def hub():
    hub = Hub(KEY, attempt=0, nnodes=3, host="127.0.0.1", timeout=2.0)
    hub.begin()
    yield hub
    hub.close()


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """One clock for node 0's hub and channel and node 1's link (one machine), moved by the test alone.

    ``clock[0]`` is now; a pause of node 0's (lingering at its end) moves it too.
    """
    now = [1000.0]
    fake = types.SimpleNamespace(
        monotonic=lambda: now[0], time=time.time, sleep=lambda s: now.__setitem__(0, now[0] + s)
    )
    monkeypatch.setattr(spark_hub, "time", fake)
    monkeypatch.setattr(channel, "time", fake)
    return now


def link_to(hub: Hub, node: int, key: bytes = KEY, attempt: int = 0) -> HubLink:
    return HubLink(key, attempt, node, ("127.0.0.1", hub.port), timeout=1.0)


def test_the_hub_listens_on_the_address_it_is_given_only(hub):
    assert hub._server.server_address[0] == "127.0.0.1"


def test_beating_nodes_stay_and_a_silent_one_is_named_lost_and_stops_the_others(hub):
    one, two = link_to(hub, 1), link_to(hub, 2)
    assert one.beat()["stop"] is None and two.beat()["stop"] is None
    for _ in range(10):  # node 2 falls silent; node 1 beats on
        time.sleep(0.25)
        assert one.beat() is not None
        hub.check()
    summary = hub.summary()
    assert set(summary["lost"]) == {"2"} and summary["stop"][0] == NodeState.PEER_LOST.value
    assert one.beat()["stop"][0] == "peer-lost"  # node 1 hears it in the answer to its next beat
    assert "node 2" in one.beat()["stop"][1]


def test_a_beat_sealed_with_another_key_is_refused_and_keeps_nobody_alive(hub):
    stranger = link_to(hub, 1, key=b"x" * 32)
    for _ in range(10):
        assert stranger.beat() is None
        time.sleep(0.25)
    hub.check()
    assert "1" in hub.summary()["lost"]


def test_a_replayed_beat_keeps_no_dead_node_alive(hub):
    genuine = spark_hub._frame(KEY, spark_hub._place(0, "beat"), {"node": 1, "count": 5, "ended": None})
    with socket.create_connection(("127.0.0.1", hub.port)) as sock:
        reader = sock.makefile("rb")
        sock.sendall(genuine)
        assert json.loads(reader.readline())  # the first time it counts
        for _ in range(10):  # someone who saw it on the wire sends it again and again
            time.sleep(0.25)
            sock.sendall(genuine)
            reader.readline()
    hub.check()
    assert "1" in hub.summary()["lost"]


def test_an_answer_of_another_attempt_or_an_old_answer_is_not_taken(hub):
    assert link_to(hub, 1, attempt=1).beat() is None  # the hub of attempt 0 does not verify attempt 1's beat
    one = link_to(hub, 1)
    assert one.beat() is not None
    heard = hub.members[1].last_change
    one.count -= 1  # the next beat repeats a count: answered, but it does not count as a sign of life
    assert one.beat() is not None
    assert (hub.members[1].count, hub.members[1].last_change) == (1, heard)


def test_a_node_whose_hub_is_gone_stops_and_names_node_0(tmp_path, clock):
    rd = RunDir(tmp_path / "job", key=KEY)
    rd.prepare_attempt(0)
    rd.file(RunLayout.spark(0)).mkdir(parents=True)
    launch = NodeLaunch(str(rd.path), 0, 2, 1, {}, KEY, 1, None, peer_timeout=1.0)
    hub = Hub(KEY, 0, 2, "127.0.0.1", timeout=1.0)
    node = NodeLink(HubLink(KEY, 0, 1, ("127.0.0.1", hub.port), 1.0), rd, launch)
    assert node.step(clock[0]) is None
    hub.close()  # node 0's executor is gone
    started = clock[0]
    while (stop := node.step(clock[0])) is None and clock[0] - started < 10:
        clock[0] += 0.05
    assert stop is not None and stop[0] is NodeState.PEER_LOST and node.lost == (0,)
    # Counted from its last answer: lost at the first beat (every 0.5 s) once silent for 1 s.
    assert 1.0 < node.link.silent_for() <= 1.5 + 1e-9


def test_node_0_hands_the_clients_stop_request_to_every_node(tmp_path):
    zero_rd, other_rd = RunDir(tmp_path / "n0" / "job", key=KEY), RunDir(tmp_path / "n1" / "job", key=KEY)
    for rd in (zero_rd, other_rd):
        rd.prepare_attempt(0)
        rd.file(RunLayout.spark(0)).mkdir(parents=True)
    launch = NodeLaunch(str(zero_rd.path), 0, 2, 1, {}, KEY, 1, None, store_url="memory://x", peer_timeout=2.0)
    zero = NodeZero(Hub(KEY, 0, 2, "127.0.0.1", 2.0), zero_rd, launch)
    other = NodeLink(HubLink(KEY, 0, 1, ("127.0.0.1", zero.hub.port), 2.0), other_rd, launch)
    try:
        zero_rd.write_control(zero_rd.file("attempts/0/STOP"), b"the runtime cap is near\n")  # as the mirror fetched it
        zero.step(time.monotonic())
        assert other.step(time.monotonic()) is None  # a stop request is for the ranks: the node runs on
        assert other_rd.read_control(other_rd.file("attempts/0/STOP")) == b"the runtime cap is near\n"
    finally:
        zero.hub.close()


def test_one_hub_serves_256_nodes(tmp_path):
    hub = Hub(KEY, 0, 257, "127.0.0.1", timeout=30.0)
    links = [link_to(hub, n) for n in range(1, 257)]
    try:
        started = time.monotonic()
        for _ in range(3):
            assert all(link.beat() is not None for link in links)
        elapsed = time.monotonic() - started
        assert all(m.count == 3 for m in hub.members.values())
        assert elapsed < 10, f"768 beats took {elapsed:.1f}s"
    finally:
        for link in links:
            link.close()
        hub.close()


def _two_nodes(tmp_path, client_timeout: float, peer_timeout: float = 8.0) -> tuple[NodeZero, NodeLink, RunDir]:
    """Node 0 and node 1 of an attempt on a shared run dir, node 1 beating every ``peer_timeout / 4`` s."""
    rd = RunDir(tmp_path / "job", key=KEY)
    rd.prepare_attempt(0)
    rd.file(RunLayout.spark(0)).mkdir(parents=True, exist_ok=True)
    launch = NodeLaunch(
        str(rd.path), 0, 2, 1, {}, KEY, 1, client_timeout, peer_timeout=peer_timeout, control_interval=0.5
    )
    zero = NodeZero(Hub(KEY, 0, 2, "127.0.0.1", peer_timeout), rd, launch)
    other = NodeLink(HubLink(KEY, 0, 1, ("127.0.0.1", zero.hub.port), peer_timeout), rd, launch)
    return zero, other, rd


def _until_both_stop(zero: NodeZero, other: NodeLink, limit: float, clock: list[float]) -> dict[str, float]:
    """Steps both nodes as their watch loops do (every 0.2 s of ``clock``); when each applied its stop."""
    stopped: dict[str, float] = {}
    end = clock[0] + limit
    while len(stopped) < 2 and clock[0] < end:
        for name, node in (("zero", zero), ("other", other)):
            if name not in stopped and node.step(clock[0]) is not None:
                stopped[name] = clock[0]
        clock[0] += 0.2
    return stopped


def test_a_lost_client_stops_every_node_at_once_as_soon_as_its_silence_counts(tmp_path, clock):
    # Node 1 beats every 2 s. Told when the client's silence will count, it beats at that moment,
    # so it stops with node 0, one second after the loss is due, not up to a beat period later.
    zero, other, rd = _two_nodes(tmp_path, client_timeout=3.0)
    try:
        rd.write_control(rd.file(RunLayout.client_heartbeat(0)), b"1\n")
        last_beat = clock[0]
        stopped = _until_both_stop(zero, other, limit=15, clock=clock)
        assert set(stopped) == {"zero", "other"}
        assert zero.hub.stop[0] == NodeState.CLIENT_LOST.value and other.stop[0] is NodeState.CLIENT_LOST
        assert "no heartbeat from the client for 3s" in other.stop[1]
        # Together: at the moment node 0 set, to the millisecond "stop_in" is said in, so at the
        # same step of the watch loops or, for that millisecond, the next one.
        assert other.stop_at == pytest.approx(zero.hub.stop_at, abs=1e-3)
        assert 0 <= stopped["other"] - stopped["zero"] <= 0.2 + 1e-9, stopped
        for at in stopped.values():  # due 3 s after the beat; applied FORESEEN_TOGETHER later
            assert 3.0 + spark_hub.FORESEEN_TOGETHER - 0.3 <= at - last_beat < 3.0 + spark_hub.FORESEEN_TOGETHER + 1.0
    finally:
        zero.hub.close()


def test_a_client_that_beats_before_its_silence_counts_stops_nobody(tmp_path, clock):
    zero, other, rd = _two_nodes(tmp_path, client_timeout=2.0)
    try:
        end, count = clock[0] + 7, 0
        while clock[0] < end:
            count += 1
            rd.write_control(rd.file(RunLayout.client_heartbeat(0)), f"{count}\n".encode())  # a beat every 1.5 s
            beat_until = clock[0] + 1.5
            while clock[0] < beat_until:
                assert zero.step(clock[0]) is None and other.step(clock[0]) is None
                clock[0] += 0.2
        assert count == 5  # 7 s of beats
        assert zero.hub.stop is None and 0 < zero.hub.client_due_at - clock[0] <= 2.0
    finally:
        zero.hub.close()


def test_the_moment_is_not_told_once_node_0_ended_nor_long_after_it_passed(tmp_path, clock):
    zero, other, rd = _two_nodes(tmp_path, client_timeout=30.0)
    try:
        rd.write_control(rd.file(RunLayout.client_heartbeat(0)), b"1\n")
        zero.step(clock[0])
        assert 29 < other.link.beat()["due_in"] <= 30  # told while node 0 watches the client
        zero.hub.foresee_client_loss(0.0)  # due now, and node 0 stalls instead of judging
        clock[0] += spark_hub._DUE_STALE + 0.2
        assert "due_in" not in other.link.beat()  # no node beats fast for a stalled node 0
        zero.hub.foresee_client_loss(10.0)
        zero.end({"node": 0, "exit_code": 0, "state": NodeState.SUCCEEDED.value, "ended_at": time.time()})
    finally:
        zero.hub.close()
    assert zero.hub.client_due_at is None  # node 0 ended: it no longer looks at the client


def test_with_a_staging_store_the_moment_is_not_foreseen_and_a_lost_client_stops_within_a_beat_period(tmp_path, clock):
    # The client's beat arrives with each pull of its files: its silence is timed at pulls, so
    # nobody is told a moment, and the stop is set a beat period ahead as for a cancel.
    rd = RunDir(tmp_path / "job", key=KEY)
    rd.prepare_attempt(0)
    rd.file(RunLayout.spark(0)).mkdir(parents=True, exist_ok=True)
    launch = NodeLaunch(
        str(rd.path), 0, 2, 1, {}, KEY, 1, 1.0, store_url="memory://x", peer_timeout=8.0, control_interval=0.5
    )
    zero = NodeZero(Hub(KEY, 0, 2, "127.0.0.1", 8.0), rd, launch)
    other = NodeLink(HubLink(KEY, 0, 1, ("127.0.0.1", zero.hub.port), 8.0), rd, launch)
    try:
        rd.write_control(rd.file(RunLayout.client_heartbeat(0)), b"1\n")
        beat = clock[0]
        zero.step(beat)
        assert "due_in" not in other.link.beat()
        stopped = _until_both_stop(zero, other, limit=15, clock=clock)
        assert set(stopped) == {"zero", "other"} and other.stop[0] is NodeState.CLIENT_LOST
        # Together, a beat period (2.5 s) after: at the moment node 0 set, to the millisecond.
        assert other.stop_at == pytest.approx(zero.hub.stop_at, abs=1e-3)
        assert 0 <= stopped["other"] - stopped["zero"] <= 0.2 + 1e-9, stopped
        assert stopped["zero"] - beat >= 1.0 + spark_hub.together_delay(8.0) - 0.3
    finally:
        zero.hub.close()
