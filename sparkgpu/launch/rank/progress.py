"""A rank's side of hang detection: its progress record, its stacks on request, NCCL's flight recorder.

:func:`watch_rank` runs once in the rank entrypoint, before any user code:

* it starts the rank's progress record (:mod:`sparkgpu.rundir.progress`) in
  ``attempts/<k>/progress/rank-<r>``; :func:`note` (the same as ``sparkgpu.rundir.progress.note``)
  is what the Trainer and Lightning patches, ``Checkpointer``, the loaders and
  ``runtime.heartbeat()`` call;
* it opens ``attempts/<k>/stacks/rank-<r>.txt``, writes a header naming the rank, its node,
  its pid and its main thread, and registers :mod:`faulthandler` on :data:`DUMP_SIGNAL`:
  the signal makes the interpreter write every thread's Python stack there from its C
  handler, whatever the main thread does (blocked in a collective's C code, sleeping, spinning
  in Python), with no help from the rank's Python code and without ptrace rights;
* it turns on torch's flight recorder for every backend (``TORCH_FR_BUFFER_SIZE``) and serves its
  dump whenever the stacks are asked for (:mod:`sparkgpu.launch.rank.flight_recorder`); for an
  NCCL job also NCCL's own recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``) and its dump on a
  watchdog timeout into the attempt's folder (``TORCH_NCCL_DUMP_ON_TIMEOUT``,
  ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``); a value the user set is kept.
* in a job whose supervisor looks for stragglers (:data:`~sparkgpu.launch.rank.arrivals.LOOK_ENV`
  set), the same thread rewrites the rank's latest collectives' arrivals every look
  (:mod:`sparkgpu.launch.rank.arrivals`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import IO

from sparkgpu.launch.rank import arrivals, flight_recorder
from sparkgpu.rundir import progress as _progress
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout

__all__ = [
    "DUMP_SIGNAL",
    "DUMP_MARKER",
    "DUMP_WAIT",
    "STACKS_HEADER",
    "note",
    "finish_progress",
    "watch_rank",
    "nccl_trace_env",
    "request_stacks",
]

#: The signal that makes a rank dump its threads' stacks into its stacks file.
DUMP_SIGNAL = signal.SIGUSR1
#: The header line of a rank's stacks file; the diagnosis finds the main thread by it.
STACKS_HEADER = "sparkgpu rank {rank} on node {node}, pid {pid}, main thread 0x{thread:016x}\n"
#: The line appended to a rank's stacks file before a dump is asked for; the dump follows it.
DUMP_MARKER = "--- sparkgpu asked for a dump of every thread's stack ---"
#: Most seconds :func:`request_stacks` waits for the ranks' stacks once it asked for them.
DUMP_WAIT = 3.0
#: A dump counts as whole once its file stopped growing for this long.
_SETTLED = 0.2
#: Entries of NCCL's flight recorder kept per rank: the same ring as every backend's recorder.
NCCL_TRACE_ENTRIES = flight_recorder.FR_ENTRIES

_logger = logging.getLogger(__name__)

note = _progress.note
finish_progress = _progress.finish

_stacks: IO[str] | None = None  # kept open: faulthandler writes to its descriptor from a signal handler


def nccl_trace_env(rd: RunDir, attempt: int, environ=None) -> dict[str, str]:
    """The flight recorder's variables for an NCCL rank that the environment does not set already."""
    environ = os.environ if environ is None else environ
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(NCCL_TRACE_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(rd.file(RunLayout.attempt(attempt)) / "nccl-trace" / "rank-"),
    }
    return {name: value for name, value in wanted.items() if not environ.get(name)}


def watch_rank(rd: RunDir, attempt: int, rank: int, node: int, nccl: bool) -> None:
    """Starts the rank's progress record and its stacks on request (see the module docstring)."""
    global _stacks
    _progress.start(rd.file(RunLayout.progress(attempt, rank)), node)
    path = Path(rd.file(RunLayout.stacks(attempt, rank)))
    path.parent.mkdir(parents=True, exist_ok=True)
    # Appending: the supervisor appends a marker before each dump it asks for, and the dump follows it.
    _stacks = open(path, "a", encoding="utf-8")
    thread = threading.main_thread().ident or 0
    _stacks.write(STACKS_HEADER.format(rank=rank, node=node, pid=os.getpid(), thread=thread))
    _stacks.flush()
    faulthandler.register(DUMP_SIGNAL, file=_stacks, all_threads=True, chain=False)
    os.environ.update(flight_recorder.recorder_env())  # read when the process group is made, after this
    out = Path(rd.file(RunLayout.flight_record(attempt, rank)))
    look = _arrivals_look()
    timed = (Path(rd.file(RunLayout.arrivals(attempt, rank))), look) if look else None
    flight_recorder.serve_dumps(path, out, "nccl" if nccl else "gloo", DUMP_MARKER, timed)
    if nccl:
        trace = nccl_trace_env(rd, attempt)
        if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in trace:
            Path(trace["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]).parent.mkdir(parents=True, exist_ok=True)
        os.environ.update(trace)  # read when the NCCL process group is made, after this


def _arrivals_look() -> float:
    """Seconds between two looks at the rank's arrivals (:data:`~sparkgpu.launch.rank.arrivals.LOOK_ENV`; 0: none)."""
    try:
        return max(0.0, float(os.environ.get(arrivals.LOOK_ENV) or 0))
    except ValueError:
        return 0.0


def request_stacks(rd: RunDir, attempt: int, pids: dict[int, int], wait: float = DUMP_WAIT) -> dict[int, str | None]:
    """Asks each rank of ``pids`` (rank -> pid, on this host) to dump its stacks and its flight
    recorder; returns the text of each rank's stacks file once its dump settled (``None``: no
    file, or nothing came). The flight recorder's dumps are at ``RunLayout.flight_record``: it
    waits for them too, within the same ``wait``.

    Whoever watches the ranks on their host calls it: the local supervisor, a Spark node.
    """
    paths = {rank: rd.file(RunLayout.stacks(attempt, rank)) for rank in pids}
    records = {rank: rd.file(RunLayout.flight_record(attempt, rank)) for rank in pids}
    asked: dict[int, int] = {}
    for rank, pid in pids.items():
        try:
            records[rank].unlink(missing_ok=True)  # the rank writes a fresh one on the marker
            with open(paths[rank], "a", encoding="utf-8") as out:
                out.write(f"\n{DUMP_MARKER}\n")
            asked[rank] = paths[rank].stat().st_size
            os.kill(pid, DUMP_SIGNAL)
        except (OSError, ProcessLookupError) as exc:
            _logger.warning("rank %d's stacks could not be asked for: %s", rank, exc)
            asked.pop(rank, None)
    deadline = time.monotonic() + wait
    sizes = {rank: (size, time.monotonic()) for rank, size in asked.items()}
    settled: set[int] = set()
    while time.monotonic() < deadline and (
        len(settled) < len(asked) or not all(records[rank].exists() for rank in asked)
    ):
        time.sleep(0.05)
        now = time.monotonic()
        for rank, start in asked.items():
            if rank in settled:
                continue
            with contextlib.suppress(OSError):
                size = paths[rank].stat().st_size
                if size != sizes[rank][0]:
                    sizes[rank] = (size, now)
                elif size > start and now - sizes[rank][1] >= _SETTLED:
                    settled.add(rank)
    found: dict[int, str | None] = {}
    for rank in pids:
        try:
            text = paths[rank].read_text(encoding="utf-8", errors="replace")
        except OSError:
            found[rank] = None
            continue
        found[rank] = text if rank in settled or DUMP_MARKER in text else None
    return found
