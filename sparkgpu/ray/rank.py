"""What every rank of a ``@ray_launch`` job runs: rendezvous, Ray node, driver or wait, teardown.

The ranks talk over torch.distributed on a gloo group of their own (it works beside an nccl
default group, and its long timeout lets them wait for a driver that runs for days):

1. ``all_gather_object`` of each rank's :class:`~sparkgpu.ray.plan.RankResources`; every rank
   derives the same :func:`~sparkgpu.ray.plan.plan_ray_nodes`.
2. Rank 0 starts the head and broadcasts ``(address, failure)``; the planned ranks join and
   ``all_gather_object`` their own failures, so that a failed start ends every rank at once
   (the rank that failed raises, the others return ``None``).
3. Rank 0 runs the function as the driver and broadcasts ``"finished"`` or ``"failed"``
   afterwards, whatever happened; the other ranks wait for that broadcast.
4. Every rank stops its node in ``finally``; SIGTERM from the launcher kills the node first.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from sparkgpu import runtime
from sparkgpu._util.report import report
from sparkgpu.errors import MissingDependencyError
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.ray.node import RayNode
from sparkgpu.ray.plan import (
    RANK_LABEL,
    RankResources,
    RayClusterError,
    RayNodeSpec,
    plan_ray_nodes,
    ray_node_env,
    ray_start_command,
    short_temp_dir,
)

__all__ = ["RayOptions", "run_rank", "read_cluster_info", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'sparkgpu[ray]'"
_FOREVER = datetime.timedelta(days=365)  # the driver may run as long as the job's runtime cap


@dataclasses.dataclass(frozen=True)
class RayOptions:
    """The ``@ray_launch`` settings every rank needs.

    Attributes:
        layout: ``"per_node"`` or ``"per_rank"`` (see :func:`~sparkgpu.ray.plan.plan_ray_nodes`).
        start_timeout: Seconds one Ray node may take to start.
        metrics_interval: Seconds between samples of Ray's metrics into the job's MLflow run;
            ``None`` or 0 for none.
    """

    layout: str
    start_timeout: float
    metrics_interval: float | None = 10.0


def _ray_dir() -> Path | None:
    run_dir = os.environ.get(runtime.ENV_RUN_DIR)
    return Path(run_dir) / RunLayout.ray(runtime.attempt()) if run_dir else None


def read_cluster_info(run_dir: str | os.PathLike, attempt: int = 0) -> dict | None:
    """The Ray cluster of one attempt, as its driver saw it once every node was up.

    ``{"address", "nodes": [{"node_id", "rank", "ip", "metrics_export_port", "resources"}]}``,
    ``rank`` being the job rank that started the node. Each node serves Ray's Prometheus
    metrics at ``http://<ip>:<metrics_export_port>/metrics`` (with ``ray[default]``); a tracked
    job samples them into its MLflow run (:mod:`sparkgpu.ray.metrics`). ``None`` until the
    cluster is up.
    """
    path = Path(run_dir) / RunLayout.ray_cluster(attempt)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


_live_nodes: list[RayNode] = []


def _teardown_on_sigterm():
    """Makes SIGTERM (the launcher stopping this rank) stop the rank's Ray node first.

    The rank then still dies by SIGTERM, as the launcher expects, so it reports no error of
    its own. Returns the previous handler, or ``None`` off the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        for node in list(_live_nodes):
            node.kill_now()  # a stop() in progress may have been interrupted: no waiting on it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    return signal.signal(signal.SIGTERM, handler)


def run_rank(fn: Callable, options: RayOptions, *args, **kwargs):
    """The function every rank of a ``@ray_launch`` job runs; rank 0 returns ``fn``'s value."""
    import torch.distributed as dist

    if importlib.util.find_spec("ray") is None:
        raise MissingDependencyError("@ray_launch on the workers", INSTALL_HINT)
    rank, world = dist.get_rank(), dist.get_world_size()
    # Object collectives on a gloo group of their own: it works beside an nccl default group,
    # and its timeout lets the other ranks wait for a driver that runs for days.
    group = dist.new_group(backend="gloo", timeout=_FOREVER)
    assert isinstance(group, dist.ProcessGroup)  # every rank is a member
    previous_handler = _teardown_on_sigterm()
    node: RayNode | None = None
    ray_dir = _ray_dir()
    try:
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, RankResources.of_this_rank(), group=group)
        plan = plan_ray_nodes(everyone, options.layout)
        spec = plan.get(rank)

        head: list[Any] = [None]
        if rank == 0:
            assert spec is not None  # the plan always starts the head on rank 0
            node, head[0] = _start_node(spec, None, options, ray_dir)
        dist.broadcast_object_list(head, src=0, group=group)
        address, failure = head[0]
        if rank != 0 and address and spec is not None:
            node, (_, failure) = _start_node(spec, address, options, ray_dir)
        elif rank != 0:
            failure = None  # rank 0 reports its own failure; the others only step aside
        failures: list[Any] = [None] * world
        dist.all_gather_object(failures, failure, group=group)
        if failure:
            raise RayClusterError(failure)
        if any(failures) or not address:
            return None  # the rank that failed raises; the job fails there

        if rank == 0:
            return _drive_and_release(fn, args, kwargs, address, len(plan), options, ray_dir, group)
        _wait_for_driver(group, node)
        return None
    finally:
        if node is not None:
            node.stop()
            _live_nodes.remove(node)
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)


