"""What runs inside Spark tasks on the executors: one node of a job.

:func:`run_node` is shipped to the executors by reference (``sparkgpu`` must be installed
there) as a ``mapInArrow`` function; the capacity probe's functions are in
:mod:`sparkgpu.launch.backends.spark_probe`. A node task starts its node's agent
(:mod:`sparkgpu.launch.agent`) and watches it; results, tracebacks and logs go to the run
dir, and the task itself returns one tiny status row. It never raises for a failed rank:
a failed task would make Spark retry the barrier stage and run the training again, and
restarts belong to the client's supervisor.

The run dir is the client's own, on a folder mounted under the same path everywhere; or,
with a staging store (``SPARKGPU_STAGING_ROOT`` an fsspec URL), a scratch copy on this
executor that :class:`~sparkgpu.launch.staging.NodeMirror` keeps in step with the store.
"""

from __future__ import annotations

import contextlib
import dataclasses
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

from sparkgpu._report import report
from sparkgpu.launch.agent import build_command, strip_spark_secrets, verify_or_refuse
from sparkgpu.launch.backends.spark_probe import executor_identity
from sparkgpu.launch.entrypoint import NODE_DEVICES_ENV
from sparkgpu.launch.keys import send_key
from sparkgpu.protocol import NodeExit, NodeState
from sparkgpu.launch.run_dir import RunDir
from sparkgpu.launch.run_layout import RunLayout
from sparkgpu.launch.threads import rank_thread_env
from sparkgpu.launch.staging import (
    NodeMirror,
    StagingStore,
    scratch_run_dir,
)

__all__ = ["NodeLaunch", "run_node", "NODE_SCHEMA", "NODE_DDL", "Heartbeat"]

NODE_SCHEMA = pa.schema(
    [
        ("node", pa.int32()),
        ("executor", pa.string()),
        ("host", pa.string()),
        ("devices", pa.string()),
        ("pid", pa.int64()),
        ("exit_code", pa.int32()),
        ("state", pa.string()),
    ]
)
# mapInArrow takes the schema as DDL; the Arrow schema above builds the batches that match it.
NODE_DDL = "node int, executor string, host string, devices string, pid bigint, exit_code int, state string"
_POLL_SECONDS = 0.2
#: Seconds between two looks at the client's files and the peers' (cancel, beats, exits).
_CHECK_SECONDS = 1.0


def beat_interval(timeout: float | None) -> float:
    """Seconds between two beats of a node whose silence counts after ``timeout`` seconds:
    four beats per timeout, at most one a second (a beat is a put on a staging store)."""
    return max(1.0, (timeout or 10.0) / 4)


# -- one node of a job ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NodeLaunch:
    """Everything a node task needs; pickled into the task closure (so the key never touches disk).

    Attributes:
        run_dir: The job's run directory on the client: reachable from the executors under
            this path, unless ``store_url`` is set (then only its name, the job id, is used).
        attempt: Attempt number.
        nnodes: Number of nodes (barrier tasks).
        nproc: Ranks per node.
        env: Environment for the ranks.
        key: The job's signing key, handed to the node's agent on its stdin
            (:mod:`sparkgpu.launch.keys`).
        shutdown_grace: Seconds ranks get after SIGTERM.
        client_timeout: Seconds without a client heartbeat after which the node stops its
            ranks (the client died); ``None`` to keep running.
        threads_per_rank: ``OMP_NUM_THREADS`` for CPU ranks.
        store_url: The staging store (``SPARKGPU_STAGING_ROOT`` as an fsspec URL), or ``None``
            when the executors share the client's run dir.
        peer_timeout: Seconds a started peer node may go without a heartbeat (and without
            its end marker) before this node counts it lost and stops its own ranks; ``None``
            to not watch peers.
        log_ranks: Ranks whose output the client echoes live (``None``: all): with a staging
            store, their logs ship every few seconds, the others' at the mirror's slower interval.
    """

    run_dir: str
    attempt: int
    nnodes: int
    nproc: int
    env: dict
    key: bytes
    shutdown_grace: float
    client_timeout: float | None
    threads_per_rank: int | None = None
    store_url: str | None = None
    peer_timeout: float | None = None
    log_ranks: tuple[int, ...] | None = ()

    def __repr__(self) -> str:  # keeps the key out of Spark's logs and error messages
        return f"NodeLaunch(run_dir={self.run_dir!r}, attempt={self.attempt}, nnodes={self.nnodes}, nproc={self.nproc})"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _claim(rd: RunDir, marker: Path, info: dict) -> bool:
    """Creates the node's start marker, sealed under the job key (the client bills from its time, and
    a planted one must not pass for a started node); False if it exists (Spark is re-running the stage)."""
    return rd.create_control(marker, json.dumps(info).encode())


