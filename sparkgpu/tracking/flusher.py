"""Client-side forwarding of a job's tracking spool to MLflow: :class:`SpoolFlusher`, and
:func:`flush_spool` for what a job left unsent.

The flusher runs in the client and is the only writer of worker data to the store: it tails
the record files that the ranks append to in the job's spool directory and forwards them
with ``log_batch`` in chunks within MLflow's limits, remembering how far it got in the
spool's ``flusher.json`` so that a client that resumes the job does not forward anything
twice. The spool's format and the workers' side of it (the MLflow store that writes into
it) are in :mod:`sparkgpu.tracking.spool`.

At the job's end the flusher retries a failing store a few times (:meth:`SpoolFlusher.stop`).
When the store stays unreachable, the records wait in ``<run_dir>/tracking`` and the run carries
the tag ``sparkgpu.tracking.unsent`` (when the store took that much); :func:`flush_spool`
forwards them once the store is back and ends the run as the job ended.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.errors import ConfigurationError, JobStateError, SparkGPUError
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.tracking.spool import SpoolDir

__all__ = ["SpoolFlusher", "flush_spool", "UNSENT_TAG"]

# The spool's one logger name, which users' logging set-ups configure.
_logger = logging.getLogger(__name__)

_MAX_METRICS_PER_CALL = 1000  # MLflow's log_batch limits
_MAX_PARAMS_TAGS_PER_CALL = 100


@dataclasses.dataclass
class _Batch:
    metrics: list = dataclasses.field(default_factory=list)
    params: list = dataclasses.field(default_factory=list)
    tags: list = dataclasses.field(default_factory=list)
    checkpoints: list = dataclasses.field(default_factory=list)

    def add(self, record: dict) -> None:
        self.metrics.extend(record.get("m", ()))
        self.params.extend(record.get("p", ()))
        self.tags.extend(record.get("g", ()))
        self.checkpoints.extend(record.get("c", ()))


class SpoolFlusher:
    """Forwards spooled records to the job's run; the only writer of worker data to the store.

    Records are forwarded range by range: a pass reads every complete record not forwarded
    yet, then sends that range in ``log_batch`` chunks. What each chunk carried counts as sent
    only once its call succeeded, and a range that failed part-way is finished first by the
    next pass (of this flusher, or of a resumed client that reads ``flusher.json``), so a
    flaky store neither loses records nor receives them twice.

    Args:
        spool: The job's spool directory.
        client: An ``MlflowClient`` on the real tracking store.
        run_id: The job's run.
        interval: Seconds between two passes of the background thread.
        stop_attempts: Passes :meth:`stop` tries before it gives up on an unreachable store.
        stop_backoff: Seconds before the second of those passes, doubled for each later one.
    """

    def __init__(
        self,
        spool: SpoolDir,
        client,
        run_id: str,
        interval: float = 1.0,
        *,
        stop_attempts: int = 3,
        stop_backoff: float = 1.0,
    ):
        self.spool = spool
        self.client = client
        self.run_id = run_id
        self.interval = interval
        self.stop_attempts = max(1, int(stop_attempts))
        self.stop_backoff = stop_backoff
        self._offsets: dict[str, int] = {}
        self._params: dict[str, str] = {}
        self._checkpoints: list[dict] = []
        # The range being forwarded: its end offsets and how many of its tags and metrics
        # went through already; None between ranges.
        self._pending: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drain_lock = threading.Lock()
        self._last_warning = 0.0
        if spool.state_file.exists():
            self.load_state_dict(json.loads(spool.state_file.read_text()))

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "offsets": dict(self._offsets),
            "params": dict(self._params),
            "checkpoints": list(self._checkpoints),
            "pending": None if self._pending is None else json.loads(json.dumps(self._pending)),
        }

    def load_state_dict(self, state: dict) -> None:
        self._offsets = dict(state.get("offsets", {}))
        self._params = dict(state.get("params", {}))
        self._checkpoints = list(state.get("checkpoints", []))
        self._pending = state.get("pending")

    def _save_state(self) -> None:
        atomic_write_bytes(self.spool.state_file, json.dumps(self.state_dict()).encode())

    @property
    def checkpoints(self) -> list[dict]:
        """Checkpoint lineage forwarded so far: ``{"step", "path", "timestamp"}`` dicts."""
        return list(self._checkpoints)

    # -- background thread ---------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="sparkgpu-tracking-flusher", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stops the thread, then forwards whatever the workers left.

        A store that fails is tried ``stop_attempts`` times with a doubling pause in between;
        then the error is raised and the records stay in the spool, where
        :func:`sparkgpu.tracking.flush_spool` forwards them later.
        """
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        for attempt in range(1, self.stop_attempts + 1):
            try:
                self.drain(raise_errors=True)
                return
            except Exception as exc:
                if attempt == self.stop_attempts:
                    raise
                delay = self.stop_backoff * 2 ** (attempt - 1)
                _logger.warning(
                    "sparkgpu: could not forward the last tracking data to MLflow (%s); retrying in %.1f s", exc, delay
                )
                time.sleep(delay)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.drain()

    # -- one pass ------------------------------------------------------------------------
    def drain(self, raise_errors: bool = False) -> int:
        """Forwards every complete record not forwarded yet; returns how many were forwarded.

        A store that cannot be reached leaves the records in the spool for the next pass
        (the error is logged, or raised with ``raise_errors``); what already went through
        is remembered and not sent again.
        """
        with self._drain_lock:
            forwarded = 0
            try:
                if self._pending is not None:  # a range that failed part-way is finished first
                    forwarded += self._forward_range(*self._read(self._pending["offsets"]))
                batch, offsets, count = self._read(None)
                if count:
                    self._pending = {"offsets": offsets, "tags": 0, "metrics": 0}
                    forwarded += self._forward_range(batch, offsets, count)
            except Exception as exc:
                self._save_state()  # what went through stays sent, also for a resumed client
                if raise_errors:
                    raise
                if time.monotonic() - self._last_warning > 60:
                    self._last_warning = time.monotonic()
                    _logger.warning("sparkgpu: could not forward tracking data to MLflow yet (%s); retrying", exc)
            return forwarded

    def _forward_range(self, batch: "_Batch", offsets: dict[str, int], count: int) -> int:
        assert self._pending is not None  # the range's progress, recorded before it is forwarded
        self._forward(batch, self._pending)
        self._offsets.update(offsets)
        self._pending = None
        self._save_state()
        return count

    def _read(self, limits: dict[str, int] | None) -> tuple[_Batch, dict[str, int], int]:
        """Records after the forwarded offsets: up to ``limits`` (a range read before), or
        every complete line when ``limits`` is None."""
        batch, count = _Batch(), 0
        offsets: dict[str, int] = {}
        if not self.spool.records_dir.exists():
            return batch, offsets, 0
        for path in sorted(self.spool.records_dir.glob("*.jsonl")):
            if limits is not None and path.name not in limits:
                continue
            start = self._offsets.get(path.name, 0)
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read() if limits is None else f.read(max(0, limits[path.name] - start))
            end = data.rfind(b"\n") + 1  # a trailing partial line is still being written
            if end == 0:
                continue
            for line in data[:end].splitlines():
                try:
                    batch.add(json.loads(line))
                    count += 1
                except (ValueError, AttributeError):
                    _logger.warning("sparkgpu: skipping a corrupt tracking record in %s", path)
            offsets[path.name] = start + end
        return batch, offsets, count

    def _forward(self, batch: _Batch, progress: dict) -> None:
        """Sends one range; ``progress`` and the known params record each call that succeeded."""
        from mlflow.entities import Metric, Param, RunTag

        params: dict[str, str] = {}
        for key, value in batch.params:
            known = self._params.get(key, params.get(key))
            if known is None:
                params[key] = value
            elif known != value:
                _logger.warning(
                    "sparkgpu: param %r was logged as %r and then %r; MLflow params cannot change, "
                    "so the second value is dropped. Log values that change as metrics.",
                    key,
                    known,
                    value,
                )
        items = list(params.items())
        for i in range(0, len(items), _MAX_PARAMS_TAGS_PER_CALL):
            chunk = items[i : i + _MAX_PARAMS_TAGS_PER_CALL]
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in chunk])
            self._params.update(chunk)
        tags = {key: value for key, value in batch.tags}  # the last value of a tag wins
        tag_list = [RunTag(k, v) for k, v in tags.items()]
        for i in range(progress["tags"], len(tag_list), _MAX_PARAMS_TAGS_PER_CALL):
            tag_chunk = tag_list[i : i + _MAX_PARAMS_TAGS_PER_CALL]
            self.client.log_batch(self.run_id, tags=tag_chunk)
            progress["tags"] = i + len(tag_chunk)
        metrics = [Metric(k, float(v), int(ts), int(s)) for k, v, s, ts in batch.metrics]
        for i in range(progress["metrics"], len(metrics), _MAX_METRICS_PER_CALL):
            metric_chunk = metrics[i : i + _MAX_METRICS_PER_CALL]
            self.client.log_batch(self.run_id, metrics=metric_chunk)
            progress["metrics"] = i + len(metric_chunk)
        if batch.checkpoints:
            self._forward_checkpoints(batch.checkpoints)

    def _forward_checkpoints(self, records: list) -> None:
        from mlflow.entities import Metric, RunTag

        seen = {(c["step"], c["path"]) for c in self._checkpoints}
        new: list[dict[str, Any]] = []
        for step, path, ts in records:
            if (step, path) not in seen:
                seen.add((step, path))
                new.append({"step": int(step), "path": str(path), "timestamp": int(ts)})
        if not new:
            return
        lineage = sorted(self._checkpoints + new, key=lambda c: (c["step"], c["timestamp"]))
        latest = lineage[-1]
        # The artifact goes first: writing it again after a failure is harmless, while the
        # metric points of the call below must go exactly once.
        self.client.log_text(self.run_id, json.dumps(lineage, indent=2), "lineage/checkpoints.json")
        self.client.log_batch(
            self.run_id,
            metrics=[Metric("checkpoint/step", c["step"], c["timestamp"], c["step"]) for c in new],
            tags=[
                RunTag("sparkgpu.checkpoint.latest_path", latest["path"]),
                RunTag("sparkgpu.checkpoint.latest_step", str(latest["step"])),
            ],
        )
        self._checkpoints = lineage


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

    spool = SpoolDir(Path(run_dir) / RunLayout.TRACKING)
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
