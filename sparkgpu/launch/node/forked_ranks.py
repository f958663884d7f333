"""Ranks forked from their node's agent, which has imported torch, instead of new interpreters.

torch's elastic agent starts each rank of a binary entrypoint as a new process
(``python -u -c <_air.py text> RUN_DIR``), and each of them imports torch again: about two
seconds of CPU per rank, eight at once on an eight-GPU node, at every attempt. The agent has
imported torch already, so here it forks them: torch's agent keeps everything else (its
rendezvous, the ranks' variables, its polling, its teardown with SIGTERM and then SIGKILL, its
failure report), because only the process it starts differs (:func:`forking_ranks` swaps the
handler its process context builds, for the length of one launch).

A forked rank runs the same checked ``_air.py`` text as a new one would, as ``__main__``, with
the job key handed in memory (as the warm pool's zygote does); it gets a session of its own,
the default signal handlers, the process variables torch's agent gave it, no descriptor of
the agent's beyond the standard three, and the exit status ``python -c`` would have given.

The agent never initialises CUDA, so forked ranks may use GPUs. A job that ships its
environment forks its ranks only where the shipped packages hold the agent's modules byte for
byte (:mod:`~sparkgpu.launch.node.shipped_overlay`). ``SPARKGPU_FORK_RANKS=0`` starts new
interpreters for every job.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from sparkgpu.config import reset_settings
from sparkgpu._util.process import die_with_parent
from sparkgpu.rundir.exit_codes import EXIT_FAILED
from sparkgpu.rundir.key_handover import make_undumpable

__all__ = ["ForkedRank", "RankSpares", "become_rank", "can_fork", "forking_ranks"]

# What torch's agent catches in its main thread while its ranks run; a rank starts with none of it.
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _handler_module():
    """torch's process context module, when it builds its handlers the way this module replaces."""
    try:
        from torch.distributed.elastic.multiprocessing import api
        from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
    except ImportError:
        return None
    if not callable(getattr(api, "get_subprocess_handler", None)) or not hasattr(SubprocessHandler, "_popen"):
        return None  # another torch: its agent starts new interpreters
    return api


def can_fork(wanted: bool) -> bool:
    """Whether this node's agent may fork its ranks: asked for (``SPARKGPU_FORK_RANKS``), the
    platform forks, and torch builds its handlers as known."""
    return wanted and hasattr(os, "fork") and _handler_module() is not None


