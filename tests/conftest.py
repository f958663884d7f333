"""Session-wide fixtures. Real components only: one Spark Connect server per test session."""

from __future__ import annotations

import os
import re

import pytest

from tests.s3_server import s3_bucket, s3_server  # noqa: F401  (fixtures: a real S3 server on loopback)


#: Session fixtures that start a server, and the xdist group of the tests that take each: under
#: ``pytest -n N`` (``make test``) a group runs on one worker, so each server starts once. The
#: clusters come first: a test taking both gets the group of the first listed.
_SERVER_GROUPS = (
    ("spark_cluster", "spark-cluster"),
    ("disposable_spark_cluster", "disposable-spark-cluster"),
    ("spark", "spark-local"),
)
#: Modules of tests on Spark clusters (``test_spark_cluster*.py``); one that starts a cluster of
#: its own (a module fixture) is one group too.
_CLUSTER_MODULE = "test_spark_cluster"
#: The disposable cluster's tests are the suite's longest chain (faults, elastic jobs, killed
#: clients: ten minutes on one worker). These modules form a second group, which a second worker
#: runs on a disposable cluster of its own (the fixture is per session, and each xdist worker
#: is a session), so the two halves run side by side.
_SECOND_DISPOSABLE_MODULES = frozenset(
    {"test_spark_cluster_faults", "test_spark_cluster_elastic", "test_spark_cluster_hf_faults"}
)


def server_group(item) -> str | None:
    """The xdist group of a test: that of the first server fixture it takes (directly or through
    another fixture), else its module's if that is a Spark cluster module; None where it may run
    on any worker."""
    names = set(getattr(item, "fixturenames", ()))
    group = next((group for fixture, group in _SERVER_GROUPS if fixture in names), None)
    module = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
    if group is None and module.startswith(_CLUSTER_MODULE):
        group = module
    if group == "disposable-spark-cluster" and module in _SECOND_DISPOSABLE_MODULES:
        group = "disposable-spark-cluster-faults"
    return group


def _before_local_spark(item, group: str | None) -> bool:
    """Whether a test's Connect clients must run before the in-process `spark` server exists in
    its process: once it does, pyspark redirects and re-authenticates every other Connect client."""
    return _CLUSTER_MODULE in item.nodeid or (group or "").startswith(("spark-cluster", "disposable-spark-cluster"))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the items' groups
def pytest_collection_modifyitems(config, items):
    """Tests on the standalone Spark clusters run first, and the tests sharing a server are
    grouped (:func:`server_group`).

    ``make test`` hands groups to its workers in this order (``--dist loadgroup
    --no-loadscope-reorder``, in pyproject.toml's addopts), and a worker runs its groups in the
    order it gets them: every worker runs its cluster tests before any other.
    """
    groups = {item: server_group(item) for item in items}
    items.sort(key=lambda item: 0 if _before_local_spark(item, groups[item]) else 1)
    for item in items:
        if groups[item] and not any(item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(groups[item]))


@pytest.hookimpl(tryfirst=True)  # before the xdist worker sends its test ids to the controller
def pytest_collection_finish(session):
    """Under ``--dist loadgroup``, each grouped test's id ends in ``@<group>``, which is what the
    controller groups by. xdist 3.8 writes that suffix where pytest 9 no longer reads a test's id
    (``item._nodeid``); here it goes where pytest 9 keeps it."""
    if not getattr(session.config.option, "loadgroup", False):  # set in xdist workers only
        return
    for item in session.items:
        groups = sorted(
            {
                str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                for mark in item.iter_markers("xdist_group")
            }
        )
        if groups and "@" not in item.nodeid.rsplit("]", 1)[-1] and hasattr(item, "_id"):
            item._id = type(item._id).parse(f"{item.nodeid}@{'_'.join(groups)}")


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


@pytest.fixture(scope="session", autouse=True)
def _session_gpu_lock_dir(tmp_path_factory):
    """The simulated hosts' GPU leases and queues of this test session (of this xdist worker):
    the default, ``<tmp>/sparkgpu-gpus``, is the machine's, shared with every other test session
    on it. In the process environment, so the Spark clusters' executors get it too."""
    saved = os.environ.get("SPARKGPU_GPU_LOCK_DIR")
    os.environ["SPARKGPU_GPU_LOCK_DIR"] = str(tmp_path_factory.mktemp("gpu-locks"))
    yield
    if saved is None:
        os.environ.pop("SPARKGPU_GPU_LOCK_DIR", None)
    else:
        os.environ["SPARKGPU_GPU_LOCK_DIR"] = saved


