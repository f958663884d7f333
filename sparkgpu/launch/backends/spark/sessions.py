"""Which Spark session a ``remote=True`` job runs on.

Without a pools file: the caller's active session, else one to ``SPARKGPU_SPARK_REMOTE``.
With one (``SPARKGPU_POOLS``, :mod:`sparkgpu.spec.pools`): the session of the pool the job's GPU
type (or its ``pool=``) chooses, opened once per URL and reused. A pool's session is a
handle of the backend's own: it never becomes the process's default or active session, so
the caller's ``SparkSession.getActiveSession()`` stays what it was.

A job keeps the Connect URL it runs on (without credentials) in its run dir, so that
``sparkgpu resume`` in a fresh process reconnects there; a backend whose session its server
closed (a restart) opens a new one to the same URL for its next attempt.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
from typing import Any

from sparkgpu.config import settings
from sparkgpu.errors import ConfigurationError
from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.rundir.directory import RunDir
from sparkgpu.spec.pools import POOL_TAG, Pool, choose_pool, configured_pools
from sparkgpu.spec import JobSpec

__all__ = [
    "active_spark_session",
    "pool_for_job",
    "pool_session",
    "session_for",
    "close_sessions",
    "close_channels",
    "new_connect_session",
    "connect_url",
    "full_url",
    "connection_closed",
    "record_session",
    "recorded_remote",
    "recorded_options",
    "detach_refusal",
    "check_key_transport",
    "SESSION_FILE",
    "PLAINTEXT_ENV",
]

#: Set to 1 to send job keys over a Spark Connect channel with neither TLS nor a token.
PLAINTEXT_ENV = "SPARKGPU_ALLOW_PLAINTEXT_CONNECT"

#: Where a job's run dir keeps the Spark Connect URL it ran on, for ``sparkgpu resume``.
SESSION_FILE = "spark-session.json"
#: Beside it: the URL with its token, sealed under the job key (only where the URL has one).
SEALED_URL_FILE = "spark-session.sealed"

_remote_sessions: dict[str, Any] = {}  # Connect sessions: pyspark imported on first use
_lock = threading.Lock()
_logger = logging.getLogger(__name__)


def active_spark_session(fallback: str | None = None):
    """The session ``remote=True`` jobs run on when no pools file is configured.

    In order: this thread's active session (Connect, then classic), the process's default
    Connect session, a session to ``SPARKGPU_SPARK_REMOTE``, a session to ``fallback``.

    Args:
        fallback: Connect URL to open when nothing else names a session (a resumed job's).

    Raises:
        ConfigurationError: there is none of them.
    """
    connect = sys.modules.get("pyspark.sql.connect.session")
    classic = sys.modules.get("pyspark.sql.session")
    candidates = []
    if connect is not None:
        candidates += [connect.SparkSession.getActiveSession, connect.SparkSession._get_default_session]
    if classic is not None:
        candidates.insert(1 if candidates else 0, classic.SparkSession.getActiveSession)
    for lookup in candidates:
        try:
            session = lookup()
        except Exception:  # classic lookups raise in Connect-only installs
            session = None
        if session is not None:
            return session
    remote = settings().spark_remote or fallback
    if remote:
        return session_for(remote)
    raise ConfigurationError(
        "remote=True runs on a Spark session, and there is none: create one first "
        "(SparkSession.builder.remote('sc://host:15002').getOrCreate()), or set SPARKGPU_SPARK_REMOTE=sc://host:15002"
    )


def session_for(remote: str):
    """A session to the Connect URL ``remote``, opened on first use and reused while it lives."""
    # builder.getOrCreate() would hand back any existing default session, whatever its URL.
    session = _remote_sessions.get(remote)
    if session is None or session.is_stopped:
        from pyspark.sql import SparkSession

        session = _remote_sessions[remote] = SparkSession.builder.remote(remote).create()
    return session


def pool_session(pool: Pool):
    """The session of ``pool`` (opened once, reused), kept out of the caller's default and
    active session."""
    with _lock:
        session = _remote_sessions.get(pool.url)
        if session is not None and not session.is_stopped:
            return session
        session = _remote_sessions[pool.url] = new_connect_session(pool.url)
        return session


def new_connect_session(url: str):
    """A new Connect session to ``url`` that never becomes the process's default or active one."""
    from pyspark.sql.connect.session import SparkSession

    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"  # what pyspark's builder.remote() sets: ResourceProfiles need it
    had_default = SparkSession._default_session
    had_active = getattr(SparkSession._active_session, "session", None)
    try:
        return SparkSession.builder.remote(url).create()
    finally:
        SparkSession._default_session = had_default
        SparkSession._active_session.session = had_active


def close_sessions() -> None:
    """Stops every session opened here (pools and ``SPARKGPU_SPARK_REMOTE``); the next job
    opens new ones. For notebooks moving to other clusters, and tests that stop theirs."""
    with _lock:
        sessions = list(_remote_sessions.values())
        _remote_sessions.clear()
    for session in sessions:
        if not session.is_stopped:
            session.stop()


def close_channels() -> None:
    """Closes the channel of every Connect session this process opened or holds, calling the server
    for nothing; for a process about to exit.

    pyspark registers an exit hook for each Connect client that cleans its ML cache on the server
    unless the client was closed; against a server that went away (a cluster stopped once the job
    ended) that call retries for minutes, and the process cannot exit meanwhile.
    """
    connect = sys.modules.get("pyspark.sql.connect.session")
    if connect is None:
        return  # no Connect session was ever made here
    with _lock:
        found = list(_remote_sessions.values())
    found += [connect.SparkSession._default_session, getattr(connect.SparkSession._active_session, "session", None)]
    closed: set[int] = set()
    for session in found:
        client = getattr(session, "client", None)
        if client is None or id(client) in closed or client.is_closed:
            continue
        closed.add(id(client))
        try:
            client.close()
        except Exception as exc:  # the process is exiting: what is left is pyspark's to skip
            _logger.debug("a Connect channel did not close: %s: %s", type(exc).__name__, exc)


def pool_for_job(job: JobSpec, pool: str | None = None) -> Pool | None:
    """The pool ``job`` runs on, or ``None`` when no pools file is configured.

    Args:
        job: The job; a resumed job's :data:`~sparkgpu.spec.pools.POOL_TAG` names its pool.
        pool: The pool asked for by name or id (``pool=``); ``SPARKGPU_POOL`` when ``None``.

    Raises:
        ConfigurationError: ``pool`` is given without a pools file, or names no pool.
        CapacityError: no pool has the job's GPU type (the message names the pools).
    """
    pools = configured_pools()
    if pools is None:
        if pool is not None:
            raise ConfigurationError(
                f"pool={pool!r} names a GPU pool, and no pools file is configured: set "
                "SPARKGPU_POOLS to a pools.yaml naming it, or drop pool="
            )
        return None
    s = settings()
    asked = pool or job.tags.get(POOL_TAG) or s.pool
    return choose_pool(job.resources, asked, pools=pools, reserved=s.use_reserved_pool)


@contextlib.contextmanager
def active(spark):
    """Makes ``spark`` the thread's active Connect session (Connect builds ResourceProfiles on it)."""
    local = getattr(type(spark), "_active_session", None)
    if not isinstance(local, threading.local):
        yield
        return
    previous = getattr(local, "session", None)
    local.session = spark
    try:
        yield
    finally:
        local.session = previous


def connect_url(spark) -> str | None:
    """The Connect URL of ``spark`` without its credentials (a token never goes to disk), or
    ``None`` for a classic session."""
    builder = getattr(getattr(spark, "client", None), "_builder", None)
    endpoint = getattr(builder, "endpoint", None)
    if not isinstance(endpoint, str):
        return None
    params = []
    if getattr(builder, "use_ssl", False):
        params.append("use_ssl=true")
    user_id = getattr(builder, "userId", None)
    if user_id:
        params.append(f"user_id={user_id}")
    return f"sc://{endpoint}" + (f"/;{';'.join(params)}" if params else "")


def connection_closed(spark) -> bool:
    """Whether pyspark closed this Connect session for good (its server restarted, or ``stop()``)."""
    try:
        return bool(getattr(spark, "is_stopped", False))
    except Exception:  # a classic session, or a fake: never "closed" by its server
        return False


def full_url(spark) -> str | None:
    """The Connect URL ``spark`` was opened with, credentials included: kept in memory only."""
    url = getattr(getattr(getattr(spark, "client", None), "_builder", None), "url", None)
    if url is None or not hasattr(url, "geturl"):
        return None
    parsed = url.geturl()  # pyspark parses "sc://" URLs as "http://" ones
    return "sc://" + parsed.split("://", 1)[1] if "://" in parsed else None


def _is_loopback(host: str) -> bool:
    import ipaddress

    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def check_key_transport(spark, job_id: str) -> None:
    """Refuses to send a job's key to a Spark Connect server reached without TLS or a token.

    The key travels in the node tasks' closure, over the session's channel: on a plaintext
    channel anyone on the network path reads it and can sign results that the client then
    unpickles. A loopback server, a channel with TLS (``use_ssl=true``) or a bearer token
    (``token=``, which pyspark sends only over TLS off loopback), and classic sessions (the
    closure goes over Spark's own RPC, see ``spark.network.crypto.enabled``) pass.

    Raises:
        ConfigurationError: The channel is plaintext and :data:`PLAINTEXT_ENV` is not set.
    """
    builder = getattr(getattr(spark, "client", None), "_builder", None)
    endpoint, host = getattr(builder, "endpoint", None), getattr(builder, "host", None)
    if not isinstance(endpoint, str) or not isinstance(host, str):
        return  # a classic session
    if getattr(builder, "secure", False) or _is_loopback(host) or os.environ.get(PLAINTEXT_ENV) == "1":
        return
    raise ConfigurationError(
        f"refusing to start job {job_id}: its signing key would travel to the Spark Connect server at "
        f"{endpoint} in plaintext (the URL sets neither use_ssl=true nor a token), where anyone on the network "
        "path could read it and forge results that this client unpickles. Connect with TLS and a token "
        f"(sc://{endpoint}/;use_ssl=true;token=...), or, on a network you trust, set {PLAINTEXT_ENV}=1 to "
        "accept that risk"
    )


def record_session(spark, run_dir: RunDir, options: dict | None = None) -> None:
    """Keeps the Connect URL a job runs on in its run dir: ``sparkgpu resume`` and a detached
    job's supervisor, in fresh processes, reconnect there when nothing else names a session.

    Args:
        options: The backend's own settings (``SparkBackend.rebuild_options``), for a process
            that rebuilds it. Kept when omitted (each attempt records the URL again).

    The URL is kept without its credentials; a ``token=`` it carries is sealed under the job key
    beside it (:data:`SEALED_URL_FILE`), for the job's own processes only.
    """
    url = connect_url(spark)
    if url is None:
        return
    record: dict = {"remote": url}
    if options is None:
        previous = _read_record(run_dir)
        if isinstance(previous.get("backend"), dict):
            record["backend"] = previous["backend"]
    else:
        record["backend"] = options
    atomic_write_bytes(run_dir.path / SESSION_FILE, json.dumps(record).encode())
    full = full_url(spark)
    if full is not None and _has_credentials(full) and run_dir.key:
        from sparkgpu.job_secrets import seal

        atomic_write_bytes(run_dir.path / SEALED_URL_FILE, seal(run_dir.key, {"url": full}))


def _has_credentials(url: str) -> bool:
    return any(part.split("=", 1)[0].lower() == "token" for part in url.split(";")[1:])


def _read_record(run_dir: RunDir) -> dict:
    try:
        record = json.loads((run_dir.path / SESSION_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def recorded_remote(run_dir: RunDir) -> str | None:
    """The Connect URL :func:`record_session` kept for the job, if any: with its sealed token
    when the run dir holds the job key to open it."""
    url = _read_record(run_dir).get("remote")
    if not isinstance(url, str):
        return None
    if run_dir.key:
        try:
            sealed = (run_dir.path / SEALED_URL_FILE).read_bytes()
        except FileNotFoundError:
            return url
        from sparkgpu.job_secrets import unseal

        return unseal(run_dir.key, sealed).get("url", url)
    return url


def recorded_options(run_dir: RunDir) -> dict:
    """The backend settings :func:`record_session` kept for the job (``{}`` when none)."""
    options = _read_record(run_dir).get("backend")
    return options if isinstance(options, dict) else {}


def detach_refusal(spark) -> str | None:
    """Why a job on ``spark`` cannot be supervised by processes of its own; ``None`` when it can.

    Another process reaches a Spark Connect server by its URL; a classic session lives only in
    this process.
    """
    if spark is None or connect_url(spark) is not None:
        return None
    return (
        "its session is a classic SparkSession of this process, which no other process can reach; "
        "connect through Spark Connect (SparkSession.builder.remote('sc://host:15002')) to submit detached jobs"
    )
