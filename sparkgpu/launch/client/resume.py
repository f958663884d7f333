"""``sparkgpu resume JOB_ID``: continue a job whose client process died.

Reads the job's spec and supervisor state from its run dir, checks the payload's signature
with the key kept on this machine, and starts the next attempt. The training function
resumes from its latest complete checkpoint (``Checkpointer.restore``), as after any restart.
A job that a live client still drives is refused (two supervisors on one run dir would
submit overlapping attempts) unless ``force`` says the caller knows better.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Mapping
from typing import Any

from sparkgpu._util.process import ProcessRef
from sparkgpu.config import settings
from sparkgpu.errors import ConfigurationError, JobStateError
from sparkgpu.launch.backends.base import BACKENDS, Backend, backend_class, create_backend
from sparkgpu.launch.backends.capabilities import Reattachable
from sparkgpu.rundir.keyring import load_key
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.rundir.serialization import unpack_callbacks
from sparkgpu.rundir.states import JobState, JobStatus
from sparkgpu.launch.client.job_state import JobBook
from sparkgpu.launch.client.supervision_lock import SupervisionLock
from sparkgpu.launch.client.supervisor import CANCEL_REQUEST_FILE, Supervisor
from sparkgpu.spec import JobSpec

__all__ = ["resume_job", "take_over", "find_run_dir", "client_is_gone"]


def client_is_gone(client: Mapping[str, Any] | None) -> bool:
    """True when the client process recorded in a job's state (a :meth:`ProcessRef.record`) has
    certainly exited; False while it runs, or when that cannot be told from here (another machine)."""
    return client is not None and ProcessRef.from_record(client).is_gone()


def _check_no_live_client(job_id: str, state: JobState) -> None:
    if JobStatus(state["status"]).is_terminal:
        return  # the call that drove it has returned or raised; its process may live on (a notebook)
    client = state.get("client")
    if not client or client_is_gone(client):
        return
    force = f"pass --force (resume_job({job_id!r}, force=True)) only if you are sure it no longer drives the job"
    if not ProcessRef.from_record(client).on_this_machine():
        raise JobStateError(
            f"job {job_id} is {state['status']}, driven by a client on {client.get('host')} (pid {client.get('pid')}), "
            f"which cannot be checked from here; resume it on that host, or {force}"
        )
    raise JobStateError(
        f"job {job_id} is still {state['status']}: its client (pid {client['pid']} on this host) is alive, and two "
        f"supervisors would run overlapping attempts in one run dir; stop that process first (Ctrl-C stops its "
        f"ranks), or {force}"
    )


def find_run_dir(job_id: str) -> RunDir:
    """The run dir of ``job_id``, or of the one job whose id starts with it.

    Raises:
        ConfigurationError: no job, or several, match; names them.
    """
    root = settings().staging_root
    run_dir = RunDir(root / job_id)
    if run_dir.spec_file.exists():
        return run_dir
    matches = sorted(p.parent for p in root.glob(f"{glob.escape(job_id)}*/{RunLayout.SPEC}"))
    if len(matches) == 1:
        return RunDir(matches[0])
    if not matches:
        raise ConfigurationError(
            f"no job {job_id!r} under {root}; `sparkgpu jobs` lists the jobs there "
            "(set SPARKGPU_STAGING_ROOT if they were staged elsewhere)"
        )
    names = ", ".join(m.name for m in matches[:5])
    raise ConfigurationError(f"{job_id!r} matches {len(matches)} jobs ({names}, ...); give more of the id")


def resume_job(job_id: str, backend=None, out=None, force: bool = False) -> list:
    """Runs the next attempt of ``job_id`` and returns its per-rank results.

    Args:
        job_id: The job to continue.
        backend: Where to run it; the job's own backend by default.
        out: Where the ranks' live output goes.
        force: Resume even if the client that drives the job still seems alive.

    Raises:
        JobStateError: a job that already succeeded, or whose client still runs (without
            ``force``).
        ConfigurationError: unknown job, or no key here.
        WorkerFailedError, JobTimeoutError: as for ``.distributed()``.
    """
    return take_over(job_id, backend=backend, out=out, force=force).run()


def take_over(
    job_id: str,
    backend=None,
    out=None,
    force: bool = False,
    lock: SupervisionLock | None = None,
    run_dir: RunDir | None = None,
) -> Supervisor:
    """A supervisor that continues ``job_id`` from its run dir, ready to ``run()``; starts nothing.

    It holds the job's supervision lock (``lock``, when the caller took it already) from before
    it changes anything until its ``run()`` ends: a second ``sparkgpu resume`` or ``attach``
    meanwhile is refused.

    Its attempts left ``RUNNING`` by a client that died are marked ``LOST``. A cancel asked
    for before a job ended cancelled still holds; resuming a job that did end cancelled is
    a new decision, so the old request is dropped.

    Args:
        run_dir: The job's run dir, when the caller knows it (a detached supervisor); else found
            under the staging root.

    Raises:
        ConfigurationError: as for :func:`resume_job`.
        JobStateError: another process supervises the job.
    """
    run_dir = run_dir or find_run_dir(job_id)
    job_id = run_dir.job_id
    lock = lock or SupervisionLock(run_dir)
    if not lock.acquire():
        raise JobStateError(
            f"job {job_id} is already supervised by {lock.holder()}; wait for it, or follow it with "
            f"sparkgpu.attach({job_id!r})"
        )
    try:
        return _take_over_locked(run_dir, backend, out, force, lock)
    except BaseException:
        lock.release()
        raise


def _take_over_locked(run_dir: RunDir, backend, out, force: bool, lock: SupervisionLock) -> Supervisor:
    job_id = run_dir.job_id
    job = JobSpec.from_dict(json.loads(run_dir.spec_file.read_text()))
    book = JobBook.read(run_dir.state_file)
    state: JobState | None = book.state if book is not None else None
    if state and state["status"] == JobStatus.SUCCEEDED:
        raise JobStateError(f"job {job_id} already succeeded; nothing to resume")
    if state and not force:
        _check_no_live_client(job_id, state)
    key = load_key(job_id)
    _, parts = run_dir.load_verified(key)
    callbacks = unpack_callbacks(parts)  # the function itself is the ranks' to import, not the supervisor's
    backend = backend or _backend_for(job, RunDir(run_dir.path, key))  # the key opens a sealed Connect token
    supervisor = Supervisor(job, run_dir, backend, key, callbacks, out=out)
    supervisor.lock = lock
    if book is not None and book.state:
        if book.status.is_terminal:
            (run_dir.path / CANCEL_REQUEST_FILE).unlink(missing_ok=True)
        lost = book.mark_lost_attempts()  # the client died while they ran
        supervisor.load_state_dict(book.state)
        _stop_outliving_nodes(job, run_dir, lost)
    return supervisor


def _backend_for(job: JobSpec, run_dir: RunDir) -> Backend:
    """The job's own backend, for this process.

    A :class:`~sparkgpu.launch.backends.capabilities.Reattachable` one is rebuilt from the run dir
    to reach where the job ran (a Spark job's Connect server).
    """
    kind = backend_class(job.backend)
    if issubclass(kind, Reattachable):
        return kind.reattach(run_dir)
    return create_backend(job.backend)


def _stop_outliving_nodes(job: JobSpec, run_dir: RunDir, lost: list[int]) -> None:
    """Stops the nodes of lost attempts that outlive their dead client.

    Only the nodes of a :class:`~sparkgpu.launch.backends.capabilities.Reattachable` backend do
    (Spark's run until they miss the heartbeat); local ranks die with their client. The next
    attempt must not run beside them on the same GPUs and checkpoints.
    """
    if not lost or job.backend not in BACKENDS:  # an unregistered backend (given as an instance): nothing to ask
        return
    kind = backend_class(job.backend)
    if issubclass(kind, Reattachable):
        kind.stop_lost_attempts(job, run_dir, lost)
