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
import time
from collections.abc import Mapping
from typing import Any

from sparkgpu._process import ProcessRef
from sparkgpu.config import settings
from sparkgpu.errors import ConfigurationError, JobStateError
from sparkgpu.launch.backends.base import create_backend
from sparkgpu._keyring import load_key
from sparkgpu.launch.rundir.directory import RunDir
from sparkgpu.launch.rundir.layout import RunLayout
from sparkgpu.protocol import AttemptStatus, JobState, JobStatus
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
    job_id: str, backend=None, out=None, force: bool = False, lock: SupervisionLock | None = None
) -> Supervisor:
    """A supervisor that continues ``job_id`` from its run dir, ready to ``run()``; starts nothing.

    It holds the job's supervision lock (``lock``, when the caller took it already) from before
    it changes anything until its ``run()`` ends: a second ``sparkgpu resume`` or ``attach``
    meanwhile is refused.

    Its attempts left ``RUNNING`` by a client that died are marked ``LOST``. A cancel asked
    for before a job ended cancelled still holds; resuming a job that did end cancelled is
    a new decision, so the old request is dropped.

    Raises:
        ConfigurationError: as for :func:`resume_job`.
        JobStateError: another process supervises the job.
    """
    run_dir = find_run_dir(job_id)
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
    state: JobState | None = json.loads(run_dir.state_file.read_text()) if run_dir.state_file.exists() else None
    if state and state["status"] == JobStatus.SUCCEEDED:
        raise JobStateError(f"job {job_id} already succeeded; nothing to resume")
    if state and not force:
        _check_no_live_client(job_id, state)
    key = load_key(job_id)
    _, parts = run_dir.load_verified(key)
    callbacks = RunDir.unpack(parts)[3]
    backend = backend or _backend_for(job, run_dir)
    supervisor = Supervisor(job, run_dir, backend, key, callbacks, out=out)
    supervisor.lock = lock
    if state:
        if JobStatus(state["status"]).is_terminal:
            (run_dir.path / CANCEL_REQUEST_FILE).unlink(missing_ok=True)
        lost = []
        for attempt in state["attempts"]:
            if attempt["status"] == AttemptStatus.RUNNING:  # the client died while it ran
                attempt["status"] = AttemptStatus.LOST.value
                lost.append(attempt["attempt"])
        state.pop("stop_reason", None)
        supervisor.load_state_dict(state)
        _stop_outliving_nodes(job, run_dir, lost)
    return supervisor


def _backend_for(job: JobSpec, run_dir: RunDir):
    """The job's own backend; a Spark job reconnects to the Connect server it ran on when this
    process has no session and ``SPARKGPU_SPARK_REMOTE`` is unset."""
    if job.backend != "spark":
        return create_backend(job.backend)
    from sparkgpu.launch.backends.spark.sessions import recorded_remote

    return create_backend("spark", remote=recorded_remote(run_dir))


def _stop_outliving_nodes(job: JobSpec, run_dir: RunDir, lost: list[int]) -> None:
    """Stops the Spark nodes of attempts whose client died, and waits (bounded) until they did.

    Local ranks die with their client; Spark nodes run on until they miss its heartbeat
    (minutes). The next attempt must not run beside them on the same GPUs and checkpoints.
    With a staging store the nodes read the marker from the store, which only a live client
    mirrors: they stop on the lost heartbeat instead.
    """
    if job.backend != "spark" or not lost:
        return
    from sparkgpu.launch.backends.spark.backend import SparkBackend

    for attempt in lost:
        if run_dir.spark_dir(attempt).is_dir():
            run_dir.write_control(run_dir.spark_cancel_file(attempt), b"its client is gone; the job was taken over\n")
    deadline = time.monotonic() + job.policy.shutdown_grace + SparkBackend.node_stop_margin
    while any(run_dir.nodes_without_end(a) for a in lost) and time.monotonic() < deadline:
        time.sleep(0.2)
