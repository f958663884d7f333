"""Node 0's hub: how the nodes of a Spark attempt know of each other without the staging store.

Every node task beats to node 0's task over TCP, on the address its peers already use to reach
node 0 for the rendezvous, a few times per ``node_timeout``. Node 0 keeps each node's last beat
(as torch elastic's dynamic rendezvous keeps keep-alive keys in its store) and answers every
beat with the attempt's state: whether to stop and why, the client's control files that node 0
fetched (a stop request), who ended and who is lost. So a node never reads the store or its
peers' files for control: one connection per node, to one node, whatever the node count.

The client reads the same state from one small object that node 0 writes into the run dir
(``attempts/<k>/spark/state``, :meth:`Hub.summary`) when it changes, and at least every
:data:`KEEPALIVE` seconds; with a staging store, node 0 alone fetches the client's control
files, as one object, every ``control_interval`` seconds.

Frames are one JSON line each way, ``{"b": body, "m": MAC}``, the MAC taken as
:func:`~sparkgpu.rundir.control.seal` takes it, under the job key, over a place that names the
attempt and the direction: a frame of another job, another attempt or the other direction does
not verify. A beat's count must grow, so a replayed beat keeps no dead node alive; a reply
echoes the count it answers, so a replayed reply answers nothing. The port is open to whoever
reaches node 0: a stranger can hold a connection, not speak for a node.

**A stop node 0 decides on for everyone at once** (the client is lost or cancelled the job) is
set :func:`together_delay` ahead (a beat period and a margin): every node hears it within one
beat period, each reply says how long until it applies (``stop_in``), and every node, node 0 included, stops its ranks
at about the same moment. Ranks that left their loop one beat apart would otherwise wait in a
collective for peers still stepping, until the shutdown grace kills them. A stop a failed or
lost node calls for applies at once: its peers are blocked already.

**The ranks' progress rides the beats.** A beat carries one compact row per rank of its node (its
progress record, :mod:`sparkgpu.launch.backends.spark.executor.node_progress`); node 0 keeps
each node's latest rows, adds its own and rank 0's trial reports, and the state the client reads
holds them all (``progress``, ``reports``), and so the ranks' latest collectives' arrivals
(``arrivals``, :mod:`sparkgpu.launch.rank.arrivals`). A reply carries ``dump`` once the client asked for
the ranks' stacks (a hung attempt): every node then dumps its ranks' stacks.

**A lost client is foreseen.** Its silence counts from the last beat node 0 saw, so node 0 knows
when it will count as lost, and every reply says how long until then (``due_in``). Node 0 looks
at the client's beat at that moment, and every node beats then: the stop, set
:data:`FORESEEN_TOGETHER` seconds ahead, reaches every node at once instead of within a beat
period. A client beat that arrives before moves the moment on, and nobody stops.
"""

from __future__ import annotations

import dataclasses
import io
import hmac
import json
import math
import socket
import socketserver
import threading
import time

from sparkgpu._util.report import report
from sparkgpu.rundir.control import mac, pack_files, unpack_files
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.rundir.states import NodeState

__all__ = ["Hub", "HubLink", "KEEPALIVE", "FORESEEN_TOGETHER", "beat_interval", "together_delay"]

#: Most seconds between two writes of node 0's state object while nothing changes.
KEEPALIVE = 120.0
#: Seconds between node 0 deciding on a stop every node foresaw (a lost client) and every node
#: applying it: each node beats at the moment the stop became due, and hears it then.
FORESEEN_TOGETHER = 1.0
#: Seconds after the foreseen moment at which, with no judgement from node 0, it is no longer told.
_DUE_STALE = 1.0
#: The longest frame either side reads (a beat is ~100 bytes; a reply carries small control files).
_MAX_FRAME = 1 << 16


def together_delay(timeout: float | None) -> float:
    """Seconds between node 0 deciding on a stop for everyone and every node applying it: one
    beat period, in which every node beats and hears it, and a margin."""
    return beat_interval(timeout) + 0.5


