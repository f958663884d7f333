"""Runs one rank: the code behind the generated ``_air.py``.

Order matters: tie the process to its parent (no orphans), send its output to the run dir,
verify the payload's signature, show the node's devices, make torch's process-group set-up
idempotent (before unpickling binds user modules to it), unpickle, join the process group,
run the user's function, write the result or the traceback, leave the process group.

Devices follow torchrun: every rank of a node sees the job's devices of that node, in order
(``CUDA_VISIBLE_DEVICES``, and ``SPARKGPU_NODE_DEVICES`` also for simulated GPUs), and
``LOCAL_RANK`` indexes them, so ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))`` works
as under torchrun. ``SPARKGPU_GPU_ADDRESS`` is the rank's own device address.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import sys

from sparkgpu import runtime
from sparkgpu._util.modules import imported
from sparkgpu._util.process import die_with_parent
from sparkgpu._util.report import report
from sparkgpu.callbacks import WorkerContext
from sparkgpu.errors import HydrationError, ResultError, SparkGPUError
from sparkgpu.rundir.keyring import hold_job_key
from sparkgpu.launch.rank.process_group import RankProcessGroup
from sparkgpu.launch.rank.progress import finish_progress, watch_rank
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.rundir.exit_codes import EXIT_FAILED, EXIT_PREEMPTED
from sparkgpu.train.trained_models import save_models, unwrap_models
from sparkgpu.launch.rank.threads import pin_rank_threads

__all__ = ["main", "rank_device_env", "NODE_DEVICES_ENV"]

# Set by a node's launcher when the node's device addresses are known only at launch (a Spark
# task's GPU addresses); takes precedence over the spec's devices.
NODE_DEVICES_ENV = runtime.ENV_NODE_DEVICES

ACCELERATE_USE_CPU = "ACCELERATE_USE_CPU"


def _redirect_output(path) -> None:
    """Points fds 1 and 2 at the rank's log file, so native crashes land there too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    faulthandler.enable(file=sys.stderr, all_threads=True)


def rank_device_env(spec: dict, local_rank: int, node_devices: str | None) -> dict[str, str]:
    """The device variables of one rank, as torchrun would set them.

    Args:
        spec: The job's spec (its ``devices``, ``simulated`` and ``resources``).
        local_rank: The rank's index on its node.
        node_devices: The node's device addresses that its launcher exported
            (``SPARKGPU_NODE_DEVICES``), if any; they take precedence over the spec's.

    Returns:
        ``CUDA_VISIBLE_DEVICES`` (every device of the job on this node, in order; empty for
        CPU ranks and simulated GPUs), ``SPARKGPU_NODE_DEVICES`` (the same list, simulated
        ones included) and ``SPARKGPU_GPU_ADDRESS`` (the address that ``LOCAL_RANK`` indexes).
    """
    devices = node_devices.split(",") if node_devices else list(spec.get("devices") or [])
    env: dict[str, str] = {}
    if devices:
        env[NODE_DEVICES_ENV] = ",".join(devices)
        env[runtime.ENV_GPU_ADDRESS] = devices[local_rank % len(devices)]
    if spec.get("simulated"):
        env[runtime.ENV_SIMULATED] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    elif spec["resources"]["gpu_type"] == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if env.get("CUDA_VISIBLE_DEVICES") == "":
        # Accelerate (and a Trainer through it) joins a multi-process CPU world only when told
        # to; without it every CPU rank trains alone as process 0 of a world of one.
        env[ACCELERATE_USE_CPU] = "true"
    return env


def _set_device_env(env: dict[str, str]) -> None:
    """Exports the rank's device variables; a user's own ``ACCELERATE_USE_CPU`` wins."""
    if ACCELERATE_USE_CPU in os.environ:
        env = {k: v for k, v in env.items() if k != ACCELERATE_USE_CPU}
    os.environ.update(env)


def _install_framework_patches() -> None:
    """Patches ``transformers.Trainer`` when the user's code imports it (sealed checkpoints, resume)."""
    from sparkgpu.config import settings

    if settings().hf_resume:
        from sparkgpu.hf import autopatch

        autopatch.install()


def _process_group(spec: dict) -> RankProcessGroup:
    timeout = datetime.timedelta(seconds=spec["policy"]["init_timeout"])
    device = runtime.device()
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
        return RankProcessGroup("nccl", timeout, device)
    return RankProcessGroup("gloo", timeout)


def _environment_error(exc: BaseException) -> SparkGPUError:
    # Hydration raises sparkgpu.errors' own classes (EnvironmentMismatchError, HydrationError);
    # anything else (an OSError while extracting) is a HydrationError here.
    cls = type(exc) if isinstance(exc, SparkGPUError) else HydrationError
    return cls(f"the job's environment could not be rehydrated on this worker: {exc}")


def _finish_pending_checkpoints() -> None:
    # Only a process that made a Checkpointer has saves to wait for; never import torch's
    # checkpoint machinery for the others.
    checkpoint = imported("sparkgpu.train.checkpoint")
    if checkpoint is not None:
        checkpoint.finish_pending_checkpoints()


