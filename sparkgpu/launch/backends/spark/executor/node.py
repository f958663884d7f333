"""What runs inside Spark tasks on the executors: one node of a job.

:func:`run_node` is shipped to the executors by reference (``sparkgpu`` must be installed
there) as a ``mapInArrow`` function; the capacity probe's functions are in
:mod:`sparkgpu.launch.backends.spark.executor.probe`. A node task starts its node's agent
(:mod:`sparkgpu.launch.node.agent`) and watches it; results, tracebacks and logs go to the run
dir, and the task itself returns one tiny status row. It never raises for a failed rank:
a failed task would make Spark retry the barrier stage and run the training again, and
restarts belong to the client's supervisor.

The run dir is the client's own, on a folder mounted under the same path everywhere; or,
with a staging store (``SPARKGPU_STAGING_ROOT`` an fsspec URL), a scratch copy on this
executor that :class:`~sparkgpu.launch.staging.mirror.NodeMirror` keeps in step with the store.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa

from sparkgpu._util.report import report
from sparkgpu.launch.node.agent import build_command, strip_spark_secrets, verify_or_refuse
from sparkgpu.launch.backends.spark.executor.hub import HubLink
from sparkgpu.launch.backends.spark.executor.channel import (
    Heartbeat,
    NodeLink,
    NodeZero,
    control_interval,
    open_hub,
)
from sparkgpu.launch.backends.spark.executor.node_launch import NodeLaunch
from sparkgpu.launch.backends.spark.executor.probe import executor_identity
from sparkgpu.launch.backends.spark.executor.seating import take_seat
from sparkgpu.launch.rank.entrypoint import NODE_DEVICES_ENV
from sparkgpu.rundir.key_handover import send_key
from sparkgpu.rundir.states import NodeState
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.launch.rank.threads import rank_thread_env
from sparkgpu.launch.staging.mirror import (
    NodeMirror,
    StagingStore,
    scratch_run_dir,
)

__all__ = ["NodeLaunch", "run_node", "NODE_SCHEMA", "NODE_DDL", "Heartbeat", "NodeZero", "NodeLink", "open_hub"]

NODE_SCHEMA = pa.schema(
    [
        ("node", pa.int32()),
        ("executor", pa.string()),
        ("host", pa.string()),
        ("devices", pa.string()),
        ("pid", pa.int64()),
        ("exit_code", pa.int32()),
        ("state", pa.string()),
        ("detail", pa.string()),
    ]
)
# mapInArrow takes the schema as DDL; the Arrow schema above builds the batches that match it.
NODE_DDL = (
    "node int, executor string, host string, devices string, pid bigint, exit_code int, state string, detail string"
)
_POLL_SECONDS = 0.2


# -- one node of a job ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _claim(rd: RunDir, marker: Path, info: dict) -> bool:
    """Creates the node's start marker, sealed under the job key (the client bills from its time, and
    a planted one must not pass for a started node); False if it exists (Spark is re-running the stage)."""
    return rd.create_control(marker, json.dumps(info).encode())


def _row(node, identity, devices, pid, code, state: NodeState, detail: str = ""):
    return pa.RecordBatch.from_pydict(
        {
            "node": [node],
            "executor": [identity.executor_id],
            "host": [identity.host],
            "devices": [",".join(devices)],
            "pid": [pid],
            "exit_code": [code],
            "state": [state.value],
            "detail": [detail],
        },
        schema=NODE_SCHEMA,
    )


def run_node(launch: NodeLaunch, batches):
    """``mapInArrow`` function of the barrier stage: starts this node's agent and waits for it."""
    from pyspark import BarrierTaskContext

    for _ in batches:
        pass
    ctx = BarrierTaskContext.get()
    identity = executor_identity()
    gpu = ctx.resources().get("gpu")
    devices = tuple(gpu.addresses) if gpu is not None else ()
    seat = take_seat(ctx, launch, identity.executor_id, devices)
    if seat.node is None:  # a spare, or an executor to leave out: starts nothing
        assert seat.state is not None
        if seat.exchanges:
            ctx.allGather(json.dumps({"node": None, "state": seat.state.value}))
        yield _row(-1, identity, devices, 0, 1 if seat.state is NodeState.BAD_NODE else 0, seat.state, seat.detail)
        return
    node = seat.node
    rd, mirror, state = _node_run_dir(launch, node)
    rd.key = launch.key  # the node's markers are sealed under it
    info = {
        "node": node,
        "executor": identity.executor_id,
        "host": identity.host,
        "devices": list(devices),
        "python_pid": os.getpid(),
        "started_at": time.time(),
        "run_dir": str(rd.path),
    }
    if state is None:
        claimed = rd.file(RunLayout.node_marker(launch.attempt, node, "started"))
        if (mirror is not None and mirror.claimed_before()) or not _claim(rd, claimed, info) or ctx.attemptNumber() > 0:
            # Spark re-ran the stage after a task or executor was lost. Restarts are the
            # supervisor's decision, so this stage reports and ends without training again.
            state = NodeState.SPARK_RETRY
        else:
            state = _start_mirror(mirror) or _verify(rd, launch, node)
            if state is NodeState.READY and seat.state is NodeState.BAD_NODE:
                state = NodeState.BAD_NODE  # the others hear of it at the exchange: nobody starts

    pid, code, hub = 0, 1, None
    try:
        master_addr = ctx.getTaskInfos()[0].address.rsplit(":", 1)[0].strip("[]")
        port = hub_port = 0
        if node == 0 and state is NodeState.READY:
            port = _free_port()
            try:
                hub = open_hub(launch, master_addr)
                hub_port = hub.port
            except OSError as exc:
                report(f"node 0 cannot listen on {master_addr} for the other nodes' beats: {exc}")
                state = NodeState.FAILED
        # Every task reaches allGather exactly once, whatever it decides (barrier semantics).
        message = {"node": node, "port": port, "hub": hub_port, "state": state.value}
        # The nodes' messages by node rank; spare tasks take the step too, saying nothing of use.
        gathered = sorted(
            (m for m in map(json.loads, ctx.allGather(json.dumps(message))) if m["node"] is not None),
            key=lambda m: m["node"],
        )
        if state is not NodeState.READY or any(m["state"] != NodeState.READY for m in gathered):
            state = state if state is not NodeState.READY else NodeState.PEER_NOT_READY
        else:
            clock = mirror.clock if mirror is not None else None
            if hub is not None:
                kick = mirror.kick if mirror is not None else None
                channel: NodeZero | NodeLink = NodeZero(hub, rd, launch, clock, written=kick)
            else:
                address = (master_addr, int(gathered[0]["hub"]))
                channel = NodeLink(HubLink(launch.key, launch.attempt, node, address, _hub_timeout(launch)), rd, launch)
            pid, code, state = _run_agent(rd, launch, node, devices, master_addr, gathered[0]["port"], channel)
    finally:
        # Also when the barrier itself fails: Spark reuses this Python worker, and neither the
        # hub nor the sync thread may outlive the task.
        if hub is not None:
            hub.close()
        if mirror is not None:
            state = _end_mirror(mirror, state)
    yield _row(node, identity, devices, pid, code, state, seat.detail if state is NodeState.BAD_NODE else "")


