"""Names in a run dir that the ranks, tracking and the environment use as well as the launcher.

:class:`sparkgpu.rundir.layout.RunLayout` spells every path of a run dir; these are also
used by parts that must not import the launcher (:mod:`sparkgpu.runtime` looks for the stop
file, tracking spools into the tracking folder, :mod:`sparkgpu.env` ships the hydration
files), so they live here, below both. ``_errors.py`` is also spelled in
:mod:`sparkgpu.env.hydrate`, which runs on a worker before sparkgpu can be imported.
"""

from __future__ import annotations

__all__ = [
    "STOP_FILE",
    "TRACKING_DIR",
    "TRACKING_RUN_FILE",
    "TRACKING_RECORDS_DIR",
    "HYDRATE_FILE",
    "ERRORS_FILE",
]

STOP_FILE = "STOP"  # written into attempts/<k>/ by the supervisor to ask ranks to checkpoint and stop
TRACKING_DIR = "tracking"  # the run dir's folder of the job's tracking run and spooled records
TRACKING_RUN_FILE = "run.json"  # in TRACKING_DIR: the job's tracking run
TRACKING_RECORDS_DIR = "records"  # in TRACKING_DIR: the ranks' spooled records
HYDRATE_FILE = "_hydrate.py"  # sparkgpu.env.hydrate, shipped beside _air.py with the environment
ERRORS_FILE = "_errors.py"  # sparkgpu.errors, shipped beside it (hydration raises its classes)
