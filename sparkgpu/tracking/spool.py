"""Single-writer tracking: ranks append to files, one flusher on the client writes to MLflow.

Why: many ranks writing into one SQLite file fail with "database is locked" once writes
queue up behind each other, and a flaky tracking server should never kill a week-long
training run. So no rank ever writes to the store. Each worker process appends its records
(metrics, params, tags, checkpoints) as JSON lines to its own file in the job's spool
directory, ``<run_dir>/tracking``; the client's
:class:`~sparkgpu.tracking.flusher.SpoolFlusher` tails those files and forwards them with
``log_batch`` in chunks, remembering how far it got in a small state file so that a client
that resumes the job does not forward anything twice.

Workers reach the spool through MLflow itself: their ``MLFLOW_TRACKING_URI`` is
``sparkgpu-spool:///<spool dir>`` and ``SpoolStore`` serves that scheme, so
``mlflow.log_metric`` in user code lands in the job's run too. Writes to the job's run go to
the spool; everything else (artifacts, other runs, logged models) goes to the real store.

The alternative considered was a local ``mlflow server`` on loopback as the single writer.
It costs a server start per job (seconds), a port, and does not reach ranks on other hosts;
the spool only needs the run directory that workers and client already share.

This module holds the spool's format (:class:`JobRunInfo`, :class:`SpoolDir`,
:class:`SpoolWriter`) and the worker side, the MLflow tracking store over the spool
(:func:`spool_store`, :func:`register_spool_scheme`); the client side, which forwards the
records to the store, is :mod:`sparkgpu.tracking.flusher`.

Spool layout::

    run.json                       the job's run (id, experiment, stores), written by the client
    records/a<k>.r<rank>.p<pid>.jsonl   one file per worker process and attempt
    flusher.json                   how far the flusher got, params seen, checkpoint lineage
    end.json                       how the job ended, written by the client when it ends
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.runtime import ENV_RUN_DIR
from sparkgpu.tracking.target import REAL_TRACKING_URI_ENV, SPOOL_SCHEME

__all__ = [
    "JobRunInfo",
    "SpoolDir",
    "SpoolWriter",
    "register_spool_scheme",
    "spool_store",
    "job_spool_writer",
    "SPOOL_ENV",
    "spool_path_from_env",
    "JOB_SPOOL_URI",
]

SPOOL_ENV = "SPARKGPU_TRACKING_SPOOL"


#: The tracking URI the ranks get: their job's spool, wherever their node's run dir is.
JOB_SPOOL_URI = f"{SPOOL_SCHEME}:"


def spool_path_from_env(environ=None) -> str | None:
    """This process's job spool: ``SPARKGPU_TRACKING_SPOOL``, which names it relative to the run
    dir its node runs (``SPARKGPU_RUN_DIR``, set by the node's launcher), or as an absolute
    path; ``None`` outside a tracked job.

    A relative name is what lets every node of a job find the spool in its own copy of the run
    dir (a scratch copy when the staging root is an object store) without rewriting paths.
    """
    environ = os.environ if environ is None else environ
    path = environ.get(SPOOL_ENV)
    if not path or os.path.isabs(path):
        return path or None
    run_dir = environ.get(ENV_RUN_DIR)
    return os.path.join(run_dir, path) if run_dir else None


@dataclasses.dataclass(frozen=True)
class JobRunInfo:
    """The MLflow run of one job, as workers and resumed clients find it in ``run.json``."""

    run_id: str
    experiment_id: str
    experiment_name: str
    tracking_uri: str
    registry_uri: str
    artifact_uri: str
    run_name: str
    job_id: str
    user_id: str
    started_at: float


class SpoolDir:
    """The job's spool directory (``<run_dir>/tracking``)."""

    def __init__(self, path):
        self.path = Path(path)

    @property
    def run_file(self) -> Path:
        return self.path / RunLayout.TRACKING_RUN_FILE

    @property
    def records_dir(self) -> Path:
        return self.path / RunLayout.TRACKING_RECORDS_DIR

    @property
    def state_file(self) -> Path:
        return self.path / "flusher.json"

    @property
    def end_file(self) -> Path:
        return self.path / "end.json"

    @property
    def uri(self) -> str:
        """Tracking URI that makes a worker's MLflow client write into this spool."""
        return f"{SPOOL_SCHEME}://" + urllib.parse.quote(str(self.path.resolve()))

    @classmethod
    def from_uri(cls, uri: str) -> "SpoolDir":
        """The spool a ``sparkgpu-spool://PATH`` URI names; ``sparkgpu-spool:`` alone names this
        process's job spool (:func:`spool_path_from_env`)."""
        path = urllib.parse.unquote(urllib.parse.urlparse(uri).path)
        if not path:
            from_env = spool_path_from_env()
            if from_env is None:
                raise ValueError(
                    f"{uri} names this job's spool, and {SPOOL_ENV} / {ENV_RUN_DIR} are not set in this process"
                )
            path = from_env
        return cls(path)

    def read_run_info(self) -> JobRunInfo | None:
        if not self.run_file.exists():
            return None
        return JobRunInfo(**json.loads(self.run_file.read_text()))

    def write_run_info(self, info: JobRunInfo) -> None:
        self.records_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.run_file, json.dumps(dataclasses.asdict(info), indent=2).encode())

    def read_job_end(self) -> dict | None:
        """How the job ended (``status``, ``error``, ``ended_at``), or ``None`` while it runs."""
        if not self.end_file.exists():
            return None
        return json.loads(self.end_file.read_text())

    def write_job_end(self, status: str, error: str | None) -> None:
        """Records the run's final status, so that whoever forwards the spool's leftover
        later ends the run as the job ended."""
        atomic_write_bytes(
            self.end_file, json.dumps({"status": status, "error": error, "ended_at": time.time()}).encode()
        )

    def clear_job_end(self) -> None:
        """The job runs again (resumed): it has not ended."""
        self.end_file.unlink(missing_ok=True)