def _row(node, identity, devices, pid, code, state: NodeState):
    return pa.RecordBatch.from_pydict(
        {
            "node": [node],
            "executor": [identity.executor_id],
            "host": [identity.host],
            "devices": [",".join(devices)],
            "pid": [pid],
            "exit_code": [code],
            "state": [state.value],
        },
        schema=NODE_SCHEMA,
    )


def run_node(launch: NodeLaunch, batches):
    """``mapInArrow`` function of the barrier stage: starts this node's agent and waits for it."""
    from pyspark import BarrierTaskContext

    for _ in batches:
        pass
    ctx = BarrierTaskContext.get()
    node = ctx.partitionId()
    identity = executor_identity()
    gpu = ctx.resources().get("gpu")
    devices = tuple(gpu.addresses) if gpu is not None else ()
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
        claimed = rd.node_marker(launch.attempt, node, "started")
        if (mirror is not None and mirror.claimed_before()) or not _claim(rd, claimed, info) or ctx.attemptNumber() > 0:
            # Spark re-ran the stage after a task or executor was lost. Restarts are the
            # supervisor's decision, so this stage reports and ends without training again.
            state = NodeState.SPARK_RETRY
        else:
            state = _start_mirror(mirror) or _verify(rd, launch, node)

    pid, code = 0, 1
    try:
        # Every task reaches allGather exactly once, whatever it decides (barrier semantics).
        port = _free_port() if node == 0 and state is NodeState.READY else 0
        gathered = [json.loads(m) for m in ctx.allGather(json.dumps({"port": port, "state": state.value}))]
        if state is not NodeState.READY or any(m["state"] != NodeState.READY for m in gathered):
            state = state if state is not NodeState.READY else NodeState.PEER_NOT_READY
        else:
            master_addr = ctx.getTaskInfos()[0].address.rsplit(":", 1)[0].strip("[]")
            clock = mirror.clock if mirror is not None else None
            pid, code, state = _run_agent(rd, launch, node, devices, master_addr, gathered[0]["port"], clock)
    finally:
        # Also when the barrier itself fails: Spark reuses this Python worker, and the sync
        # thread must not outlive the task.
        if mirror is not None:
            state = _end_mirror(mirror, state)
    yield _row(node, identity, devices, pid, code, state)


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
        mirror = NodeMirror(StagingStore(launch.store_url, job_id), rd, launch.attempt, node, followed=followed)
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


def _run_agent(
    rd: RunDir, launch: NodeLaunch, node: int, devices: tuple, master_addr: str, master_port: int, clock=None
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
    with open(rd.agent_log(launch.attempt, node), "ab") as log:
        # Same session as this Python worker: when Spark kills the worker (job cancelled),
        # the agent dies with it (PR_SET_PDEATHSIG) and the ranks with the agent.
        agent = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE)
    assert agent.stdin is not None
    with contextlib.suppress(BrokenPipeError), agent.stdin:  # an agent that died at once: _watch says how
        send_key(agent.stdin, launch.key)
    code, state = _watch(agent, rd, launch, node, clock=clock)
    return agent.pid, code, state


def _verify(rd: RunDir, launch: NodeLaunch, node: int) -> NodeState:
    """``READY`` when the payload's signature holds; else reports the refusal and says so.

    The agent checks again, but refusing here keeps every node of the barrier stage from
    starting an agent at all.
    """
    verified = verify_or_refuse(
        rd, launch.key, launch.attempt, node, launch.nproc, log=rd.agent_log(launch.attempt, node)
    )
    return NodeState.BAD_SIGNATURE if verified is None else NodeState.READY


def _peer_failed(rd: RunDir, attempt: int, node: int) -> bool:
    for peer, path in rd.node_exit_files(attempt).items():
        if peer != node:
            record = rd.read_control_json(path)  # None: being replaced, or forged
            try:
                if record is not None and NodeExit.from_json(record).status != 0:
                    return True
            except (KeyError, TypeError):
                continue
    return False


