"""How a Spark node hears of the others: node 0's duties and every other node's beats.

Node 0 serves the hub (:mod:`sparkgpu.launch.backends.spark.executor.hub`) and is the only node that
reads the client's files (a cancel, a stop request, the client's heartbeat); it decides when
the attempt stops and tells every node in its answers to their beats, and it writes the
attempt's state for the client. Every other node only beats to node 0. A node's watch loop
(:func:`sparkgpu.launch.backends.spark.executor.node._watch`) calls its channel's ``step`` and ``end``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from sparkgpu.launch.backends.spark.executor.hub import (
    FORESEEN_TOGETHER,
    KEEPALIVE,
    Hub,
    HubLink,
    beat_interval,
    together_delay,
)
from sparkgpu.launch.backends.spark.executor.node_launch import CONTROL_INTERVAL, NodeLaunch
from sparkgpu.launch.backends.spark.executor.node_progress import (
    dump_stacks,
    ranks_of,
    read_node_arrivals,
    read_progress,
    read_trial_reports,
)
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.rundir.states import NodeState

__all__ = ["Heartbeat", "NodeZero", "NodeLink", "Stop", "open_hub", "control_interval", "CONTROL_INTERVAL"]

#: Seconds between two looks of node 0 at its local copies of the client's files (with a store).
CHECK_SECONDS = 1.0
#: Seconds after a stop was due at which a node that foresaw it beats again, when the answer had no stop yet.
_DUE_MARGIN = 0.1
#: Seconds node 0 waits between two looks whether the other nodes ended.
_LINGER_POLL = 0.2
#: Seconds between two reads of node 0's own ranks' progress records and rank 0's trial reports.
PROGRESS_LOOK = 0.5
#: Least seconds between two writes of node 0's state for a change of progress alone (with a
#: staging store, the node's mirror puts it in its next round, as it puts the ranks' logs).
PROGRESS_WRITE = 1.0


class Heartbeat:
    """Notices a client that stopped beating, by content, so clocks of other hosts never matter.

    A beat counts only when its file is sealed under the job key and its count grew: a forged
    beat, or a genuine old one put back, keeps no lost client alive.

    Args:
        rd: The run dir the file belongs to (its key checks the seal).
        path: The file the other side rewrites with a new count every few seconds.
        timeout: Seconds without a change after which it counts as lost (``None``: never).
        clock: Seconds that count towards the silence. With a staging store: the seconds
            during which the store answered (:class:`~sparkgpu.launch.staging.mirror.StoreClock`), so
            a store that stalls for a minute makes nobody silent.
    """

    def __init__(self, rd: RunDir, path: Path, timeout: float | None, clock=None):
        self.rd, self.path, self.timeout = rd, path, timeout
        self.clock = clock if clock is not None else time.monotonic
        self.last_value: int | None = None
        self.last_change = self.clock()

    def silent_for(self) -> float:
        """Seconds since the count last grew, as of now."""
        body = self.rd.read_control(self.path)
        try:
            value = int(body) if body is not None else None
        except ValueError:
            value = None
        now = self.clock()
        if value is not None and (self.last_value is None or value > self.last_value):
            self.last_value, self.last_change = value, now
        return now - self.last_change

    def lost(self) -> bool:
        return self.timeout is not None and self.silent_for() > self.timeout

    def due_in(self) -> float | None:
        """Seconds, on :attr:`clock`, until the silence counts as lost (negative once it does);
        ``None`` when it never does."""
        return None if self.timeout is None else self.timeout - self.silent_for()


# -- how a node hears of the others ------------------------------------------------------------

#: A reason to stop the ranks: the node's state, and why.
Stop = tuple[NodeState, str]


def control_interval(launch: NodeLaunch) -> float:
    """Seconds between two looks of node 0 at the client's files: ``launch.control_interval``, and
    at most a third of the client's timeout (a silence is judged between two looks)."""
    if launch.client_timeout is None:
        return launch.control_interval
    return min(launch.control_interval, launch.client_timeout / 3)


def folder_check_interval(launch: NodeLaunch) -> float:
    """Seconds between two looks of node 0 at the client's files in a shared run dir: the control
    interval, and at most a sixth of the client's timeout. A look is one read of a few small files
    by node 0 alone, and a dead client's silence is judged between two looks, so its ranks stop
    within about the timeout and a third (the defaults, 20 s and 120 s, look every 20 s)."""
    if launch.client_timeout is None:
        return control_interval(launch)
    return min(control_interval(launch), launch.client_timeout / 6)


