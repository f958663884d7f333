"""Environment shipping: snapshot the client's packages and code, stage them, rehydrate on workers.

Client::

    from sparkgpu.env import stage_environment
    staged = stage_environment()          # snapshot + upload what the store lacks
    staged.manifest                       # hand it to the workers (signed with the job)
    print(staged.report)                  # bytes and seconds per step

Worker (standard library only, loadable by file path: see :func:`worker_bootstrap_files`)::

    overlay = hydrate_environment(manifest, cache_dir)
    activate(overlay)                     # overlay first on sys.path and PYTHONPATH
"""

from __future__ import annotations

from pathlib import Path

from sparkgpu.env.hydrate import (
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
from sparkgpu.errors import EnvironmentMismatchError, HydrationError
from sparkgpu.rundir.layout import RunLayout

# The name this package gave the workers' mismatch when it had a class of its own; it is the
# one EnvironmentMismatchError now, raised on the client and on the workers alike.
WorkerEnvironmentMismatchError = EnvironmentMismatchError

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
    "worker_bootstrap_files",
]


def hydrate_module_path() -> Path:
    """The file of :mod:`sparkgpu.env.hydrate`, to copy next to a worker's entrypoint."""
    return Path(__file__).with_name("hydrate.py")


def worker_bootstrap_files() -> dict[str, bytes]:
    """The files a run dir needs beside ``_air.py`` to rehydrate the environment on a worker.

    ``_hydrate.py`` (:mod:`sparkgpu.env.hydrate`) and ``_errors.py`` (:mod:`sparkgpu.errors`,
    whose classes hydration raises): both use the standard library only, as they run before
    the overlay that may bring sparkgpu itself.
    """
    return {
        RunLayout.HYDRATE: hydrate_module_path().read_bytes(),
        RunLayout.ERRORS: Path(__file__).parent.parent.joinpath("errors.py").read_bytes(),
    }
