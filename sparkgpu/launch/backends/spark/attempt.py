"""One attempt of a job on Spark, as the client follows it: the Spark job's thread, its nodes' files.

Kept apart from :mod:`sparkgpu.launch.backends.spark.backend` (which submits it) and
:mod:`sparkgpu.launch.backends.spark.node_watch` (which follows its nodes), so that both use it
without importing each other.
"""

from __future__ import annotations

import dataclasses
import threading

from sparkgpu.launch.client.attempt_report import AttemptReport
from sparkgpu.launch.backends.base import AttemptHandle
from sparkgpu.launch.backends.spark.capacity import RankPlacement
from sparkgpu.launch.rundir.directory import RunDir
from sparkgpu.launch.rundir.staging import ClientMirror
from sparkgpu.spec import JobSpec

__all__ = ["SparkAttempt", "sync_now"]


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

    @property
    def nodes(self) -> list[dict]:
        """The node tasks' status rows (node, executor, host, devices, pid, exit_code, state)."""
        return [row.asDict() for row in self.rows or ()]


def sync_now(handle: SparkAttempt) -> None:
    """One sync with the staging store outside the background thread: a cancel marker must go up now."""
    if handle.mirror is not None:
        handle.mirror.try_sync(handle.attempt)