@pytest.fixture(autouse=True)
def _piped_terminal(monkeypatch):
    """Every test sees output piped, as in CI: the CLI sizes its tables from ``COLUMNS`` where it
    is set, and xdist's workers have ``COLUMNS=80`` in their environment."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)


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
        from sparkgpu.launch.backends.local.zygote_client import _request

        _request(directory, {"op": "stop"})
    _stop_detached_jobs(home)
    reset_settings()


def _stop_detached_jobs(home) -> None:
    """Kills what a test's detached jobs left running (their keepers, supervisors, agents and ranks):
    a detached job outlives the test that submitted it, as it outlives any caller."""
    import signal

    from tests.integration.processes import processes_of

    for proc in processes_of(home):
        if "sparkgpu.launch.client.detached" in " ".join(proc.info["cmdline"] or ()):
            try:
                os.killpg(os.getpgid(proc.pid), signal.SIGKILL)  # the keeper's group: it and its supervisor
            except (ProcessLookupError, PermissionError):
                continue  # ended meanwhile


def _process_state() -> dict:
    """What one test may change in the test process that the next test on the worker would
    inherit: the working directory and MLflow's process-wide state (its environment variables,
    the tracking URI set with ``mlflow.set_tracking_uri``, the active runs of this thread)."""
    import sys

    fluent = sys.modules.get("mlflow.tracking.fluent")
    uris = sys.modules.get("mlflow.tracking._tracking_service.utils")
    return {
        "cwd": os.getcwd(),
        "env": {key: value for key, value in os.environ.items() if key.startswith("MLFLOW_")},
        "active runs": [run.info.run_id for run in fluent._active_run_stack.get()] if fluent else [],
        "active experiment": fluent._active_experiment_id if fluent else None,
        "tracking uri": uris._tracking_uri if uris else None,
    }


_STATE_BEFORE = pytest.StashKey[dict]()


def pytest_configure(config):
    """With ``SPARKGPU_TEST_TIMELINE`` set, every test's wall and CPU time is recorded (tests/timeline.py)."""
    from tests.timeline import VARIABLE, Recorder

    if os.environ.get(VARIABLE):
        config.pluginmanager.register(_Timeline(Recorder(os.environ[VARIABLE])), "sparkgpu-timeline")


class _Timeline:
    def __init__(self, recorder) -> None:
        self.recorder = recorder

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        import time

        from tests.timeline import _cpu

        started, before = time.time(), _cpu()
        try:
            return (yield)
        finally:
            self.recorder.record(item.nodeid, started, before)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_STATE_BEFORE] = _process_state()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """A test that leaves the working directory or MLflow's process state changed (its fixtures
    torn down) fails here, by name, and the state is put back: otherwise a later test on the
    same worker fails instead (an active run it did not start, another test's store), depending
    on which tests the worker ran before it."""
    result = yield
    before = item.stash.get(_STATE_BEFORE, None)
    after = _process_state()
    left = {key: (before[key], value) for key, value in after.items() if before is not None and before[key] != value}
    if left:
        _restore(before, after)
        if "env" in left:  # names only: MLFLOW_TRACKING_PASSWORD and its kind are credentials
            old, new = left["env"]
            left["env"] = sorted(key for key in set(old) | set(new) if old.get(key) != new.get(key))
        pytest.fail(f"{item.nodeid} left process state behind (before, after): {left}", pytrace=False)
    return result


def _restore(before: dict, after: dict) -> None:
    import mlflow
    import mlflow.tracking.fluent as fluent

    fluent._active_run_stack.get().clear()  # not ended: its store may be gone with the test's tmp_path
    fluent._active_experiment_id = before["active experiment"]
    mlflow.set_tracking_uri(before["tracking uri"])  # also sets or unsets MLFLOW_TRACKING_URI
    for key in set(after["env"]) | {"MLFLOW_TRACKING_URI"}:
        os.environ.pop(key, None)
    os.environ.update(before["env"])
    os.chdir(before["cwd"])


@pytest.fixture(scope="session")
def spark():
    """A real Spark Connect session on a local server (started once, about 20 s).

    The server listens on 127.0.0.1 on a free port, as users get it from
    :func:`sparkgpu.testing.local_spark.local_session`: ``remote("local[2]")`` would bind every
    interface on the fixed port 15002, reachable from the network and clashing with any other
    test session on the machine.
    """
    from sparkgpu.testing.local_spark import local_session

    session = local_session(cores=2, conf={"spark.sql.shuffle.partitions": "4"})
    yield session
    session.stop()
    from pyspark.sql import SparkSession as ClassicSession

    if ClassicSession._instantiatedSession is not None:
        ClassicSession._instantiatedSession.stop()


_MOSAIC_SHM = r"^\d{6}_[a-z_]+$"  # Mosaic's shared-memory names: 000042_locals, 000042_barrier, ...


def _remove_mosaic_shared_memory(names) -> None:
    for name in names:
        if re.match(_MOSAIC_SHM, name):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:  # removed by its dataset meanwhile
                continue


def _open_anywhere(but: int | None = None) -> set[str]:
    """The /dev/shm names some live process (other than ``but``) has open."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if pid == str(but):
            continue
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
        new = set(os.listdir("/dev/shm")) - before
        # Names another process holds open are not this test's: another xdist worker's (or
        # another test session's) dataset made them meanwhile.
        if any(re.match(_MOSAIC_SHM, name) for name in new):
            new -= _open_anywhere(but=os.getpid())
        _remove_mosaic_shared_memory(new)


@pytest.fixture(scope="session")
def _mosaic_shared_memory_stale_removed():
    """Names left in /dev/shm by earlier sessions that ended without removing them."""
    if os.path.isdir("/dev/shm"):
        _remove_mosaic_shared_memory(set(os.listdir("/dev/shm")) - _open_anywhere())
