"""A real Spark standalone cluster with GPU-declaring workers and a Spark Connect server.

Everything comes from the ``pyspark`` package itself (``$SPARK_HOME`` is the package dir):
one ``Master``, N ``Worker`` processes that declare ``gpu`` resources through a discovery
script reporting fake addresses, and a ``SparkConnectServer`` driver against the master.
Each worker gets its own addresses (worker 0: ``0,1``, worker 1: ``2,3``, ...) so a test can
tell from a task's GPU addresses which worker ran it.

Usable from tests (``tests/integration/conftest.py``), benchmarks and by hand::

    python tests/integration/spark_cluster.py      # starts one, prints sc://..., Ctrl-C stops it

Every JVM is started in its own session and stopped (SIGTERM, then SIGKILL of its process
group) by :meth:`LocalSparkCluster.stop`; :meth:`leftover_processes` lists anything that
survived, for tests to assert on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from sparkgpu._util.java import java_available, java_environment

__all__ = ["LocalSparkCluster", "java_available", "spark_home", "is_loopback", "disposable_cluster", "cluster_session"]

_CONNECT_SERVER = "org.apache.spark.sql.connect.service.SparkConnectServer"
#: Every JVM of a test cluster (master, workers, Connect server, executors) compiles with C1
#: only and collects with one serial thread: they serve a few RPCs, and the optimizing compiler's
#: and parallel collector's threads would otherwise take CPU from the tests on a small machine.
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


#: Why the Spark cluster tests are skipped where :func:`java_available` is false.
NO_JAVA = "the Spark cluster tests need Java 17: pip install 'sparkgpu[java]', or install Java 17 and set JAVA_HOME"


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_loopback(ip: str) -> bool:
    """Whether a listening address is on loopback (IPv4, IPv6, or IPv4 mapped into IPv6)."""
    import ipaddress

    address = ipaddress.ip_address(ip.split("%")[0])
    if getattr(address, "ipv4_mapped", None):
        address = address.ipv4_mapped
    return address.is_loopback


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class LocalSparkCluster:
    """Master, workers and Connect server on this host, on free ports.

    Args:
        workdir: Folder for scripts, logs and the workers' work dirs.
        workers: Number of worker processes (one executor each).
        gpus_per_worker: Fake GPU addresses each worker declares.
        cores_per_worker: Task slots of each worker's executor.
        gpu_type: Value of ``spark.sparkgpu.gpuType`` (``None`` to leave it unset).
        simulated: Set ``spark.sparkgpu.simulatedGpus=true``: the addresses are fake, ranks run on CPU.
        worker_memory: Memory each worker offers (``SPARK_WORKER_MEMORY``).
        executor_memory: ``spark.executor.memory``.
        extra_conf: More ``--conf`` settings for the Connect server.
        env: Extra environment for every JVM (and so for the executors' Python workers).
        name: The cluster's name: its application name, and ``TEST_SPARK_CLUSTER`` in the
            environment of its executors and so of every rank it runs (tests with several
            clusters read it to tell which one ran a job).
    """

    def __init__(
        self,
        workdir,
        *,
        workers: int = 2,
        gpus_per_worker: int = 2,
        cores_per_worker: int = 2,
        gpu_type: str | None = "A10",
        simulated: bool = True,
        worker_memory: str = "1g",
        executor_memory: str = "512m",
        extra_conf: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        name: str = "sparkgpu-test-cluster",
    ):
        self.workdir = Path(workdir)
        self.workers = workers
        self.gpus_per_worker = gpus_per_worker
        self.cores_per_worker = cores_per_worker
        self.gpu_type = gpu_type
        self.simulated = simulated
        self.worker_memory = worker_memory
        self.executor_memory = executor_memory
        self.extra_conf = dict(extra_conf or {})
        self.name = name
        self.env = {"TEST_SPARK_CLUSTER": name, **(env or {})}
        self.master_port = self.master_ui_port = self.connect_port = 0
        self._processes: dict[str, subprocess.Popen] = {}
        self._logs: list = []

    # -- addresses ---------------------------------------------------------------------
    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.master_port}"

    @property
    def connect_url(self) -> str:
        return f"sc://127.0.0.1:{self.connect_port}"

    def worker_addresses(self, index: int) -> list[str]:
        """The fake GPU addresses worker ``index`` declares."""
        start = index * self.gpus_per_worker
        return [str(a) for a in range(start, start + self.gpus_per_worker)]

    def pool_entry(self, **fields) -> dict:
        """This cluster as an entry of a pools file (``SPARKGPU_POOLS``), plus ``fields``."""
        return {
            "url": self.connect_url,
            "gpu_type": self.gpu_type or "cpu",
            "gpus_per_node": self.gpus_per_worker,
            **fields,
        }

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, timeout: float = 180.0) -> "LocalSparkCluster":
        """Starts every process and waits until the executors have registered.

        Raises:
            RuntimeError: a process exited or the cluster was not up within ``timeout``;
                the message holds the tail of the failing process's log.
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout
        try:
            self._start_master(deadline)
            for index in range(self.workers):
                self._start_worker(index)
            self._wait(self._workers_registered, deadline, "workers to register with the master")
            self._start_connect_server(deadline)
            self._wait(self._executors_registered, deadline, "executors to start")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace: float = 20.0) -> None:
        """Stops the Connect server first (its executors end with the application), then the rest."""
        for name in sorted(self._processes, key=lambda n: (n != "connect", n != "master")):
            process = self._processes[name]
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + grace
        for process in self._processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for process in self._processes.values():
            # Executors and Python daemons are children of the worker JVMs, in their groups.
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        # Python daemons make their own process group and end when their executor's pipe closes,
        # which on a busy machine can come after the JVMs are gone: they are killed here too.
        import psutil

        stragglers = self._cluster_processes()
        for proc in stragglers:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(stragglers, timeout=10)
        for log in self._logs:
            log.close()
        self._logs.clear()

    def _cluster_processes(self) -> list:
        """Live processes (``psutil.Process``) from this cluster's work dir or process groups."""
        import psutil

        groups = {p.pid for p in self._processes.values()}
        workdir = str(self.workdir.resolve())
        found = []
        for proc in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
                    continue  # exited, waiting to be reaped by init
                cmdline = " ".join(proc.info["cmdline"] or ())
                # Python daemons make their own process group; their cwd is the executor's dir.
                if os.getpgid(proc.pid) in groups or workdir in cmdline or proc.cwd().startswith(workdir):
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
                continue
        return found

    def leftover_processes(self, settle: float = 10.0) -> list[str]:
        """Command lines of processes still running from this cluster's work dir or groups,
        after up to ``settle`` seconds for ones that are exiting (their command line is already
        empty) to be gone."""
        import psutil

        deadline = time.monotonic() + settle
        while True:
            left = []
            for proc in self._cluster_processes():
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    left.append(f"{proc.pid}: {' '.join(proc.cmdline())[:200]}")
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)

    def listeners(self) -> list[tuple[str, int, str, int]]:
        """Every TCP socket listening in this cluster's processes and their descendants
        (executors, Python workers, node agents, ranks): ``(process, pid, address, port)``."""
        import psutil

        found = []
        for name, process in self._processes.items():
            if process.poll() is not None:
                continue
            try:
                tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for proc in tree:
                try:
                    connections = proc.net_connections(kind="inet")
                    label = f"{name}/{proc.name()}"
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                found += [
                    (label, proc.pid, c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN
                ]
        return found

    def exposed_listeners(self) -> list[tuple[str, int, str, int]]:
        """The :meth:`listeners` reachable from beyond this host (not on a loopback address)."""
        return [entry for entry in self.listeners() if not is_loopback(entry[2])]

    # -- faults ------------------------------------------------------------------------
    def executor_pids(self) -> dict[str, tuple[int, int]]:
        """Live executor JVMs of this cluster: ``{executor id: (pid, worker index)}``."""
        import psutil

        found = {}
        for name, process in self._processes.items():
            if not name.startswith("worker-") or process.poll() is not None:
                continue
            for child in psutil.Process(process.pid).children(recursive=True):
                try:
                    argv = child.cmdline()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                if "org.apache.spark.executor.CoarseGrainedExecutorBackend" in argv and "--executor-id" in argv:
                    found[argv[argv.index("--executor-id") + 1]] = (child.pid, int(name[len("worker-") :]))
        return found

    def kill_worker(self, index: int) -> None:
        """SIGKILLs worker ``index`` with its executors (one process group), as a lost machine."""
        process = self._processes[f"worker-{index}"]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)

    def restart_worker(self, index: int, timeout: float = 120.0) -> None:
        """Starts worker ``index`` again and waits until the application has its executor back."""
        deadline = time.monotonic() + timeout
        self._start_worker(index)
        self._wait(self._workers_registered, deadline, f"worker {index} to register again", f"worker-{index}")
        self.wait_for_executors(max(1.0, deadline - time.monotonic()))

    def restart_connect_server(self, timeout: float = 180.0) -> None:
        """Kills the Connect server (a crashed driver: its application ends, and its executors
        with it) and starts a new one on the same port; returns once the new one has executors."""
        old_apps = {app.get("id") for app in self._master_state().get("activeapps", [])}
        process = self._processes["connect"]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        deadline = time.monotonic() + timeout
        self._start_connect_server(deadline, port=self.connect_port)

        def new_app_has_executors() -> bool:
            wanted = self.workers * self.cores_per_worker
            return any(
                app.get("id") not in old_apps and app.get("cores", 0) >= wanted
                for app in self._master_state().get("activeapps", [])
            )

        self._wait(new_app_has_executors, deadline, "the new Connect server's executors to start", "connect")

    def repaired(self, timeout: float = 180.0) -> "LocalSparkCluster":
        """This cluster with every process a test killed started again (a worker, the Connect
        server), once the application holds an executor on every worker."""
        deadline = time.monotonic() + timeout
        if self._processes["master"].poll() is not None:
            raise RuntimeError(f"the master of {self.name} is gone; a test must not kill it")
        if self._processes["connect"].poll() is not None:
            self._start_connect_server(deadline, port=self.connect_port)
        for index in range(self.workers):
            if self._processes[f"worker-{index}"].poll() is not None:
                self.restart_worker(index, max(1.0, deadline - time.monotonic()))
        self.wait_for_executors(max(1.0, deadline - time.monotonic()))
        return self

    def wait_for_executors(self, timeout: float = 120.0) -> None:
        """Waits until the application holds an executor on every worker again (after a fault)."""
        self._wait(self._executors_registered, time.monotonic() + timeout, "the executors to be back", "master")

    def __enter__(self) -> "LocalSparkCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def session(self):
        """A new Spark Connect session to this cluster."""
        # Connect's own builder, and create(): pyspark's generic builder redirects every remote
        # URL to the in-process local server once a `remote("local")` session was started in
        # this process (the shared `spark` fixture), and getOrCreate() returns that session.
        from pyspark.sql.connect.session import SparkSession

        # A local server started in this process leaves a token in the environment, which makes
        # every later client speak TLS; this cluster's server is plain loopback without a token.
        saved = {k: os.environ.pop(k) for k in ("SPARK_CONNECT_AUTHENTICATE_TOKEN",) if k in os.environ}
        os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"  # as pyspark's own builder sets for Connect
        had_default = SparkSession._default_session is not None
        had_active = getattr(SparkSession._active_session, "session", None) is not None
        try:
            session = SparkSession.builder.remote(self.connect_url).create()
        finally:
            os.environ.update(saved)
        # create() makes the first session of the process its default and active one, and a
        # later `builder.remote("local").getOrCreate()` (the shared `spark` fixture) would then
        # return this cluster session. It is an explicit handle, not the process default.
        if not had_default:
            SparkSession._default_session = None
        if not had_active:
            SparkSession._active_session.session = None
        return session

    # -- processes ---------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        self._logs.append(log)
        # SPARK_LOCAL_IP: every JVM binds its RPC, block manager and web UI there (the UIs
        # of the master and workers bind every interface otherwise, whatever --host says).
        full_env = {
            **java_environment(),
            "SPARK_HOME": str(spark_home()),
            "SPARK_LOG_DIR": str(self.workdir),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "PYSPARK_PYTHON": sys.executable,
            "SPARK_DAEMON_MEMORY": "256m",
            "SPARK_DAEMON_JAVA_OPTS": TEST_JVM_OPTIONS,
            "SPARK_SUBMIT_OPTS": TEST_JVM_OPTIONS,
            "SPARK_NO_DAEMONIZE": "1",
            **self.env,
            **env,
        }
        full_env.pop("SPARK_CONNECT_MODE_ENABLED", None)
        process = subprocess.Popen(
            [str(spark_home() / "bin" / "spark-class"), *args],
            env=full_env,
            cwd=self.workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._processes[name] = process
        return process

    def _start_master(self, deadline: float) -> None:
        self.master_port, self.master_ui_port = _free_port(), _free_port()
        self._spawn(
            "master",
            [
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.master_port),
                "--webui-port",
                str(self.master_ui_port),
            ],
            {},
        )
        self._wait(lambda: self._master_ui_bound() and self._master_bound(), deadline, "the master to listen", "master")

    def _discovery_script(self, index: int) -> Path:
        script = self.workdir / f"gpus-worker-{index}.sh"
        addresses = json.dumps({"name": "gpu", "addresses": self.worker_addresses(index)})
        script.write_text(f"#!/bin/sh\necho '{addresses}'\n")
        script.chmod(0o755)
        return script

    def _start_worker(self, index: int) -> None:
        work = self.workdir / f"worker-{index}"
        work.mkdir(exist_ok=True)
        opts = (
            f"-Dspark.worker.resource.gpu.amount={self.gpus_per_worker} "
            f"-Dspark.worker.resource.gpu.discoveryScript={self._discovery_script(index)}"
        )
        self._spawn(
            f"worker-{index}",
            [
                "org.apache.spark.deploy.worker.Worker",
                self.master_url,
                "--host",
                "127.0.0.1",
                "--cores",
                str(self.cores_per_worker),
                "--memory",
                self.worker_memory,
                "--work-dir",
                str(work),
                "--webui-port",
                str(_free_port()),
            ],
            # Each worker has a cache disk of its own, as each machine of a real cluster has.
            {"SPARK_WORKER_OPTS": opts, "SPARKGPU_CACHE_DIR": str(self.cache_dir(index))},
        )

    def cache_dir(self, index: int) -> Path:
        """Worker ``index``'s cache disk (``SPARKGPU_CACHE_DIR`` of its executors and their ranks)."""
        return self.workdir / f"worker-{index}" / "cache"

    def _start_connect_server(self, deadline: float, port: int | None = None) -> None:
        self.connect_port = port or _free_port()
        conf = {
            "spark.master": self.master_url,
            "spark.app.name": self.name,
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.connect.grpc.binding.port": str(self.connect_port),
            "spark.driver.host": "127.0.0.1",
            "spark.executor.memory": self.executor_memory,
            "spark.executor.cores": str(self.cores_per_worker),
            "spark.executor.resource.gpu.amount": str(self.gpus_per_worker),
            "spark.executor.resource.gpu.discoveryScript": str(self._discovery_script(0)),
            "spark.task.resource.gpu.amount": "0",
            "spark.pyspark.python": sys.executable,
            "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "4",
            "spark.executor.extraJavaOptions": TEST_JVM_OPTIONS,
        }
        if self.gpu_type:
            conf["spark.sparkgpu.gpuType"] = self.gpu_type
        if self.simulated:
            conf["spark.sparkgpu.simulatedGpus"] = "true"
        conf.update(self.extra_conf)
        args = [
            "org.apache.spark.deploy.SparkSubmit",
            "--class",
            _CONNECT_SERVER,
        ]
        for key, value in conf.items():
            args += ["--conf", f"{key}={value}"]
        args.append("spark-internal")
        log = self.workdir / "connect.log"
        since = log.stat().st_size if log.exists() else 0  # a restarted server appends to its log
        # The launcher sizes a Connect server's heap from SPARK_DAEMON_MEMORY, not --driver-memory.
        self._spawn("connect", args, {"SPARK_DAEMON_MEMORY": "768m"})
        self._wait(lambda: self._connect_bound(log, since), deadline, "the Connect server to listen", "connect")

    # -- readiness ---------------------------------------------------------------------
    def _master_bound(self) -> bool:
        # The same for the master's own port: the workers must be told the port it took, not the
        # one it was given (another cluster's master listening there took their registrations).
        found = re.findall(r"Starting Spark master at spark://127\.0\.0\.1:(\d+)", self._log_tail("master", 400))
        if not found:
            return False
        self.master_port = int(found[-1])
        return _port_open(self.master_port)

    def _connect_bound(self, log: Path, since: int) -> bool:
        # As for the master: a port another process took moves the server on, and a client sent to
        # the port asked for would reach whoever holds it (another cluster's Connect server).
        try:
            with open(log, "rb") as f:
                f.seek(since)
                text = f.read().decode(errors="replace")
        except OSError:
            return False
        found = re.findall(r"Spark Connect server started at: 127\.0\.0\.1:(\d+)", text)
        if not found:
            return False
        self.connect_port = int(found[-1])
        return _port_open(self.connect_port)

    def _master_ui_bound(self) -> bool:
        # Another process may take the free UI port before the master binds it; Spark then moves
        # to the next port and says so in its log.
        found = re.findall(r"started service 'MasterUI' on port (\d+)", self._log_tail("master", 400))
        if found:
            self.master_ui_port = int(found[-1])
        return _port_open(self.master_ui_port)

    def _master_state(self) -> dict:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.master_ui_port}/json/", timeout=2) as r:
                return json.loads(r.read())
        except (OSError, ValueError):  # not up yet, or an empty answer while its UI starts: ask again
            return {}

    def _workers_registered(self) -> bool:
        workers = self._master_state().get("workers", [])
        return sum(w.get("state") == "ALIVE" for w in workers) >= self.workers

    def _executors_registered(self) -> bool:
        apps = self._master_state().get("activeapps", [])
        wanted = self.workers * self.cores_per_worker
        return any(app.get("cores", 0) >= wanted for app in apps)

    def _wait(self, ready, deadline: float, what: str, process: str | None = None) -> None:
        while not ready():
            for name, proc in self._processes.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"spark {name} exited with code {proc.returncode} while waiting for {what}:\n"
                        + self._log_tail(name)
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}:\n" + self._log_tail(process or "master"))
            time.sleep(0.25)

    def _log_tail(self, name: str, lines: int = 40) -> str:
        path = self.workdir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def hold_until(path):
    """A training function that keeps its GPUs until ``path`` exists."""
    import time as _t

    while not os.path.exists(path):
        _t.sleep(0.2)
    return "released"


