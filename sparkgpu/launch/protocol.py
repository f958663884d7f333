"""The run dir's protocol types, under the name the Spark node modules still import them by.

They live in :mod:`sparkgpu.protocol`, below the launcher, so that the callback interface
and its implementations (tracking, metering) use the same states. This module goes once
``launch.backends.spark``, ``.spark_node`` and ``.spark_node_watch`` import from there.
"""

from __future__ import annotations

from sparkgpu.protocol import (
    AttemptRecord,
    AttemptStatus,
    ClientInfo,
    JobState,
    JobStatus,
    ListedStatus,
    NodeExit,
    NodeState,
    RankExit,
    WaitingInfo,
)

__all__ = [
    "JobStatus",
    "AttemptStatus",
    "ListedStatus",
    "NodeState",
    "NodeExit",
    "RankExit",
    "JobState",
    "AttemptRecord",
    "ClientInfo",
    "WaitingInfo",
]