def open_hub(launch: NodeLaunch, host: str) -> Hub:
    """Node 0's hub, listening on ``host`` (the address the other nodes reach this host by)."""
    return Hub(launch.key, launch.attempt, launch.nnodes, host, launch.peer_timeout or math.inf)


class NodeZero:
    """Node 0's part: serves the hub, reads the client's files, keeps the state object the client reads.

    Args:
        hub: The hub the other nodes beat to.
        rd: This node's run dir.
        launch: The attempt's launch.
        clock: Times the client's silence (the staging store's answered seconds, with one).
        written: Called when a changed state was written (the mirror then sends it at once).
    """

    def __init__(self, hub: Hub, rd: RunDir, launch: NodeLaunch, clock=None, written=None):
        self.hub, self.rd, self.launch, self.on_written = hub, rd, launch, written
        self.client = Heartbeat(
            rd, rd.file(RunLayout.client_heartbeat(launch.attempt)), launch.client_timeout, clock=clock
        )
        # With a store the client's files arrive through the mirror: reading the local copies is free.
        self.check_every = CHECK_SECONDS if launch.store_url else folder_check_interval(launch)
        self.next_check = 0.0
        self.written: tuple[int, float] = (-1, 0.0)  # (version, monotonic time) of the last state written
        self.progress_written = -1  # the hub's progress version last written
        self.next_look = 0.0
        self.ranks = ranks_of(0, launch.nproc)
        self.dumped = False  # this node dumped its ranks' stacks on the client's request
        self.due_at: float | None = None  # monotonic: when the client's silence counts, as the nodes were told
        #: Nodes this one found lost itself: none (node 0 names the lost in its state).
        self.lost: tuple[int, ...] = ()
        hub.begin()

    def step(self, now: float) -> Stop | None:
        if now >= self.next_look:
            self.next_look = now + PROGRESS_LOOK
            attempt = self.launch.attempt
            self.hub.note_own(
                read_progress(self.rd, attempt, self.ranks),
                read_trial_reports(self.rd, attempt),
                read_node_arrivals(self.rd, attempt, self.ranks),
            )
        if now >= self.next_check:
            due_in = self._read_client()
            # Judged at the moment the client's silence counts, not at the next look after it.
            wait = self.check_every if due_in is None else min(self.check_every, max(due_in, 0.0) + _DUE_MARGIN)
            self.next_check = now + wait
        self.hub.check()
        self._write_state(now)
        stop = self.hub.stop_due()
        return (NodeState(stop[0]), stop[1]) if stop else None

    def _read_client(self) -> float | None:
        """Looks at the client's files; seconds until its silence counts as lost, when foreseen."""
        rd, attempt = self.rd, self.launch.attempt
        cancel = rd.read_control(rd.file(RunLayout.spark_cancel(attempt)))
        if not self.dumped and rd.read_control(rd.file(RunLayout.spark_dump(attempt))) is not None:
            self.dumped = True
            self.hub.ask_dump()  # the other nodes hear it in their next replies
            dump_stacks(rd, attempt, read_progress(rd, attempt, self.ranks))
            if self.on_written is not None:
                self.on_written()  # with a store: the stacks go up now
        due_in = self.client.due_in()
        now = time.monotonic()
        if cancel is not None:
            why = cancel.decode(errors="replace").strip() or "cancelled"
            # Every node hears it within a beat period, and stops its ranks at the same moment.
            self.hub.set_stop(NodeState.CANCELLED, why, together_delay(self.launch.peer_timeout))
        elif due_in is not None and due_in < 0:
            why = f"no heartbeat from the client for {(self.client.timeout or 0.0) - due_in:.0f}s"
            # Every node was told to beat at this moment when it was foreseen; else within a beat period.
            foreseen = self.due_at is not None and self.due_at <= now + 2 * _DUE_MARGIN
            together = FORESEEN_TOGETHER if foreseen else together_delay(self.launch.peer_timeout)
            self.hub.set_stop(NodeState.CLIENT_LOST, why, together)
        # With a staging store the client's beat arrives, and its silence is timed, at each pull of
        # the client's files: the moment it counts is not known ahead.
        if self.hub.stop is not None or self.launch.store_url:
            due_in = None
        self.due_at = None if due_in is None else now + due_in
        self.hub.foresee_client_loss(due_in)
        if self.launch.store_url:  # a shared run dir shows every node the client's stop request itself
            stop = RunLayout.stop(attempt)
            try:
                self.hub.relay({stop: rd.file(stop).read_bytes()})
            except FileNotFoundError:
                pass
        return due_in

    def _write_state(self, now: float, force: bool = False) -> None:
        version, at = self.written
        progressed = self.hub.progress_version != self.progress_written and now - at >= PROGRESS_WRITE
        if force or self.hub.version != version or progressed or now - at >= KEEPALIVE:
            summary = self.hub.summary()
            self.rd.write_control(
                self.rd.file(RunLayout.spark_state(self.launch.attempt)), json.dumps(summary).encode()
            )
            if summary["version"] != version and self.on_written is not None:
                self.on_written()  # a change of progress alone waits for the mirror's next round
            self.written = (summary["version"], now)
            self.progress_written = summary["progress_version"]

    def end(self, done: dict) -> None:
        """Says how node 0 ended, then serves the others until each ended or is lost."""
        if done["state"] != NodeState.SUCCEEDED.value:
            self.hub.set_stop(NodeState.PEER_FAILED, f"node 0 ended {done['state']}")
        self.hub.foresee_client_loss(None)  # node 0 no longer looks at the client
        self.hub.end_own(done)
        # With no node timeout nobody is ever counted lost: then node 0 waits long enough for the
        # others to hear why to stop and to stop, not for ever.
        bound = time.monotonic() + self.launch.shutdown_grace + 2 * beat_interval(self.launch.peer_timeout) + 10
        while not self.hub.done() and (math.isfinite(self.hub.timeout) or time.monotonic() < bound):
            time.sleep(_LINGER_POLL)
            self.hub.check()
            self._write_state(time.monotonic())
        self._write_state(time.monotonic(), force=True)
        self.hub.close()


