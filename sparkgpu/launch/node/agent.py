"""One node's launcher: torch's elastic agent starting that node's ranks.

Run as ``python -m sparkgpu.launch.node.agent RUN_DIR --attempt K --nnodes N --node-rank I
--nproc P --master-addr A --master-port Q``. The local backend starts one; the Spark backend
starts one inside each barrier task. Rendezvous is torch's ``static`` backend at node 0's
address, its store listening on that address alone (:mod:`sparkgpu.launch.node.rendezvous`); it waits
the job's ``policy.init_timeout`` for every node. When ranks fail, the agent
tears the others down and writes their exit codes and signals to ``attempts/<K>/node-<I>.json``
for the client, with the time each rank exited; a rank that exits with code 0 without a result
counts as failed there too (:class:`~sparkgpu.launch.node.rank_exits.RankExitWatcher`).

The job key comes as the first line of the agent's stdin, never in its environment or command
line; the agent makes itself undumpable before reading it. Before any rank starts, the agent
checks the payload's signature over every signed file, ``_air.py`` included, with this
installed sparkgpu and that key, and the ranks run the ``_air.py`` text it checked, not the
file, which anyone who can write the staging root could swap in the meantime. The agent forks
them with torch imported and the key in memory (:mod:`~sparkgpu.launch.node.forked_ranks`); a
job that ships its environment, or ``SPARKGPU_FORK_RANKS=0``, starts each as a new interpreter
(``python -c``) with a key file of its own (:mod:`sparkgpu.rundir.key_handover`). A payload that fails the check starts
nothing: each of the node's ranks reports a signed :class:`PayloadSignatureError`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from sparkgpu import runtime
from sparkgpu._util.report import report
from sparkgpu.config import settings
from sparkgpu.errors import PayloadSignatureError, SparkGPUError
from sparkgpu._util.process import die_with_parent
from sparkgpu.launch.rank.entrypoint import leave_quickly
from sparkgpu.rundir.exit_codes import EXIT_FAILED
from sparkgpu.rundir.key_handover import KEY_DIR_ENV, hand_to_ranks, make_undumpable, rank_secrets, receive_key
from sparkgpu.rundir.states import NodeExit, RankExit
from sparkgpu.launch.node.forked_ranks import RankSpares, can_fork, forking_ranks
from sparkgpu.launch.node.shipped_overlay import forkable_overlay
from sparkgpu.launch.node.preload import preload_before_fork
from sparkgpu.launch.node.rank_exits import RankExitWatcher
from sparkgpu.rundir.directory import PRIVATE_UMASK, RunDir
from sparkgpu.rundir.layout import RunLayout

__all__ = [
    "main",
    "build_command",
    "strip_spark_secrets",
    "verify_or_refuse",
    "refuse",
    "reported",
    "preflight_refusal",
]

# Credentials Spark hands its Python workers; the ranks run user code and need none of them.
_SPARK_SECRETS = frozenset({"PYTHON_WORKER_FACTORY_SECRET", "PYSPARK_GATEWAY_SECRET"})


def _is_spark_secret(name: str) -> bool:
    # _SPARK_AUTH_SECRET (spark.authenticate) and _SPARK_SSL_RPC_*_PASSWORD (spark.ssl.rpc.*).
    return name in _SPARK_SECRETS or (name.startswith("_SPARK_") and ("SECRET" in name or "PASSWORD" in name))


def strip_spark_secrets(environ: MutableMapping[str, str]) -> list[str]:
    """Removes Spark's own credentials from ``environ``.

    Returns:
        The names removed, sorted.
    """
    names = sorted(name for name in environ if _is_spark_secret(name))
    for name in names:
        del environ[name]
    return names


def build_command(
    python: str,
    run_dir: str,
    *,
    attempt: int,
    nnodes: int,
    node_rank: int,
    nproc: int,
    master_addr: str,
    master_port: int,
    shutdown_grace: float,
    env_on_stdin: bool = False,
    preflight: bool = False,
) -> list[str]:
    """The command line that starts one node's agent.

    Args:
        env_on_stdin: The agent reads one more JSON object of environment variables from its
            standard input before it starts any rank (:meth:`LocalBackend.prestart
            <sparkgpu.launch.backends.local.backend.LocalBackend.prestart>`); end of input starts none.
        preflight: The agent runs the node's pre-flight check (:mod:`~sparkgpu.launch.node.preflight`)
            before it starts any rank; a Spark node task runs it itself, before the agent.
    """
    return [
        python,
        "-m",
        "sparkgpu.launch.node.agent",
        run_dir,
        "--attempt",
        str(attempt),
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc",
        str(nproc),
        "--master-addr",
        master_addr,
        "--master-port",
        str(master_port),
        "--shutdown-grace",
        str(int(max(1, shutdown_grace))),
        *(["--env-on-stdin"] if env_on_stdin else []),
        *(["--preflight"] if preflight else []),
    ]


def refuse(rd: RunDir, attempt: int, node_rank: int, nproc: int, exc: SparkGPUError, out=None) -> None:
    """Reports that a node starts none of its ranks, where the client reads rank failures.

    With the job key (``rd.key``) each of the node's ranks gets a signed error file; without
    it nothing can be signed, and the reason is only in ``out`` (the node's agent log;
    ``sys.stderr`` by default).
    """
    report(f"node {node_rank} starts none of its ranks: {exc}", out)
    rd.prepare_attempt(attempt)
    if rd.key:
        for rank in range(node_rank * nproc, (node_rank + 1) * nproc):
            rd.write_error(attempt, rank, exc)
    node = NodeExit(node_rank, EXIT_FAILED, refused=str(exc))
    if rd.key:  # without it nothing can be signed: the launcher reads the agent's exit code instead
        rd.write_control(rd.file(RunLayout.node_exits(attempt, node_rank)), json.dumps(node.to_json()).encode())


def verify_or_refuse(
    rd: RunDir, key: bytes | None, attempt: int, node_rank: int, nproc: int, log: Path | None = None
) -> dict[str, bytes] | None:
    """The node's check before it starts any rank: the payload's verified files, or a refusal.

    Sets the job key on ``rd`` and checks the signature
    (:meth:`RunDir.verify`). When it does not hold, the refusal is reported as :func:`refuse`
    does and ``None`` is returned: the node starts nothing.

    Args:
        rd: The run dir the node runs.
        key: The job key the node was handed; ``None`` when it got none (refused).
        attempt: Attempt number.
        node_rank: The node's index.
        nproc: Ranks per node.
        log: File to append the reason to (the node's agent log); ``sys.stderr`` by default.
    """
    try:
        rd.key = key
        return rd.verify()
    except PayloadSignatureError as exc:
        if log is None:
            refuse(rd, attempt, node_rank, nproc, exc)
        else:
            rd.prepare_attempt(attempt)
            with open(log, "a") as out:
                refuse(rd, attempt, node_rank, nproc, exc, out=out)
        return None


def _parse(argv):
    parser = argparse.ArgumentParser(prog="sparkgpu.launch.node.agent")
    parser.add_argument("run_dir")
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--shutdown-grace", type=int, default=10)
    parser.add_argument("--env-on-stdin", action="store_true")
    parser.add_argument("--preflight", action="store_true")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    die_with_parent(EXIT_FAILED)
    make_undumpable()  # before the key arrives: same-user processes cannot read it from /proc
    os.umask(PRIVATE_UMASK)  # what the agent and its ranks write in the run dir is the user's alone
    key = receive_key(sys.stdin)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s agent %(levelname)s %(message)s")
    strip_spark_secrets(os.environ)  # the ranks inherit this environment
    os.environ["SPARKGPU_ATTEMPT"] = str(args.attempt)
    rd = RunDir(args.run_dir)
    verified = verify_or_refuse(rd, key, args.attempt, args.node_rank, args.nproc)
    if verified is None:
        return EXIT_FAILED
    spec = json.loads(verified[rd.spec_file.name])
    init_timeout = spec["policy"]["init_timeout"]
    # torch's import is the agent's longest part: done before an early agent waits for its variables.
    import torch.distributed.launcher.api  # noqa: F401

    from sparkgpu.launch.node import rendezvous

    assert rd.key is not None  # the payload verified, which takes the job key
    air = verified[rd.air.name].decode()
    # Forked now, before the agent starts a thread or waits for anyone: each becomes one rank.
    forks = can_fork(wanted=settings().fork_ranks)
    if forks and spec.get("preload"):  # what the job's function imports, so that no rank imports it again
        hazard = preload_before_fork(spec["preload"])
        if hazard is not None:
            logging.warning("the ranks start as new interpreters: %s", hazard)
            forks = False
    shared = None
    if forks and RunLayout.HYDRATE in verified:  # the job ships its environment
        shared = forkable_overlay(verified[RunLayout.HYDRATE], str(rd.file(RunLayout.HYDRATE)), spec["env"])
        forks = shared is not None
    prelude = shared.enter_rank if shared is not None else None
    spares = RankSpares(args.nproc, air, str(rd.air), rd.path, rd.key, prelude) if forks else None
    try:
        if args.env_on_stdin:  # started before the client's callbacks ran: their variables come now
            line = sys.stdin.readline()
            if not line.strip():
                report(f"node {args.node_rank} starts none of its ranks: the client withdrew the attempt")
                return EXIT_FAILED
            os.environ.update(json.loads(line))
        if args.preflight:
            refused = preflight_refusal(os.environ, args.node_rank)
            if refused is not None:
                refuse(rd, args.attempt, args.node_rank, args.nproc, refused)
                return EXIT_FAILED
        # The run dir of this node (on Spark with a staging store, its scratch copy): the ranks find
        # their files, the tracking spool included, relative to it.
        os.environ[runtime.ENV_RUN_DIR] = str(rd.path)
        rendezvous.register()
        # The ranks inherit these.
        os.environ.update(rendezvous.collective_interface_env(args.master_addr))
        os.environ.update(rank_secrets(rd.key, os.environ))
        key_dir = None if spares else hand_to_ranks(rd.key, args.nproc)  # spares hold the key in memory
        if key_dir is not None:
            os.environ[KEY_DIR_ENV] = str(key_dir)
        try:
            return _launch(args, rd, air, init_timeout, spares)
        finally:
            if key_dir is not None:
                shutil.rmtree(key_dir, ignore_errors=True)  # the files of ranks that never started
            leave_quickly()  # the node's exit file is written
    finally:
        if spares is not None:
            spares.close()


def preflight_refusal(rank_env: Mapping[str, str], node_rank: int) -> SparkGPUError | None:
    """This host's pre-flight check with the ranks' environment and GPUs; the error when it fails."""
    import socket

    from sparkgpu.launch.node.preflight import run_preflight
    from sparkgpu.launch.rank.entrypoint import NODE_DEVICES_ENV

    devices = [d for d in rank_env.get(NODE_DEVICES_ENV, "").split(",") if d]
    checked = run_preflight(rank_env, devices, simulated=bool(settings().simulate_gpus))
    if checked.ok:
        return None
    # One host: no other node can stand in, so no restart is tried (failure_policy).
    return checked.error(f"node {node_rank} on host {socket.gethostname()}", replaceable=False)


def _shutdown_grace(config_type, seconds: int) -> dict:
    """``shutdown_timeout=seconds`` where this torch's ``LaunchConfig`` takes it (2.11's does not:
    it stops ranks with its own grace)."""
    import dataclasses

    names = {field.name for field in dataclasses.fields(config_type)}
    return {"shutdown_timeout": seconds} if "shutdown_timeout" in names else {}


def _launch(args: argparse.Namespace, rd: RunDir, air: str, init_timeout: float, spares: RankSpares | None) -> int:
    """Starts the node's ranks on ``air`` (the checked ``_air.py`` text) under torch's elastic
    agent: ``spares`` when given (:mod:`~sparkgpu.launch.node.forked_ranks`), else new
    interpreters; writes the node's exit file; returns its status."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from sparkgpu.launch.node import rendezvous

    run_id = f"{rd.job_id}-{args.attempt}"
    config = LaunchConfig(
        min_nodes=args.nnodes,
        max_nodes=args.nnodes,
        nproc_per_node=args.nproc,
        run_id=run_id,
        rdzv_backend=rendezvous.RENDEZVOUS_BACKEND,  # torch's static one, its store bound to master_addr
        rdzv_endpoint=f"{args.master_addr}:{args.master_port}",
        rdzv_configs={"rank": args.node_rank, "timeout": max(1, math.ceil(init_timeout))},
        max_restarts=0,  # restarts are the supervisor's: it resumes from checkpoints
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(rd.file(RunLayout.elastic(args.attempt)))),
        **_shutdown_grace(LaunchConfig, args.shutdown_grace),
    )
    failures: dict[int, RankExit] = {}
    status = 0
    watcher = RankExitWatcher(
        run_id,
        lambda rank: reported(rd, args.attempt, rank),
        checkpoints_on_sigterm=lambda rank: rd.file(RunLayout.checkpoints_on_sigterm(args.attempt, rank)).exists(),
        ranks=0 if spares else args.nproc,  # forked ranks are named to it as they start
    )
    starting = forking_ranks(spares, started=watcher.adopt) if spares else contextlib.nullcontext()
    try:
        with watcher, starting:
            elastic_launch(config, sys.executable)("-u", "-c", air, str(rd.path))
    except ChildFailedError as exc:
        status = EXIT_FAILED
        for failed_rank, process in exc.failures.items():
            failures[failed_rank] = RankExit(
                process.exitcode, signal=process.signal_name() if process.exitcode < 0 else None, pid=process.pid
            )
    except DistError as exc:  # the rendezvous: no rank of this node started
        status = EXIT_FAILED
        report(
            f"node {args.node_rank} of {args.nnodes} gave up meeting the others at {args.master_addr}:"
            f"{args.master_port} after the job's init_timeout of {init_timeout:g}s ({exc}); a node that did not "
            "start, or a firewall between the nodes, keeps them apart; if they only start slowly, raise "
            "init_timeout"
        )
    for rank in watcher.quiet:  # torch saw exit code 0: a success to it, not to the job
        status = EXIT_FAILED
        failures[rank] = watcher.exits[rank]
    for failed, failure in failures.items():
        if failed in watcher.exits:  # torch's own time is whole seconds, and when it noticed
            failure.time = watcher.exits[failed].time
            failure.oom_killed = watcher.exits[failed].oom_killed  # torch's record cannot tell the OOM killer
    node = NodeExit(args.node_rank, status, failures)
    rd.write_control(rd.file(RunLayout.node_exits(args.attempt, args.node_rank)), json.dumps(node.to_json()).encode())
    return status


def reported(rd: RunDir, attempt: int, rank: int) -> bool:
    """Whether a rank left a result, an error or a preemption marker (did not exit quietly)."""
    return any(
        path.exists()
        for path in (
            rd.file(RunLayout.result(attempt, rank)),
            rd.file(RunLayout.error(attempt, rank)),
            rd.file(RunLayout.preempted(attempt, rank)),
        )
    )


if __name__ == "__main__":
    sys.exit(main())
