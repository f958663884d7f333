"""Environment shipping: snapshot the client's packages and code, stage them, rehydrate on workers.

Client::

    from sparkgpu.env import stage_environment
    staged = stage_environment()          # snapshot + upload what the store lacks
    staged.manifest                       # hand it to the workers (signed with the job)
    print(staged.report)                  # bytes and seconds per step

Worker (standard library only, loadable by file path: see :func:`hydrate_module_path`)::

    overlay = hydrate_environment(manifest, cache_dir)
    activate(overlay)                     # overlay first on sys.path and PYTHONPATH
"""

from __future__ import annotations

from pathlib import Path

from sparkgpu.env.hydrate import (
    EnvironmentMismatchError as WorkerEnvironmentMismatchError,
    HydrationError,
    HydrationReport,
    Overlay,
    activate,
    check_compatibility,
    describe_interpreter,
    probe,
)
from sparkgpu.env.hydrate import hydrate as hydrate_environment  # the module keeps its name: sparkgpu.env.hydrate
from sparkgpu.env.snapshot import Component, Excluded, Snapshot, parse_worker_has, snapshot_environment
from sparkgpu.env.stage import StagedEnvironment, StageReport, StepReport, check_size, stage_environment, stage_snapshot
from sparkgpu.env.store import BlobStore

__all__ = [
    "snapshot_environment",
    "stage_environment",
    "stage_snapshot",
    "check_size",
    "parse_worker_has",
    "Snapshot",
    "Component",
    "Excluded",
    "StagedEnvironment",
    "StageReport",
    "StepReport",
    "BlobStore",
    "hydrate_environment",
    "activate",
    "probe",
    "describe_interpreter",
    "check_compatibility",
    "Overlay",
    "HydrationReport",
    "HydrationError",
    "WorkerEnvironmentMismatchError",
    "hydrate_module_path",
]


def hydrate_module_path() -> Path:
    """The file of :mod:`sparkgpu.env.hydrate`, to copy next to a worker's entrypoint."""
    return Path(__file__).with_name("hydrate.py")
