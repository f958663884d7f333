"""``sparkgpu resume JOB_ID``: continue a job whose client process died.

Reads the job's spec and supervisor state from its run dir, checks the payload's signature
with the key kept on this machine, and starts the next attempt. The training function
resumes from its latest complete checkpoint (``Checkpointer.restore``), as after any restart.
"""

from __future__ import annotations

import json

from sparkgpu.config import settings
from sparkgpu.errors import ConfigurationError
from sparkgpu.launch.backends.base import create_backend
from sparkgpu.launch.keys import load_key
from sparkgpu.launch.payload import RunDir
from sparkgpu.launch.supervisor import JobStatus, Supervisor
from sparkgpu.spec import JobSpec

__all__ = ["resume_job", "find_run_dir"]


def find_run_dir(job_id: str) -> RunDir:
    run_dir = RunDir(settings().staging_root / job_id)
    if not run_dir.spec_file.exists():
        raise ConfigurationError(
            f"no job {job_id!r} under {settings().staging_root}; `sparkgpu jobs` lists the jobs there "
            "(set SPARKGPU_STAGING_ROOT if they were staged elsewhere)"
        )
    return run_dir


def resume_job(job_id: str, backend=None, out=None) -> list:
    """Runs the next attempt of ``job_id`` and returns its per-rank results.

    Raises:
        ConfigurationError: unknown job, a job that already succeeded, or no key here.
        WorkerFailedError, JobTimeoutError: as for ``.distributed()``.
    """
    run_dir = find_run_dir(job_id)
    job = JobSpec.from_dict(json.loads(run_dir.spec_file.read_text()))
    state = json.loads(run_dir.state_file.read_text()) if run_dir.state_file.exists() else None
    if state and state["status"] == JobStatus.SUCCEEDED.value:
        raise ConfigurationError(f"job {job_id} already succeeded; nothing to resume")
    key = load_key(job_id)
    _, parts = run_dir.load_verified(key)
    callbacks = RunDir.unpack(parts)[3]
    backend = backend or create_backend(job.backend)
    supervisor = Supervisor(job, run_dir, backend, key, callbacks, out=out)
    if state:
        for attempt in state["attempts"]:
            if attempt["status"] == "running":  # the client died while it ran
                attempt["status"] = "lost"
        state.pop("stop_reason", None)
        supervisor.load_state_dict(state)
    return supervisor.run()
