"""A detached sweep's keeper: ``python -m sparkgpu.sweeps.keeper SWEEP_ID``.

``sweep(..., detach=True)`` starts it in a session of its own (:class:`~sparkgpu.sweeps.api.DetachedSweep`)
and names it in the sweep's ``keeper.json``. It runs the sweep's driver in a child (a fork of the
keeper, which imported the sweep's code once: :mod:`sparkgpu._util.keeper`, as a detached job's
keeper runs its supervisor) and, should that child be killed before the sweep ended (SIGKILL, the
host's OOM killer), starts another, which resumes the sweep as ``sparkgpu sweep resume`` does: no
finished trial runs again, and the trials still running (detached jobs, which ran on meanwhile)
are found again by their idempotency keys. A driver that exited (the sweep ended, or it could not
be driven) is not replaced. The keeper ends with the sweep.

Processes and what each outlives::

    caller (notebook, script, CLI)       starts the sweep; may exit or be killed at any time
      keeper (own session)               restarts the driver; ends when the sweep ends
        driver (keeper's child)          asks Optuna, submits trials, holds driver.lock
          trials (detached jobs)         each kept by a keeper of its own; outlive the driver

Observers take a sweep whose keeper lives for running, and ``sparkgpu sweep resume`` refuses
it: only the keeper's own child drives a kept sweep. The keeper and its drivers write to
``driver.log`` in the sweep's folder; they read nothing secret (each trial's job key is made
and kept by the job's own submission).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from sparkgpu._util.keeper import Kept, keep
from sparkgpu.launch.backends.spark.sessions import close_channels
from sparkgpu.sweeps.folder import SweepFolder, find_sweep

__all__ = ["main", "drive"]

logger = logging.getLogger(__name__)


def drive(sweep_id: str) -> int:
    """Drives the sweep to its end here (the keeper's child); 0 once it ended, however it ended."""
    from sparkgpu.sweeps.api import resume_sweep
    from sparkgpu.sweeps.driver import SweepStoppedError

    try:
        result = resume_sweep(sweep_id)
    except SweepStoppedError as exc:  # an end of the sweep: it is in sweep.json
        logger.warning("%s", exc)
        return 0
    finally:
        close_channels()  # its trials' Spark cluster may be gone already: exit without calling it
    logger.info("sweep %s ended (stopped because: %s)", result.sweep_id, result.stopped_because)
    return 0


def _ended(folder: SweepFolder) -> bool:
    return bool(folder.read().get("finished_at"))


def main(argv: Sequence[str] | None = None) -> int:
    """Keeps the sweep ``SWEEP_ID`` (the only argument) until it ended."""
    args = list(sys.argv[1:] if argv is None else argv)
    os.umask(0o077)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s sparkgpu %(levelname)s %(message)s", stream=sys.stdout)
    if len(args) != 1:
        logger.error("usage: python -m sparkgpu.sweeps.keeper SWEEP_ID")
        return 2
    # Imported once, here: each driver forks with them.
    import optuna  # noqa: F401

    import sparkgpu.sweeps.api  # noqa: F401
    import sparkgpu.sweeps.driver  # noqa: F401

    folder = find_sweep(args[0])
    return keep(
        Kept(
            kind="sweep",
            name=folder.sweep_id,
            worker="driver",
            run=lambda: drive(folder.sweep_id),
            ended=lambda: _ended(folder),
            resume=f"sparkgpu sweep resume {folder.sweep_id}",
        )
    )


if __name__ == "__main__":
    sys.exit(main())
