"""Settings: every ``SPARKGPU_*`` environment variable the package reads is named here, and read once
(:func:`settings`). Constructors elsewhere take explicit arguments; only the public edges
(decorator, ``spark.gpu``, the CLI) fall back on these settings.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

from sparkgpu.errors import ConfigurationError
from sparkgpu.spec.units import parse_duration, parse_size

__all__ = ["Settings", "settings", "reset_settings"]


def _data_home() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "sparkgpu"


def _login_name(env) -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):  # containers often run as a uid without a passwd entry
        return env.get("USER") or env.get("LOGNAME") or f"uid-{os.getuid()}"


def _env_seconds(env, name, default):
    """A duration variable: seconds (``600``) or a duration such as ``90s``, ``30m``, ``2h``, ``7d``
    (:func:`sparkgpu.spec.units.parse_duration`, as the arguments of the same settings take)."""
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        return float(raw)  # a plain number, negative ones included: the caller says what range it takes
    except ValueError:
        pass
    try:
        return parse_duration(raw, name=name)
    except ConfigurationError:
        raise ConfigurationError(
            f"{name}={raw!r} is not a number of seconds or a duration; set it as e.g. {name}=600 or {name}=10m"
        ) from None


def _heartbeat_timeout(env, name, default, *, at_least: float, may_be_none: bool = False):
    """Seconds without a heartbeat before its sender counts as gone: at least ``at_least`` (a few
    beats, or a busy host would pass for a dead one); with ``may_be_none``, ``none`` reads as never."""
    raw = env.get(name)
    if may_be_none and raw is not None and raw.strip().lower() in ("none", "off", "never"):
        return None
    seconds = _env_seconds(env, name, default)
    if seconds < at_least:
        fix = f"at least {at_least:g} seconds" + (", or none" if may_be_none else "")
        raise ConfigurationError(f"{name}={raw!r} must be {fix}, e.g. {name}={default:g}")
    return seconds


def _keep_runs(raw: str) -> dict:
    """``SPARKGPU_KEEP_RUNS``: a count, an age in days (``30d``), both (``100,30d``), or ``all``."""
    count, days = None, None
    if raw.strip().lower() != "all":
        for part in (p.strip().lower() for p in raw.split(",")):
            try:
                if part.endswith("d"):
                    days = parse_duration(part, name="SPARKGPU_KEEP_RUNS") / 86400
                    ok = True
                else:
                    count = int(part)
                    ok = count >= 0
            except (ValueError, ConfigurationError):
                ok = False
            if not ok:
                raise ConfigurationError(
                    f"SPARKGPU_KEEP_RUNS={raw!r}: give a number of jobs (100), an age in days (30d), both "
                    "(100,30d), or all"
                )
    return {"keep_runs": count, "keep_runs_days": days}


def _staging(raw: str | None, home: Path) -> tuple[Path, str | None]:
    """``(staging_root, staging_url)`` from ``SPARKGPU_STAGING_ROOT``: a path, or a store URL.

    Raises:
        MissingDependencyError: The URL's filesystem is not installed (the message has the
            ``pip install``; the executors need it too).
        ConfigurationError: fsspec knows no filesystem for the URL's scheme.
    """
    from sparkgpu._util.urls import check_url, is_url, scheme_of

    if not raw:
        return home / "runs", None
    if not is_url(raw):
        return Path(raw), None
    url = raw.rstrip("/")
    # Before, Path("s3://b/runs") silently became the relative folder "s3:/b/runs".
    check_url(
        url,
        f"the {scheme_of(url)}:// staging store SPARKGPU_STAGING_ROOT={raw} (on the client and on "
        "every Spark executor)",
    )
    return home / "runs", url


def _straggler_factor(raw: str | None) -> float:
    if raw in (None, ""):
        return 1.5
    try:
        factor = float(raw)
    except ValueError:
        factor = -1.0
    if factor != 0 and not factor > 1:
        raise ConfigurationError(
            f"SPARKGPU_STRAGGLER_FACTOR={raw!r} must be a number above 1 (how many times slower than its peers "
            "a rank is named a straggler), or 0 to turn the detection off; e.g. SPARKGPU_STRAGGLER_FACTOR=1.5"
        )
    return factor


def _free_bytes(raw: str | None) -> int:
    if raw in (None, ""):
        return 5 * 2**30
    if raw.strip() == "0":
        return 0
    return parse_size(raw, "SPARKGPU_PREFLIGHT_FREE")


def _positive_seconds(env, name: str, default: float) -> float:
    seconds = _env_seconds(env, name, default)
    if not seconds > 0:
        raise ConfigurationError(f"{name}={env.get(name)!r} must be a positive duration, e.g. {name}=60 or {name}=2m")
    return seconds


@dataclasses.dataclass(frozen=True)
class Settings:
    """Process-wide defaults taken from ``SPARKGPU_*`` environment variables.

    Attributes:
        home: Root of everything the package keeps on this machine (``SPARKGPU_HOME``).
        staging_root: Where this machine keeps per-run directories: ``SPARKGPU_STAGING_ROOT``
            when it is a path (Spark executors must then see it under the same path), else
            ``<home>/runs``.
        staging_url: The staging store when ``SPARKGPU_STAGING_ROOT`` is an fsspec URL
            (``s3://``, ``gs://``, ``abfs://``, ``file://``...), else ``None``: the Spark
            backend mirrors run dirs through ``<staging_url>/<job_id>/`` and its executors
            run in node-local copies, so they need no shared mount.
        cache_dir: Local NVMe cache for data shards (``SPARKGPU_CACHE_DIR``).
        simulate_gpus: ``"TYPE:N"`` makes this host pretend to have N GPUs of TYPE while the
            ranks run on CPU with gloo (``SPARKGPU_SIMULATE_GPUS``); for tests and laptops.
        max_cpu_ranks: Most CPU ranks one host runs for ``gpu_type="cpu"``
            (``SPARKGPU_MAX_CPU_RANKS``).
        spark_remote: Spark Connect URL for ``remote=True`` jobs (``SPARKGPU_SPARK_REMOTE``).
        default_timeout: Default limit in seconds on one whole call, ``None`` for no limit
            (``SPARKGPU_TIMEOUT``).
        python: Interpreter that runs the workers (``SPARKGPU_PYTHON``).
        registry_catalog: Catalog that completes a one-part model name when no Spark session
            is active (``SPARKGPU_REGISTRY_CATALOG``, default ``"main"``).
        registry_schema: Schema that completes one- and two-part model names when no Spark
            session is active (``SPARKGPU_REGISTRY_SCHEMA``, default ``"default"``).
        cache_limit_bytes: Default size limit of the data cache, ``None`` for no limit
            (``SPARKGPU_CACHE_LIMIT``, e.g. ``500GB``).
        usage_ledger_uri: Delta table that records GPU usage (``SPARKGPU_USAGE_LEDGER``; a path or
            any URL deltalake reads; default ``<home>/usage/ledger``).
        usage_policy_path: TOML or YAML usage policy checked before and during every job
            (``SPARKGPU_USAGE_POLICY``), ``None`` for none.
        usage_rates: Rate card in $ per GPU-hour, a file path or ``"H100=6.5,A10=1.2"``
            (``SPARKGPU_USAGE_RATES``), ``None`` for the built-in defaults.
        user: Name usage is attributed to (``SPARKGPU_USER``, default the login name).
        warm_pool: Local jobs fork their ranks from a warm pool with torch already imported
            (``SPARKGPU_WARM_POOL=1``).
        warm_idle_timeout: Seconds the warm pool waits for work before it stops itself
            (``SPARKGPU_POOL_IDLE_TIMEOUT``, default 3600).
        tracking: Every job gets an MLflow run (``SPARKGPU_TRACKING``, default on; ``0`` turns
            it off).
        lightning_checkpoints: Lightning's ``Trainer.fit`` in a job saves signed checkpoints
            into the job's store and resumes from them (``SPARKGPU_LIGHTNING_CHECKPOINTS``,
            default on; ``0`` turns it off).
        system_metrics_interval: Seconds between two samples of each node's system metrics in
            the job's run (``SPARKGPU_SYSTEM_METRICS_INTERVAL``, default 10).
        env_size_limit: Most bytes of client environment shipped to the workers
            (``SPARKGPU_ENV_SIZE_LIMIT``, default ``15GB``).
        env_store: Store of staged environment blobs, a path or fsspec URL
            (``SPARKGPU_ENV_STORE``, default ``<home>/envstore``, or ``<staging_url>/_envstore``
            with a staging store).
        env_exclude: Distribution names or patterns never shipped (``SPARKGPU_ENV_EXCLUDE``,
            comma-separated, e.g. ``nvidia-*,torch``).
        env_worker_lock: What the workers' image already has: a lock file or probe JSON
            (``SPARKGPU_ENV_WORKER_LOCK``), ``None`` when unknown.
        spark_wait_timeout: Seconds a Spark job waits for busy GPUs (or for busy executors to
            answer the capacity probe) before it gives up (``SPARKGPU_SPARK_WAIT_TIMEOUT``,
            default 600).
        gpu_lock_dir: The machine-wide folder of local GPU leases and their queue
            (``SPARKGPU_GPU_LOCK_DIR``; ``<tmp>/sparkgpu-gpus`` by default). Every user of the
            machine must use the same one, or their jobs share GPUs and skip each other's queue.
        spark_client_timeout: Seconds a Spark job's nodes keep its ranks running without a
            heartbeat from the client that drives it; then they stop them, and ``sparkgpu
            resume JOB_ID`` continues the job (``SPARKGPU_SPARK_CLIENT_TIMEOUT``, default 120, at
            least 6: the client beats every 2 s; ``none`` keeps them running, unsupervised).
        spark_node_timeout: Seconds a started Spark node may go without a beat to node 0 (and
            without saying how its ranks ended) before node 0 counts its executor lost and stops
            the attempt; the same silence of node 0 makes the others count it lost
            (``SPARKGPU_SPARK_NODE_TIMEOUT``, default 10, at least 3: nodes beat four times per timeout).
        spark_control_interval: Most seconds between two looks of a Spark job's node 0 at the
            client's files: a cancel or a stop request reaches the ranks within about this
            long, and with a staging store each look is one request
            (``SPARKGPU_SPARK_CONTROL_INTERVAL``, default 20).
        data_volume: Folder or fsspec URL where ``spark.gpu.train(data=...)`` keeps its MDS
            conversions; the ranks must reach it (``SPARKGPU_DATA_VOLUME``, default
            ``<home>/volumes/mds``, or ``<staging_url>/_mds`` with a staging store).
        data_metrics_interval: Seconds between two points of each rank's data loader metrics
            in the job's run (``SPARKGPU_DATA_METRICS_INTERVAL``, default 30).
        straggler_factor: How much slower than its peers a rank must be, steadily over the
            straggler window, to be named a straggler in the log and the job's run
            (``SPARKGPU_STRAGGLER_FACTOR``, default 1.5; ``0`` turns the detection off).
        preflight_free_bytes: Free space a node's cache disk needs in its pre-flight check
            (``SPARKGPU_PREFLIGHT_FREE``, default ``5GiB``; ``0`` checks only that it is writable).
        preflight_exclude_seconds: How long a Spark executor that failed its pre-flight check
            is kept out of this client's jobs (``SPARKGPU_PREFLIGHT_EXCLUDE``, default 1 hour,
            as Spark's own ``spark.excludeOnFailure.timeout``).
        straggler_window: Seconds over which a rank's lateness is judged
            (``SPARKGPU_STRAGGLER_WINDOW``, default 60).
        keep_runs: How many finished jobs' run dirs to keep, newest first (``SPARKGPU_KEEP_RUNS``:
            ``"100,30d"`` by default keeps at most 100, none older than 30 days; ``"all"`` keeps
            every one); ``None`` for no count limit.
        keep_runs_days: Age in days past which a finished job's run dir goes; ``None`` for none.
        pools_path: Pools file naming the Spark clusters ``remote=True`` jobs choose from by
            GPU type (``SPARKGPU_POOLS``; :mod:`sparkgpu.spec.pools`), ``None`` for none.
        pool: Pool every remote job runs on, by name or id (``SPARKGPU_POOL``, or the
            Databricks alias ``DATABRICKS_REMOTE_GPU_POOL_ID``), ``None`` to choose by GPU type.
        use_reserved_pool: Choose only reserved pools (``SPARKGPU_USE_RESERVED_POOL``, or the
            Databricks alias ``DATABRICKS_USE_RESERVED_GPU_POOL``).
        hf_resume: In a rank, patch ``transformers.Trainer`` when it is imported so that it seals
            its checkpoints into the job and resumes from them (``SPARKGPU_HF_RESUME``, default on;
            ``0`` turns it off: then ``sparkgpu.hf.resumable(trainer)`` does it for one Trainer).
        fork_ranks: A node's agent forks its ranks with torch already imported instead of
            starting each as a new interpreter (``SPARKGPU_FORK_RANKS``, default on; ``0`` turns it
            off; a job that ships its environment always starts new interpreters).
    """

    home: Path
    staging_root: Path
    cache_dir: Path
    simulate_gpus: str | None
    max_cpu_ranks: int
    spark_remote: str | None
    default_timeout: float | None
    python: str
    registry_catalog: str = "main"
    registry_schema: str = "default"
    cache_limit_bytes: int | None = None
    usage_ledger_uri: str = ""
    usage_policy_path: str | None = None
    usage_rates: str | None = None
    user: str = ""
    warm_pool: bool = False
    warm_idle_timeout: float = 3600.0
    tracking: bool = True
    lightning_checkpoints: bool = True
    system_metrics_interval: float = 10.0
    env_size_limit: int = 15 * 1000**3
    env_store: str = ""
    env_exclude: tuple[str, ...] = ()
    env_worker_lock: str | None = None
    spark_wait_timeout: float = 600.0
    gpu_lock_dir: str | None = None
    spark_client_timeout: float | None = 120.0
    spark_node_timeout: float = 10.0
    spark_control_interval: float = 20.0
    data_volume: str = ""
    keep_runs: int | None = 100
    keep_runs_days: float | None = 30.0
    staging_url: str | None = None
    data_metrics_interval: float = 30.0
    straggler_factor: float = 1.5
    straggler_window: float = 60.0
    preflight_free_bytes: int = 5 * 2**30
    preflight_exclude_seconds: float = 3600.0
    pools_path: str | None = None
    pool: str | None = None
    use_reserved_pool: bool = False
    hf_resume: bool = True
    fork_ranks: bool = True

    @classmethod
    def from_env(cls, env=None) -> "Settings":
        import sys

        env = os.environ if env is None else env
        home = Path(env.get("SPARKGPU_HOME") or _data_home())
        max_cpu = env.get("SPARKGPU_MAX_CPU_RANKS")
        try:
            max_cpu_ranks = int(max_cpu) if max_cpu else max(8, os.cpu_count() or 1)
        except ValueError:
            raise ConfigurationError(f"SPARKGPU_MAX_CPU_RANKS={max_cpu!r} must be an integer") from None
        staging_root, staging_url = _staging(env.get("SPARKGPU_STAGING_ROOT"), home)
        return cls(
            home=home,
            staging_root=staging_root,
            staging_url=staging_url,
            cache_dir=Path(env.get("SPARKGPU_CACHE_DIR") or home / "cache"),
            simulate_gpus=env.get("SPARKGPU_SIMULATE_GPUS") or None,
            max_cpu_ranks=max_cpu_ranks,
            spark_remote=env.get("SPARKGPU_SPARK_REMOTE") or None,
            default_timeout=_env_seconds(env, "SPARKGPU_TIMEOUT", None),
            python=env.get("SPARKGPU_PYTHON") or sys.executable,
            registry_catalog=env.get("SPARKGPU_REGISTRY_CATALOG") or "main",
            registry_schema=env.get("SPARKGPU_REGISTRY_SCHEMA") or "default",
            cache_limit_bytes=(
                parse_size(env["SPARKGPU_CACHE_LIMIT"], "SPARKGPU_CACHE_LIMIT")
                if env.get("SPARKGPU_CACHE_LIMIT")
                else None
            ),
            usage_ledger_uri=env.get("SPARKGPU_USAGE_LEDGER") or str(home / "usage" / "ledger"),
            usage_policy_path=env.get("SPARKGPU_USAGE_POLICY") or None,
            usage_rates=env.get("SPARKGPU_USAGE_RATES") or None,
            user=env.get("SPARKGPU_USER") or _login_name(env),
            warm_pool=(env.get("SPARKGPU_WARM_POOL") or "0").lower() in ("1", "true", "yes", "on"),
            warm_idle_timeout=_env_seconds(env, "SPARKGPU_POOL_IDLE_TIMEOUT", 3600.0),
            tracking=(env.get("SPARKGPU_TRACKING") or "1").lower() not in ("0", "false", "no", "off"),
            lightning_checkpoints=(env.get("SPARKGPU_LIGHTNING_CHECKPOINTS") or "1").lower()
            not in ("0", "false", "no", "off"),
            system_metrics_interval=_env_seconds(env, "SPARKGPU_SYSTEM_METRICS_INTERVAL", 10.0),
            env_size_limit=parse_size(env.get("SPARKGPU_ENV_SIZE_LIMIT") or "15GB", "SPARKGPU_ENV_SIZE_LIMIT"),
            # With a staging store the executors share no folder with the client: shipped
            # environments and conversions default to the store too.
            env_store=env.get("SPARKGPU_ENV_STORE")
            or (f"{staging_url}/_envstore" if staging_url else str(home / "envstore")),
            env_exclude=tuple(p.strip() for p in (env.get("SPARKGPU_ENV_EXCLUDE") or "").split(",") if p.strip()),
            env_worker_lock=env.get("SPARKGPU_ENV_WORKER_LOCK") or None,
            spark_wait_timeout=_env_seconds(env, "SPARKGPU_SPARK_WAIT_TIMEOUT", 600.0),
            gpu_lock_dir=env.get("SPARKGPU_GPU_LOCK_DIR") or None,
            spark_client_timeout=_heartbeat_timeout(
                env, "SPARKGPU_SPARK_CLIENT_TIMEOUT", 120.0, at_least=6.0, may_be_none=True
            ),
            spark_node_timeout=_heartbeat_timeout(env, "SPARKGPU_SPARK_NODE_TIMEOUT", 10.0, at_least=3.0),
            spark_control_interval=_heartbeat_timeout(env, "SPARKGPU_SPARK_CONTROL_INTERVAL", 20.0, at_least=0.5),
            **_keep_runs(env.get("SPARKGPU_KEEP_RUNS") or "100,30d"),
            data_volume=env.get("SPARKGPU_DATA_VOLUME")
            or (f"{staging_url}/_mds" if staging_url else str(home / "volumes" / "mds")),
            data_metrics_interval=_env_seconds(env, "SPARKGPU_DATA_METRICS_INTERVAL", 30.0),
            straggler_factor=_straggler_factor(env.get("SPARKGPU_STRAGGLER_FACTOR")),
            straggler_window=_positive_seconds(env, "SPARKGPU_STRAGGLER_WINDOW", 60.0),
            preflight_free_bytes=_free_bytes(env.get("SPARKGPU_PREFLIGHT_FREE")),
            preflight_exclude_seconds=_positive_seconds(env, "SPARKGPU_PREFLIGHT_EXCLUDE", 3600.0),
            pools_path=env.get("SPARKGPU_POOLS") or None,
            pool=env.get("SPARKGPU_POOL") or env.get("DATABRICKS_REMOTE_GPU_POOL_ID") or None,
            use_reserved_pool=(
                env.get("SPARKGPU_USE_RESERVED_POOL") or env.get("DATABRICKS_USE_RESERVED_GPU_POOL") or "0"
            ).lower()
            in ("1", "true", "yes", "on"),
            hf_resume=(env.get("SPARKGPU_HF_RESUME") or "1").lower() not in ("0", "false", "no", "off"),
            fork_ranks=(env.get("SPARKGPU_FORK_RANKS") or "1").lower() not in ("0", "false", "no", "off"),
        )


@functools.lru_cache(maxsize=1)
def settings() -> Settings:
    """The settings of this process, read from the environment on first use."""
    return Settings.from_env()


def reset_settings() -> None:
    """Forgets the cached settings so the next :func:`settings` re-reads the environment.

    For tests and for notebooks that change ``SPARKGPU_*`` variables after import.
    """
    settings.cache_clear()