class ForkedRank:
    """A forked rank, as torch's handler keeps a :class:`subprocess.Popen`: ``pid``, ``poll``,
    ``wait`` (:class:`subprocess.TimeoutExpired` past its timeout), ``returncode``, signals."""

    def __init__(self, pid: int, args: tuple[str, ...]):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def _reap(self, flags: int) -> int | None:
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped elsewhere: its status is gone, as Popen reads it
                self.returncode = 0
                return 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            code = self._reap(0)
            assert code is not None, "a blocking waitpid returns the child's status"
            return code
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while (code := self.poll()) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            delay = min(delay * 2, remaining, 0.05)
            time.sleep(delay)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _exit_status(exc: SystemExit) -> int:
    """The status ``python -c`` leaves with for ``exc``; a message is printed as it prints it."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def become_rank(
    text: str | bytes,
    filename: str,
    run_dir: Path,
    key: bytes,
    env: dict[str, str],
    streams: tuple[str | None, str | None] = (None, None),
    prelude: Callable[[], None] | None = None,
) -> NoReturn:
    """In a forked process (a spare, or a warm pool's fork): becomes a rank as ``python -c <text>
    RUN_DIR`` would be one, with exactly the variables ``env``; never returns. The caller has
    given it its process group or session. ``prelude`` runs just before the text."""
    code = 1
    try:
        for sig in _AGENT_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        for fd, path in zip((1, 2), streams):
            if path is not None:  # torch's redirect, opened (and emptied) by its handler
                target = os.open(path, os.O_WRONLY | os.O_APPEND)
                os.dup2(target, fd)
                os.close(target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        os.environ.clear()
        os.environ.update(env)
        reset_settings()  # the agent's were read from its environment, before the callbacks' variables came
        logging.root.handlers.clear()  # the agent's format says "agent"; the rank sets up its own
        logging.root.setLevel(logging.WARNING)
        atexit._clear()  # the agent's exit functions are the agent's
        make_undumpable(False)  # the agent's mark is inherited; a rank is as debuggable as any
        main = types.ModuleType("__main__")
        main.__dict__.update(__builtins__=__builtins__, _sparkgpu_job_key=key)
        sys.modules["__main__"] = main
        sys.argv = ["-c", str(run_dir)]
        if prelude is not None:
            prelude()
        exec(compile(text, filename, "exec"), main.__dict__)
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):  # a closed or broken stream: nothing left to write
                    stream.flush()
        finally:
            os._exit(code)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


class RankSpares:
    """The node's ranks-to-be: forked from the agent once torch is imported, before it starts any
    thread (its rendezvous store, its watchers), each waiting on a pipe to become one rank.

    Forked there, a rank holds no lock another thread held, and its stack is the agent's first
    few frames, not torch's launcher. A spare that is never taken ends at :meth:`close` (and
    with the agent, whatever ends it).

    Args:
        count: The node's ranks.
        text: The checked ``_air.py`` text each rank runs.
        filename: The name its tracebacks give it (the run dir's ``_air.py``).
        run_dir: The run dir (this node's copy), each rank's ``sys.argv[1]``.
        key: The job key, which each rank gets in memory.
        prelude: Run in each rank before the text (:func:`become_rank`).
    """

    def __init__(
        self,
        count: int,
        text: str,
        filename: str,
        run_dir: Path,
        key: bytes,
        prelude: Callable[[], None] | None = None,
    ):
        self._prelude = prelude
        self._waiting: list[tuple[int, int]] = []  # (pid, write end of its pipe), in the order ranks take them
        # What torch's import made stays out of every collection, the ranks' included: a rank's
        # collections then write to none of the pages it shares with the agent (Python's advice
        # for fork without exec).
        gc.freeze()
        try:
            for _ in range(count):
                self._waiting.append(self._fork(text, filename, run_dir, key))
        except BaseException:
            self.close()
            raise

    def _fork(self, text: str, filename: str, run_dir: Path, key: bytes) -> tuple[int, int]:
        orders_r, orders_w = os.pipe()
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                # Only the agent writes orders: a spare holding another's pipe would keep it from its end of file.
                for fd in (orders_w, ready_r, *(w for _, w in self._waiting)):
                    os.close(fd)
                os.setsid()  # torch's handler stops a rank by its process group, as a new one's
                die_with_parent(EXIT_FAILED)
                os.close(ready_w)
                orders = _read_all(orders_r)
                os.close(orders_r)
                if not orders:  # not taken
                    os._exit(0)
                order = json.loads(orders)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            become_rank(text, filename, run_dir, key, order["env"], (order["stdout"], order["stderr"]), self._prelude)
        os.close(orders_r)
        os.close(ready_w)
        try:
            _read_all(ready_r)  # end of file once the spare leads its session: torch may then signal its group
        finally:
            os.close(ready_r)
        return pid, orders_w

    def take(self, env: dict[str, str], stdout: str | None, stderr: str | None) -> int:
        """Makes the next spare a rank with these process variables and torch's redirects (paths);
        returns its pid."""
        if not self._waiting:
            raise RuntimeError("torch's agent started more ranks than the node has; none is left to fork")
        pid, orders_w = self._waiting.pop(0)
        try:
            with os.fdopen(orders_w, "wb") as orders:
                orders.write(json.dumps({"env": env, "stdout": stdout, "stderr": stderr}).encode())
        except BrokenPipeError:  # the spare died (killed with its session); torch reads its status
            pass
        return pid

    def close(self) -> None:
        """Ends the spares no rank took."""
        waiting, self._waiting = self._waiting, []
        for pid, orders_w in waiting:
            os.close(orders_w)
            os.waitpid(pid, 0)


@contextlib.contextmanager
def forking_ranks(spares: RankSpares, started: Callable[[int, int], None]) -> Iterator[None]:
    """While open, the ranks torch's agent starts in this process are ``spares``.

    Args:
        spares: The node's spares, forked before the agent started any thread.
        started: Called with ``(pid, global_rank)`` in the agent as each rank is handed its orders.
    """
    api = _handler_module()
    if api is None:
        raise RuntimeError("this torch builds its rank handlers otherwise: start new interpreters (can_fork)")
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    class _SpareHandler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]):
            streams = [stream.name if stream else None for stream in (self._stdout, self._stderr)]
            pid = spares.take(env, *streams)
            started(pid, int(env["RANK"]))
            return ForkedRank(pid, (args[0], "-c", "<_air.py>", *args[3:]))

    def handler(**kwargs) -> SubprocessHandler:
        return _SpareHandler(**kwargs)

    original = api.get_subprocess_handler
    api.get_subprocess_handler = handler
    try:
        yield
    finally:
        api.get_subprocess_handler = original
