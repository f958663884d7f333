"""The warm pool for local ranks: ranks forked from a process with torch already imported.

A cold ``.distributed()`` call pays for an interpreter and ``import torch`` in the agent and
again in every rank (seconds). The warm pool keeps one long-lived "zygote" process per
interpreter that has imported torch and sparkgpu once; each call asks it over a private
UNIX socket to fork the ranks, which then run exactly what a cold rank runs (the generated
``_air.py``). The zygote never initialises CUDA, so forked ranks may use GPUs.

This module is the client side: it starts the zygote (:mod:`sparkgpu.launch.backends.local.zygote`,
which holds the process itself), asks it for status, stops it, and forks a job's ranks on
it (:func:`run_on_zygote`, used by :class:`~sparkgpu.launch.backends.local.warm.WarmBackend`
and by a job's :class:`Standby`). The zygote is single-threaded and stops itself after
``idle_timeout`` without work; ``sparkgpu warm-pool status`` / ``sparkgpu warm-pool stop`` show and
stop it. If the client disconnects mid-run (Ctrl-C, or the client was killed), the zygote
kills that job's ranks.

A warm zygote runs the code it imported when it started, so it is keyed by the interpreter and by a
fingerprint of that code (sparkgpu's files, torch's, numpy's and cloudpickle's): after an
upgrade or an edit the next call starts a new one, and the outdated one stops once its
running jobs end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import select
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import sparkgpu
from sparkgpu._util.process import pid_gone
from sparkgpu.config import settings
from sparkgpu.errors import SparkGPUError
from sparkgpu.launch.backends.base import AttemptHandle
from sparkgpu.launch.rank.threads import rank_thread_env, threads_per_rank
from sparkgpu.rundir.layout import RunLayout

__all__ = ["Standby", "ZygoteAttempt", "ensure_warm_zygote", "warm_zygote_status", "stop_warm_zygote", "run_on_zygote"]

_START_TIMEOUT = 120.0
# A warm job often ends within a fraction of a second: for its first second, poll waits up to
# this long for the result, so a short job's end is seen when it happens rather than one
# supervisor poll (and sleep) later.
_EARLY_RESULT_WAIT = 0.25
_EARLY_SECONDS = 1.0
# What the zygote imports before it forks (zygote._serve); the ranks inherit these
# modules as they were then.
_PRELOADED = ("torch", "numpy", "cloudpickle")


def _interpreter_tag(python: str) -> str:
    return hashlib.sha256(os.path.realpath(python).encode()).hexdigest()[:12]


def _warm_zygote_dir(python: str, fingerprint: str | None = None) -> Path:
    # One warm zygote per interpreter and code: one started from another venv, or before an
    # upgrade or an edit of sparkgpu, would run other code than a cold call does.
    return settings().home / "pool" / f"{_interpreter_tag(python)}-{fingerprint or code_fingerprint()}"


def code_fingerprint(package_dir: Path | None = None, preloaded: tuple[str, ...] = _PRELOADED) -> str:
    """A short hash of the code a warm zygote would preload: path, size and mtime of every file of
    the sparkgpu package and of the entry files of ``preloaded``; no module is imported.

    Reinstalling or upgrading a distribution rewrites its files, so their mtimes change.
    This describes this process's environment, which is the warm zygote's unless
    ``SPARKGPU_PYTHON`` names another interpreter (that one is part of the key anyway).

    Args:
        package_dir: The sparkgpu package directory (this one by default).
        preloaded: Top-level modules whose entry file is included.
    """
    digest = hashlib.sha256()
    root = package_dir or Path(sparkgpu.__file__).resolve().parent
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            _add_stat(digest, os.path.join(folder, name))
    for name in preloaded:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            _add_stat(digest, spec.origin)
    return digest.hexdigest()[:12]


def _add_stat(digest, path: str) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:  # removed while we walked: the next call sees the new state
        return
    digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())


# -- the client side --------------------------------------------------------------------------


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return data.decode()


def _connect(directory: Path) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(directory / "pool.sock"))
        return sock
    except OSError:
        sock.close()
        return None


def _request(directory: Path, message: dict) -> dict | None:
    """Sends one request; ``None`` when no zygote answers (also one that stopped meanwhile)."""
    sock = _connect(directory)
    if sock is None:
        return None
    with sock:
        try:
            sock.sendall((json.dumps(message) + "\n").encode())
            reply = _read_line(sock)
        except (BrokenPipeError, ConnectionResetError):  # it stopped (idle) as we connected
            return None
    return json.loads(reply) if reply else None


def ensure_warm_zygote(python: str, idle_timeout: float) -> Path:
    """Starts the zygote for ``python`` and the current code unless it runs already; returns
    its directory. Warm zygotes of the same interpreter with outdated code are asked to stop once
    their running jobs end."""
    fingerprint = code_fingerprint()
    directory = _warm_zygote_dir(python, fingerprint)
    if _request(directory, {"op": "status"}) is not None:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    # One starter at a time: two jobs that find no zygote at once (a sweep's concurrent trials)
    # would start two, and the second's socket would hide the first, left idle for its timeout.
    with _starting(directory):
        if _request(directory, {"op": "status"}) is not None:  # the starter before us started it
            return directory
        for outdated in _warm_zygote_dirs(python):
            if outdated != directory:
                _request(outdated, {"op": "retire"})
        log = open(directory / "pool.log", "ab")
        subprocess.Popen(
            [python, "-m", "sparkgpu.launch.backends.local.zygote", str(directory), str(idle_timeout), fingerprint],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log.close()
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            if _request(directory, {"op": "status"}) is not None:
                return directory
            time.sleep(0.05)
    raise SparkGPUError(f"the warm pool did not start within {_START_TIMEOUT:g}s; see {directory / 'pool.log'}")


@contextlib.contextmanager
def _starting(directory: Path) -> Iterator[None]:
    """Holds the zygote directory's start lock (an exclusive ``flock``, released with its process)."""
    fd = os.open(directory / "start.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def warm_zygote_status(python: str | None = None) -> dict | None:
    """The running warm zygote's pid, start time, idle timeout, code fingerprint and jobs; ``None``
    when none runs. The one of the current code if it runs, else an outdated one that is
    still finishing its jobs."""
    python = python or settings().python
    current = _warm_zygote_dir(python)
    for directory in [current] + [d for d in _warm_zygote_dirs(python) if d != current]:
        info = _request(directory, {"op": "status"})
        if info is not None:
            return info
    return None


def stop_warm_zygote(python: str | None = None) -> bool:
    """Stops the warm zygotes of ``python`` (killing ranks they still run), outdated ones included.

    Returns:
        False when none was running.
    """
    stopped = False
    for directory in _warm_zygote_dirs(python or settings().python):
        info = _request(directory, {"op": "status"})
        if info is None or _request(directory, {"op": "stop"}) is None:
            continue
        stopped = True
        pid = info["pid"]
        deadline = time.monotonic() + 10
        while pid and not pid_gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    return stopped


def _warm_zygote_dirs(python: str) -> list[Path]:
    """Directories of every warm zygote of ``python``, whatever code it was started with (also
    those of versions that keyed them by interpreter alone)."""
    return sorted((settings().home / "pool").glob(f"{_interpreter_tag(python)}*"))


@dataclasses.dataclass
class ZygoteAttempt(AttemptHandle):
    """An attempt whose ranks a zygote forked; the zygote answers on ``conn`` when they ended."""

    attempt: int
    conn: socket.socket
    node_file: Path
    status: int | None = None
    submitted: float = dataclasses.field(default_factory=time.monotonic)

    def poll(self) -> int | None:
        if self.status is not None:
            return self.status
        if time.monotonic() - self.submitted < _EARLY_SECONDS and self.conn.fileno() >= 0:
            # poll(), not select(): a long-lived client (a notebook, a test session) can hold
            # descriptors past select()'s limit of 1024.
            waiter = select.poll()
            waiter.register(self.conn, select.POLLIN)
            waiter.poll(_EARLY_RESULT_WAIT * 1000)
        try:
            data = self.conn.recv(1 << 12)
        except BlockingIOError:
            return None
        self.conn.close()
        self.status = json.loads(data.decode())["status"] if data else 1
        return self.status

    def cancel(self, grace: float) -> None:
        if self.status is not None:
            return
        self.conn.close()  # the zygote sees EOF and stops this job's ranks (SIGKILL after grace)
        self.status = 130
        deadline = time.monotonic() + grace + 5
        while not self.node_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def run_on_zygote(directory: Path, job, run_dir, attempt: int, env: dict[str, str]) -> ZygoteAttempt:
    """Asks the zygote at ``directory`` to fork the attempt's ranks; returns once they were forked."""
    conn = _connect(directory)
    if conn is None:
        raise SparkGPUError(f"the warm pool at {directory} stopped answering; run `sparkgpu warm-pool stop` and retry")
    full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    # The zygote's torch was imported without these: the forked ranks apply them themselves.
    full_env.update(rank_thread_env(full_env, threads_per_rank(job.world_size)))
    request = {
        "op": "run",
        "run_dir": str(run_dir.path),
        "attempt": attempt,
        "nproc": job.world_size,
        "env": full_env,
        "key": run_dir.key.hex(),  # over the user's own socket; the zygote hands it to the ranks in memory
        "grace": job.policy.shutdown_grace,
    }
    conn.sendall((json.dumps(request) + "\n").encode())
    if not _read_line(conn):  # {"started": true} when the ranks were forked
        conn.close()
        raise SparkGPUError(f"the warm pool at {directory} refused the job; see {directory / 'pool.log'}")
    conn.setblocking(False)
    return ZygoteAttempt(attempt=attempt, conn=conn, node_file=run_dir.file(RunLayout.node_exits(attempt, 0)))


class Standby:
    """One job's private zygote, started while an attempt runs, that forks the next attempt's ranks.

    A restart through it skips the interpreters' start and ``import torch`` (seconds). It
    serves this job alone, dies with the client (``PR_SET_PDEATHSIG``; start it from the
    thread that supervises the job) and is stopped when the job ends. While it is still
    starting, a restart waits for it rather than starting cold beside it; one that failed to
    start leaves the restart to the cold path.

    Args:
        python: The interpreter of the job's ranks.
        job_id: The job it serves.
        preload: The libraries the job's function imports, which it imports before it forks
            (:mod:`sparkgpu.launch.node.preload`).
    """

    def __init__(self, python: str, job_id: str, preload: list | None = None):
        self.job_id = job_id
        name = hashlib.sha256(job_id.encode()).hexdigest()[:12]  # a UNIX socket's path is short
        self.directory = settings().home / "standby" / name
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / "pool.log", "ab") as log:
            self.process = subprocess.Popen(
                [
                    python,
                    "-m",
                    "sparkgpu.launch.backends.local.zygote",
                    str(self.directory),
                    "inf",
                    "",
                    "standby",
                    json.dumps(preload or []),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def ready(self, timeout: float = _START_TIMEOUT) -> bool:
        """Waits until it answers; ``False`` when it ended or did not answer within ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            if _request(self.directory, {"op": "status"}) is not None:
                return True
            time.sleep(0.02)
        return False

    def submit(self, job, run_dir, attempt: int, env: dict[str, str]) -> ZygoteAttempt | None:
        """The attempt, its ranks forked here; ``None`` when the standby cannot serve it."""
        if not self.ready():
            return None
        return run_on_zygote(self.directory, job, run_dir, attempt, env)

    def stop(self) -> None:
        if self.process.poll() is None:
            _request(self.directory, {"op": "stop"})
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)
