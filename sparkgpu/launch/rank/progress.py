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
* for an NCCL job it turns on torch's NCCL flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``)
  and its dump on a watchdog timeout into the attempt's folder (``TORCH_NCCL_DUMP_ON_TIMEOUT``,
  ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``); a value the user set is kept.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
from pathlib import Path
from typing import IO

from sparkgpu.rundir import progress as _progress
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout

__all__ = ["DUMP_SIGNAL", "STACKS_HEADER", "note", "finish_progress", "watch_rank", "nccl_trace_env"]

#: The signal that makes a rank dump its threads' stacks into its stacks file.
DUMP_SIGNAL = signal.SIGUSR1
#: The header line of a rank's stacks file; the diagnosis finds the main thread by it.
STACKS_HEADER = "sparkgpu rank {rank} on node {node}, pid {pid}, main thread 0x{thread:016x}\n"
#: Entries of NCCL's flight recorder kept per rank (its ring buffer of collectives).
NCCL_TRACE_ENTRIES = 2000

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
    if nccl:
        trace = nccl_trace_env(rd, attempt)
        if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in trace:
            Path(trace["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]).parent.mkdir(parents=True, exist_ok=True)
        os.environ.update(trace)  # read when the NCCL process group is made, after this
