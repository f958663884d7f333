"""How the Spark backend follows an attempt's nodes: lost ones, the stop of the others, the report.

A node is lost when it started and then fell silent (no heartbeat for ``node_timeout``, no
end marker), or when Spark names its executor lost. The others are then stopped through the
cancel marker (and the Spark job's tag), and the attempt's
:class:`~sparkgpu.launch.attempt_report.AttemptReport` says, per node, how it ended. A
:class:`~sparkgpu.launch.backends.spark.SparkBackend` holds one :class:`NodeWatch`, kept apart from its
session and submit logic: an object of its own, which reaches its backend through the
:class:`WatchOwner` interface only.
"""

from __future__ import annotations

import re
import time
from typing import Protocol, TextIO

from sparkgpu._report import report
from sparkgpu.launch.attempt_report import AttemptReport, NodeReport
from sparkgpu.launch.backends.spark_attempt import SparkAttempt, sync_now
from sparkgpu.launch.backends.spark_node import Heartbeat
from sparkgpu.protocol import NodeState
from sparkgpu.launch.run_dir import RunDir

__all__ = ["NodeWatch", "WatchOwner", "end_markers"]

#: How Spark names the executor it lost in a failed job's message.
_LOST_EXECUTOR = re.compile(r"ExecutorLostFailure \(executor (\S+?)[ )]|[Ee]xecutor (?:id )?(\S+?) (?:lost|exited)")


class WatchOwner(Protocol):
    """What a :class:`NodeWatch` needs of the backend that holds it (read when used: a test
    or a setting may change them after the watch was made)."""

    #: Seconds of silence after which a started node without an end marker is lost.
    node_timeout: float
    #: Seconds past the shutdown grace that a failed attempt waits for its nodes' end markers.
    node_stop_margin: float

    @property
    def stream(self) -> TextIO:
        """Where notices for the user go."""
        ...

    def interrupt(self, tag: str) -> None:
        """Interrupts the Spark job run under ``tag``."""
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
        """Counts started nodes lost that stopped beating for ``node_timeout`` without an end marker,
        or whose executor Spark names in ``named``; ``True`` when a node is newly lost.

        Only the first nodes to fall silent count by their silence: once Spark notices a lost
        executor it kills the barrier stage's other tasks, and their nodes fall silent after.
        """
        self._read_node_infos(handle)
        attempt_report = self._report_of(handle)
        known = {n.node for n in attempt_report.lost}
        found = False
        for node in handle.run_dir.nodes_without_end(handle.attempt):
            if node in known:
                continue
            beat = self._beat_of(handle, node)
            info = handle.node_infos.get(node, {})
            if str(info.get("executor")) in named:
                cause = "Spark reported its executor lost"
            elif not known and beat.lost():
                cause = f"no heartbeat from it for {beat.silent_for():.0f}s and no word on how its ranks ended"
            else:
                continue
            lost_at = time.time() - beat.silent_for()
            attempt_report.lost_at = min(attempt_report.lost_at or lost_at, lost_at)
            attempt_report.nodes.append(
                NodeReport(
                    node,
                    str(info.get("executor", "")),
                    str(info.get("host", "")),
                    NodeState.LOST,
                    self._ranks_of(handle, node),
                    cause=cause,
                )
            )
            found = True
        if found:
            self.write_report(handle)
        return found

    def _beat_of(self, handle: SparkAttempt, node: int) -> Heartbeat:
        beat = handle.beats.get(node)
        if beat is None:
            marker = handle.run_dir.node_marker(handle.attempt, node, "beat")
            # With a staging store, silence counts only while the store answers: a stall loses nobody.
            clock = handle.mirror.clock if handle.mirror is not None else time.monotonic
            beat = handle.beats[node] = Heartbeat(
                handle.run_dir, marker, self.owner.node_timeout, seen_first=True, clock=clock
            )
        return beat

    def stop_for_lost(self, handle: SparkAttempt) -> None:
        """A node is lost while the Spark job runs: stop the others' ranks and end the job now."""
        message = self._report_of(handle).lost_message()
        report(f"{message}; stopping the ranks of the other nodes", self.owner.stream)
        handle.run_dir.write_control(handle.run_dir.spark_cancel_file(handle.attempt), f"{message}\n".encode())
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
        per_node = handle.layout.ranks_per_node
        return list(range(node * per_node, (node + 1) * per_node))

    def stop_outliving_nodes(self, handle: SparkAttempt) -> None:
        """Stops the ranks of a failed Spark job and waits (bounded) until the nodes say they stopped.

        The Connect stream can break while the barrier tasks run on: without this, a restart
        would start the next attempt beside ranks still training on the same GPUs and
        checkpoint directory. A node that stops beating meanwhile is not waited for: it is lost.
        """
        rd, attempt = handle.run_dir, handle.attempt
        rd.write_control(rd.spark_cancel_file(attempt), b"the Spark job of this attempt failed\n")
        sync_now(handle)
        try:
            self.owner.interrupt(handle.tag)
        except Exception as exc:  # the broken stream may have taken the session with it
            self.note(
                handle,
                f"could not interrupt the Spark job ({type(exc).__name__}: {exc}); the nodes "
                "stop their ranks on the cancel marker",
            )
        named = tuple(name for found in _LOST_EXECUTOR.findall(str(handle.error or "")) for name in found if name)
        limit = handle.job.policy.shutdown_grace + self.owner.node_stop_margin
        deadline = time.monotonic() + limit
        running = rd.nodes_without_end(attempt)
        while running and time.monotonic() < deadline:
            time.sleep(0.2)
            sync_now(handle)  # with a store, the end markers arrive by pulls
            self.find_lost(handle, named)
            lost = {n.node for n in self._report_of(handle).lost}
            # A silent node is not waited for: lost, or its task was killed by Spark with its ranks.
            running = [
                n for n in rd.nodes_without_end(attempt) if n not in lost and not self._beat_of(handle, n).lost()
            ]
        if running:
            self.note(
                handle,
                f"node(s) {', '.join(map(str, running))} did not confirm within {limit:g}s that "
                "their ranks stopped (their executor may be lost); any rank left stops when it "
                "sees the cancel marker or loses this client's heartbeat",
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
        attempt_report.write(handle.run_dir.attempt_dir(handle.attempt))


def end_markers(run_dir: RunDir, attempt: int) -> dict[int, dict]:
    """The nodes' end markers (exit code, state), by node."""
    found = {}
    for node, path in run_dir.node_markers(attempt, "ended").items():
        marker = run_dir.read_control_json(path)
        if marker is not None:  # written atomically and sealed: absent, being replaced, or forged otherwise
            found[node] = marker
    return found