@contextlib.contextmanager
def every_gpu_held(session, release: Path):
    """A job holding all 4 GPUs of the test cluster until the block ends; entered once both
    of its nodes started (so GPUs are busy for whatever the block submits)."""
    from sparkgpu.config import settings

    holder: dict = {}

    def hold():
        try:
            holder["result"] = session.gpu.train(hold_until, gpus=4, gpu_type="A10", args=(str(release),))
        except BaseException as exc:  # surfaced by the assertions
            holder["error"] = exc

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while len(list(settings().staging_root.glob("hold-until-*/attempts/0/spark/node-*.started"))) < 2:
            assert time.monotonic() < deadline, "the job holding the GPUs never got them"
            assert "error" not in holder, holder.get("error")
            time.sleep(0.2)
        yield
    finally:
        release.write_text("go")
        thread.join(120)
    assert holder.get("result") == ["released"] * 4, holder.get("error")


def _main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sparkgpu-cluster-") as tmp, LocalSparkCluster(tmp) as cluster:
        print(f"master {cluster.master_url}  connect {cluster.connect_url}  (Ctrl-C stops it)", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    _main()


#: The name of the session's disposable cluster (``TEST_SPARK_CLUSTER`` on its executors).
DISPOSABLE_CLUSTER = "sparkgpu-disposable-cluster"


@contextlib.contextmanager
def disposable_cluster(folder: Path, name: str):
    """Two workers (GPUs 0,1 and 2,3) of one test module's own, for tests that kill or restart
    its processes (never those of the session's shared cluster); fails if any outlives it."""
    import pytest

    if not java_available():
        pytest.skip(NO_JAVA)
    cluster = LocalSparkCluster(
        folder, workers=2, gpus_per_worker=2, cores_per_worker=2, gpu_type="A10", simulated=True, name=name
    )
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
    left = cluster.leftover_processes()
    assert not left, f"processes of {name} survived its shutdown:\n" + "\n".join(left)


@contextlib.contextmanager
def cluster_session(cluster: LocalSparkCluster):
    """A Spark Connect session on ``cluster`` with ``spark.gpu`` attached and its capacity probed."""
    from sparkgpu.api.spark_gpu import attach

    attach()
    session = cluster.session()
    session.gpu.capacity()
    try:
        yield session
    finally:
        if not session.is_stopped:  # a test that restarts the Connect server closes it
            session.stop()
