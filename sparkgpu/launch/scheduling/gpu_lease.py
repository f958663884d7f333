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
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from sparkgpu._util.files import try_lock_file
from sparkgpu._util.report import report
from sparkgpu.errors import CapacityError
from sparkgpu.launch.scheduling.gpu_queue import GpuHolder, GpuQueue, QueueEntry
from sparkgpu.spec.priority import Priority, fewest_to_stop

__all__ = ["GpuLease", "lease_gpus", "lock_dir", "gpu_kind_of", "to_preempt", "waiting_jobs"]

_POLL_SECONDS = 0.5


def lock_dir() -> Path:
    """The machine's lease folder: ``SPARKGPU_GPU_LOCK_DIR``, else ``<tmp>/sparkgpu-gpus``."""
    from sparkgpu.config import settings

    folder = Path(settings().gpu_lock_dir or Path(tempfile.gettempdir()) / "sparkgpu-gpus")
    with contextlib.suppress(FileExistsError):
        folder.mkdir(parents=True)
        folder.chmod(0o1777)  # every user of the machine takes its GPUs here
    return folder


def waiting_jobs() -> dict[str, tuple[QueueEntry, int]]:
    """The jobs waiting in this host's GPU queue: job id -> (its entry, its 1-based place)."""
    return GpuQueue(lock_dir()).positions()


def gpu_kind_of(simulated: bool) -> str:
    """The kind of the host's GPUs a job uses: simulated GPUs' locks and queue are apart from real ones'."""
    return "simulated-gpu" if simulated else "gpu"


class GpuLease:
    """GPUs held by this process for one job; :meth:`release` gives them back."""

    def __init__(self, devices: tuple[str, ...], fds: list[int], holder: GpuHolder | None = None):
        self.devices, self._fds, self.holder = devices, fds, holder

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # releases its flock
        self._fds = []


def _try_all(folder: Path, gpu_kind: str, addresses: Sequence[str], count: int, holder: GpuHolder):
    """All or nothing: ``(lease, {})`` or ``(None, busy address -> its holder or None)``."""
    fds: list[int] = []
    devices: list[str] = []
    busy: dict[str, GpuHolder | None] = {}
    for address in addresses:
        if len(devices) == count:
            break
        path = folder / f"{gpu_kind}-{address}.lock"
        fd = try_lock_file(path, holder.to_json(), mode=0o666)  # every user of the machine locks it
        if fd is None:
            busy[address] = GpuHolder.read(path)
        else:
            fds.append(fd)
            devices.append(address)
    if len(devices) == count:
        return GpuLease(tuple(devices), fds, holder), {}
    for fd in fds:
        os.close(fd)  # never sit on some GPUs while waiting for others
    return None, busy


def to_preempt(busy: dict[str, GpuHolder | None], *, free: int, count: int) -> list[GpuHolder]:
    """The best-effort holders whose GPUs, with the ``free`` ones, make up ``count``: the fewest
    jobs, those holding most first; none when even all of them would not make it up (stopping
    them would idle their GPUs behind the normal or critical jobs that hold the rest)."""
    held: dict[GpuHolder, int] = {}
    for holder in busy.values():
        if holder is not None and holder.priority.preemptible:
            held[holder] = held.get(holder, 0) + 1
    ordered = sorted(held.items(), key=lambda item: (-item[1], item[0].job_id))
    return fewest_to_stop(ordered, free=free, need=count)


def lease_gpus(
    addresses: Sequence[str],
    count: int,
    job_id: str,
    *,
    wait: float | None,
    simulated: bool = False,
    priority: Priority = Priority.NORMAL,
    order: float | None = None,
) -> GpuLease:
    """Leases ``count`` of the host GPUs ``addresses``, waiting in the host's queue up to ``wait`` seconds.

    The job waits behind every live entry of a higher class or of its class that asked
    earlier (:mod:`sparkgpu.launch.scheduling.gpu_queue`); first in the queue, a ``critical`` job asks the
    ``best_effort`` jobs holding GPUs to checkpoint and stop.

    Args:
        addresses: The host's GPU addresses.
        count: How many the job needs.
        job_id: Written into each lock, so that a waiting job can say whose GPUs are busy.
        wait: Seconds to wait for enough free GPUs; ``None`` for as long as it takes.
        simulated: The GPUs are simulated (``SPARKGPU_SIMULATE_GPUS``): their locks are apart
            from real GPUs' ones.
        priority: The job's class.
        order: When the job first asked (its place within its class); now by default.

    Raises:
        CapacityError: fewer than ``count`` GPUs came free within ``wait``; names the busy ones
            and the jobs ahead in the queue.
    """
    folder = lock_dir()
    gpu_kind = gpu_kind_of(simulated)
    holder = GpuHolder(job_id, priority)
    queue = GpuQueue(folder)
    queue.enter(QueueEntry(job_id, priority, count, order if order is not None else time.time(), gpu_kind=gpu_kind))
    deadline = None if wait is None else time.monotonic() + wait
    said = ""
    try:
        while True:
            ahead = queue.ahead()
            busy: dict[str, GpuHolder | None] = {}
            if not ahead:
                lease, busy = _try_all(folder, gpu_kind, addresses, count, holder)
                if lease is not None:
                    return lease
                if priority is Priority.CRITICAL:
                    for gpu_holder in to_preempt(busy, free=len(addresses) - len(busy), count=count):
                        if queue.ask_to_give_way(gpu_holder):
                            report(
                                f"job {job_id} ({priority.value}) asks best-effort job {gpu_holder.job_id} to checkpoint and give way"
                            )
            listing = "; ".join(f"GPU {a}: {who or 'another job'}" for a, who in busy.items())
            waiting_for = (
                f"{len(ahead)} job(s) ahead in the queue ({', '.join(f'{e.job_id} ({e.priority.value})' for e in ahead)})"
                if ahead
                else f"busy: {listing}"
            )
            if deadline is not None and time.monotonic() >= deadline:
                raise CapacityError(
                    f"job {job_id} needs {count} of this host's {len(addresses)} GPUs but did not get them within "
                    f"{wait:g}s (SPARKGPU_SPARK_WAIT_TIMEOUT); {waiting_for}. Wait for those jobs, cancel one, ask "
                    "for fewer GPUs, or give the job a higher priority="
                )
            message = f"job {job_id} ({priority.value}) waits for {count} free GPUs; {waiting_for}"
            if message != said:
                report(message)
                said = message
            time.sleep(_POLL_SECONDS)
    finally:
        queue.leave()
