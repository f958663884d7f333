"""Session-wide fixtures. Real components only: one Spark Connect server per test session."""

from __future__ import annotations

import os

import pytest

from tests.s3_server import s3_bucket, s3_server  # noqa: F401  (fixtures: a real S3 server on loopback)


def pytest_collection_modifyitems(config, items):
    """Tests on the standalone Spark cluster run first: once the shared in-process `spark`
    server exists, pyspark redirects and re-authenticates every other Connect client."""
    items.sort(key=lambda item: 0 if "test_spark_cluster" in item.nodeid else 1)


@pytest.fixture(scope="session")
def _worker_image_lock(tmp_path_factory):
    """What the test workers' image has: this very environment (probed once per session)."""
    import subprocess
    import sys

    from sparkgpu.env import hydrate_module_path

    probe = subprocess.run(
        [sys.executable, str(hydrate_module_path()), "--probe"], capture_output=True, text=True, check=True
    ).stdout
    path = tmp_path_factory.mktemp("worker-image") / "probe.json"
    path.write_text(probe)
    return str(path)


@pytest.fixture(autouse=True)
def _isolated_sparkgpu_home(tmp_path_factory, monkeypatch, _worker_image_lock):
    """Every test gets its own SPARKGPU_HOME, so runs, caches and ledgers never leak."""
    from sparkgpu.config import reset_settings

    home = tmp_path_factory.mktemp("sparkgpu-home")
    monkeypatch.setenv("SPARKGPU_HOME", str(home))
    monkeypatch.delenv("SPARKGPU_STAGING_ROOT", raising=False)
    monkeypatch.delenv("SPARKGPU_CACHE_DIR", raising=False)
    monkeypatch.delenv("SPARKGPU_SIMULATE_GPUS", raising=False)
    # Jobs in tests are untracked unless a test asks for tracking (an MLflow run per job is
    # slow); tests/integration/test_tracking_default.py covers the default path.
    monkeypatch.setenv("SPARKGPU_TRACKING", "0")
    # Remote jobs ship only what the workers lack: in tests the workers run this environment,
    # so editable installs and the caller's code travel (as on a real cluster with a matching image).
    monkeypatch.setenv("SPARKGPU_ENV_WORKER_LOCK", _worker_image_lock)
    # Node 0 of a Spark job looks at the client's files every 20 s by default (one store request
    # each); a cancel or stop request waits for that look. Tests look every 2 s, to run quickly;
    # tests/unit/test_config.py checks the default.
    monkeypatch.setenv("SPARKGPU_SPARK_CONTROL_INTERVAL", "2")
    reset_settings()
    yield home
    # A warm pool a test started (and did not stop) would wait out its idle timeout, an hour,
    # after the suite; the tests that check stopping stop theirs themselves.
    for directory in (home / "pool").glob("*"):
        from sparkgpu.launch.warm_pool import _request

        _request(directory, {"op": "stop"})
    reset_settings()


@pytest.fixture(scope="session")
def spark():
    """A real Spark Connect session on a local server (started once, about 20 s).

    The server listens on 127.0.0.1 on a free port, as users get it from
    :func:`sparkgpu.local_spark.local_session`: ``remote("local[2]")`` would bind every
    interface on the fixed port 15002, reachable from the network and clashing with any other
    test session on the machine.
    """
    from sparkgpu.local_spark import local_session

    session = local_session(cores=2, conf={"spark.sql.shuffle.partitions": "4"})
    yield session
    session.stop()
    from pyspark.sql import SparkSession as ClassicSession

    if ClassicSession._instantiatedSession is not None:
        ClassicSession._instantiatedSession.stop()


_MOSAIC_SHM = r"^\d{6}_[a-z_]+$"  # Mosaic's shared-memory names: 000042_locals, 000042_barrier, ...


def _remove_mosaic_shared_memory(names) -> None:
    import re

    for name in names:
        if re.match(_MOSAIC_SHM, name):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:  # removed by its dataset meanwhile
                continue


def _open_anywhere() -> set[str]:
    """The /dev/shm names some live process has open."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    held.add(target[len("/dev/shm/") :])
        except OSError:  # the process ended, or is not ours to read
            continue
    return held


@pytest.fixture(autouse=True)
def _mosaic_shared_memory_released(_mosaic_shared_memory_stale_removed):
    """Tests read our shards with Mosaic's ``StreamingDataset`` to check them. It leaves its
    shared-memory names in /dev/shm when a dataset is dropped, and each later dataset on the
    machine opens every one of them again and keeps them open: a test session ended with more
    than 2,000 descriptors on /dev/shm. The names a test left behind are removed after it
    (Mosaic's own ``clean_stale_shared_memory`` stops at the first free prefix and misses them)."""
    before = set(os.listdir("/dev/shm"))
    yield
    import sys

    if "streaming" in sys.modules:
        _remove_mosaic_shared_memory(set(os.listdir("/dev/shm")) - before)


@pytest.fixture(scope="session")
def _mosaic_shared_memory_stale_removed():
    """Names left in /dev/shm by earlier sessions that ended without removing them."""
    if os.path.isdir("/dev/shm"):
        _remove_mosaic_shared_memory(set(os.listdir("/dev/shm")) - _open_anywhere())
