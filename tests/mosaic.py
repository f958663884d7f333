"""Mosaic Streaming's reader opened as the suite's parallel workers need it."""

from __future__ import annotations

import fcntl
import os
import tempfile

_LOCK = os.path.join(tempfile.gettempdir(), "sparkgpu-tests-mosaic-shm.lock")


def streaming_dataset(**kwargs):
    """``streaming.StreamingDataset(**kwargs)``, opened while no other test process opens one.

    Mosaic names a dataset's shared memory by the first free number it finds under ``/dev/shm``
    and then creates it: two processes that open a dataset at the same moment find the same
    number, and the second fails with ``FileExistsError`` (the ranks of one job take turns by a
    barrier; the suite's workers are separate jobs). For tests outside a job's ranks.
    """
    from streaming import StreamingDataset

    with open(_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return StreamingDataset(**kwargs)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
