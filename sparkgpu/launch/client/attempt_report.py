"""What a backend knows about how an attempt's nodes ended, beyond what the ranks wrote.

A backend whose nodes run out of the client's sight (Spark executors) writes one
:class:`AttemptReport` into the attempt's dir: per node its executor, host, state, exit code
and cause, the nodes it lost, and notes on the attempt (an executor that cannot see the run
dir, a staging store out of reach). The supervisor reads it back when it judges the attempt:
a lost node ends the attempt as :class:`~sparkgpu.errors.NodeLostError` naming its host.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.rundir.states import NodeState
from sparkgpu.rundir.layout import RunLayout

__all__ = ["AttemptReport", "NodeReport", "REPORT_FILE"]

#: In ``attempts/<k>/``: the backend's report on the attempt.
REPORT_FILE = RunLayout.REPORT


@dataclasses.dataclass
class NodeReport:
    """One node of an attempt, as the backend saw it end.

    Attributes:
        node: Node rank.
        executor: The executor that ran it (Spark's executor id).
        host: Host of that executor.
        state: How it ended: ``SUCCEEDED``, ``FAILED``, ``EXECUTOR_LOST`` (its executor or worker died:
            it stopped beating and never wrote how it ended), ``CANCELLED``, ...
        ranks: Global ranks the node ran.
        exit_code: Exit code of the node's agent, when known.
        signal: Signal that ended the agent, when known.
        cause: What the backend knows of why it ended that way.
    """

    node: int
    executor: str = ""
    host: str = ""
    state: NodeState = NodeState.UNKNOWN
    ranks: list[int] = dataclasses.field(default_factory=list)
    exit_code: int | None = None
    signal: int | None = None
    cause: str = ""

    def __post_init__(self) -> None:
        self.state = NodeState(self.state)  # as read back from the report's JSON

    @property
    def where(self) -> str:
        """``"executor 1 on host h"``."""
        return f"executor {self.executor or '?'} on host {self.host or '?'}"


@dataclasses.dataclass
class AttemptReport:
    """The backend's account of one attempt (see the module docstring).

    Attributes:
        attempt: Attempt number.
        nodes: One entry per node that started (or was lost).
        notes: Sentences for the user about the attempt as a whole.
        lost_at: Unix time the first lost node was last seen alive; billing ends there.
        bad: The executors that failed their pre-flight check (state ``BAD_NODE``, the failed
            checks in ``cause``); ``node`` is -1 for one that stood aside as a spare would.
    """

    attempt: int
    nodes: list[NodeReport] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    lost_at: float | None = None
    bad: list[NodeReport] = dataclasses.field(default_factory=list)

    def bad_message(self) -> str:
        """``"executor 1 on host h failed its pre-flight check: cache_disk: ..."``, one per bad executor."""
        return "; ".join(f"{n.where} failed its pre-flight check: {n.cause}" for n in self.bad)

    @property
    def lost(self) -> list[NodeReport]:
        """The nodes whose executor was lost."""
        return [n for n in self.nodes if n.state is NodeState.EXECUTOR_LOST]

    def lost_message(self) -> str:
        """``"executor 1 on host h was lost (...)"`` for each lost node, one sentence."""
        return "; ".join(f"{n.where} was lost ({n.cause})" if n.cause else f"{n.where} was lost" for n in self.lost)

    def write(self, attempt_dir: Path) -> None:
        atomic_write_bytes(Path(attempt_dir) / REPORT_FILE, json.dumps(dataclasses.asdict(self), indent=1).encode())

    @classmethod
    def read(cls, attempt_dir: Path) -> AttemptReport | None:
        """The report in ``attempt_dir``; ``None`` when the backend wrote none (or it is unreadable)."""
        try:
            data = json.loads((Path(attempt_dir) / REPORT_FILE).read_text())
            return cls(
                attempt=data["attempt"],
                nodes=[NodeReport(**n) for n in data.get("nodes", ())],
                notes=list(data.get("notes", ())),
                lost_at=data.get("lost_at"),
                bad=[NodeReport(**n) for n in data.get("bad", ())],
            )
        except (OSError, ValueError, KeyError, TypeError):  # none written (written atomically: never half)
            return None