def main(run_dir: str, env_error: BaseException | None = None, key: bytes | None = None) -> int:
    """Runs the rank described by the torchrun environment variables; returns the exit code.

    The rank's outcome is written when this returns; :func:`leave_quickly` then keeps the
    interpreter's exit from sweeping the rank's objects (see there).

    Args:
        run_dir: The job's run directory.
        env_error: Why rehydrating the shipped environment failed in ``_air.py``, if it did;
            reported as this rank's failure.
        key: The job key ``_air.py`` took (:mod:`sparkgpu.rundir.key_handover`); without it the rank
            runs nothing.
    """
    code = _run(run_dir, env_error, key)
    leave_quickly()
    return code


def leave_quickly() -> None:
    """Takes every object out of the garbage collector's sight once the outcome is written.

    A rank or agent that imported torch and trained holds millions of objects; the collections
    of the interpreter's exit walk them all, which takes seconds on a busy host, and the node
    hears that the process ended only after. Nothing those collections would free matters
    then: what must outlive the process is written already.
    """
    gc.freeze()


def _run(run_dir: str, env_error: BaseException | None, key: bytes | None) -> int:
    die_with_parent(EXIT_FAILED)
    rd = RunDir(run_dir)
    rank, attempt = runtime.get_global_rank(), runtime.attempt()
    _redirect_output(rd.file(RunLayout.rank_log(attempt, rank)))

    try:
        spec, parts = rd.load_verified(key)
        hold_job_key(rd.key)
        if env_error is not None:
            raise _environment_error(env_error)
        _set_device_env(rank_device_env(spec, runtime.get_local_rank(), os.environ.get(NODE_DEVICES_ENV)))
        # Before any user code: the same thread counts in every attempt, whatever forked it.
        pin_rank_threads()
        group = _process_group(spec)
        # Progress and stacks on request, before any user code; NCCL's flight recorder before its group.
        watch_rank(rd, attempt, rank, runtime.get_node_rank(), nccl=group.backend == "nccl")
        group.install()
        _install_framework_patches()
        fn, args, kwargs, callbacks = RunDir.unpack(parts)
    except BaseException as exc:
        rd.write_error(attempt, rank, exc)
        report(f"rank {rank} could not start: {exc}")
        return EXIT_FAILED

    ctx = WorkerContext(
        job_id=spec["job_id"],
        run_dir=str(rd.path),
        attempt=attempt,
        rank=rank,
        local_rank=runtime.get_local_rank(),
        world_size=runtime.get_world_size(),
        node_rank=runtime.get_node_rank(),
        device=str(runtime.device()),
    )
    error: BaseException | None = None
    try:
        group.create()
        for callback in callbacks:
            callback.on_worker_start(ctx)
        stopping = False
        try:
            result = fn(*args, **kwargs)
        except runtime.StopForRestart:
            stopping = True
        # A save still being written when fn ended gets its commit marker before the process
        # group goes: a checkpoint saved just before stop_for_restart() is the one to resume
        # from. A failed save fails the rank rather than resuming from an older checkpoint.
        _finish_pending_checkpoints()
        if stopping:
            rd.file(RunLayout.preempted(attempt, rank)).write_text("checkpointed; resume in a new attempt\n")
            return EXIT_PREEMPTED
    except BaseException as exc:  # report anything, including SystemExit and KeyboardInterrupt
        error = exc
        rd.write_error(attempt, rank, exc)
        report(f"rank {rank} failed: {type(exc).__name__}: {exc}")
        return EXIT_FAILED
    finally:
        finish_progress()  # the function ended: no more progress to judge on this rank
        for callback in callbacks:
            try:
                callback.on_worker_end(ctx, error)
            except Exception as exc:  # a broken callback must not hide the user's outcome
                report(f"callback {callback!r} failed on rank {rank}: {exc}")
        group.close()
        sys.stdout.flush()
        sys.stderr.flush()

    return _write_result(rd, attempt, rank, result)


def _write_result(rd: RunDir, attempt: int, rank: int, result) -> int:
    """Writes the rank's return value, its models unwrapped (:func:`unwrap_models`); returns the exit code.

    A value that cannot be written fails the rank with a :class:`ResultError`, which is never
    restarted; its models are saved into the run dir first, and the error says where.
    """
    try:
        result = unwrap_models(result)
        rd.write_result(attempt, rank, result)
        return 0
    except Exception as exc:
        error = _result_error(rd, attempt, rank, result, exc)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: reported as they are
        rd.write_error(attempt, rank, exc)
        return EXIT_FAILED
    rd.write_error(attempt, rank, error)
    report(f"rank {rank} failed: {error}")
    return EXIT_FAILED


def _result_error(rd: RunDir, attempt: int, rank: int, result, exc: Exception) -> ResultError:
    """The rank's :class:`ResultError` for ``exc``, once the models in ``result`` are saved."""
    folder = rd.file(RunLayout.saved_models(attempt, rank))
    saved = {where: os.path.relpath(path, rd.path) for where, path in save_models(result, folder).items()}
    if saved:
        places = ", ".join(f"{where!r} at {path}" for where, path in saved.items())
        kept = (
            f" The models it returned were saved first, in the job's run dir {rd.path}: {places} "
            "(a folder: load it with from_pretrained; a .pt file: model.load_state_dict(torch.load(path)))."
        )
    else:
        kept = ""
    cause = exc if isinstance(exc, SparkGPUError) else f"{type(exc).__name__}: {exc}"
    error = ResultError(
        f"rank {rank}'s function returned, but its result could not be written back: {cause}.{kept} The job is "
        "not restarted: a new attempt would run the function again only to fail the same way at its end.",
        saved,
    )
    error.__cause__ = exc
    return error
