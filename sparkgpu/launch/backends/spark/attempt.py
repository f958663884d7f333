"""One attempt of a job on Spark, as the client follows it: the Spark job's thread, its nodes' files,
and the watch over its nodes (lost ones, the stop of the others, the report).

A node is lost when it started and then fell silent: node 0 names it in the attempt's state
(no beat to node 0's hub for ``node_timeout``, :mod:`sparkgpu.launch.backends.spark.executor.hub`), the
other nodes name node 0 in their end markers (it stopped answering), or Spark names its
executor lost. The client reads those files only, never a beat of each node, so what it reads
does not grow with the node count. The others are then stopped through the cancel marker (and
the Spark job's tag), and the attempt's
:class:`~sparkgpu.launch.client.attempt_report.AttemptReport` says, per node, how it ended. A
:class:`~sparkgpu.launch.backends.spark.backend.SparkBackend` holds one :class:`NodeWatch`, kept apart from its
session and submit logic: an object of its own, which reaches its backend through the
:class:`WatchOwner` interface only.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from typing import Protocol, TextIO

from sparkgpu._util.report import report
from sparkgpu.launch.backends.base import AttemptHandle
from sparkgpu.launch.backends.spark.capacity import RankPlacement
from sparkgpu.launch.client.attempt_report import AttemptReport, NodeReport
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.launch.staging.mirror import ClientMirror
from sparkgpu.rundir.states import NodeState
from sparkgpu.spec import JobSpec

__all__ = ["NodeWatch", "SparkAttempt", "WatchOwner", "end_markers", "silent_nodes", "sync_now"]

#: How Spark names the executor it lost in a failed job's message.
#: Seconds, beyond the shutdown grace, that the client waits for the nodes of a Spark job it
#: interrupted to confirm that their ranks stopped (Spark kills the rest with their tasks).
KILLED_TASK_SECONDS = 5.0
_LOST_EXECUTOR = re.compile(r"ExecutorLostFailure \(executor (\S+?)[ )]|[Ee]xecutor (?:id )?(\S+?) (?:lost|exited)")


@dataclasses.dataclass
class SparkAttempt(AttemptHandle):
    """One attempt: a Spark job running in a background thread of the client."""

    attempt: int
    job: JobSpec
    run_dir: RunDir
    placement: RankPlacement
    tag: str
    submitted_at: float  # monotonic
    submitted_wall: float = 0.0
    thread: threading.Thread | None = None
    rows: list | None = None
    error: BaseException | None = None
    cancelled: bool = False
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)
    next_check: float = 0.0
    next_notice: float = 0.0
    nodes_started: bool = False
    started_at: float | None = None  # Unix time the barrier tasks got their GPUs and started
    exit_code: int | None = None
    mirror: ClientMirror | None = None  # with a staging store
    node_infos: dict[int, dict] = dataclasses.field(default_factory=dict)  # the nodes' start markers
    report: AttemptReport = dataclasses.field(init=False)  # written to the attempt's dir as it fills

    def __post_init__(self):
        self.report = AttemptReport(self.attempt)

    spares: int = 0  # tasks beyond the nodes, standing in for executors that failed pre-flight
    avoid: tuple[str, ...] = ()  # those executors

    @property
    def nodes(self) -> list[dict]:
        """The node tasks' status rows (node, executor, host, devices, pid, exit_code, state, detail),
        without the spare tasks that started nothing."""
        return [row for row in map(_as_dict, self.rows or ()) if row["state"] != NodeState.SPARE]


def _as_dict(row) -> dict:
    return row if isinstance(row, dict) else row.asDict()


def sync_now(handle: SparkAttempt) -> None:
    """One sync with the staging store outside the background thread: a cancel marker must go up now."""
    if handle.mirror is not None:
        handle.mirror.try_sync(handle.attempt)


class WatchOwner(Protocol):
    """What a :class:`NodeWatch` needs of the backend that holds it (read when used: a test
    or a setting may change them after the watch was made)."""

    #: Seconds past the shutdown grace that a failed attempt waits for its nodes' end markers.
    node_stop_margin: float
    #: Most seconds before node 0 sees the cancel marker.
    control_interval: float

    @property
    def stream(self) -> TextIO:
        """Where notices for the user go."""
        ...

    def interrupt(self, tag: str) -> None:
        """Interrupts the Spark job run under ``tag``."""
        ...

    def session_gone(self) -> bool:
        """Whether the Spark session is closed under the backend (its server restarted): the
        executors, and every node with them, are gone."""
        ...


class NodeWatch:
    """Follows an attempt's nodes for a backend: names the lost, stops the others, writes the report.

    Args:
        owner: The backend, through :class:`WatchOwner`.
    """

    def __init__(self, owner: WatchOwner):
        self.owner = owner

    @staticmethod
    def _report_of(handle: SparkAttempt) -> AttemptReport:
        """The attempt's report, which a SparkAttempt makes when it is created."""
        assert handle.report is not None
        return handle.report

    # -- lost nodes ---------------------------------------------------------------------
    def find_lost(self, handle: SparkAttempt, named: tuple[str, ...] = ()) -> bool:
        """Counts started nodes lost that node 0 (or, for node 0, another node) found silent without
        an end marker, or whose executor Spark names in ``named``; ``True`` when a node is newly lost.

        Only the first nodes to fall silent count by their silence: once Spark notices a lost
        executor it kills the barrier stage's other tasks, and their nodes fall silent after.
        """
        self._read_node_infos(handle)
        attempt_report = self._report_of(handle)
        known = {n.node for n in attempt_report.lost}
        ended = end_markers(handle.run_dir, handle.attempt)  # read once for both questions
        silent = silent_nodes(handle.run_dir, handle.attempt, ended)
        found = False
        for node in handle.run_dir.nodes_without_end(handle.attempt, ended):
            if node in known:
                continue
            info = handle.node_infos.get(node, {})
            if str(info.get("executor")) in named:
                cause, lost_at = "Spark reported its executor lost", time.time()
            elif not known and node in silent:
                cause, lost_at = silent[node]
            else:
                continue
            attempt_report.lost_at = min(attempt_report.lost_at or lost_at, lost_at)
            attempt_report.nodes.append(
                NodeReport(
                    node,
                    str(info.get("executor", "")),
                    str(info.get("host", "")),
                    NodeState.EXECUTOR_LOST,
                    self._ranks_of(handle, node),
                    cause=cause,
                )
            )
            found = True
        if found:
            self.write_report(handle)
        return found

    def stop_for_lost(self, handle: SparkAttempt) -> None:
        """A node is lost while the Spark job runs: stop the others' ranks and end the job now."""
        message = self._report_of(handle).lost_message()
        report(f"{message}; stopping the ranks of the other nodes", self.owner.stream)
        handle.run_dir.write_control(
            handle.run_dir.file(RunLayout.spark_cancel(handle.attempt)), f"{message}\n".encode()
        )
        sync_now(handle)
        try:
            self.owner.interrupt(handle.tag)  # Spark may wait for the lost executor's slots otherwise
        except Exception as exc:  # the session may be gone with the executor's host: the nodes stop on the marker
            self.note(handle, f"could not interrupt the Spark job ({type(exc).__name__}: {exc})")

    def _read_node_infos(self, handle: SparkAttempt) -> None:
        for node, info in handle.run_dir.started_nodes(handle.attempt).items():
            handle.node_infos.setdefault(node, info)

    @staticmethod
    def _ranks_of(handle: SparkAttempt, node: int) -> list[int]:
        per_node = handle.placement.ranks_per_node
        return list(range(node * per_node, (node + 1) * per_node))

    def stop_outliving_nodes(self, handle: SparkAttempt) -> None:
        """Stops the ranks of a failed Spark job and waits (bounded) until the nodes say they stopped.

        The Connect stream can break while the barrier tasks run on: without this, a restart
        would start the next attempt beside ranks still training on the same GPUs and
        checkpoint directory. A node that stops beating meanwhile is not waited for: it is lost.
        """
        rd, attempt = handle.run_dir, handle.attempt
        rd.write_control(rd.file(RunLayout.spark_cancel(attempt)), b"the Spark job of this attempt failed\n")
        sync_now(handle)
        interrupted = True
        try:
            self.owner.interrupt(handle.tag)
        except Exception as exc:  # the broken stream may have taken the session with it
            interrupted = False
            self.note(
                handle,
                f"could not interrupt the Spark job ({type(exc).__name__}: {exc}); the nodes "
                "stop their ranks on the cancel marker",
            )
        if self.owner.session_gone():
            return  # the server's executors ended with it, and the ranks with them: nobody to wait for
        named = tuple(name for found in _LOST_EXECUTOR.findall(str(handle.error or "")) for name in found if name)
        # Spark kills the tasks of a job it interrupted, their Python workers within its kill timeout
        # (spark.python.task.killTimeout, 2 s) and the agents and ranks with them (PR_SET_PDEATHSIG):
        # such a node writes no end marker, so only nodes that stop on their own are waited for.
        # Without the interrupt, the nodes stop on the cancel marker, which node 0 reads every
        # control interval.
        margin = KILLED_TASK_SECONDS if interrupted else self.owner.control_interval + self.owner.node_stop_margin
        limit = handle.job.policy.shutdown_grace + margin
        deadline = time.monotonic() + limit
        running = rd.nodes_without_end(attempt)
        while running and time.monotonic() < deadline:
            time.sleep(0.2)
            sync_now(handle)  # with a store, the end markers arrive by pulls
            self.find_lost(handle, named)
            # A silent node is not waited for: lost, or its task was killed by Spark with its ranks.
            ended = end_markers(rd, attempt)
            gone = {n.node for n in self._report_of(handle).lost} | set(silent_nodes(rd, attempt, ended))
            running = [n for n in rd.nodes_without_end(attempt, ended) if n not in gone]
        if running:
            self.note(
                handle,
                f"node(s) {', '.join(map(str, running))} did not confirm within {limit:g}s that "
                "their ranks stopped ("
                + (
                    "Spark killed their tasks when the job was interrupted"
                    if interrupted
                    else "their executor may be lost"
                )
                + "); any rank left stops when it sees the cancel marker or loses this client's heartbeat",
            )

    # -- the attempt's report -----------------------------------------------------------
    def note(self, handle: SparkAttempt, message: str) -> None:
        """A sentence for the user about the attempt, kept in its report."""
        self._report_of(handle).notes.append(message)
        self.write_report(handle)

    def write_report(self, handle: SparkAttempt, rows: list[dict] | None = None) -> None:
        """Writes the report; with the node tasks' ``rows`` (or their end markers) it is the final one."""
        attempt_report = self._report_of(handle)
        if rows is not None:
            attempt_report.bad = [
                NodeReport(
                    r["node"],
                    str(r["executor"]),
                    str(r["host"]),
                    NodeState.BAD_NODE,
                    self._ranks_of(handle, r["node"]) if r["node"] >= 0 else [],
                    exit_code=r["exit_code"],
                    cause=r.get("detail") or "",
                )
                for r in rows
                if r["state"] == NodeState.BAD_NODE
            ]
            rows = [r for r in rows if r["node"] >= 0]
            lost = {n.node: n for n in attempt_report.lost}
            by_node = {r["node"]: r for r in rows}
            ended = end_markers(handle.run_dir, handle.attempt)
            self._read_node_infos(handle)
            nodes = []
            for node in sorted(set(by_node) | set(ended) | set(handle.node_infos) | set(lost)):
                if node in lost:
                    nodes.append(lost[node])
                    continue
                row, end, info = by_node.get(node, {}), ended.get(node, {}), handle.node_infos.get(node, {})
                code = row.get("exit_code", end.get("exit_code"))
                state = NodeState(row.get("state", end.get("state", NodeState.UNKNOWN)))
                nodes.append(
                    NodeReport(
                        node,
                        str(row.get("executor", info.get("executor", ""))),
                        str(row.get("host", info.get("host", ""))),
                        state,
                        self._ranks_of(handle, node),
                        exit_code=code,
                        signal=-code if code is not None and code < 0 else None,
                    )
                )
            attempt_report.nodes = nodes
        attempt_report.write(handle.run_dir.file(RunLayout.attempt(handle.attempt)))