def _start_node(spec: RayNodeSpec, head_address: str | None, options: RayOptions, ray_dir: Path | None):
    """Starts this rank's node; returns ``(node, (address, failure text or None))``."""
    temp_dir = short_temp_dir()
    log_dir = ray_dir if ray_dir is not None else Path(temp_dir)
    node = RayNode(
        ray_start_command(spec, temp_dir, head_address),
        ray_node_env(spec),
        temp_dir,
        log_dir / f"start-rank-{spec.rank}.log",
        keep_logs=ray_dir / "logs" / f"rank-{spec.rank}" if ray_dir is not None else None,
    )
    _live_nodes.append(node)
    try:
        return node, (node.start(options.start_timeout), None)
    except RayClusterError as exc:
        role = "the Ray head" if spec.head else "a Ray worker node"
        return node, (None, f"rank {spec.rank} could not start {role}: {exc}")


def _drive_and_release(fn, args, kwargs, address, expected_nodes, options, ray_dir, group):
    """Runs ``fn`` as the Ray driver, then tells the other ranks to tear down, whatever happened."""
    import torch.distributed as dist

    outcome = "failed"
    try:
        result = _drive(fn, args, kwargs, address, expected_nodes, options, ray_dir)
        outcome = "finished"
        return result
    finally:
        try:
            dist.broadcast_object_list([outcome], src=0, group=group)
        except Exception as exc:  # a peer already gone must not hide the driver's own outcome
            report(f"could not tell the other ranks that the driver {outcome}: {exc}")


def _drive(fn, args, kwargs, address, expected_nodes, options, ray_dir):
    """Connects to the cluster as its driver, checks every node joined, and runs ``fn``."""
    import ray

    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = address
    try:
        ray.init(address=address)
        _teardown_on_sigterm()  # ray.init installed its own SIGTERM handler; ours stops the node
        nodes = _wait_for_nodes(ray, expected_nodes, options.start_timeout)
        if ray_dir is not None:
            _write_cluster_info(ray_dir, address, nodes)
        reporter = _start_metrics_reporter(ray, options)
        try:
            return fn(*args, **kwargs)
        finally:
            if reporter is not None:
                reporter.stop()
    finally:
        ray.shutdown()
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous


def _start_metrics_reporter(ray, options: RayOptions):
    """Ray's metrics into the job's MLflow run, when the job is tracked; else ``None``."""
    from sparkgpu.ray.metrics import RayMetricsReporter
    from sparkgpu.tracking import autolog
    from sparkgpu.tracking.spool import SpoolDir, spool_path_from_env

    session = autolog._current_session()
    if session is None or not options.metrics_interval:
        return None
    info = SpoolDir(spool_path_from_env()).read_run_info()
    started_at = info.started_at if info is not None else time.time()
    writer: Any = session.writer  # a SpoolWriter
    return RayMetricsReporter(
        ray, lambda records: writer.write(metrics=records), interval=options.metrics_interval, started_at=started_at
    ).start()


def _wait_for_nodes(ray, expected: int, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if len(alive) >= expected:
            return alive
        if time.monotonic() > deadline:
            raise RayClusterError(
                f"only {len(alive)} of {expected} Ray nodes joined within {timeout:g}s; see the start logs "
                "in the attempt's ray/ directory, or raise ray_start_timeout="
            )
        time.sleep(0.5)


def _write_cluster_info(ray_dir: Path, address: str, nodes: list[dict]) -> None:
    from sparkgpu._util.files import atomic_write_bytes

    info = {
        "address": address,
        "nodes": [
            {
                "node_id": n.get("NodeID"),
                "rank": (n.get("Labels") or {}).get(RANK_LABEL),
                "ip": n.get("NodeManagerAddress"),
                "metrics_export_port": n.get("MetricsExportPort"),
                "resources": n.get("Resources", {}),
            }
            for n in nodes
        ],
    }
    ray_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(ray_dir / RunLayout.RAY_CLUSTER, json.dumps(info, indent=2).encode())


def _wait_for_driver(group, node: RayNode | None) -> None:
    """Blocks until rank 0 broadcasts that the driver is done, or until rank 0 is gone.

    The collective runs on a helper thread so that the main thread stays free to handle
    SIGTERM (a blocked collective would delay the handler until SIGKILL).
    """
    import torch.distributed as dist

    done = threading.Event()
    errors: list[BaseException] = []

    def receive():
        try:
            dist.broadcast_object_list([None], src=0, group=group)
        except BaseException as exc:  # handed to the main thread below
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=receive, name="sparkgpu-ray-wait", daemon=True).start()
    reported = False
    while not done.wait(1.0):
        if node is not None and not node.alive() and not reported:
            reported = True  # Ray reschedules the node's work; the driver decides whether that is fatal
            report(f"this rank's Ray node stopped unexpectedly:\n{node.log_tail()}")
    if errors:
        # Rank 0 is gone; its own exit is the failure the job reports. Raising here too would
        # add a second, later error that reads like a root cause.
        report(f"lost the Ray driver on rank 0 while waiting for it: {errors[0]}")
