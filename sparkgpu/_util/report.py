"""What sparkgpu shows the person running a job, as opposed to what it logs.

The library has two ways out, and this module is the one that decides where the first goes:

- :func:`report`: a line the user must see where the job runs (a notebook cell, a terminal):
  progress and waiting, restarts, decisions taken on their behalf (data read in place or
  converted, an environment staged, a job taken over or cancelled at exit), and what a rank,
  node or warm-pool process says about itself, whose stderr is the log the client streams back or
  the user reads when it fails. Ranks' own output, copied back line by line, goes to
  :func:`console`.
- ``logging.getLogger(__name__)``, under the ``sparkgpu`` logger: diagnostics of work the job
  survives on its own (a usage ledger that is down and written later). The package installs a
  ``NullHandler`` only, so they stay silent until the application configures logging.

The command-line modules print their own output and use neither.
"""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["PREFIX", "console", "report"]

PREFIX = "sparkgpu: "


def report(message: str, out: TextIO | None = None) -> None:
    """Shows the user one line, prefixed ``sparkgpu:``, and flushes it at once.

    Args:
        message: The line, without the prefix; it may span lines (a log tail).
        out: A stream the caller was given for its user-facing lines (a backend's ``out``);
            this process's stderr, as it is at the call, by default (a notebook replaces it
            per cell, and a rank's or node's stderr is its log file).
    """
    stream = out if out is not None else sys.stderr
    stream.write(f"{PREFIX}{message}\n")  # one write: lines of other threads do not land inside it
    stream.flush()


def console() -> TextIO:
    """Where ranks' live output is copied to when the caller names no stream: this process's stdout, as it is now."""
    return sys.stdout
