"""Where runs and models are kept: the embedded SQLite store by default, any MLflow URI otherwise.

The embedded store lives under ``<SPARKGPU_HOME>/mlflow``: ``mlflow.db`` (runs, metrics and
the model registry) with an ``artifacts/`` folder beside it. It is used unless a tracking URI
is given explicitly, through ``MLFLOW_TRACKING_URI`` or with ``mlflow.set_tracking_uri``.

MLflow builds SQLite stores with ``./mlruns`` (relative to the working directory) as their
default artifact root, so every experiment this module creates in a SQLite store (the
embedded one or another) gets an explicit location in an ``artifacts/`` folder beside the
database file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import sys
import urllib.parse
from pathlib import Path

from sparkgpu._util.modules import imported
from sparkgpu.config import settings

__all__ = [
    "TrackingTarget",
    "SPOOL_SCHEME",
    "REAL_TRACKING_URI_ENV",
    "embedded_store_dir",
    "embedded_tracking_uri",
    "resolve_target",
    "ensure_experiment",
    "default_experiment_name",
]

# Tracking URIs of this scheme point a worker's MLflow client at the job's spool directory
# (see sparkgpu.tracking.spool); the real store is then named by REAL_TRACKING_URI_ENV.
SPOOL_SCHEME = "sparkgpu-spool"
REAL_TRACKING_URI_ENV = "SPARKGPU_MLFLOW_TRACKING_URI"

_UC_REGISTRY_SCHEMES = ("databricks-uc", "uc")


@dataclasses.dataclass(frozen=True)
class TrackingTarget:
    """A resolved pair of stores.

    Attributes:
        tracking_uri: Where runs, params and metrics go.
        registry_uri: Where registered models go.
        embedded: True for the embedded SQLite store under ``SPARKGPU_HOME``.
        artifact_root: Root URI for the artifacts of experiments created here: beside the
            database for SQLite stores (the embedded one included), ``None`` for servers
            (the server decides).
    """

    tracking_uri: str
    registry_uri: str
    embedded: bool
    artifact_root: str | None = None

    @property
    def is_unity_catalog(self) -> bool:
        """True when models go to a Unity Catalog registry, which takes three-level names as they are."""
        scheme = self.registry_uri.split(":", 1)[0]
        return self.registry_uri in _UC_REGISTRY_SCHEMES or scheme in _UC_REGISTRY_SCHEMES


def embedded_store_dir() -> Path:
    """Folder of the embedded store: ``<SPARKGPU_HOME>/mlflow``."""
    return settings().home / "mlflow"


def embedded_tracking_uri() -> str:
    """SQLite URI of the embedded store (the file is created on first use)."""
    return "sqlite:///" + str((embedded_store_dir() / "mlflow.db").resolve())


_initialised: set[str] = set()


def _ensure_embedded_store() -> tuple[str, str]:
    """Creates (or migrates) the embedded database once per process, under a file lock.

    Two clients starting on a fresh database would otherwise both run MLflow's schema
    migrations and one of them fail.
    """
    folder = embedded_store_dir()
    uri = embedded_tracking_uri()
    artifact_root = (folder / "artifacts").resolve().as_uri()
    if uri in _initialised:
        return uri, artifact_root
    import filelock
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    (folder / "artifacts").mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(folder / ".init.lock"), timeout=300):
        # Building the store creates the schema and the "Default" experiment, whose artifact
        # location then lies inside the embedded folder instead of the working directory.
        SqlAlchemyStore(uri, artifact_root)
    _initialised.add(uri)
    return uri, artifact_root


def _user_tracking_uri() -> str | None:
    """The tracking URI the user chose (env var or ``mlflow.set_tracking_uri``), if any."""
    env_uri = os.environ.get("MLFLOW_TRACKING_URI")
    if env_uri and env_uri.startswith(SPOOL_SCHEME + ":"):
        # Inside a job's worker: the spool stands in for the store named here.
        return os.environ.get(REAL_TRACKING_URI_ENV) or None
    if env_uri:
        return env_uri
    if imported("mlflow") is not None:
        from mlflow.tracking._tracking_service import utils as tracking_utils

        if tracking_utils.is_tracking_uri_set():
            return tracking_utils.get_tracking_uri()
    return None


def resolve_target(tracking_uri: str | None = None, registry_uri: str | None = None) -> TrackingTarget:
    """Resolves where runs and models go.

    Args:
        tracking_uri: Explicit tracking URI; by default the one the user set for MLflow,
            else the embedded store.
        registry_uri: Explicit registry URI; by default ``MLFLOW_REGISTRY_URI`` or
            ``mlflow.set_registry_uri``, else what MLflow derives from the tracking URI
            (``databricks`` tracking means the ``databricks-uc`` registry).

    Returns:
        The resolved :class:`TrackingTarget`; the embedded database exists when it is used.
    """
    from mlflow.tracking._model_registry import utils as registry_utils

    uri = tracking_uri or _user_tracking_uri()
    embedded = uri is None
    artifact_root: str | None
    if uri is None:
        uri, artifact_root = _ensure_embedded_store()
    else:
        artifact_root = _sqlite_artifact_root(uri)
    registry = registry_uri or os.environ.get("MLFLOW_REGISTRY_URI") or registry_utils._registry_uri
    if not registry:
        registry = registry_utils._get_default_registry_uri_for_tracking_uri(uri) or uri
    if registry == embedded_tracking_uri():
        _ensure_embedded_store()
    return TrackingTarget(uri, registry, embedded, artifact_root)


def _sqlite_artifact_root(uri: str) -> str | None:
    """``artifacts/`` beside a SQLite database file, for experiments created in it.

    MLflow would otherwise put them under ``./mlruns`` of whichever working directory the
    experiment happened to be created from.
    """
    if not uri.startswith("sqlite:///") or uri == "sqlite:///:memory:":
        return None
    path = Path(urllib.parse.unquote(uri[len("sqlite:///") :].split("?", 1)[0]))
    return (path.resolve().parent / "artifacts").as_uri()


def _experiment_folder(name: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.")[:60] or "experiment"
    return f"{slug}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def ensure_experiment(client, name: str, target: TrackingTarget) -> str:
    """Returns the id of experiment ``name``, creating it when missing.

    Args:
        client: An ``MlflowClient`` on ``target.tracking_uri``.
        name: Experiment name (``"/team/ctr"``, ``"train_ctr"``, ...).
        target: Where it lives; embedded experiments get their artifact folder set explicitly.
    """
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            client.restore_experiment(experiment.experiment_id)
        return experiment.experiment_id
    location = f"{target.artifact_root}/{_experiment_folder(name)}" if target.artifact_root else None
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException as exc:
        # Another client created it between our lookup and our create.
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


def default_experiment_name() -> str:
    """Experiment name derived from the calling script or notebook.

    A script ``train_ctr.py`` gives ``"train_ctr"``; a Jupyter notebook the notebook's file
    name (``JPY_SESSION_NAME``, or ``__vsc_ipynb_file__`` in VS Code); an interactive
    interpreter ``"sparkgpu"``.
    """
    main = sys.modules.get("__main__")
    notebook = os.environ.get("JPY_SESSION_NAME") or getattr(main, "__vsc_ipynb_file__", None)
    if notebook:
        return Path(notebook).stem or "sparkgpu"
    main_file = getattr(main, "__file__", None)
    if main_file and not hasattr(sys, "ps1"):
        stem = Path(main_file).stem
        if stem not in ("__main__", "ipykernel_launcher"):
            return stem
    return "sparkgpu"
