"""Helpers a training function calls on its rank.

Every helper gives a sensible answer outside a distributed call too (rank 0 of a world of
one, CPU or the first GPU), so the same function runs as a plain local call.

The launcher describes the rank through environment variables (the torchrun ones plus a
few ``SPARKGPU_*`` ones set per job); they are per process, so they are read on each call
rather than cached at import.
"""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = [
    "get_global_rank",
    "get_replica_rank",
    "get_node_ip",
    "get_local_rank",
    "get_world_size",
    "get_local_world_size",
    "get_node_rank",
    "device",
    "is_main_process",
    "is_distributed",
    "gpu_address",
    "job_id",
    "attempt",
    "checkpoint_dir",
    "secret",
    "should_checkpoint",
    "request_checkpoint",
    "handle_sigterm_as_checkpoint_request",
    "StopForRestart",
    "stop_for_restart",
    "heartbeat",
    "trial",
    "report",
]

# Environment set by the launcher for each worker (see sparkgpu.launch.rank.entrypoint).
ENV_JOB_ID = "SPARKGPU_JOB_ID"
ENV_ATTEMPT = "SPARKGPU_ATTEMPT"
ENV_RUN_DIR = "SPARKGPU_RUN_DIR"
ENV_CHECKPOINT_DIR = "SPARKGPU_CHECKPOINT_DIR"
ENV_DEADLINE = "SPARKGPU_CHECKPOINT_DEADLINE"  # unix time after which ranks should checkpoint
ENV_SIMULATED = "SPARKGPU_SIMULATED_GPUS"  # "1" when GPU addresses are simulated on CPU
ENV_GPU_ADDRESS = "SPARKGPU_GPU_ADDRESS"  # the device address assigned to this rank
# The node's device addresses, when its launcher knows them only at launch (a Spark task's GPUs).
ENV_NODE_DEVICES = "SPARKGPU_NODE_DEVICES"


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def get_global_rank(group=None) -> int:
    """Rank of this process among all processes of the job (0 outside a job).

    Args:
        group: A ``torch.distributed`` process group: then the rank within that group
            (``dist.get_rank(group)``), as in ``databricks.air``.
    """
    if group is not None:
        import torch.distributed as dist

        return dist.get_rank(group)
    return _int_env("RANK", 0)


def get_replica_rank() -> int:
    """Index of this replica when several copies of a job run side by side (0 here: one replica).

    ``databricks.air`` reads ``REPLICA_RANK``; a job here is one replica unless that is set.
    """
    return _int_env("REPLICA_RANK", 0)


def get_node_ip() -> str:
    """The IP address by which the job's other nodes reach this one.

    Inside a job, the address this rank's process-group connection leaves from (towards the
    rendezvous host, ``MASTER_ADDR``); outside one, the address of this host's default route,
    falling back to ``127.0.0.1`` on a host without a network. Nothing is sent.
    """
    import socket

    target = os.environ.get("MASTER_ADDR") or "192.0.2.1"  # TEST-NET-1: only picks the route
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, int(os.environ.get("MASTER_PORT") or 9)))  # UDP connect sends nothing
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def get_local_rank() -> int:
    """Rank of this process among the job's processes on this node (0 outside a job)."""
    return _int_env("LOCAL_RANK", 0)


def get_world_size() -> int:
    """Number of processes in the job (1 outside a job)."""
    return _int_env("WORLD_SIZE", 1)


def get_local_world_size() -> int:
    """Number of the job's processes on this node (1 outside a job)."""
    return _int_env("LOCAL_WORLD_SIZE", 1)


def get_node_rank() -> int:
    """Index of this node among the job's nodes (0 outside a job)."""
    return _int_env("GROUP_RANK", 0)


def is_main_process() -> bool:
    """True on global rank 0: the rank that should log, save and register."""
    return get_global_rank() == 0


