"""Is this process still alive? One answer for every record that names a process.

A job's client, a conversion's claim, a usage journal entry and a download's partial file each
name the process that owns them, so that others can tell an owner that died from one that is
busy. A pid alone is not enough: pids are recycled. A :class:`ProcessRef` therefore names the
machine (host, boot and PID namespace: only processes that share these see each other's pids)
and the process's start time in clock ticks since boot (``/proc/PID/stat``), which a recycled
pid does not share.

A job's processes also die with the one that started them (:func:`die_with_parent`): a rank with its
node's launcher, an agent with its own, so none is left running when its watcher is gone.

Standard library only: it runs on clients, node agents and Spark executors alike.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import signal
import socket
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["ProcessRef", "machine_id", "start_ticks", "pid_gone", "die_with_parent"]


@functools.cache
def machine_id() -> str | None:
    """This machine's host name, boot id and PID namespace; ``None`` where that cannot be told (no ``/proc``)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{socket.gethostname()}/{boot}/{namespace}"


def _stat_fields(pid: int) -> list[str] | None:
    # The fields after the command name, which may itself hold spaces and parentheses.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> str | None:
    """When process ``pid`` of this machine started, in clock ticks since boot; ``None`` if unknown."""
    fields = _stat_fields(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def pid_gone(pid: int, started: str | None = None) -> bool:
    """Whether process ``pid`` of this machine has certainly exited.

    Args:
        pid: The process id.
        started: Its :func:`start_ticks`, if recorded: a live process with another start
            time is a recycled pid, and the process named is gone.

    Returns:
        True when no such process runs (a zombie counts as exited); False when it runs, or
        when that cannot be told (another user's process on a system that hides ``/proc``).
    """
    if not _exists(pid):
        return True
    fields = _stat_fields(pid)
    if fields is None:
        return False
    if fields[0] in ("Z", "X"):  # exited, not reaped yet by its parent
        return True
    return started is not None and len(fields) > 19 and fields[19] != started


def die_with_parent(exit_code: int) -> None:
    """Linux: the kernel kills this process when its parent dies, whatever killed the parent.

    A rank dies with its node's launcher, the agent with whoever started it, so no process of a
    job outlives the one that watches it. Where the parent is gone already (before the request
    took effect), this process exits at once with ``exit_code``. Elsewhere it does nothing.
    """
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(exit_code)


@dataclasses.dataclass(frozen=True)
class ProcessRef:
    """A process named so that a recycled pid is never taken for it.

    Attributes:
        machine: :func:`machine_id` of the machine it runs on (``None``: unknown).
        pid: Its process id there.
        started: Its :func:`start_ticks` (``None``: unknown).
    """

    machine: str | None
    pid: int
    started: str | None

    @classmethod
    def current(cls) -> ProcessRef:
        """This process."""
        pid = os.getpid()
        return cls(machine_id(), pid, start_ticks(pid))

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        """Process ``pid`` of this machine as it runs now."""
        return cls(machine_id(), pid, start_ticks(pid))

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ProcessRef:
        """The process a record written by :meth:`record` names (fields it lacks are unknown)."""
        started = record.get("pid_started")
        return cls(record.get("machine"), int(record.get("pid") or 0), started if isinstance(started, str) else None)

    def record(self) -> dict[str, Any]:
        """The JSON fields naming this process: ``host`` (for people), ``machine``, ``pid``, ``pid_started``."""
        return {"host": socket.gethostname(), "machine": self.machine, "pid": self.pid, "pid_started": self.started}

    def on_this_machine(self) -> bool:
        """Whether its pid can be looked up from here."""
        return self.machine is not None and self.machine == machine_id()

    def is_gone(self) -> bool:
        """Whether it has certainly exited: False while it runs, and when that cannot be told from here."""
        return self.pid > 0 and self.on_this_machine() and pid_gone(self.pid, self.started)
