"""Names in a run dir that the ranks and tracking use as well as the launcher.

:class:`sparkgpu.launch.run_layout.RunLayout` spells every path of a run dir; these two are
also read on the user's side of the job (:mod:`sparkgpu.runtime` looks for the stop file,
tracking spools into the tracking folder), which must not import the launcher, so they live
here, below both.
"""

from __future__ import annotations

__all__ = ["STOP_FILE", "TRACKING_DIR"]

STOP_FILE = "STOP"  # written into attempts/<k>/ by the supervisor to ask ranks to checkpoint and stop
TRACKING_DIR = "tracking"  # the run dir's folder of the job's tracking run and spooled records
