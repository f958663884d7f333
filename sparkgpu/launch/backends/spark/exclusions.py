"""Executors that failed their pre-flight check, kept out of this client's jobs for a while.

A Spark barrier stage cannot be pinned away from an executor, and Spark's own
``spark.excludeOnFailure`` learns only from task sets that succeed (a barrier stage that
fails is re-run whole), so sparkgpu keeps its own list: each executor that failed the check,
with its host and the failed checks, for ``SPARKGPU_PREFLIGHT_EXCLUDE`` (1 hour by default, as
Spark's ``spark.excludeOnFailure.timeout``). It is per cluster (the session's Connect URL) and
per client process: every job this process runs on that cluster leaves those executors out
(:func:`stand_ins`), through spare tasks
(:mod:`~sparkgpu.launch.backends.spark.executor.seating`). An executor replaced by the cluster
comes back under a new id, and so is not kept out.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from sparkgpu.config import settings
from sparkgpu.errors import PreflightError

__all__ = ["Excluded", "exclude", "excluded", "stand_ins", "forget"]


@dataclasses.dataclass(frozen=True)
class Excluded:
    """One executor kept out: its host, what failed, and until when (monotonic seconds)."""

    executor: str
    host: str
    cause: str
    until: float

    @property
    def where(self) -> str:
        return f"executor {self.executor} on host {self.host}"


_lock = threading.Lock()
_by_cluster: dict[str, dict[str, Excluded]] = {}


def exclude(cluster: str, executor: str, host: str, cause: str) -> Excluded:
    """Keeps ``executor`` of ``cluster`` out for ``SPARKGPU_PREFLIGHT_EXCLUDE`` from now."""
    entry = Excluded(executor, host, cause, time.monotonic() + settings().preflight_exclude_seconds)
    with _lock:
        _by_cluster.setdefault(cluster, {})[executor] = entry
    return entry


def excluded(cluster: str) -> list[Excluded]:
    """The executors of ``cluster`` kept out now."""
    now = time.monotonic()
    with _lock:
        kept = {e: x for e, x in _by_cluster.get(cluster, {}).items() if x.until > now}
        _by_cluster[cluster] = kept
        return list(kept.values())


def forget(cluster: str | None = None) -> None:
    """Lets every executor (of ``cluster``, or of all) back in."""
    with _lock:
        if cluster is None:
            _by_cluster.clear()
        else:
            _by_cluster.pop(cluster, None)


def stand_ins(cluster: str, capacity, gpus_per_node: int, nodes: int, job_id: str) -> tuple[tuple[str, ...], int]:
    """The executors an attempt of ``nodes`` nodes avoids, and the spare tasks it runs for them.

    Args:
        capacity: The cluster's :class:`~sparkgpu.launch.backends.spark.capacity.SparkCapacity`:
            only excluded executors still in it need a spare, one per node slot they hold.

    Raises:
        PreflightError: without them the cluster has too few node slots for the job (and it
            cannot grow: no dynamic allocation); it names them and the fix.
    """
    kept = {x.executor: x for x in excluded(cluster)}
    present = [e for e in capacity.executors if e.executor_id in kept]
    if not present:
        return (), 0
    spares = sum(capacity.executor_slots(e, gpus_per_node) for e in present)
    left = capacity.node_slots(gpus_per_node) - spares
    if left < nodes and not capacity.dynamic_allocation:
        named = "; ".join(f"{kept[e.executor_id].where} failed it: {kept[e.executor_id].cause}" for e in present)
        raise PreflightError(
            f"without the executors that failed their pre-flight check ({named}) the cluster has {left} node "
            f"slot(s) for the job's {nodes}: repair them (restarting an executor's worker gives it a new id) or "
            f"add executors, then `sparkgpu resume {job_id}`; SPARKGPU_PREFLIGHT_EXCLUDE sets how long a failed "
            "executor stays out (default 1h)",
            replaceable=False,
        )
    return tuple(e.executor_id for e in present), spares