class SpoolWriter:
    """Appends this process's records to its own file; thread-safe, one syscall per record.

    Each record is one JSON line written with a single ``os.write`` on an ``O_APPEND`` file
    owned by this process alone, so a reader sees whole lines or a trailing partial line it
    leaves for later, never interleaved writes.
    """

    _by_path: dict[str, "SpoolWriter"] = {}
    _lock = threading.Lock()

    def __init__(self, spool: SpoolDir, attempt: int, rank: int):
        spool.records_dir.mkdir(parents=True, exist_ok=True)
        self.pid = os.getpid()
        self.file = spool.records_dir / f"a{attempt}.r{rank}.p{self.pid}.jsonl"
        self._fd = os.open(self.file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._write_lock = threading.Lock()

    @classmethod
    def for_process(cls, spool: SpoolDir, attempt: int | None = None, rank: int | None = None) -> "SpoolWriter":
        """The writer of this process for ``spool`` (a new one after a fork)."""
        attempt = int(os.environ.get("SPARKGPU_ATTEMPT", 0)) if attempt is None else attempt
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        key = f"{spool.path.resolve()}|{attempt}|{rank}"
        with cls._lock:
            writer = cls._by_path.get(key)
            if writer is None or writer.pid != os.getpid():
                writer = cls._by_path[key] = cls(spool, attempt, rank)
            return writer

    def write(self, *, metrics=(), params=(), tags=(), checkpoints=()) -> None:
        """Appends one record.

        Args:
            metrics: ``(key, value, step, timestamp_ms)`` tuples.
            params: ``(key, value)`` string pairs.
            tags: ``(key, value)`` string pairs.
            checkpoints: ``(step, path, timestamp_ms)`` tuples.
        """
        record: dict[str, Any] = {}
        if metrics:
            record["m"] = [list(m) for m in metrics]
        if params:
            record["p"] = [list(p) for p in params]
        if tags:
            record["g"] = [list(t) for t in tags]
        if checkpoints:
            record["c"] = [list(c) for c in checkpoints]
        if not record:
            return
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._write_lock:
            written = os.write(self._fd, data)
            while written < len(data):  # only on a full disk or a signal mid-write
                written += os.write(self._fd, data[written:])


def job_spool_writer() -> SpoolWriter | None:
    """This process's writer into its job's spool, or ``None`` outside a job with tracking."""
    path = spool_path_from_env()
    return SpoolWriter.for_process(SpoolDir(path)) if path else None


# -- the worker side: an MLflow tracking store over the spool -----------------------------


def _job_run_entities(info: JobRunInfo):
    from mlflow.entities import Experiment, Run, RunData, RunInfo

    run_info = RunInfo(
        run_id=info.run_id,
        experiment_id=info.experiment_id,
        user_id=info.user_id,
        status="RUNNING",
        start_time=int(info.started_at * 1000),
        end_time=None,
        lifecycle_stage="active",
        artifact_uri=info.artifact_uri,
        run_name=info.run_name,
    )
    experiment = Experiment(info.experiment_id, info.experiment_name, info.artifact_uri.rsplit("/", 2)[0], "active")
    return Run(run_info, RunData()), experiment


def _delegating(name: str):
    def method(self, *args, **kwargs):
        return getattr(self._real_store(), name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"Forwarded to the real tracking store ({name} is not spooled)."
    return method


# Everything except the job run's own writes goes straight to the real store.
_DELEGATED = (
    "search_experiments",
    "create_experiment",
    "get_experiment_by_name",
    "delete_experiment",
    "restore_experiment",
    "rename_experiment",
    "set_experiment_tag",
    "delete_experiment_tag",
    "create_run",
    "delete_run",
    "restore_run",
    "delete_tag",
    "get_metric_history",
    "_search_runs",
    "search_runs",
    "log_inputs",
    "log_outputs",
    "link_traces_to_run",
    "record_logged_model",
    "create_logged_model",
    "search_logged_models",
    "finalize_logged_model",
    "set_logged_model_tags",
    "delete_logged_model_tag",
    "get_logged_model",
    "delete_logged_model",
    "set_model_versions_tags",
    "log_logged_model_params",
    "start_trace",
    "get_trace_info",
    "get_trace",
    "search_traces",
)


def _spool_store_class():
    from mlflow.store.tracking.abstract_store import AbstractStore

    class SpoolStore(AbstractStore):
        """MLflow tracking store of a worker: the job run's writes go to the spool.

        ``get_run`` of the job's run answers from ``run.json`` with status RUNNING and no
        data (workers do not read the store), and status changes are ignored: the client owns
        the run's lifecycle, so a rank that exits (and MLflow's ``atexit`` that ends its
        "active run") never marks the whole job finished.
        """

        def __init__(self, store_uri: str, artifact_uri: str | None = None):
            super().__init__()
            from mlflow.exceptions import MlflowException

            self.spool = SpoolDir.from_uri(store_uri)
            info = self.spool.read_run_info()
            if info is None:
                raise MlflowException(
                    f"{store_uri} holds no job run (missing {self.spool.run_file}); this tracking URI is "
                    "set by sparkgpu for the workers of a running job and cannot be used elsewhere"
                )
            self.info = info
            self._run, self._experiment = _job_run_entities(info)
            self._real = None
            self._real_lock = threading.Lock()
            self._own_writer: SpoolWriter | None = None

        def _real_store(self):
            with self._real_lock:
                if self._real is None:
                    from mlflow.tracking._tracking_service.utils import _get_store

                    self._real = _get_store(os.environ.get(REAL_TRACKING_URI_ENV) or self.info.tracking_uri)
                return self._real

        def _writer(self) -> SpoolWriter:
            writer = self._own_writer
            if writer is None or writer.pid != os.getpid():  # first use, or after a fork
                writer = self._own_writer = SpoolWriter.for_process(self.spool)
            return writer

        def get_run(self, run_id):
            if run_id == self.info.run_id:
                return self._run
            return self._real_store().get_run(run_id)

        def get_experiment(self, experiment_id):
            if str(experiment_id) == self.info.experiment_id:
                return self._experiment
            return self._real_store().get_experiment(experiment_id)

        def update_run_info(self, run_id, run_status, end_time, run_name):
            if run_id == self.info.run_id:
                return self._run.info
            return self._real_store().update_run_info(run_id, run_status, end_time, run_name)

        def log_batch(self, run_id, metrics, params, tags):
            if run_id != self.info.run_id:
                return self._real_store().log_batch(run_id, metrics, params, tags)
            from mlflow.utils.validation import _validate_batch_log_data

            metrics, params, tags = _validate_batch_log_data(metrics, params, tags)
            self._writer().write(
                metrics=[(m.key, m.value, m.step, m.timestamp) for m in metrics],
                params=[(p.key, str(p.value)) for p in params],
                tags=[(t.key, str(t.value)) for t in tags],
            )
            return None

    for name in _DELEGATED:
        if hasattr(AbstractStore, name) and name not in SpoolStore.__dict__:
            setattr(SpoolStore, name, _delegating(name))
    abc.update_abstractmethods(SpoolStore)
    return SpoolStore


def spool_store(store_uri: str, artifact_uri: str | None = None):
    """Builds the ``SpoolStore`` for a ``sparkgpu-spool://`` URI.

    MLflow calls it for that scheme once :func:`register_spool_scheme` ran, or in any process
    when the package declares it as a ``mlflow.tracking_store`` entry point.
    """
    global _store_class
    if _store_class is None:
        _store_class = _spool_store_class()
    return _store_class(store_uri, artifact_uri)


_store_class = None
_registered = False


def register_spool_scheme() -> None:
    """Teaches this process's MLflow the ``sparkgpu-spool`` tracking URI scheme (idempotent)."""
    global _registered
    if _registered:
        return
    from mlflow.tracking._tracking_service import utils as tracking_utils

    tracking_utils._register(SPOOL_SCHEME, spool_store)
    _registered = True
