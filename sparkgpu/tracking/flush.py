"""Forwarding what a job's tracking spool still holds after the job ended.

The client forwards the workers' records while the job runs and, at its end, retries a
failing store a few times (:meth:`~sparkgpu.tracking.flusher.SpoolFlusher.stop`). When the store
stays unreachable, the records wait in ``<run_dir>/tracking`` and the run carries the tag
``sparkgpu.tracking.unsent`` (when the store took that much); :func:`flush_spool` forwards
them once the store is back and ends the run as the job ended.
"""

from __future__ import annotations

import os
from pathlib import Path

from sparkgpu.errors import ConfigurationError, JobStateError, SparkGPUError
from sparkgpu.runtime import TRACKING_DIR

__all__ = ["flush_spool", "UNSENT_TAG"]

# Set on a run whose job ended with records still in its spool; removed once they are forwarded.
UNSENT_TAG = "sparkgpu.tracking.unsent"


def flush_spool(run_dir: str | os.PathLike, *, tracking_uri: str | None = None) -> int:
    """Forwards the tracking records a finished job left in its run dir to its MLflow run.

    Safe to call more than once: what was forwarded before is not sent again. The run is then
    ended with the job's status (FINISHED, FAILED or KILLED) if it still shows RUNNING, and
    loses its ``sparkgpu.tracking.unsent`` tag.

    Args:
        run_dir: The job's run directory (``sparkgpu jobs`` lists them).
        tracking_uri: The tracking store, when it is reached at another URI than the one the
            job used (recorded in ``<run_dir>/tracking/run.json``).

    Returns:
        How many records were forwarded.

    Raises:
        ConfigurationError: ``run_dir`` holds no tracked job.
        JobStateError: the job has not ended (its client may still be forwarding;
            ``sparkgpu resume`` continues a job whose client died).
        SparkGPUError: the store still cannot be reached; the records stay in the spool.
    """
    from mlflow import MlflowClient

    from sparkgpu.tracking.flusher import SpoolFlusher
    from sparkgpu.tracking.spool import SpoolDir

    spool = SpoolDir(Path(run_dir) / TRACKING_DIR)
    info = spool.read_run_info()
    if info is None:
        raise ConfigurationError(
            f"{run_dir} holds no tracked job ({spool.run_file} is missing); pass the run dir of a job that ran "
            "with MLflow tracking"
        )
    end = spool.read_job_end()
    if end is None:
        raise JobStateError(
            f"job {info.job_id} in {run_dir} has not ended, so its client may still be forwarding its tracking "
            f"records; wait for it to end, or if that client died, run `sparkgpu resume {info.job_id}`"
        )
    uri = tracking_uri or info.tracking_uri
    client = MlflowClient(uri, info.registry_uri)
    try:
        forwarded = SpoolFlusher(spool, client, info.run_id).drain(raise_errors=True)
        run = client.get_run(info.run_id)
        if end.get("error") and "sparkgpu.error" not in run.data.tags:
            client.set_tag(info.run_id, "sparkgpu.error", end["error"])
        if UNSENT_TAG in run.data.tags:
            client.delete_tag(info.run_id, UNSENT_TAG)
        if run.info.status == "RUNNING":
            client.set_terminated(info.run_id, end["status"], end_time=int(end["ended_at"] * 1000))
    except Exception as exc:
        raise SparkGPUError(
            f"could not forward the tracking records of job {info.job_id} to MLflow run {info.run_id} at {uri}: "
            f"{exc}. They stay in {spool.path}; call flush_spool again once the store is reachable"
        ) from exc
    return forwarded