def _node_run_dir(launch: NodeLaunch, node: int) -> tuple[RunDir, NodeMirror | None, NodeState | None]:
    """The run dir this node runs in, its mirror (staging store only), and a state if it is out of reach."""
    if not launch.store_url:
        rd = RunDir(launch.run_dir)
        return rd, None, None if rd.spec_file.exists() else NodeState.NO_RUN_DIR  # the staging root is not mounted here
    job_id = Path(launch.run_dir).name
    rd = RunDir(scratch_run_dir(job_id, launch.attempt, node))
    try:
        ranks = range(node * launch.nproc, (node + 1) * launch.nproc)
        followed = frozenset(
            RunLayout.rank_log(launch.attempt, r) for r in ranks if launch.log_ranks is None or r in launch.log_ranks
        )
        mirror = NodeMirror(
            StagingStore(launch.store_url, job_id),
            rd,
            launch.attempt,
            node,
            followed=followed,
            control_interval=control_interval(launch),
        )
        mirror.download_payload()
    except Exception as exc:  # a missing filesystem package, credentials, a store that is down: one answer
        report(
            f"node {node} cannot fetch job {job_id} from the staging store {launch.store_url}: "
            f"{type(exc).__name__}: {exc}"
        )
        _remove_scratch(rd)
        return rd, None, NodeState.STORE_UNREACHABLE
    return rd, mirror, None


def _start_mirror(mirror: NodeMirror | None) -> NodeState | None:
    """Starts syncing with the store (the start marker goes up at once); a state if it cannot."""
    if mirror is None:
        return None
    try:
        mirror.start()
    except Exception as exc:  # whatever the filesystem raises: this node cannot report, so it does not start
        report(f"node {mirror.node} cannot write to the staging store {mirror.store.url}: {type(exc).__name__}: {exc}")
        return NodeState.STORE_UNREACHABLE
    return None