def is_distributed() -> bool:
    """True inside a ``.distributed()`` call (the process group is set up for you)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def device():
    """The ``torch.device`` this rank should use: ``cuda:<LOCAL_RANK>``, or ``cpu``.

    As under ``torchrun``, every rank of a node sees the job's GPUs of that node, in order,
    and its local rank indexes them: ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))``
    and this agree. On CPU ranks, simulated GPUs and hosts without CUDA it is ``cpu``.
    """
    import torch

    if os.environ.get(ENV_SIMULATED) != "1" and torch.cuda.is_available():
        return torch.device("cuda", get_local_rank())
    return torch.device("cpu")


def gpu_address() -> str | None:
    """The device address (as in ``nvidia-smi``) assigned to this rank; ``None`` on CPU ranks."""
    return os.environ.get(ENV_GPU_ADDRESS) or None


def job_id() -> str | None:
    """Id of the job this process belongs to, or ``None`` outside a job."""
    return os.environ.get(ENV_JOB_ID)


def attempt() -> int:
    """Number of the current attempt of the job, starting at 0 (restarts count up)."""
    return _int_env(ENV_ATTEMPT, 0)


def checkpoint_dir() -> str | None:
    """The job's checkpoint directory, shared by all attempts (``None`` outside a job)."""
    return os.environ.get(ENV_CHECKPOINT_DIR)


def secret(name: str) -> str:
    """The value of one of the job's secrets, by its name in the job file (``secrets: {HF_TOKEN: scope/key}``).

    The value was read on the client from a file of the user's own and sealed under the job key;
    it is held in this rank's memory only, never in its environment (see :mod:`sparkgpu.job_secrets`).

    Raises:
        KeyError: the job has no secret of that name; the message lists those it has.
    """
    from sparkgpu.job_secrets import secret as held_secret

    return held_secret(name)


class StopForRestart(BaseException):
    """Raised by :func:`stop_for_restart`; the worker exits with the "resume me" status.

    A ``BaseException`` so that a broad ``except Exception`` in training code does not
    swallow it.
    """


def stop_for_restart() -> None:
    """Ends this rank after a checkpoint so that the job resumes in a new attempt.

    Call it on every rank once :func:`should_checkpoint` is True and the checkpoint is saved.
    Outside a job it raises as well, so a plain local call stops the same way.

    Raises:
        StopForRestart: always.
    """
    raise StopForRestart("checkpointed; the job resumes in a new attempt")


def heartbeat(step: int | None = None) -> None:
    """Tells sparkgpu this rank is making progress (optionally: it finished ``step``).

    Patched Trainers, Lightning, ``Checkpointer`` and sparkgpu's loaders note progress by
    themselves; call this from a loop none of them sees, on every rank. A rank that notes no
    progress for ``progress_timeout`` counts as hung. Costs a few stores into shared memory:
    call it every step. A no-op outside a job.
    """
    from sparkgpu.rundir import progress as _progress

    _progress.note(step)


_checkpoint_requested = threading.Event()


def request_checkpoint() -> None:
    """Makes :func:`should_checkpoint` return True from now on in this process."""
    _checkpoint_requested.set()


def _stop_file() -> str | None:
    from sparkgpu.rundir.layout import RunLayout  # it names the stop file's place in an attempt

    run_dir = os.environ.get(ENV_RUN_DIR)
    return os.path.join(run_dir, RunLayout.stop(attempt())) if run_dir else None


def _genuine_stop(path: str) -> bool:
    """Whether the stop file is the supervisor's, sealed under the job key (not planted by a writer of the run dir)."""
    from sparkgpu.rundir.control import unseal
    from sparkgpu.rundir.keyring import current_job_key
    from sparkgpu.rundir.layout import RunLayout

    try:
        with open(path, "rb") as f:
            sealed = f.read()
    except FileNotFoundError:
        return False
    return unseal(current_job_key(), RunLayout.stop(attempt()), sealed) is not None