class Heartbeat:
    """Notices a client or a node that stopped beating, by content, so clocks of other hosts never matter.

    A beat counts only when its file is sealed under the job key and its count grew: a forged
    beat, or a genuine old one put back, keeps no lost node alive.

    Args:
        rd: The run dir the file belongs to (its key checks the seal).
        path: The file the other side rewrites with a new count every second or so.
        timeout: Seconds without a change after which it counts as lost (``None``: never).
        seen_first: Judge only once the file was read at least once (a node with a staging
            store may never share its beat with this reader).
        clock: Seconds that count towards the silence. With a staging store: the seconds
            during which the store answered (:class:`~sparkgpu.launch.staging.StoreClock`), so
            a store that stalls for a minute makes nobody silent.
    """

    def __init__(self, rd: RunDir, path: Path, timeout: float | None, seen_first: bool = False, clock=None):
        self.rd, self.path, self.timeout, self.seen_first = rd, path, timeout, seen_first
        self.clock = clock if clock is not None else time.monotonic
        self.last_value: int | None = None
        self.last_change = self.clock()

    def silent_for(self) -> float:
        """Seconds since the count last grew, as of now."""
        body = self.rd.read_control(self.path)
        try:
            value = int(body) if body is not None else None
        except ValueError:
            value = None
        now = self.clock()
        if value is not None and (self.last_value is None or value > self.last_value):
            self.last_value, self.last_change = value, now
        return now - self.last_change

    def lost(self) -> bool:
        if self.timeout is None:
            return False
        silent = self.silent_for()
        return silent > self.timeout and (self.last_value is not None or not self.seen_first)


def _peer_lost(rd: RunDir, attempt: int, node: int, beats: dict[int, Heartbeat], timeout: float | None) -> bool:
    """Whether a peer node started, never ended and stopped beating: its executor is gone."""
    if timeout is None:
        return False
    for peer in rd.nodes_without_end(attempt):
        if peer == node:
            continue
        beat = beats.setdefault(peer, Heartbeat(rd, rd.node_marker(attempt, peer, "beat"), timeout, seen_first=True))
        if beat.lost():
            return True
    return False


def _watch(agent: subprocess.Popen, rd: RunDir, launch: NodeLaunch, node: int, clock=None) -> tuple[int, NodeState]:
    """Waits for the agent; stops it when the client cancels, the client is gone or a peer node failed.

    ``clock`` times the client's silence (the staging store's answered seconds, with one).
    The agent is polled often; the client's and the peers' files are read once a second and
    this node beats a few times per ``peer_timeout``, so neither grows with the poll rate.
    """
    attempt = launch.attempt
    heartbeat = Heartbeat(rd, rd.client_heartbeat_file(attempt), launch.client_timeout, clock=clock)
    peers: dict[int, Heartbeat] = {}
    state, stop_deadline = NodeState.RUNNING, None
    beats, next_beat, next_check = 0, 0.0, 0.0
    every = beat_interval(launch.peer_timeout)
    while (code := agent.poll()) is None:
        now = time.monotonic()
        if now >= next_beat:  # the client and the peers tell a lost executor by its silence
            beats, next_beat = beats + 1, now + every
            rd.write_control(rd.node_marker(attempt, node, "beat"), f"{beats}\n".encode())
        if stop_deadline is None and now >= next_check:
            next_check = now + _CHECK_SECONDS
            reason = None
            if rd.read_control(rd.spark_cancel_file(attempt)) is not None:
                reason = NodeState.CANCELLED
            elif heartbeat.lost():
                reason = NodeState.CLIENT_LOST
            elif _peer_failed(rd, attempt, node):
                reason = NodeState.PEER_FAILED
            elif _peer_lost(rd, attempt, node, peers, launch.peer_timeout):
                reason = NodeState.PEER_LOST
            if reason:
                state = reason
                agent.send_signal(signal.SIGTERM)  # the agent forwards it to the ranks
                stop_deadline = time.monotonic() + launch.shutdown_grace + 5
        elif stop_deadline is not None and now > stop_deadline:
            agent.kill()  # the ranks follow through PR_SET_PDEATHSIG
        time.sleep(_POLL_SECONDS)
    if state is NodeState.RUNNING:
        state = NodeState.SUCCEEDED if code == 0 else NodeState.FAILED
    done = {"node": node, "exit_code": code, "state": state.value, "ended_at": time.time()}
    rd.write_control(rd.node_marker(attempt, node, "ended"), json.dumps(done).encode())
    return code, state