def _end_mirror(mirror: NodeMirror, state: NodeState) -> NodeState:
    """Pushes the node's last files (end marker last) and removes its scratch copy."""
    try:
        mirror.finish()
    except Exception as exc:  # a failed task would make Spark re-run the stage: report in the row instead
        report(
            f"node {mirror.node} could not upload its last files to the staging store {mirror.store.url} "
            f"({type(exc).__name__}: {exc}); they stay in {mirror.run_dir.path} on this host"
        )
        return NodeState.STORE_PUSH_FAILED
    _remove_scratch(mirror.run_dir)
    return state


def _remove_scratch(rd: RunDir) -> None:
    try:
        shutil.rmtree(rd.path.parent)  # scratch_run_dir's own folder
    except FileNotFoundError:
        return
    except OSError as exc:  # Spark removes its local dirs with the executor anyway
        report(f"could not remove the scratch run dir {rd.path.parent}: {exc}")


def _hub_timeout(launch: NodeLaunch) -> float:
    return launch.peer_timeout or 10.0


def _run_agent(
    rd: RunDir, launch: NodeLaunch, node: int, devices: tuple, master_addr: str, master_port: int, channel
) -> tuple[int, int, NodeState]:
    """Starts the node's agent on ``rd`` and watches it; ``(pid, exit code, state)``."""
    command = build_command(
        sys.executable,
        str(rd.path),
        attempt=launch.attempt,
        nnodes=launch.nnodes,
        node_rank=node,
        nproc=launch.nproc,
        master_addr=master_addr,
        master_port=master_port,
        shutdown_grace=launch.shutdown_grace,
    )
    # The agent tells the ranks their run dir (with a store, this node's copy; SPARKGPU_RUN_DIR).
    env = {**os.environ, **launch.env, NODE_DEVICES_ENV: ",".join(devices), "PYTHONUNBUFFERED": "1"}
    strip_spark_secrets(env)  # Spark's credentials for its Python workers are not the ranks' business
    if launch.threads_per_rank:
        env.update(rank_thread_env(env, launch.threads_per_rank))
    rd.prepare_attempt(launch.attempt)
    with open(rd.file(RunLayout.agent_log(launch.attempt, node)), "ab") as log:
        # Same session as this Python worker: when Spark kills the worker (job cancelled),
        # the agent dies with it (PR_SET_PDEATHSIG) and the ranks with the agent.
        agent = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE)
    assert agent.stdin is not None
    with contextlib.suppress(BrokenPipeError), agent.stdin:  # an agent that died at once: _watch says how
        send_key(agent.stdin, launch.key)
    code, state = _watch(agent, rd, launch, node, channel)
    return agent.pid, code, state


def _verify(rd: RunDir, launch: NodeLaunch, node: int) -> NodeState:
    """``READY`` when the payload's signature holds; else reports the refusal and says so.

    The agent checks again, but refusing here keeps every node of the barrier stage from
    starting an agent at all.
    """
    verified = verify_or_refuse(
        rd, launch.key, launch.attempt, node, launch.nproc, log=rd.file(RunLayout.agent_log(launch.attempt, node))
    )
    return NodeState.BAD_SIGNATURE if verified is None else NodeState.READY


def _watch(agent: subprocess.Popen, rd: RunDir, launch: NodeLaunch, node: int, channel) -> tuple[int, NodeState]:
    """Waits for the agent; stops it when the channel says so (cancel, lost client, lost or failed node).

    ``channel`` is :class:`NodeZero` on node 0 and :class:`NodeLink` elsewhere: the node beats
    and hears of the others through node 0, never through the store. The agent is polled often;
    the channel does its work on its own clock, so nothing grows with the poll rate.
    """
    state, stop_deadline = NodeState.RUNNING, None
    while (code := agent.poll()) is None:
        now = time.monotonic()
        reason = channel.step(now)  # also while the ranks stop: the others still hear of this node
        if stop_deadline is None and reason is not None:
            state = reason[0]
            report(f"node {node} stops its ranks: {reason[1]}", out=sys.stderr)
            agent.send_signal(signal.SIGTERM)  # the agent forwards it to the ranks
            stop_deadline = now + launch.shutdown_grace + 5
        elif stop_deadline is not None and now > stop_deadline:
            agent.kill()  # the ranks follow through PR_SET_PDEATHSIG
        time.sleep(_POLL_SECONDS)
    if state is NodeState.RUNNING:
        state = NodeState.SUCCEEDED if code == 0 else NodeState.FAILED
    done: dict[str, object] = {"node": node, "exit_code": code, "state": state.value, "ended_at": time.time()}
    if channel.lost:
        done["lost"] = list(channel.lost)
    rd.write_control(rd.file(RunLayout.node_marker(launch.attempt, node, "ended")), json.dumps(done).encode())
    channel.end(done)
    return code, state
