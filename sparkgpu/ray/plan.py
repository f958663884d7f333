"""The plan of a ``@ray_launch`` cluster: which rank starts which Ray node, with what.

Pure functions of what the ranks gathered, so every rank derives the same plan; plus the
``ray start`` command line and environment of each planned node.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import tempfile

from sparkgpu import runtime
from sparkgpu.errors import ConfigurationError, RayClusterError
from sparkgpu.launch.rank.entrypoint import NODE_DEVICES_ENV

RANK_LABEL = "sparkgpu-rank"  # Ray node label: the job rank that started the node

__all__ = [
    "RankResources",
    "RayNodeSpec",
    "NODE_LAYOUTS",
    "plan_ray_nodes",
    "ray_start_command",
    "ray_node_env",
    "short_temp_dir",
]

NODE_LAYOUTS = ("per_node", "per_rank")

# Variables torch's elastic agent sets for each rank. Ray's workers inherit the raylet's
# environment; these would make every Ray task look like a torchrun rank (Lightning, for one,
# detects torchelastic by them), so the raylets start without them.
_RANK_ENV = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        runtime.ENV_GPU_ADDRESS,
        NODE_DEVICES_ENV,  # the rank's node's devices; a raylet gets its own in CUDA_VISIBLE_DEVICES
        "RAY_ADDRESS",
    }
)
# Ray's own default share of available memory for the object store; split when several Ray
# nodes share one host, so that they do not each claim it.
_OBJECT_STORE_FRACTION = 0.3
# AF_UNIX socket paths hold at most 107 bytes; Ray puts them at
# <temp dir>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store (about 63 bytes after the temp dir).
_MAX_TEMP_ROOT = 29


@dataclasses.dataclass(frozen=True)
class RankResources:
    """What one rank holds, gathered from every rank before the cluster starts.

    Attributes:
        rank: Global rank.
        node_rank: Index of the rank's node (launcher agent) in the job.
        hostname: Host the rank runs on; Ray nodes on one host split its CPUs and memory.
        cpus: CPUs this rank's process may run on (the host's, usually).
        gpu: The rank's own GPU address (``SPARKGPU_GPU_ADDRESS``), ``None`` on CPU ranks.
        memory_available: Bytes of memory available on the host.
    """

    rank: int
    node_rank: int
    hostname: str
    cpus: int
    gpu: str | None
    memory_available: int

    @classmethod
    def of_this_rank(cls) -> "RankResources":
        import psutil

        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return cls(
            rank=runtime.get_global_rank(),
            node_rank=runtime.get_node_rank(),
            hostname=socket.gethostname(),
            cpus=cpus,
            gpu=runtime.gpu_address(),
            memory_available=psutil.virtual_memory().available,
        )


@dataclasses.dataclass(frozen=True)
class RayNodeSpec:
    """One Ray node of the plan and the rank that starts it.

    Attributes:
        rank: The rank that runs ``ray start`` for this node.
        head: True for the head node (always rank 0).
        num_cpus: CPUs the node advertises to Ray.
        devices: GPU addresses the node owns (``CUDA_VISIBLE_DEVICES`` of its raylet).
        object_store_memory: Bytes for its object store; ``None`` leaves Ray's default.
        memory: Bytes of task memory it advertises; ``None`` leaves Ray's default.
    """

    rank: int
    head: bool
    num_cpus: int
    devices: tuple[str, ...] = ()
    object_store_memory: int | None = None
    memory: int | None = None

    @property
    def num_gpus(self) -> int:
        return len(self.devices)


def plan_ray_nodes(ranks: list[RankResources], layout: str = "per_node") -> dict[int, RayNodeSpec]:
    """Which ranks start a Ray node, and with what; the same answer on every rank.

    Args:
        ranks: One entry per rank, as gathered from all ranks.
        layout: ``"per_node"``: one Ray node per job node holding all of that node's GPUs
            (started by its lowest rank), so a task may ask for several GPUs and the node
            has one object store. ``"per_rank"``: one Ray node per rank with the rank's GPU.

    Returns:
        The Ray nodes keyed by the rank that starts them; rank 0 starts the head.

    Raises:
        ConfigurationError: ``layout`` is unknown.
    """
    if layout not in NODE_LAYOUTS:
        raise ConfigurationError(f"ray_nodes={layout!r}: use one of {', '.join(map(repr, NODE_LAYOUTS))}")
    ordered = sorted(ranks, key=lambda r: r.rank)
    if layout == "per_rank":
        groups = [[r] for r in ordered]
    else:
        by_node: dict[int, list[RankResources]] = {}
        for r in ordered:
            by_node.setdefault(r.node_rank, []).append(r)
        groups = list(by_node.values())
    per_host: dict[str, int] = {}
    for group in groups:
        per_host[group[0].hostname] = per_host.get(group[0].hostname, 0) + 1
    plan = {}
    for group in groups:
        starter = group[0]
        sharing = per_host[starter.hostname]
        store = memory = None
        if sharing > 1:
            store = int(starter.memory_available * _OBJECT_STORE_FRACTION / sharing)
            memory = int(starter.memory_available * (1 - _OBJECT_STORE_FRACTION) / sharing)
        plan[starter.rank] = RayNodeSpec(
            rank=starter.rank,
            head=starter.rank == 0,
            num_cpus=max(1, starter.cpus // sharing),
            devices=tuple(r.gpu for r in group if r.gpu is not None),
            object_store_memory=store,
            memory=memory,
        )
    if 0 not in plan:  # ranks are numbered node by node, so rank 0 always leads a group
        raise RayClusterError(f"no Ray head in the plan {sorted(plan)}; rank 0 must start the head")
    return plan


def ray_start_command(
    spec: RayNodeSpec, temp_dir: str, head_address: str | None = None, python: str | None = None
) -> list[str]:
    """The ``ray start --block`` command line of one planned node.

    Fixed default ports (GCS 6379, dashboard 8265, client server 10001, agent 52365) would
    clash with any other Ray cluster on the host, so each is picked free (the GCS port by Ray).

    Args:
        spec: The node.
        temp_dir: Its ``--temp-dir`` (see :func:`short_temp_dir`).
        head_address: The GCS address to join; required for every node but the head.
        python: Interpreter that runs ``ray start`` (this one by default).

    Raises:
        RayClusterError: a worker node has no head address to join.
    """
    from sparkgpu.launch.backends.local.backend import free_port

    cmd = [
        python or sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--block",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        f"--num-cpus={spec.num_cpus}",
        f"--num-gpus={spec.num_gpus}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--labels={RANK_LABEL}={spec.rank}",
    ]
    if spec.head:
        cmd += [
            "--head",
            "--port=0",
            "--include-dashboard=false",
            f"--dashboard-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
        ]
    else:
        if not head_address:
            raise RayClusterError(f"rank {spec.rank} cannot join: no head address")
        cmd.append(f"--address={head_address}")
    if spec.object_store_memory:
        cmd.append(f"--object-store-memory={spec.object_store_memory}")
    if spec.memory:
        cmd.append(f"--memory={spec.memory}")
    return cmd


def short_temp_dir() -> str:
    """A new private directory whose path is short enough for Ray's socket paths."""
    root = tempfile.gettempdir()
    if len(root) > _MAX_TEMP_ROOT:
        root = "/tmp"
    return tempfile.mkdtemp(prefix="sgray-", dir=root)


def ray_node_env(
    spec: RayNodeSpec, base: dict[str, str] | None = None, import_paths: list[str] | None = None
) -> dict[str, str]:
    """The raylet's environment: the rank's, without the rank's identity, with the node's GPUs.

    Args:
        spec: The node.
        base: The rank's environment (``os.environ`` by default).
        import_paths: Directories the job imports the caller's modules from (the rank's
            ``sys.path`` entries outside the interpreter's own by default).
    """
    base = dict(os.environ if base is None else base)
    env = {k: v for k, v in base.items() if k not in _RANK_ENV and not k.startswith("TORCHELASTIC_")}
    # An empty CUDA_VISIBLE_DEVICES hides every GPU from Ray on CPU nodes.
    env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.devices)
    # The rank found the caller's modules through paths _air.py put on sys.path; Ray's worker
    # processes need them too, to unpickle the tasks the driver defines.
    paths = list(import_paths if import_paths is not None else _job_import_paths())
    if base.get("PYTHONPATH"):
        paths.append(base["PYTHONPATH"])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")  # the whole cluster goes at once
    return env


def _job_import_paths() -> list[str]:
    return [p for p in sys.path if p and os.path.isdir(p) and "site-packages" not in p and "lib/python" not in p]
