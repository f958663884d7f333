"""A job supervised by processes of its own, so that it outlives the caller that submitted it.

``fn.submit()`` (and ``detach=True``) start, for the job, a *keeper*: a small process in a
session of its own (``python -m sparkgpu.launch.client.detached RUN_DIR``) whose only work is
to run the job's :class:`~sparkgpu.launch.client.supervisor.Supervisor` in a child process (a fork
of the keeper, which imported the launcher once: :mod:`sparkgpu._util.keeper`, which a detached
sweep's keeper shares) and, should that child die before the job ended (SIGKILL, the host's OOM killer), start another,
which takes the job over from its run dir exactly as ``sparkgpu resume`` does: the attempt that
ran is marked lost and the next one resumes from the latest checkpoint. The caller then only
observes (``status``, ``logs``, ``result``, ``cancel`` through the run dir), and killing it, its
process group or its terminal changes nothing for the job.

Processes and what each outlives::

    caller (notebook, script, CLI)       submits, observes; may exit or be killed at any time
      keeper (own session)               restarts the supervisor; ends when the job ends
        supervisor (keeper's child)      runs attempts; holds the run dir's supervision lock
          node agent -> ranks            die with the supervisor (PR_SET_PDEATHSIG)

The keeper is named in the run dir's sealed ``supervision.json`` (its process, and the
caller's ``sys.path`` so that the supervisor can unpickle the job's callbacks): an observer
takes a job over only when both its supervisor and its keeper are gone
(:func:`keeper_alive`). The keeper reads nothing secret: the supervisor takes the job's key
from the user's private keyring, as ``sparkgpu resume`` does, never from its environment or
command line.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from sparkgpu._util.keeper import RESPAWN_LIMIT, Kept, keep as keep_alive
from sparkgpu._util.process import ProcessRef
from sparkgpu.launch.backends.spark.sessions import close_channels
from sparkgpu.rundir.directory import PRIVATE_FILE, RunDir
from sparkgpu.rundir.layout import RunLayout

__all__ = ["Keeper", "start_keeper", "keeper_alive", "supervision_record", "main", "RESPAWN_LIMIT"]

_MODULE = "sparkgpu.launch.client.detached"  # run as ``python -m`` (where ``__name__`` is ``__main__``)

logger = logging.getLogger(__name__)

#: Seconds a new supervisor waits for the supervision lock that the observer which started its keeper holds.
_LOCK_WAIT = 30.0


def supervision_record(run_dir: RunDir) -> dict | None:
    """The run dir's ``supervision.json`` (who keeps the job), or ``None`` (an attached job, or forged)."""
    record = run_dir.read_control_json(run_dir.path / RunLayout.SUPERVISION)
    return record if isinstance(record, dict) else None


def keeper_alive(run_dir: RunDir) -> bool:
    """Whether the job's keeper still runs (then it, not an observer, replaces a dead supervisor)."""
    record = supervision_record(run_dir)
    keeper = record.get("keeper") if record else None
    return isinstance(keeper, dict) and not ProcessRef.from_record(keeper).is_gone()


class Keeper:
    """A keeper started before its job is written, so that its interpreter starts and imports
    the launcher while the caller prepares and stages the job (:meth:`hand` then names the run
    dir). A keeper that is never handed a job (the job was refused, or an earlier submission
    holds its idempotency key) exits at once when :meth:`abandon` closes its pipe.
    """

    def __init__(self, python: str | None = None):
        self.process = _spawn(python, [], stdin=subprocess.PIPE)

    def hand(self, run_dir: RunDir) -> ProcessRef:
        """Gives the keeper its written job (``run_dir``, with the job key set on it) and names
        it in the run dir; a keeper that died meanwhile is replaced by a new one."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(f"{run_dir.path}\n".encode())
            self.process.stdin.close()
        except BrokenPipeError:  # it could not start (its log says nothing yet): start one the plain way
            _forget(self.process)
            return start_keeper(run_dir)
        return _named(run_dir, self.process)

    def abandon(self) -> None:
        """Ends the keeper that no job was handed to."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.close()
        except BrokenPipeError:
            logger.debug("an unused keeper had ended already")
        _forget(self.process)


def start_keeper(run_dir: RunDir, python: str | None = None) -> ProcessRef:
    """Starts the keeper of the written job in ``run_dir``; returns at once.

    Its output (and its supervisors') goes to the run dir's ``supervisor.log``. The caller's
    working directory and environment are the keeper's, as they would be the supervisor's in
    the caller's own process.

    Args:
        run_dir: The job's run dir, written, with the job key set on it.
        python: The interpreter; this one by default.
    """
    return _named(run_dir, _spawn(python, [str(run_dir.path)], stdin=subprocess.DEVNULL))


