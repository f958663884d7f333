"""One MLflow run per job: created on the client, shared by every rank and every attempt.

:class:`MLflowCallback` hooks into the launcher (:mod:`sparkgpu.callbacks`):

* ``before_job`` (client): creates the experiment if missing and the job's run (or finds it
  again when a job is resumed), logs the job spec as params, the environment lock, the
  training function's source and the data source / version, writes ``run.json`` into the
  job's spool and starts the :class:`~sparkgpu.tracking.flusher.SpoolFlusher`.
* ``before_attempt`` (client): returns the workers' environment: ``MLFLOW_TRACKING_URI``
  pointing at the spool, ``MLFLOW_RUN_ID``, ``MLFLOW_EXPERIMENT_ID``, the real
  ``MLFLOW_REGISTRY_URI``; records restarts and resumes.
* ``on_worker_start`` / ``on_worker_end`` (every rank): rank 0 autologs optimizers, local
  rank 0 of each node runs the system-metrics monitor.
* ``after_attempt`` / ``after_job`` (client): attempt statuses and durations; the last
  records are flushed (a failing store is retried a few times; what it still refuses stays
  in the spool for :func:`~sparkgpu.tracking.flusher.flush_spool`) and the run ends FINISHED,
  FAILED or KILLED.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import logging
import os
import platform
import re
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkgpu.callbacks import AttemptOutcome, JobCallback, WorkerContext
from sparkgpu.errors import ConfigurationError, NodeLostError, WorkerFailedError, first_failure
from sparkgpu.failure_class import classify
from sparkgpu.rundir.states import AttemptStatus
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.tracking._permissions import translate_permission_errors
from sparkgpu.tracking.target import REAL_TRACKING_URI_ENV, default_experiment_name, ensure_experiment, resolve_target

if TYPE_CHECKING:
    from sparkgpu.tracking.spool import JobRunInfo

__all__ = ["MLflowCallback", "environment_lock"]

_logger = logging.getLogger(__name__)

_MAX_TAG_CHARS = 5000


_lock_cache: tuple[tuple, str] | None = None


def _install_state() -> tuple:
    """What changes when a distribution is installed or removed: the import path and the
    modification times of its directories (a new ``.dist-info`` changes its folder's)."""
    state: list[tuple[str, int | None]] = []
    for entry in sys.path:
        try:
            state.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            state.append((entry, None))
    return tuple(state)


def environment_lock() -> str:
    """A pip-freeze style lock of the installed distributions, from ``importlib.metadata``.

    As ``pip freeze`` writes them: ``name==version``, ``name @ url`` for URL installs and
    ``-e url`` for editable ones; a first comment line names the interpreter and platform.
    Reading every distribution's metadata takes a noticeable part of a second, so the lock is
    kept until a distribution is installed or removed.
    """
    global _lock_cache
    state = _install_state()
    if _lock_cache is not None and _lock_cache[0] == state:
        return _lock_cache[1]
    _lock_cache = (state, _read_environment_lock())
    return _lock_cache[1]


def _read_environment_lock() -> str:
    lines: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if not name:
            continue
        key = re.sub(r"[-_.]+", "-", name).lower()  # PEP 503 normalised name
        if key in lines:  # the first one on sys.path wins, as at import time
            continue
        entry = f"{name}=={dist.version}"
        direct = dist.read_text("direct_url.json")
        if direct:  # installed from a URL or a local folder: written as `pip freeze` does
            try:
                origin = json.loads(direct)
            except ValueError:
                origin = {}
            url = origin.get("url")
            if url and origin.get("dir_info", {}).get("editable"):
                entry = f"-e {url}"
            elif url:
                entry = f"{name} @ {url}"
        lines[key] = entry
    header = f"# python {platform.python_version()} ({sys.implementation.name}) on {platform.system().lower()}-{platform.machine()}\n"
    return header + "\n".join(lines[k] for k in sorted(lines)) + "\n"


def _function_source(fn) -> tuple[str | None, str | None]:
    if fn is None:
        return None, None
    target = inspect.unwrap(getattr(fn, "fn", fn))
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
    try:
        return name, inspect.getsource(target)
    except (OSError, TypeError):  # built in a REPL without source, or not a Python function
        return name, None


def _job_params(spec: dict) -> dict[str, str]:
    params: dict[str, str] = {}
    for key, value in (spec.get("resources") or {}).items():
        params[key] = str(value)
    for key, value in (spec.get("policy") or {}).items():
        if value is not None:
            params[f"policy.{key}"] = str(value)
    for key in ("backend", "simulated"):
        if spec.get(key) is not None:
            params[key] = str(spec[key])
    return params


def _dataset_input(source: str, version):
    """An MLflow dataset input for the run's "Datasets used" (source and version only)."""
    from mlflow.data.dataset_source import DatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    dataset_source: DatasetSource
    looks_like_path = "/" in source or "://" in source
    if looks_like_path and version is not None:
        from mlflow.data.delta_dataset_source import DeltaDatasetSource

        dataset_source = DeltaDatasetSource(path=source, delta_table_version=int(version))
    else:
        from mlflow.data.spark_dataset_source import SparkDatasetSource

        dataset_source = SparkDatasetSource(path=source) if looks_like_path else SparkDatasetSource(table_name=source)
    name = source.rstrip("/").rsplit("/", 1)[-1]
    # MLflow declares Dataset.profile abstract without ABCMeta, and MetaDataset (made to be
    # instantiated) does not define it: nothing abstract is left at runtime.
    dataset = MetaDataset(dataset_source, name=name)  # type: ignore[abstract]
    return DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", "training")])


class MLflowCallback(JobCallback):
    """Tracks a job in one MLflow run: spec, environment, metrics, system metrics, lineage.

    Args:
        experiment: Experiment name (created if missing); by default the calling script's or
            notebook's name.
        run_name: Run name; the job id by default.
        tags: Extra run tags (the job's own tags are added too).
        tracking_uri: Tracking store; by default ``MLFLOW_TRACKING_URI`` (or
            ``mlflow.set_tracking_uri``), else the embedded SQLite store.
        registry_uri: Model registry for workers that register models; derived from the
            tracking store by default.
        fn: The training function, whose source is logged as ``code/<name>.py``.
        data_source: Table name, path or URL of the training data.
        data_version: Version of that data (a Delta table version, a snapshot id, ...).
        autolog: Capture optimizer hyper-parameters and the learning rate on rank 0, and turn
            on ``mlflow.pytorch.autolog`` for Lightning when it is installed.
        lr_every_n_steps: Most frequent learning-rate logging (see :mod:`.autolog`).
        system_metrics: Run MLflow's system-metrics monitor on each node.
        system_metrics_interval: Seconds between system-metric samples.
        flush_interval: Seconds between two passes of the client's flusher.
        log_environment: Log the environment lock as ``environment/requirements.txt``.

    Raises:
        ConfigurationError: an interval is not positive.
    """

    reads_results = False  # after_job ends the run / the ledger row, whatever the job returned

    def __init__(
        self,
        experiment: str | None = None,
        *,
        run_name: str | None = None,
        tags: dict | None = None,
        tracking_uri: str | None = None,
        registry_uri: str | None = None,
        fn=None,
        data_source: str | None = None,
        data_version=None,
        autolog: bool = True,
        lr_every_n_steps: int = 10,
        system_metrics: bool = True,
        system_metrics_interval: float = 10.0,
        flush_interval: float = 1.0,
        log_environment: bool = True,
    ):
        for name, value in (("system_metrics_interval", system_metrics_interval), ("flush_interval", flush_interval)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigurationError(f"{name} must be a positive number of seconds, got {value!r}")
        if not isinstance(lr_every_n_steps, int) or lr_every_n_steps < 1:
            raise ConfigurationError(f"lr_every_n_steps must be an integer >= 1, got {lr_every_n_steps!r}")
        if experiment is not None and (not isinstance(experiment, str) or not experiment.strip()):
            raise ConfigurationError(f"experiment must be a non-empty name such as '/team/ctr', got {experiment!r}")
        self.experiment = experiment
        self.run_name = run_name
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.tracking_uri = tracking_uri
        self.registry_uri = registry_uri
        self.fn_name, self.fn_source = _function_source(fn)
        self.data_source = data_source
        self.data_version = data_version
        self.autolog = autolog
        self.lr_every_n_steps = lr_every_n_steps
        self.system_metrics = system_metrics
        self.system_metrics_interval = float(system_metrics_interval)
        self.flush_interval = float(flush_interval)
        self.log_environment = log_environment
        self._reset_runtime_state()

    def _reset_runtime_state(self) -> None:
        # Typed Any: set once before_job (client) or the worker's start ran, from modules
        # imported only then (MLflow takes seconds to import).
        self.run_info: JobRunInfo | None = None  # client side, once before_job ran
        self._client: Any = None
        self._flusher: Any = None
        self._spool: Any = None
        self._attempt_statuses: dict[int, str] = {}
        self._monitor: Any = None  # worker side
        self._monitor_starter: threading.Thread | None = None
        self._monitor_lock = threading.Lock()
        self._worker_ended = False
        self._lightning_autologged = False  # worker side: this callback turned MLflow's Lightning autolog on

    def __getstate__(self):
        # Travels to the workers in the payload: configuration only, never clients or threads.
        state = dict(self.__dict__)
        for key in (
            "run_info",
            "_client",
            "_flusher",
            "_spool",
            "_attempt_statuses",
            "_monitor",
            "_monitor_starter",
            "_monitor_lock",
            "_worker_ended",
            "_lightning_autologged",
        ):
            state.pop(key, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset_runtime_state()

    @property
    def run_id(self) -> str | None:
        """The job's MLflow run id (on the client, after ``before_job``)."""
        return self.run_info.run_id if self.run_info else None

    # -- client side ---------------------------------------------------------------------
    def before_job(self, job, run_dir: str) -> None:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        from sparkgpu.tracking.flusher import SpoolFlusher
        from sparkgpu.tracking.spool import SpoolDir

        target = resolve_target(self.tracking_uri, self.registry_uri)
        self._client = MlflowClient(target.tracking_uri, target.registry_uri)
        self._spool = SpoolDir(Path(run_dir) / RunLayout.TRACKING)
        spec = job.to_dict()
        experiment = self.experiment or default_experiment_name()
        try:
            with translate_permission_errors(
                f"create the job's run in experiment '{experiment}'",
                f"EDIT permission on experiment '{experiment}'",
                target.tracking_uri,
            ):
                info = self._spool.read_run_info()
                if info is None:
                    info = self._create_run(job, spec, experiment, target)
                else:  # a resumed job keeps its run
                    self._client.update_run(info.run_id, status="RUNNING")
                    self._spool.clear_job_end()
                    self._attempt_statuses = self._recorded_attempts(info.run_id)
        except MlflowException as exc:  # before any worker starts: the job does not run untracked
            raise ConfigurationError(
                f"could not set up the job's MLflow run at {target.tracking_uri}: {exc}. Check the tracking URI "
                "(MLFLOW_TRACKING_URI or MLflowCallback(tracking_uri=...)) and its credentials, or leave "
                "MLFLOW_TRACKING_URI unset to use the embedded store"
            ) from exc
        self.run_info = info
        self._flusher = SpoolFlusher(self._spool, self._client, info.run_id, self.flush_interval)
        self._flusher.start()

    def _create_run(self, job, spec: dict, experiment: str, target):
        from mlflow.entities import Param, RunTag
        from mlflow.store.artifact.mlflow_artifacts_repo import MlflowArtifactsRepository
        from mlflow.tracking.context.registry import resolve_tags

        from sparkgpu.tracking.spool import JobRunInfo

        client = self._client
        experiment_id = ensure_experiment(client, experiment, target)
        job_id = str(spec.get("job_id") or getattr(job, "job_id", ""))
        tags = {
            "sparkgpu.job_id": job_id,
            "sparkgpu.job_name": str(spec.get("name", "")),
            "sparkgpu.backend": str(spec.get("backend", "")),
            "sparkgpu.run_dir": str(self._spool.path.parent),
            **{str(k): str(v) for k, v in (spec.get("tags") or {}).items()},
            **self.tags,
        }
        if spec.get("devices"):
            tags["sparkgpu.devices"] = ",".join(map(str, spec["devices"]))
        fn_name, fn_source = self.fn_name, self.fn_source
        if fn_name is None and getattr(job, "fn", None) is not None:
            fn_name, fn_source = _function_source(job.fn)
        if fn_name:
            tags["sparkgpu.function"] = fn_name
        data = spec.get("data") or {}
        data_source = self.data_source or data.get("source")
        data_version = self.data_version if self.data_version is not None else data.get("version")
        if data_source:
            tags["sparkgpu.data.source"] = str(data_source)
        if data_version is not None:
            tags["sparkgpu.data.version"] = str(data_version)
        run = client.create_run(experiment_id, tags=resolve_tags(tags), run_name=self.run_name or job_id or None)
        run_id = run.info.run_id
        params = [Param(k, v) for k, v in _job_params(spec).items()]
        client.log_batch(run_id, params=params, tags=[RunTag("sparkgpu.attempts", "0")])
        if self.log_environment:
            client.log_text(run_id, environment_lock(), "environment/requirements.txt")
        if fn_source and fn_name:
            client.log_text(run_id, fn_source, f"code/{fn_name.rsplit('.', 1)[-1]}.py")
        if data_source:
            try:
                client.log_inputs(run_id, datasets=[_dataset_input(str(data_source), data_version)])
            except Exception as exc:  # the tags above already record source and version
                _logger.warning("sparkgpu: could not log %s as an MLflow dataset input: %s", data_source, exc)
        artifact_uri = run.info.artifact_uri
        if artifact_uri.startswith("mlflow-artifacts:"):
            # Workers track through the spool, so they cannot resolve server-relative URIs.
            artifact_uri = MlflowArtifactsRepository.resolve_uri(artifact_uri, target.tracking_uri)
        info = JobRunInfo(
            run_id=run_id,
            experiment_id=experiment_id,
            experiment_name=experiment,
            tracking_uri=target.tracking_uri,
            registry_uri=target.registry_uri,
            artifact_uri=artifact_uri,
            run_name=run.info.run_name,
            job_id=job_id,
            user_id=run.info.user_id or "unknown",
            started_at=time.time(),
        )
        self._spool.write_run_info(info)
        return info

    def _recorded_attempts(self, run_id: str) -> dict[int, str]:
        tags = self._client.get_run(run_id).data.tags
        statuses = {}
        for key, value in tags.items():
            parts = key.split(".")
            if len(parts) == 4 and parts[:2] == ["sparkgpu", "attempt"] and parts[3] == "status":
                statuses[int(parts[2])] = value
        return statuses

    def before_attempt(self, job, attempt: int) -> dict[str, str]:
        from sparkgpu.tracking.spool import JOB_SPOOL_URI, SPOOL_ENV
        from sparkgpu.tracking.system_metrics import DEVICES_ENV

        info = self.run_info
        if info is None:
            raise ConfigurationError("MLflowCallback.before_attempt ran before before_job; call before_job first")
        earlier = [s for a, s in self._attempt_statuses.items() if a < attempt]
        restarts, resumes = earlier.count(AttemptStatus.FAILED), earlier.count(AttemptStatus.PREEMPTED)
        self._safely(
            "record attempt start",
            self._client.log_batch,
            info.run_id,
            metrics=_metrics({"sparkgpu/restarts": restarts, "sparkgpu/resumes": resumes}, step=attempt),
            tags=_tags(
                {
                    "sparkgpu.attempt": attempt,
                    "sparkgpu.restarts": restarts,
                    "sparkgpu.resumes": resumes,
                    # Until its ranks start: a remote attempt may wait long for GPUs (unbilled).
                    f"sparkgpu.attempt.{attempt}.status": "waiting",
                }
            ),
        )
        env = {
            # Named relative to the run dir each node's launcher gives its ranks
            # (SPARKGPU_RUN_DIR): the same variables serve every node's copy of the run dir.
            "MLFLOW_TRACKING_URI": JOB_SPOOL_URI,
            "MLFLOW_RUN_ID": info.run_id,
            "MLFLOW_EXPERIMENT_ID": info.experiment_id,
            "MLFLOW_REGISTRY_URI": info.registry_uri,
            # The node monitor runs instead; MLflow's own would start one per rank.
            "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
            REAL_TRACKING_URI_ENV: info.tracking_uri,
            SPOOL_ENV: self._spool.path.name,
        }
        devices = getattr(job, "devices", None) or job.to_dict().get("devices") or ()
        if devices:
            env[DEVICES_ENV] = ",".join(map(str, devices))
        return env

    def on_ranks_started(self, job, attempt: int, started_at: float) -> None:
        if self.run_info is None:
            return
        self._safely(
            "record that the attempt's ranks started",
            self._client.set_tag,
            self.run_info.run_id,
            f"sparkgpu.attempt.{attempt}.status",
            "running",
        )

    def after_attempt(self, job, outcome: AttemptOutcome) -> None:
        if self.run_info is None:
            return
        self._attempt_statuses[outcome.attempt] = outcome.status.value
        duration = max(0.0, outcome.ended_at - outcome.started_at)
        self._safely(
            "record the attempt's outcome",
            self._client.log_batch,
            self.run_info.run_id,
            metrics=_metrics({"sparkgpu/attempt_duration_s": duration}, step=outcome.attempt),
            tags=_tags(
                {
                    f"sparkgpu.attempt.{outcome.attempt}.status": outcome.status.value,
                    f"sparkgpu.attempt.{outcome.attempt}.gpus": outcome.gpus,  # an elastic job's may differ
                    "sparkgpu.attempts": outcome.attempt + 1,
                    **(
                        {f"sparkgpu.attempt.{outcome.attempt}.cause": outcome.cause[:_MAX_TAG_CHARS]}
                        if outcome.cause
                        else {}
                    ),
                }
            ),
        )

    def on_straggler(self, job, attempt: int, straggler) -> None:
        if self.run_info is None:
            return
        self._safely(
            "record a straggler",
            self._client.log_batch,
            self.run_info.run_id,
            metrics=_metrics({f"sparkgpu/straggler_factor/rank-{straggler.rank}": straggler.factor}, step=attempt),
            tags=_tags(
                {
                    f"sparkgpu.straggler.rank-{straggler.rank}": (
                        f"node {straggler.node}, attempt {attempt}: {straggler.factor:.2f}x "
                        f"({straggler.lateness:.3f}s late a step of {straggler.step:.3f}s)"
                    )
                }
            ),
        )

    def after_job(self, job, results, error: BaseException | None) -> None:
        from sparkgpu.tracking.flusher import UNSENT_TAG

        if self.run_info is None:
            return
        run_id = self.run_info.run_id
        message = None
        if error is None:
            status = "FINISHED"
        else:
            status = "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
            message = f"{type(error).__name__}: {error}"[:_MAX_TAG_CHARS]
        # Recorded before anything can fail: whoever forwards the leftover ends the run so.
        self._safely("record how the job ended in its spool", self._spool.write_job_end, status, message)
        if self._flusher is not None:
            try:
                self._flusher.stop()  # retries a failing store a few times
            except Exception as exc:
                hint = (
                    f"the workers' last tracking records stay in {self._spool.path}: forward them with "
                    f"sparkgpu.tracking.flush_spool({str(self._spool.path.parent)!r}) once MLflow is reachable"
                )
                _logger.warning("sparkgpu: could not forward to MLflow run %s (%s); %s", run_id, exc, hint)
                self._safely("flag the run's unsent records", self._client.set_tag, run_id, UNSENT_TAG, hint)
        if message is not None:
            self._safely("record the job's error", self._client.set_tag, run_id, "sparkgpu.error", message)
        found = _failure_class(error)
        if found is not None:
            self._safely(
                "record the job's failure class", self._client.set_tag, run_id, "sparkgpu.failure_class", found
            )
        self._safely("end the run", self._client.set_terminated, run_id, status)

    def _safely(self, what: str, fn, *args, **kwargs) -> None:
        # Tracking must not change a job's outcome: an unreachable store is reported, and
        # the spool keeps the workers' records for `flush_spool` to forward later.
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            _logger.warning("sparkgpu: could not %s in MLflow run %s: %s", what, self.run_id, exc)

    # -- worker side ---------------------------------------------------------------------
    def on_worker_start(self, ctx: WorkerContext) -> None:
        from sparkgpu.tracking import autolog as _autolog
        from sparkgpu.tracking.spool import SpoolDir, SpoolWriter, register_spool_scheme, spool_path_from_env

        spool_path = spool_path_from_env()
        if not spool_path:
            _logger.warning(
                "sparkgpu: rank %d has no tracking spool (MLflowCallback.before_attempt did not run)", ctx.rank
            )
            return
        if "mlflow" in sys.modules:
            register_spool_scheme()  # cheap once MLflow is imported
        # MLflow's monitor announces every start and stop at INFO, on the user's console.
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        spool = SpoolDir(spool_path)
        info = spool.read_run_info()
        writer = SpoolWriter.for_process(spool, ctx.attempt, ctx.rank)
        session = _autolog._activate(writer, ctx.rank, ctx.world_size)
        if ctx.rank == 0:
            now = int(time.time() * 1000)
            writer.write(
                metrics=[("world_size", ctx.world_size, ctx.attempt, now)],
                params=[("world_size", str(ctx.world_size))] if ctx.attempt == 0 else (),
            )
            if self.autolog:
                session.autolog = _autolog.OptimizerAutolog(writer, self.lr_every_n_steps)
                session.autolog.install()
        lightning_patched = self.autolog and _lightning_imported()
        if lightning_patched:
            # The function's module imported Lightning when it was unpickled: patch its
            # Trainer before the function can call fit (importing MLflow costs seconds).
            self._lightning_autologged = _lightning_autolog()
        # Importing MLflow takes seconds; the training function need not wait for it, nor a
        # short job's end. Until the scheme is registered here, MLflow finds the spool store
        # through this package's `mlflow.tracking_store` entry point.
        self._monitor_starter = threading.Thread(
            target=self._start_mlflow,
            args=(ctx, info, spool.uri, lightning_patched),
            name="sparkgpu-mlflow-start",
            daemon=True,
        )
        self._monitor_starter.start()

    def _start_mlflow(self, ctx: WorkerContext, info, spool_uri: str, lightning_patched: bool) -> None:
        from sparkgpu.tracking.spool import register_spool_scheme

        try:
            register_spool_scheme()
        except Exception as exc:  # the entry point still serves plain MLflow calls
            _logger.warning("sparkgpu: could not register the spool store with MLflow: %s", exc)
        if self.autolog and not lightning_patched and _lightning_imported() and not self._worker_ended:
            # Imported inside the function's body: patched as soon as MLflow is ready here.
            on = _lightning_autolog()
            with self._monitor_lock:
                ended = self._worker_ended  # the function finished meanwhile: undone at once
                self._lightning_autologged = on and not ended
            if on and ended:
                _lightning_autolog(disable=True)
        if self.system_metrics and ctx.local_rank == 0:
            self._start_monitor(ctx, info, spool_uri)

    def _start_monitor(self, ctx: WorkerContext, info, spool_uri: str) -> None:
        from sparkgpu.tracking.system_metrics import NodeMetricsMonitor, job_gpu_devices

        try:
            devices = job_gpu_devices() if ctx.device.startswith("cuda") else []
            monitor = NodeMetricsMonitor(
                info.run_id,
                node_rank=ctx.node_rank,
                tracking_uri=spool_uri,
                interval=self.system_metrics_interval,
                job_started_at=info.started_at,
                gpu_devices=devices,
            )
            with self._monitor_lock:
                if self._worker_ended:  # the function finished before MLflow was even imported
                    return
                monitor.start()
                self._monitor = monitor
        except Exception as exc:  # system metrics are an extra: training goes on without them
            _logger.warning("sparkgpu: system metrics are off on node %d: %s", ctx.node_rank, exc)

    def on_worker_end(self, ctx: WorkerContext, error: BaseException | None) -> None:
        from sparkgpu.tracking import autolog as _autolog

        # A short job does not wait for MLflow's import to finish only to stop its monitor:
        # the starter (a daemon thread) sees the flag and never starts it.
        with self._monitor_lock:
            self._worker_ended = True
            monitor, self._monitor = self._monitor, None
            autologged, self._lightning_autologged = self._lightning_autologged, False
        self._monitor_starter = None
        if monitor is not None:
            monitor.finish()
        if autologged:
            # MLflow patches Lightning's Trainer for the whole process: a process that runs
            # more than this job (a notebook's, a test's) must not log its next fit as this job.
            _lightning_autolog(disable=True)
        _autolog._deactivate()


def _lightning_imported() -> bool:
    return "lightning" in sys.modules or "pytorch_lightning" in sys.modules


def _lightning_autolog(disable: bool = False) -> bool:
    """Turns MLflow's autologging of Lightning's Trainer on (or off); whether it did."""
    try:
        import mlflow.pytorch

        mlflow.pytorch.autolog(log_models=False, checkpoint=False, silent=True, disable=disable)
    except Exception as exc:  # autologging is an extra: training goes on without it
        _logger.warning("sparkgpu: Lightning autologging is off: %s", exc)
        return False
    return True


def _metrics(values: dict, step: int):
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    return [Metric(k, float(v), now, step) for k, v in values.items()]


def _tags(values: dict):
    from mlflow.entities import RunTag

    return [RunTag(k, str(v)) for k, v in values.items()]


def _failure_class(error: BaseException | None) -> str | None:
    """The class of a job's failure (:func:`~sparkgpu.failure_class.classify`), when its ranks failed."""
    if not isinstance(error, WorkerFailedError) or not error.failures:
        return None
    root = first_failure(error.failures)
    # The supervisor raises the ranks' error from the root cause rank's own exception.
    exceptions = {root.rank: error.__cause__} if error.__cause__ is not None else {}
    lost = error.lost if isinstance(error, NodeLostError) else ""
    return classify(error.failures, exceptions, lost=lost).cls.value