def beat_interval(timeout: float | None) -> float:
    """Seconds between two beats of a node whose silence counts after ``timeout`` seconds:
    four beats per timeout, at most two a second."""
    return max(0.5, (timeout or 10.0) / 4)


def _place(attempt: int, direction: str) -> str:
    return f"{RunLayout.spark(attempt)}/hub-{direction}"


def _frame(key: bytes, place: str, body: dict) -> bytes:
    text = json.dumps(body, separators=(",", ":"))
    return json.dumps({"b": text, "m": mac(key, place, text.encode())}).encode() + b"\n"


def _open(key: bytes, place: str, line: bytes) -> dict | None:
    """The body of a frame whose MAC holds under ``key`` for ``place``, else ``None``."""
    try:
        outer = json.loads(line)
        text, given = outer["b"], outer["m"]
        if not hmac.compare_digest(str(given).encode(), mac(key, place, str(text).encode()).encode()):
            return None
        body = json.loads(text)
    except (ValueError, KeyError, TypeError):
        return None
    return body if isinstance(body, dict) else None


@dataclasses.dataclass
class _Member:
    """What the hub knows of one node."""

    last_change: float  # monotonic, when its count last grew
    last_wall: float  # Unix time of the same, for the report
    count: int = 0
    ended: dict | None = None  # {"state", "exit_code"} once it said it ended
    lost: bool = False
    progress: dict[str, list] = dataclasses.field(default_factory=dict)  # its ranks' rows, by rank
    arrivals: dict[str, list] = dataclasses.field(default_factory=dict)  # its ranks' latest collectives, by rank


