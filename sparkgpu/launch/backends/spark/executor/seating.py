"""Which of an attempt's barrier tasks become its nodes: the pre-flight check and spare tasks.

Before anything else, each node task runs the node's pre-flight check
(:func:`~sparkgpu.launch.node.preflight.run_preflight`) unless the job turned it off.

An attempt normally has one task per node, and task ``i`` is node ``i``; a task that fails
the check ends ``BAD_NODE`` and, at the barrier's exchange, no node starts a rank. A Spark
barrier stage cannot be told to leave an executor out, so after an executor failed the check
the client runs the next attempts with spare tasks, one per such executor still in the
cluster (:class:`~sparkgpu.launch.backends.spark.executor.node_launch.NodeLaunch` ``spares``
and ``avoid``). Then the tasks first exchange what they found: the tasks that passed, on
executors not avoided, become nodes 0..N-1 in task order; the others start nothing (``SPARE``,
or ``BAD_NODE`` with the failed checks). Every task decides from the same exchange, so all
take the same number of barrier steps, as Spark requires.
"""

from __future__ import annotations

import dataclasses
import json

from sparkgpu.launch.backends.spark.executor.node_launch import NodeLaunch
from sparkgpu.launch.node.preflight import PreflightReport, run_preflight
from sparkgpu.rundir.states import NodeState

__all__ = ["Seat", "take_seat"]


@dataclasses.dataclass(frozen=True)
class Seat:
    """What one task is in its attempt.

    Attributes:
        node: Its node rank; ``None`` when it starts nothing.
        state: ``BAD_NODE`` when its check failed, ``SPARE`` or ``PEER_NOT_READY`` when it starts
            nothing for another reason; ``None`` for a task that goes on as a node.
        detail: The failed checks, for ``BAD_NODE``.
        exchanges: Whether a task that starts nothing still takes the barrier's second step
            (the nodes' exchange of ports), as it must when the others do.
    """

    node: int | None
    state: NodeState | None = None
    detail: str = ""
    exchanges: bool = False


def _check(launch: NodeLaunch, devices: tuple[str, ...]) -> PreflightReport | None:
    return run_preflight(launch.env, devices, simulated=launch.simulated) if launch.preflight else None


def take_seat(ctx, launch: NodeLaunch, executor_id: str, devices: tuple[str, ...]) -> Seat:
    """Runs this task's check and decides its seat (see the module docstring); ``ctx`` is the
    task's ``BarrierTaskContext``."""
    checked = _check(launch, devices)
    bad = checked is not None and not checked.ok
    detail = checked.reason() if checked is not None and bad else ""
    task = ctx.partitionId()
    if not launch.spares:
        return Seat(task, NodeState.BAD_NODE if bad else None, detail)
    found = [json.loads(m) for m in ctx.allGather(json.dumps({"executor": executor_id, "ok": not bad}))]
    fit = [i for i, m in enumerate(found) if m["ok"] and m["executor"] not in launch.avoid]
    short = len(fit) < launch.nnodes
    if not short and task in fit[: launch.nnodes]:
        return Seat(fit.index(task))
    state = NodeState.BAD_NODE if bad else NodeState.PEER_NOT_READY if short else NodeState.SPARE
    return Seat(None, state, detail, exchanges=not short)
