"""What the capacity probe runs inside Spark tasks on the executors: who each executor is and what it has.

These ``mapInArrow`` functions are shipped to the executors by reference (``sparkgpu`` must be
installed there). :func:`probe_executor` answers with one row per executor (its id, host,
task slots, GPU addresses and names); :func:`probe_image` with the executor's Python and
distributions, which decide what a job's environment must ship. The client side that plans
a job from these rows is :mod:`sparkgpu.launch.backends.spark.capacity`; one node of a job is
:mod:`sparkgpu.launch.backends.spark.executor.node`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa

from sparkgpu.errors import ConfigurationError

__all__ = [
    "ProbeOptions",
    "probe_executor",
    "probe_image",
    "PROBE_SCHEMA",
    "PROBE_DDL",
    "IMAGE_DDL",
    "ExecutorIdentity",
    "executor_identity",
]

PROBE_SCHEMA = pa.schema(
    [
        ("executor", pa.string()),
        ("host", pa.string()),
        ("cores", pa.int32()),
        ("gpu_addresses", pa.string()),
        ("gpu_names", pa.string()),
        ("python", pa.string()),
    ]
)
# mapInArrow takes the schema as DDL; the Arrow schema above builds the batches that match it.
PROBE_DDL = "executor string, host string, cores int, gpu_addresses string, gpu_names string, python string"


# -- who am I ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExecutorIdentity:
    """The executor a Python worker serves, read from the executor JVM's command line.

    Attributes:
        executor_id: Spark's executor id (``"driver"`` in local mode).
        host: Host name Spark knows the executor by.
        cores: Task slots of the executor (0 when unknown).
        resources_file: JSON file with the resources the cluster manager assigned to the
            executor (standalone mode), or ``None``.
        jvm_pid: Process id of the executor JVM.
    """

    executor_id: str
    host: str
    cores: int
    resources_file: str | None
    jvm_pid: int


def _arg(argv: list[str], name: str) -> str | None:
    try:
        return argv[argv.index(name) + 1]
    except (ValueError, IndexError):
        return None


def executor_identity() -> ExecutorIdentity:
    """Walks up from this Python worker to the JVM that started it (daemon -> JVM).

    Every executor backend (standalone, Kubernetes, YARN) starts with ``--executor-id``,
    ``--hostname`` and ``--cores``; a JVM without them is the driver of a local-mode session.
    """
    import psutil

    process = psutil.Process()
    for ancestor in process.parents()[:4]:
        try:
            argv = ancestor.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if not argv or "java" not in os.path.basename(argv[0]):
            continue
        executor_id = _arg(argv, "--executor-id")
        if executor_id is None:
            return ExecutorIdentity("driver", socket.gethostname(), 0, None, ancestor.pid)
        cores = _arg(argv, "--cores")
        return ExecutorIdentity(
            executor_id,
            _arg(argv, "--hostname") or socket.gethostname(),
            int(cores) if cores and cores.isdigit() else 0,
            _arg(argv, "--resourcesFile"),
            ancestor.pid,
        )
    return ExecutorIdentity("unknown", socket.gethostname(), 0, None, os.getppid())


def _assigned_gpu_addresses(identity: ExecutorIdentity, discovery_script: str | None) -> list[str]:
    """GPU addresses of this executor: the manager's assignment, else the discovery script's answer.

    Raises:
        ConfigurationError: the discovery script is missing, fails or prints something other
            than Spark's resource JSON (a broken script must not read as "no GPUs").
    """
    unreadable = None
    if identity.resources_file:
        try:
            for entry in json.loads(Path(identity.resources_file).read_text()):
                if entry.get("id", {}).get("resourceName") == "gpu":
                    return [str(a) for a in entry.get("addresses", [])]
        except (OSError, ValueError, AttributeError) as exc:
            unreadable = f"its resources file {identity.resources_file} is unreadable ({exc})"
    if not discovery_script:
        if unreadable:
            raise ConfigurationError(f"cannot tell the GPUs of executor {identity.executor_id}: {unreadable}")
        return []
    return _discover_gpus(identity, discovery_script, unreadable)


def _discover_gpus(identity: ExecutorIdentity, script: str, unreadable: str | None) -> list[str]:
    where = f"executor {identity.executor_id} on {identity.host}"
    if unreadable:
        where += f" ({unreadable})"
    fix = "fix the script, or spark.executor.resource.gpu.discoveryScript"
    if not os.path.exists(script):
        raise ConfigurationError(f"the GPU discovery script {script} does not exist on {where}; {fix}")
    try:
        done = subprocess.run([script], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigurationError(f"the GPU discovery script {script} could not run on {where}: {exc}; {fix}") from exc
    output = f"stdout: {done.stdout.strip()[:500]!r}, stderr: {done.stderr.strip()[:500]!r}"
    if done.returncode != 0:
        raise ConfigurationError(
            f"the GPU discovery script {script} failed on {where} with exit code {done.returncode} ({output}); {fix}"
        )
    try:
        addresses = json.loads(done.stdout)["addresses"]
        if not isinstance(addresses, list):
            raise TypeError(f"addresses is a {type(addresses).__name__}")
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigurationError(
            f"the GPU discovery script {script} on {where} did not print Spark's resource JSON "
            f'(\'{{"name": "gpu", "addresses": ["0", ...]}}\'): {type(exc).__name__}: {exc} ({output}); {fix}'
        ) from exc
    return [str(a) for a in addresses]


# -- the capacity probe ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProbeOptions:
    """What the probe needs to know from the client.

    Attributes:
        discovery_script: ``spark.executor.resource.gpu.discoveryScript``, run when the
            cluster manager did not hand the executor a resources file.
        detect_names: Ask NVML / ``nvidia-smi`` for device names (off for simulated GPUs).
    """

    discovery_script: str | None = None
    detect_names: bool = True


def probe_executor(options: ProbeOptions, batches):
    """``mapInArrow`` function: one row describing the executor this task ran on."""
    for _ in batches:
        pass
    identity = executor_identity()
    addresses = _assigned_gpu_addresses(identity, options.discovery_script)
    names: list[str] = []
    if options.detect_names and addresses:
        from sparkgpu.launch.node.hardware import detect_host_gpus

        found = detect_host_gpus()
        names = [n for a, n in zip(found.addresses, found.names) if a in addresses] or list(found.names)
    row = {
        "executor": [identity.executor_id],
        "host": [identity.host],
        "cores": [identity.cores],
        "gpu_addresses": [",".join(addresses)],
        "gpu_names": ["|".join(names)],
        "python": [sys.executable],
    }
    yield pa.RecordBatch.from_pydict(row, schema=PROBE_SCHEMA)


IMAGE_SCHEMA = pa.schema([("executor", pa.string()), ("image", pa.string())])
IMAGE_DDL = "executor string, image string"


def probe_image(batches):
    """``mapInArrow`` function: the executor's Python and its distributions, as JSON."""
    from sparkgpu.env.hydrate import probe

    for _ in batches:
        pass
    row = {"executor": [executor_identity().executor_id], "image": [json.dumps(probe())]}
    yield pa.RecordBatch.from_pydict(row, schema=IMAGE_SCHEMA)
