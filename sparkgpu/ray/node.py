"""One Ray node's processes: started with ``ray start --block``, stopped to the last one.

``ray stop`` is no use here: it stops every Ray process on the host, other jobs' clusters
included. A node is instead its own session of processes (see :class:`RayNode`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from sparkgpu._util.report import report
from sparkgpu.errors import RayClusterError

__all__ = ["RayNode", "ADDRESS_FILE"]

ADDRESS_FILE = "ray_current_cluster"  # written by `ray start` once its node is registered

# Run as `python -c _WATCHDOG <session id> <temp dir> <logs target or "">` with a pipe from the
# rank on stdin. At EOF (the rank exited, however it died) it kills every process left in the
# Ray node's session, keeps the node's logs and removes its temp dir; after a clean stop()
# there is nothing left to do.
_WATCHDOG = """
import os, shutil, signal, sys, time
sys.stdin.buffer.read()
session, temp_dir, keep = int(sys.argv[1]), sys.argv[2], sys.argv[3]
me = os.getpid()
for sweep in range(3):
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if os.getsid(int(entry)) == session:
                os.kill(int(entry), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
    time.sleep(0.2)
logs = os.path.join(temp_dir, "session_latest", "logs")
try:
    if keep and os.path.isdir(logs):
        shutil.copytree(logs, keep, dirs_exist_ok=True, ignore_dangling_symlinks=True)
finally:
    shutil.rmtree(temp_dir, ignore_errors=True)
"""


def _wait(process: subprocess.Popen, seconds: float) -> bool:
    """Waits up to ``seconds`` for ``process`` to exit; True when it did."""
    deadline = time.monotonic() + seconds
    while process.poll() is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _die_with_parent_preexec():
    # Resolved before fork: loading a library in the child of a threaded process can deadlock.
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def preexec():
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: `ray start` dies with its rank

    return preexec


class RayNode:
    """One ``ray start --block`` process and everything it spawned.

    ``ray start`` runs in a session of its own, so every Ray process of the node — the
    raylet, the GCS, agents and the worker processes, which put themselves in process
    groups of their own but stay in the session — can be found and stopped without touching
    any other Ray cluster on the host (``ray stop`` would stop them all).

    A rank can die without running any cleanup (SIGKILL, ``os._exit``, a segfault). Ray's
    agents then outlive their raylet for a long while, so a small watchdog process, outside
    the session, holds a pipe from the rank and kills the whole session when the pipe closes.

    Args:
        command: The ``ray start --block`` command line.
        env: Its environment.
        temp_dir: The node's ``--temp-dir``; removed by :meth:`stop`.
        log_path: Where ``ray start`` writes its own output.
        keep_logs: Directory the node's Ray logs are copied into when it stops, if any.
    """

    def __init__(
        self, command: list[str], env: dict[str, str], temp_dir: str, log_path: Path, keep_logs: Path | None = None
    ):
        self.command = command
        self.env = env
        self.temp_dir = temp_dir
        self.log_path = log_path
        self.keep_logs = keep_logs
        self.process: subprocess.Popen | None = None
        self._watchdog: subprocess.Popen | None = None
        self._stopped = False

    def start(self, timeout: float) -> str:
        """Starts the node and waits until it is registered with the cluster.

        Call it from the rank's main thread: the kernel kills ``ray start`` when the thread
        that started it exits (``PR_SET_PDEATHSIG``).

        Args:
            timeout: Seconds the node may take to come up.

        Returns:
            The cluster's GCS address (``ip:port``).

        Raises:
            RayClusterError: ``ray start`` exited, or the node was not up within ``timeout``.
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent_preexec(),
            )
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(self.process.pid), self.temp_dir, str(self.keep_logs or "")],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        address_file = Path(self.temp_dir) / ADDRESS_FILE
        deadline = time.monotonic() + timeout
        while True:
            if address_file.exists() and (address := address_file.read_text().strip()):
                return address
            code = self.process.poll()
            if code is not None:
                raise RayClusterError(
                    f"`ray start` exited with code {code} before its node was up. Last lines of "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RayClusterError(
                    f"the Ray node was not up after {timeout:g}s; raise ray_start_timeout= if the host is "
                    f"slow. Last lines of {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def session_processes(self) -> list:
        """Every live process of this node's session (empty once stopped)."""
        import psutil

        if self.process is None:
            return []
        found = []
        for proc in psutil.process_iter():
            try:
                if os.getsid(proc.pid) == self.process.pid:
                    found.append(proc)
            except (OSError, psutil.Error):  # gone meanwhile, or not ours to look at
                continue
        return found

    def kill_now(self) -> None:
        """SIGKILLs every process of the node's session at once; safe at any moment, repeatable."""
        import psutil

        leftovers = self.session_processes()
        for proc in leftovers:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(leftovers, timeout=2)

    def stop(self, grace: float = 10.0) -> None:
        """Stops every process of the node; then keeps its Ray logs and removes its temp dir.

        ``ray start --block`` takes SIGTERM as "shut the node down"; whatever is left after
        ``grace`` seconds (worker processes included) is killed.

        Args:
            grace: Seconds the node gets to shut down before SIGKILL.
        """
        if self._stopped or self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            _wait(self.process, grace)  # what is left after that is killed with the session
        self.kill_now()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._keep_logs()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        if self._watchdog is not None:
            if self._watchdog.stdin is not None:  # always: it is started with a pipe
                self._watchdog.stdin.close()  # nothing is left for it to do; it exits
            if not _wait(self._watchdog, 10):
                self._watchdog.kill()
            self._watchdog.wait()
        self._stopped = True

    def _keep_logs(self) -> None:
        logs = Path(self.temp_dir) / "session_latest" / "logs"
        if self.keep_logs is None or not logs.is_dir():
            return
        try:
            shutil.copytree(logs, self.keep_logs, dirs_exist_ok=True, ignore_dangling_symlinks=True)
        except (OSError, shutil.Error) as exc:
            report(f"could not keep the Ray logs of {self.temp_dir} in {self.keep_logs}: {exc}")