def silent_nodes(run_dir: RunDir, attempt: int, ended: dict[int, dict]) -> dict[int, tuple[str, float]]:
    """Nodes found silent, by node: why, and when they were last heard of (Unix time).

    Node 0 names the nodes that stopped beating to it in the attempt's state; a node whose
    beats node 0 stopped answering names node 0 in its end marker (``ended``: :func:`end_markers`).
    """
    found: dict[int, tuple[str, float]] = {}
    state = run_dir.read_control_json(run_dir.file(RunLayout.spark_state(attempt)))
    for node, last in (state.get("lost") or {}).items() if isinstance(state, dict) else ():
        try:
            found[int(node)] = ("node 0 heard no beat from it and no word on how its ranks ended", float(last))
        except (TypeError, ValueError):
            continue
    for node, marker in ended.items():
        for peer in marker.get("lost") or () if isinstance(marker, dict) else ():
            if isinstance(peer, int) and peer not in found:
                found[peer] = (f"node {node} heard nothing from it and it said nothing of its ranks", time.time())
    return found


def end_markers(run_dir: RunDir, attempt: int) -> dict[int, dict]:
    """The nodes' end markers (exit code, state), by node."""
    found = {}
    for node, path in run_dir.node_markers(attempt, "ended").items():
        marker = run_dir.read_control_json(path)
        if marker is not None:  # written atomically and sealed: absent, being replaced, or forged otherwise
            found[node] = marker
    return found