class Hub:
    """Node 0's side: serves the other nodes' beats and keeps the attempt's state.

    Args:
        key: The job key.
        attempt: The attempt.
        nnodes: Nodes of the attempt (node 0 is this one; it never beats to itself).
        host: The address to listen on: the one the other nodes reach this host by.
        timeout: Seconds a node may go without a beat (and without saying it ended) before it
            counts as lost.
    """

    def __init__(self, key: bytes, attempt: int, nnodes: int, host: str, timeout: float):
        self.key, self.attempt, self.timeout = key, attempt, timeout
        now, wall = time.monotonic(), time.time()
        self.members = {n: _Member(now, wall) for n in range(1, nnodes)}
        self._lock = threading.Lock()
        self.stop: tuple[str, str] | None = None  # (a NodeState value, why)
        self.stop_at = 0.0  # monotonic: when the stop applies (later than set for a stop together)
        self.control: dict[str, str] = {}  # relayed control file -> its sealed bytes, base64
        self.own_end: dict | None = None
        self.client_due_at: float | None = None  # monotonic: when the client's silence will count as lost
        self.version = 0  # grows with every change the client should see
        self.progress_version = 0  # grows with every change of a rank's progress or of the reports
        self.own_progress: dict[str, list] = {}  # node 0's ranks' rows, by rank
        self.own_arrivals: dict[str, list] = {}  # node 0's ranks' latest collectives, by rank
        self.reports: list[list[float]] = []  # rank 0's trial reports, [[step, value], ...]
        self.dump = False  # the client asked for the ranks' stacks
        self._refused = False
        self._open: set[socket.socket] = set()  # the nodes' connections, closed with the hub
        hub = self

        class _Handler(socketserver.StreamRequestHandler):
            # A connection silent for a few node timeouts is dropped (a stranger's, or a lost node's).
            timeout = max(30.0, 3 * self.timeout) if math.isfinite(self.timeout) else None

            def handle(self) -> None:
                with hub._lock:
                    hub._open.add(self.connection)
                try:
                    while line := self.rfile.readline(_MAX_FRAME):
                        reply = hub._answer(line)
                        if reply is None:
                            return
                        self.wfile.write(reply)
                finally:
                    with hub._lock:
                        hub._open.discard(self.connection)

        class _Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self._server = _Server((host, 0), _Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.5}, daemon=True, name="sparkgpu-hub"
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def close(self) -> None:
        """Stops serving and drops every node's connection (as node 0's end would)."""
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            connections, self._open = list(self._open), set()
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue  # already closed by its node

    def begin(self) -> None:
        """Starts every node's silence clock now (the nodes start beating once the barrier is passed)."""
        with self._lock:
            now, wall = time.monotonic(), time.time()
            for member in self.members.values():
                if member.count == 0:
                    member.last_change, member.last_wall = now, wall

    def _answer(self, line: bytes) -> bytes | None:
        beat = _open(self.key, _place(self.attempt, "beat"), line)
        if beat is None:
            if not self._refused:
                self._refused = True
                report(f"node 0 of attempt {self.attempt} refused a beat not sealed with the job key")
            return None
        try:
            node, count = int(beat["node"]), int(beat["count"])
        except (KeyError, TypeError, ValueError):
            return None
        with self._lock:
            member = self.members.get(node)
            if member is None:
                return None
            if count > member.count and not member.lost:
                member.count, member.last_change, member.last_wall = count, time.monotonic(), time.time()
                ended = beat.get("ended")
                if isinstance(ended, dict) and member.ended is None:
                    member.ended = {"state": str(ended.get("state")), "exit_code": ended.get("exit_code")}
                    self.version += 1
                progress = beat.get("progress")
                if isinstance(progress, dict) and progress != member.progress:
                    member.progress = progress
                    self.progress_version += 1
                arrivals = beat.get("arrivals")
                if isinstance(arrivals, dict) and arrivals != member.arrivals:
                    member.arrivals = arrivals
                    self.progress_version += 1
            body: dict[str, object] = {"ack": count, "stop": list(self.stop) if self.stop else None}
            body["control"] = self.control
            if self.dump:
                body["dump"] = True
            if self.stop:
                body["stop_in"] = round(max(0.0, self.stop_at - time.monotonic()), 3)
            elif self.client_due_at is not None and time.monotonic() - self.client_due_at < _DUE_STALE:
                body["due_in"] = round(max(0.0, self.client_due_at - time.monotonic()), 3)
        return _frame(self.key, _place(self.attempt, "reply"), body)

    # -- node 0's decisions -------------------------------------------------------------
    def set_stop(self, state: NodeState, why: str, together: float = 0.0) -> None:
        """Tells every node to stop its ranks (the first reason stays), ``together`` seconds from
        now (:func:`together_delay`: long enough for every node to hear it first)."""
        with self._lock:
            if self.stop is None:
                self.stop = (state.value, why)
                self.stop_at = time.monotonic() + (together if self.members else 0.0)
                self.version += 1

    def foresee_client_loss(self, due_in: float | None) -> None:
        """Tells every node, in its next replies, that the client counts as lost ``due_in``
        seconds from now unless it beats (``None``: never)."""
        with self._lock:
            self.client_due_at = None if due_in is None else time.monotonic() + due_in

    def stop_due(self) -> tuple[str, str] | None:
        """The stop, once it applies; ``None`` before."""
        with self._lock:
            return self.stop if self.stop is not None and time.monotonic() >= self.stop_at else None

    def relay(self, files: dict[str, bytes]) -> None:
        """Hands the client's control files (sealed bytes, by name in the run dir) to every node."""
        packed = pack_files(files)
        with self._lock:
            self.control = packed

    def note_own(
        self, progress: dict[str, list], reports: list[list[float]], arrivals: dict[str, list] | None = None
    ) -> None:
        """Node 0's own ranks' progress rows, rank 0's trial reports and its ranks' arrivals, as last read."""
        arrivals = arrivals or {}
        with self._lock:
            if progress != self.own_progress or reports != self.reports or arrivals != self.own_arrivals:
                self.own_progress, self.reports, self.own_arrivals = progress, reports, arrivals
                self.progress_version += 1

    def ask_dump(self) -> None:
        """Tells every node, in its next replies, to dump its ranks' stacks."""
        with self._lock:
            self.dump = True

    def end_own(self, done: dict) -> None:
        with self._lock:
            self.own_end = done
            self.version += 1

    def check(self) -> None:
        """Counts nodes silent for longer than the timeout lost, and sets the stop a lost or failed node calls for."""
        now = time.monotonic()
        with self._lock:
            for node, member in self.members.items():
                if member.ended is None and not member.lost and now - member.last_change > self.timeout:
                    member.lost = True
                    self.version += 1
                    if self.stop is None:
                        silent = now - member.last_change
                        self.stop = (NodeState.PEER_LOST.value, f"node {node} sent no beat for {silent:.0f}s")
                        self.stop_at = now
            if self.stop is None:
                for node, member in self.members.items():
                    if member.ended is not None and member.ended["state"] != NodeState.SUCCEEDED.value:
                        self.stop = (NodeState.PEER_FAILED.value, f"node {node} ended {member.ended['state']}")
                        self.stop_at = now
                        self.version += 1
                        break

    def done(self) -> bool:
        """Whether every other node ended or is lost (node 0 may stop serving)."""
        with self._lock:
            return all(m.ended is not None or m.lost for m in self.members.values())

    def summary(self) -> dict:
        """The attempt's state as the client reads it (node 0's own end included; every rank's
        progress row, by rank; rank 0's trial reports)."""
        with self._lock:
            ended = {str(n): m.ended for n, m in self.members.items() if m.ended is not None}
            if self.own_end is not None:
                ended["0"] = self.own_end
            progress, arrivals = dict(self.own_progress), dict(self.own_arrivals)
            for member in self.members.values():
                progress.update(member.progress)
                arrivals.update(member.arrivals)
            return {
                "version": self.version,
                "progress_version": self.progress_version,
                "written_at": time.time(),
                "stop": list(self.stop) if self.stop else None,
                "ended": ended,
                "lost": {str(n): m.last_wall for n, m in self.members.items() if m.lost},
                "progress": progress,
                "arrivals": arrivals,
                "reports": list(self.reports),
            }