def _spawn(python: str | None, args: list[str], stdin: int) -> subprocess.Popen:
    """A keeper process, in a session of its own: no signal of the caller's terminal or process group
    reaches it. It writes to the run dir's ``supervisor.log`` itself, once it knows its run dir."""
    return subprocess.Popen(
        [python or sys.executable, "-m", _MODULE, *args],
        stdin=stdin,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _named(run_dir: RunDir, process: subprocess.Popen) -> ProcessRef:
    """Names ``process`` as the job's keeper in its sealed ``supervision.json``."""
    keeper = ProcessRef.of(process.pid)
    record = {"keeper": keeper.record(), "sys_path": [p for p in sys.path if p], "started_at": time.time()}
    run_dir.write_control(run_dir.path / RunLayout.SUPERVISION, json.dumps(record).encode())
    # The keeper is nobody's child to wait for: a caller that lives on must not keep it a zombie.
    _forget(process)
    return keeper


def _log_to(run_dir: RunDir) -> None:
    """Sends this process's output (and its supervisors') to the run dir's ``supervisor.log``."""
    log_fd = os.open(run_dir.path / RunLayout.SUPERVISOR_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)


def _forget(process: subprocess.Popen) -> None:
    """Lets ``process`` be reaped by whoever reaps this process's children, without a zombie left here."""
    import threading

    threading.Thread(target=process.wait, daemon=True, name=f"sparkgpu-keeper-{process.pid}").start()


# -- the keeper and the supervisor it runs ------------------------------------------------------
def _job_ended(run_dir: RunDir) -> bool:
    from sparkgpu.launch.client.job_state import JobBook

    book = JobBook.read(run_dir.state_file)
    return book is not None and book.status.is_terminal


def keep(run_dir: RunDir) -> int:
    """The keeper's loop: a supervisor at a time until the job has ended; the exit code of the last.

    Only a supervisor killed by a signal is replaced: one that exited reported why (a job it
    cannot run is ended failed in its state), and another would exit the same way."""
    return keep_alive(
        Kept(
            kind="job",
            name=run_dir.job_id,
            worker="supervisor",
            run=lambda: supervise(run_dir),
            ended=lambda: _job_ended(run_dir),
            resume=f"sparkgpu resume {run_dir.job_id}",
        )
    )


def supervise(run_dir: RunDir) -> int:
    """Runs the job to its end as its supervisor; 0 once it ended (however it ended), 1 if it cannot run it."""
    from sparkgpu._util.report import report
    from sparkgpu.errors import JobStateError
    from sparkgpu.launch.client.resume import take_over
    from sparkgpu.launch.client.supervision_lock import SupervisionLock

    lock = SupervisionLock(run_dir)
    deadline = time.monotonic() + _LOCK_WAIT
    while not lock.acquire() and time.monotonic() < deadline:
        time.sleep(0.1)  # an observer that started this keeper may hold it for a moment more
    try:
        _import_like_the_caller(run_dir)
        supervisor = take_over(run_dir.job_id, run_dir=run_dir, out=sys.stdout, lock=lock)
    except JobStateError as exc:  # supervised elsewhere (an `attach`, `sparkgpu resume`), or succeeded
        report(f"job {run_dir.job_id} is not supervised here: {exc}", sys.stdout)
        return 0
    except Exception as exc:  # no key here, a payload that does not verify: no supervisor could run it
        logger.exception("job %s cannot be supervised", run_dir.job_id)
        _end_unsupervisable(run_dir, exc)
        lock.release()
        return 1
    try:
        supervisor.run_detached()
    except BaseException as exc:  # noqa: BLE001 - the job's end is in its state; the run dir keeps the error
        if isinstance(exc, KeyboardInterrupt):
            raise
        report(f"job {run_dir.job_id} ended: {type(exc).__name__}: {exc}", sys.stdout)
    else:
        report(f"job {run_dir.job_id} succeeded", sys.stdout)
    finally:
        close_channels()  # a Spark job's cluster may be gone already: exit without calling it
    return 0


def _import_like_the_caller(run_dir: RunDir) -> None:
    """Puts the caller's ``sys.path`` before this process's: its callbacks' classes unpickle from there."""
    from sparkgpu.rundir.keyring import load_key

    signed = RunDir(run_dir.path, load_key(run_dir.job_id))
    deadline = time.monotonic() + _LOCK_WAIT
    # The caller writes the record right after starting the keeper: a quick supervisor may look first.
    while (record := supervision_record(signed)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    for entry in reversed((record or {}).get("sys_path") or []):
        if entry not in sys.path:
            sys.path.insert(0, entry)


def _end_unsupervisable(run_dir: RunDir, exc: Exception) -> None:
    """Ends ``FAILED`` a job that no supervisor can take over, with why, for whoever observes it."""
    from sparkgpu.launch.client.job_state import JobBook
    from sparkgpu.launch.client.supervisor import fail_unsupervisable

    backend = json.loads(run_dir.spec_file.read_text()).get("backend", "local")
    book = JobBook.read(run_dir.state_file) or JobBook.new(run_dir.state_file, run_dir.job_id, backend)
    fail_unsupervisable(book, f"{type(exc).__name__}: {exc}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sparkgpu.launch.client.detached [RUN_DIR]``: keeps the job in ``RUN_DIR``, or in
    the run dir its starter writes on stdin once the job is written (:class:`Keeper`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    os.umask(0o077)
    # Imported once, here (while a Keeper's caller still stages the job): each supervisor forks with it.
    import sparkgpu.launch.client.resume  # noqa: F401

    if args:
        path = args[0]
    else:
        path = sys.stdin.readline().strip()
        if not path:  # abandoned: the job was never written
            return 0
    run_dir = RunDir(Path(path))
    _log_to(run_dir)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s sparkgpu %(levelname)s %(message)s", stream=sys.stdout)
    return keep(run_dir)


if __name__ == "__main__":
    sys.exit(main())
