"""A rank's side of torch's flight recorder: turned on for every backend, dumped when the stacks are.

torch records each collective a process group runs in a ring buffer (its "flight recorder":
sequence number, operation, sizes, state) once ``TORCH_FR_BUFFER_SIZE`` is set before the
group is made; NCCL's watchdog dumps it on a timeout of its own (``TORCH_NCCL_DUMP_ON_TIMEOUT``,
set in :func:`~sparkgpu.launch.rank.progress.watch_rank`). sparkgpu usually finds a hang long
before NCCL's timeout (``progress_timeout``), and gloo has no such dump, so the rank serves one
itself: :func:`serve_dumps` starts a daemon thread that looks at the rank's stacks file four
times a second (one ``stat``), and when the supervisor appended a dump request to it
(:data:`~sparkgpu.launch.rank.progress.DUMP_MARKER`) writes the recorder's JSON to
``attempts/<k>/flight-recorder/rank-<r>.json``. A thread can dump while the main thread is
blocked in a collective: torch releases the GIL there.

The dump names the last collective the rank issued and whether it completed, which is what
tells the rank that is behind from the ranks that wait for it
(:mod:`sparkgpu.launch.client.flight_record` reads it).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.launch.rank.arrivals import write_arrivals

__all__ = ["FR_ENTRIES", "recorder_env", "serve_dumps", "dump"]

#: Entries of the flight recorder kept per rank (its ring buffer of collectives).
FR_ENTRIES = 2000
#: Seconds between two looks at the stacks file for a dump request.
_LOOK = 0.25

_logger = logging.getLogger(__name__)


def recorder_env(environ=None) -> dict[str, str]:
    """The flight recorder's variable for any backend, where the environment does not set it already."""
    environ = os.environ if environ is None else environ
    return {} if environ.get("TORCH_FR_BUFFER_SIZE") else {"TORCH_FR_BUFFER_SIZE": str(FR_ENTRIES)}


def dump(backend: str) -> dict:
    """This process's flight recorder as torch writes it (``entries``, ``pg_config``, ``pg_status``, ...),
    or ``{"error": ...}`` saying why there is none."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return {"error": "the rank had no process group yet"}
    try:
        from torch._C import _distributed_c10d as c10d

        if backend == "nccl" and hasattr(c10d, "_dump_nccl_trace_json"):
            text = c10d._dump_nccl_trace_json(True, False)
        else:
            text = c10d._dump_fr_trace_json(True, False)  # type: ignore[attr-defined]
        return json.loads(text)
    except Exception as exc:  # a torch without the recorder, or one that refused: said in the file
        return {"error": f"torch's flight recorder could not be dumped: {type(exc).__name__}: {exc}"}


def serve_dumps(
    stacks: Path, out: Path, backend: str, marker: str, arrivals: tuple[Path, float] | None = None
) -> threading.Thread:
    """Starts the daemon thread that writes ``out`` each time ``marker`` is appended to ``stacks``,
    and, with ``arrivals`` (a path and seconds), rewrites that path with the rank's latest
    arrivals every so many seconds (:mod:`sparkgpu.launch.rank.arrivals`)."""
    thread = threading.Thread(
        target=_serve, args=(stacks, out, backend, marker, arrivals), name="sparkgpu-flight-recorder", daemon=True
    )
    thread.start()
    return thread


def _serve(stacks: Path, out: Path, backend: str, marker: str, arrivals: tuple[Path, float] | None) -> None:
    try:
        seen = stacks.stat().st_size
    except OSError:
        seen = 0
    next_arrivals = time.monotonic() + (arrivals[1] if arrivals else 0.0)
    while True:
        time.sleep(_LOOK)
        try:
            if arrivals is not None and time.monotonic() >= next_arrivals:
                next_arrivals = time.monotonic() + arrivals[1]
                try:
                    write_arrivals(arrivals[0], backend)
                except OSError:
                    raise
                except Exception as exc:  # a torch whose recorder cannot be read: no straggler figures
                    _logger.warning(
                        "rank's collectives cannot be timed for stragglers: %s: %s", type(exc).__name__, exc
                    )
                    arrivals = None
            size = stacks.stat().st_size
            if size <= seen:
                continue
            with open(stacks, "rb") as handle:
                handle.seek(seen)
                added = handle.read(size - seen)
            seen = size
            if marker.encode() not in added:
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(out, json.dumps(dump(backend)).encode(), fsync=False)
        except OSError as exc:  # the run dir went away (the attempt ended): nothing left to serve
            _logger.debug("flight recorder dumps stop: %s", exc)
            return
