"""Which of this host's GPUs a local job may use: one ``flock`` per GPU, machine-wide.

Two local jobs, from one process or from two users' notebooks on the same machine, never share
a GPU: a job leases the GPUs it runs on (the first free ones, not always ``0..n-1``) for as
long as it runs, its attempts included, and a second job that does not fit waits for GPUs to
come free, saying which are busy and whose they are, as a Spark job waits for busy executors,
then fails with :class:`~sparkgpu.errors.CapacityError` naming them. The locks live in one
folder per machine (``<tmp>/sparkgpu-gpus``, mode 1777) and go with their process however it
ends.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from sparkgpu._files import try_lock_file
from sparkgpu._report import report
from sparkgpu.errors import CapacityError

__all__ = ["GpuLease", "lease_gpus"]

_POLL_SECONDS = 0.5


def _lock_dir() -> Path:
    folder = Path(tempfile.gettempdir()) / "sparkgpu-gpus"
    with contextlib.suppress(FileExistsError):
        folder.mkdir()
        folder.chmod(0o1777)  # every user of the machine takes its GPUs here
    return folder


class GpuLease:
    """GPUs held by this process for one job; :meth:`release` gives them back."""

    def __init__(self, devices: tuple[str, ...], fds: list[int]):
        self.devices, self._fds = devices, fds

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # releases its flock
        self._fds = []


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "another job"
    except OSError:
        return "another job"


def lease_gpus(addresses: Sequence[str], count: int, job_id: str, *, wait: float, simulated: bool = False) -> GpuLease:
    """Leases ``count`` of the host GPUs ``addresses``, waiting up to ``wait`` seconds for them.

    Args:
        addresses: The host's GPU addresses.
        count: How many the job needs.
        job_id: Written into each lock, so that a waiting job can say whose GPUs are busy.
        wait: Seconds to wait for enough free GPUs.
        simulated: The GPUs are simulated (``SPARKGPU_SIMULATE_GPUS``): their locks are apart
            from real GPUs' ones.

    Raises:
        CapacityError: fewer than ``count`` GPUs came free within ``wait``; names the busy ones.
    """
    folder = _lock_dir()
    prefix = "simulated-gpu" if simulated else "gpu"
    holder = f"{job_id} (pid {os.getpid()} on {socket.gethostname()}, user {os.getuid()})\n"
    deadline = time.monotonic() + wait
    said = False
    while True:
        fds: list[int] = []
        devices: list[str] = []
        busy: dict[str, str] = {}
        for address in addresses:
            if len(devices) == count:
                break
            path = folder / f"{prefix}-{address}.lock"
            fd = try_lock_file(path, holder, mode=0o666)  # every user of the machine locks it
            if fd is None:
                busy[address] = _holder(path)
            else:
                fds.append(fd)
                devices.append(address)
        if len(devices) == count:
            return GpuLease(tuple(devices), fds)
        for fd in fds:
            os.close(fd)  # all or nothing: never sit on some GPUs while waiting for others
        listing = "; ".join(f"GPU {a}: {who}" for a, who in busy.items())
        if time.monotonic() >= deadline:
            raise CapacityError(
                f"job {job_id} needs {count} of this host's {len(addresses)} GPUs but only {len(addresses) - len(busy)} "
                f"came free within {wait:g}s (SPARKGPU_SPARK_WAIT_TIMEOUT); busy: {listing}. Wait for those jobs, "
                "cancel one, or ask for fewer GPUs"
            )
        if not said:
            report(f"job {job_id} waits for {count} free GPUs; busy: {listing}")
            said = True
        time.sleep(_POLL_SECONDS)