class HubLink:
    """A node's side: beats to node 0's hub and returns what it answered.

    Args:
        key: The job key.
        attempt: The attempt.
        node: This node.
        address: Node 0's ``(host, port)``.
        timeout: Seconds without an answer after which node 0 counts as lost.
    """

    def __init__(self, key: bytes, attempt: int, node: int, address: tuple[str, int], timeout: float):
        self.key, self.attempt, self.node, self.address, self.timeout = key, attempt, node, address, timeout
        self.count = 0
        self.last_answer = time.monotonic()
        self._sock: socket.socket | None = None
        self._file: io.BufferedReader | None = None

    def beat(
        self,
        ended: dict | None = None,
        progress: dict[str, list] | None = None,
        arrivals: dict[str, list] | None = None,
    ) -> dict | None:
        """One beat (saying how this node ended, when given, its ranks' progress rows and their
        latest collectives' arrivals); node 0's
        answer, or ``None`` if none came."""
        self.count += 1
        body: dict[str, object] = {"node": self.node, "count": self.count, "ended": ended}
        if progress is not None:
            body["progress"] = progress
        if arrivals:
            body["arrivals"] = arrivals
        try:
            if self._sock is None:
                self._sock = socket.create_connection(self.address, timeout=max(1.0, self.timeout / 4))
                self._file = self._sock.makefile("rb")
            self._sock.sendall(_frame(self.key, _place(self.attempt, "beat"), body))
            assert self._file is not None
            line = self._file.readline(_MAX_FRAME)
        except OSError:
            self.close()
            return None
        reply = _open(self.key, _place(self.attempt, "reply"), line)
        if reply is None or reply.get("ack") != self.count:
            self.close()  # a forged or stale answer: start over on a fresh connection
            return None
        self.last_answer = time.monotonic()
        return reply

    def silent_for(self) -> float:
        return time.monotonic() - self.last_answer

    @staticmethod
    def relayed(reply: dict) -> dict[str, bytes]:
        """The control files a reply hands on (sealed bytes, by name in the run dir)."""
        return unpack_files(reply.get("control"))[0]  # node 0 packed them: nothing malformed to report

    def close(self) -> None:
        for thing in (self._file, self._sock):
            if thing is not None:
                thing.close()
        self._sock = self._file = None
