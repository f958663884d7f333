"""The one process that supervises a job: an exclusive ``flock`` on the run dir's ``supervision.lock``.

Every way a job gets a supervisor takes it: ``.distributed()`` and ``submit()`` when they start,
:func:`sparkgpu.attach` when it takes over a job whose client is gone, and ``sparkgpu resume``.
Two of them never run attempts side by side in one run dir. The lock goes with its process
however that ends (the kernel releases a ``flock`` with the last descriptor), so a killed client
never leaves a job locked; the descriptor is not inherited by the ranks.
"""

from __future__ import annotations

import os
import socket

from sparkgpu._util.files import try_lock_file
from sparkgpu.rundir.directory import PRIVATE_FILE, RunDir
from sparkgpu.rundir.layout import RunLayout

__all__ = ["SupervisionLock"]


class SupervisionLock:
    """The supervision lock of ``run_dir``; :meth:`acquire` it before supervising, :meth:`release` after."""

    def __init__(self, run_dir: RunDir):
        self.path = run_dir.path / RunLayout.SUPERVISION_LOCK
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> bool:
        """Takes the lock without waiting; False if another process (or another object) holds it."""
        if self._fd is not None:
            return True
        self._fd = try_lock_file(self.path, f"pid {os.getpid()} on {socket.gethostname()}\n", PRIVATE_FILE)
        return self._fd is not None

    def holder(self) -> str:
        """Who holds the lock, as its holder wrote it (``"pid 123 on host"``), or ``"another process"``."""
        try:
            return self.path.read_text().strip() or "another process"
        except OSError:
            return "another process"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None