class NodeLink:
    """The part of every node but node 0: beats to node 0's hub and takes its answers.

    Args:
        link: The connection to node 0's hub.
        rd: This node's run dir.
        launch: The attempt's launch.
    """

    def __init__(self, link: HubLink, rd: RunDir, launch: NodeLaunch):
        self.link, self.rd, self.launch = link, rd, launch
        self.every = beat_interval(launch.peer_timeout)
        self.next_beat = 0.0
        self.stop: Stop | None = None
        self.stop_at = 0.0  # monotonic: when ``stop`` applies here
        self.relayed: dict[str, bytes] = {}
        #: Nodes this one found lost (node 0, when it stopped answering).
        self.lost: tuple[int, ...] = ()
        self.ranks = ranks_of(link.node, launch.nproc)
        self.dumped = False  # this node dumped its ranks' stacks on the client's request

    def step(self, now: float) -> Stop | None:
        if now >= self.next_beat:
            self.next_beat = now + self.every
            self._beat(now)
        return self.stop if self.stop is not None and now >= self.stop_at else None

    def _beat(self, now: float) -> None:
        progress = read_progress(self.rd, self.launch.attempt, self.ranks)
        reply = self.link.beat(progress=progress, arrivals=read_node_arrivals(self.rd, self.launch.attempt, self.ranks))
        if reply is None:
            silent = self.link.silent_for()
            if self.stop is None and self.launch.peer_timeout is not None and silent > self.launch.peer_timeout:
                self.stop, self.lost = (NodeState.PEER_LOST, f"node 0 answered no beat for {silent:.0f}s"), (0,)
                self.stop_at = now
            return
        if self.launch.store_url:  # the ranks read the client's stop request here
            self.rd.write_control_copies(self.launch.attempt, HubLink.relayed(reply), self.relayed)
        if reply.get("dump") is True and not self.dumped:
            self.dumped = True
            dump_stacks(self.rd, self.launch.attempt, progress)
        due_in = reply.get("due_in")
        if self.stop is None and not reply.get("stop") and isinstance(due_in, (int, float)):
            # Beat again when a stop node 0 foresees falls due (a lost client), to hear it at once.
            self.next_beat = min(self.next_beat, now + max(0.0, due_in) + _DUE_MARGIN)
        if self.stop is None and reply.get("stop"):
            try:
                self.stop = (NodeState(reply["stop"][0]), str(reply["stop"][1]))
            except (ValueError, IndexError, TypeError):
                self.stop = (NodeState.PEER_FAILED, "node 0 asked to stop")
            try:  # a stop for everyone at once applies when node 0 applies it
                self.stop_at = now + min(float(reply.get("stop_in") or 0.0), 60.0)
            except (TypeError, ValueError):
                self.stop_at = now

    def end(self, done: dict) -> None:
        """Tells node 0 how this node ended (a few tries: it stops the others on a failure)."""
        for _ in range(3):
            if self.link.beat(ended=done) is not None:
                break
            time.sleep(_LINGER_POLL)
        self.link.close()