def should_checkpoint() -> bool:
    """True when the job is about to be stopped and this rank should checkpoint now.

    That happens ``checkpoint_grace`` before the runtime cap, when a usage budget is spent
    (the supervisor then writes a stop file into the attempt's directory),
    or when the worker received SIGTERM (see
    :func:`handle_sigterm_as_checkpoint_request`). The training function checks it between steps,
    saves, and calls :func:`stop_for_restart` on every rank: the supervisor then resumes the job
    in a new attempt. Do not ``return`` instead: when every rank returns, the job counts as
    *succeeded* with its training unfinished, and no new attempt starts.
    """
    if _checkpoint_requested.is_set():
        return True
    stop_file = _stop_file()
    if stop_file and os.path.exists(stop_file) and _genuine_stop(stop_file):
        _checkpoint_requested.set()
        return True
    deadline = os.environ.get(ENV_DEADLINE)
    if deadline and time.time() >= float(deadline):
        _checkpoint_requested.set()
        return True
    return False


def handle_sigterm_as_checkpoint_request() -> bool:
    """From now on SIGTERM asks this rank for a checkpoint instead of killing it at once.

    A checkpointing training loop (``sparkgpu.train.Checkpointer``) turns this on: a
    preempted node then saves before it goes. Ranks that never checkpoint keep the default
    SIGTERM behaviour, so tearing down a failed job stays quick. Only the main thread can
    install signal handlers; elsewhere this returns False and changes nothing.

    Returns:
        True when the handler is installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return False

    def _handler(signum, frame):
        _checkpoint_requested.set()

    signal.signal(signal.SIGTERM, _handler)
    _tell_the_launcher_sigterm_checkpoints()
    return True


def _tell_the_launcher_sigterm_checkpoints() -> None:
    """Marks this rank, for its node's launcher, as one that sits out SIGTERM to checkpoint:
    after a peer crashed it is killed (it could only wait for the dead peer), while ranks that
    clean up on SIGTERM (a Ray node) get the whole shutdown grace."""
    from sparkgpu.rundir.layout import RunLayout

    run_dir = os.environ.get(ENV_RUN_DIR)
    if run_dir and os.environ.get("RANK") is not None:
        marker = os.path.join(run_dir, RunLayout.checkpoints_on_sigterm(attempt(), get_global_rank()))
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        with open(marker, "w") as f:
            f.write("SIGTERM asks this rank for a checkpoint\n")


def trial(defaults: dict | None = None) -> dict:
    """The parameters of the sweep trial this job runs (:func:`sparkgpu.sweep`), the same on every rank.

    Sampled once, on the sweep's side, and handed to every rank; ``defaults`` fills in the names
    the trial does not set. Outside a sweep trial (a plain call, a job of its own) a copy of
    ``defaults``, or ``{}``.
    """
    from sparkgpu.sweeps.reports import trial_params

    return trial_params(defaults)


def report(step: int, value: float) -> bool:
    """Reports the value a sweep optimizes at ``step``; True when every rank should stop now.

    Call it on every rank at the same point of the loop (rank 0's value is recorded): the sweep's
    pruner reads it, and when it prunes the trial, the job asks its ranks to stop
    (:func:`should_checkpoint` turns True) and this returns True on every rank at the same step,
    so that no rank is left waiting in a collective. Then leave the loop and return the value.
    Outside a sweep it records nothing and returns :func:`should_checkpoint` (agreed by all ranks).

    Raises:
        ValueError: ``step`` is not an int >= 0, or ``value`` not a finite number.
    """
    from sparkgpu.rundir import progress as _progress
    from sparkgpu.rundir.layout import RunLayout
    from sparkgpu.sweeps.reports import report as record

    _progress.note(step)  # a report is progress too (the hang watch)
    run_dir = os.environ.get(ENV_RUN_DIR)
    path = os.path.join(run_dir, RunLayout.trial_reports(attempt())) if run_dir else None
    return record(step, value, path=path, is_main=is_main_process(), stop_requested=should_checkpoint)
