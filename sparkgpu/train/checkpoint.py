"""Checkpoint-and-restart for training functions, on torch.distributed.checkpoint (DCP).

A :class:`Checkpointer` saves the model, optimizer, any object with ``state_dict()`` /
``load_state_dict()`` (LR scheduler, data loader position, grad scaler...), the RNG states
and the step, and restores them in a later attempt of the same job::

    ckpt = Checkpointer(every_steps=100)                   # directory: the job's
    state = dict(model=model, optimizer=opt, scheduler=sched, loader=ds)
    start = ckpt.restore(**state)                          # 0 when nothing saved yet
    for step in range(start, total_steps):
        train_step(...)
        ckpt.maybe_save(step, **state)
        if ckpt.should_stop:                               # runtime cap, preemption
            runtime.stop_for_restart()                     # the job resumes in a new attempt
    ckpt.close()

How it behaves:

* Saves are asynchronous by default (``dcp.async_save``): the training loop waits only for
  the state to be copied into host memory (reused between saves); a background thread
  writes it. The next save first waits for the previous one. The time the loop was blocked
  is in :attr:`Checkpointer.last_blocking_seconds` and in the log.
* A checkpoint exists only once rank 0 has written its completion marker, after every
  rank's data reached storage; a process killed at any moment never leaves a checkpoint
  that loads half (see ``_checkpoint_store``). :meth:`Checkpointer.restore` loads the
  newest complete one.
* Plain modules, DDP and FSDP models (``fully_shard``; tested on CPU with gloo): model
  and optimizer go through ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
  ``set_state_dict``, so DDP prefixes and FSDP shards are handled, each rank writes only
  its own shards, and a checkpoint loads into another number of ranks or a plain module.
* Inside a process group the calls are collective: every rank creates the Checkpointer
  and calls ``restore``/``maybe_save``/``save``/``wait``/``close`` at the same points.
  Checkpoint traffic uses two gloo groups of its own, so it never interleaves with the
  training's collectives. Without a process group everything runs in the one process.
* Checkpoints are read back with pickle (as ``torch.load`` does): restore only from a
  directory you trust.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import os
import threading
import time
import warnings
import weakref
from concurrent.futures import Future
from typing import Any

from sparkgpu._modules import imported
from sparkgpu import runtime
from sparkgpu.errors import CheckpointError, ConfigurationError, SparkGPUError
from sparkgpu.train._checkpoint_checks import (
    check_compatible,
    check_extras,
    check_objects,
    check_positive,
    check_step,
    dcp_errors,
    describe,
    local_nbytes,
    save_failed,
)
from sparkgpu.train._checkpoint_store import CheckpointInfo, CheckpointStore
from sparkgpu.train._rng_state import capture_rng_state, restore_rng_state

__all__ = ["Checkpointer", "CheckpointInfo", "list_checkpoints", "latest_checkpoint", "finish_pending_checkpoints"]

logger = logging.getLogger("sparkgpu.train.checkpoint")

# DCP warns on every save and load without a process group; for a single process that is
# the intended mode, so only that exact message is silenced.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
)

_LIVE: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


@dataclasses.dataclass
class _PendingSave:
    """A save whose data may still be being written."""

    info: CheckpointInfo
    started: float
    blocking: float = 0.0
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: CheckpointError | None = None
    mlflow_run_id: str | None = None  # the caller's active MLflow run (runs are per thread)


class Checkpointer:
    """Saves and restores the training state of every rank of a job.

    Args:
        directory: Where checkpoints go: a local path (shared by all ranks, e.g. a shared
            filesystem across nodes) or an fsspec URL. Defaults to the job's checkpoint
            directory (``sparkgpu.runtime.checkpoint_dir()``), shared by all its attempts.
        every_steps: :meth:`maybe_save` saves after every this many steps.
        every_minutes: :meth:`maybe_save` saves when this much time passed since the last
            save (or since the start); ranks agree on the decision.
        keep_last: How many complete checkpoints to keep (``None``: all).
        async_save: Write in a background thread (the default) instead of blocking the
            loop for the whole write.
        save_rng: Also save and restore the Python, NumPy, torch and CUDA RNG states of
            each rank.
        write_threads: Threads writing each rank's data (``FileSystemWriter``).
        handle_sigterm: Turn SIGTERM into a checkpoint request
            (``runtime.handle_sigterm_as_checkpoint_request``), so a preempted rank saves
            before it goes.

    Raises:
        ConfigurationError: An argument is out of range.
        CheckpointError: No directory was given outside a job, or it cannot be created.
    """

    # Seams for tests: the directory layout (and the DCP writers it hands out) and the clock
    # that every_minutes is measured with.
    store_cls = CheckpointStore
    clock = staticmethod(time.monotonic)

    def __init__(
        self,
        directory: str | os.PathLike | None = None,
        *,
        every_steps: int | None = None,
        every_minutes: float | None = None,
        keep_last: int | None = 3,
        async_save: bool = True,
        save_rng: bool = True,
        write_threads: int = 1,
        handle_sigterm: bool = True,
    ):
        check_positive("every_steps", every_steps, int)
        check_positive("every_minutes", every_minutes, (int, float))
        check_positive("keep_last", keep_last, int)
        check_positive("write_threads", write_threads, int)
        if directory is None:
            directory = runtime.checkpoint_dir()
        if directory is None:
            raise CheckpointError(
                "no checkpoint directory: pass Checkpointer(directory=...) or run inside a "
                "distributed job, which provides one shared by all its attempts"
            )
        import torch.distributed as dist

        self.every_steps = every_steps
        self.every_minutes = every_minutes
        self.keep_last = keep_last
        self.async_save = async_save
        self.save_rng = save_rng
        self.write_threads = write_threads
        self._store = self.store_cls(directory)
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self.world_size = dist.get_world_size() if self._distributed else 1
        self._control_group = self._save_group = None
        if self._distributed:
            # The background writer runs DCP's collectives while the loop runs its own
            # (stop agreement, restore): one group each keeps their order per group.
            self._control_group = dist.new_group(backend="gloo")
            self._save_group = dist.new_group(backend="gloo") if async_save else self._control_group
        self._run_on_rank0(self._store.ensure_directory)
        self._stager = _make_stager() if async_save else None
        if handle_sigterm:
            runtime.handle_sigterm_as_checkpoint_request()

        self._pending: _PendingSave | None = None
        self._flags_in_flight = None
        self._last_saved_step: int | None = None
        self._last_save_time = self.clock()
        self._should_stop = False
        self._closed = False
        self.last_blocking_seconds: float | None = None
        self.last_write_seconds: float | None = None
        self.last_restore_seconds: float | None = None
        self.restored: CheckpointInfo | None = None
        _LIVE.add(self)

    def __repr__(self):
        return (
            f"Checkpointer({self.directory!r}, every_steps={self.every_steps}, "
            f"every_minutes={self.every_minutes}, keep_last={self.keep_last}, async_save={self.async_save})"
        )

    @property
    def directory(self) -> str:
        """The checkpoint directory (path or URL)."""
        return self._store.directory

    @property
    def should_stop(self) -> bool:
        """True once :meth:`maybe_save` saved because the job is about to be stopped.

        The runtime cap is near, a usage budget is spent or the worker got SIGTERM; the
        checkpoint is committed and every rank should call ``runtime.stop_for_restart()``
        now, so the job resumes from it in a new attempt (returning instead would end the
        job as succeeded, its training cut short). All ranks see the same value at the
        same step.
        """
        return self._should_stop

    # -- saving ------------------------------------------------------------------------

    def maybe_save(self, step: int, *, model=None, optimizer=None, extras: dict | None = None, **stateful) -> bool:
        """Saves when a checkpoint is due; call it on every rank after every step.

        Due means: ``every_steps`` steps have been done since the last multiple, or
        ``every_minutes`` passed, or this job is about to be stopped
        (``runtime.should_checkpoint()`` on any rank). In that last case the save is
        waited for and :attr:`should_stop` becomes True. With several ranks, time and stop
        are noticed one call late: the ranks agree on them without waiting for each other.

        Args:
            step: Index of the step just finished (0 for the first).
            model: The model (plain, DDP or FSDP).
            optimizer: Its optimizer, or a list of optimizers.
            extras: JSON values to keep in the checkpoint (``restored.extras``).
            **stateful: Further objects with ``state_dict()``/``load_state_dict()``.

        Returns:
            True when a checkpoint was started at this step.

        Raises:
            ConfigurationError: An argument cannot be saved.
            CheckpointError: This or the previous save failed.
        """
        step = check_step(step)
        steps_due = self.every_steps is not None and (step + 1) % self.every_steps == 0
        time_due = (
            self.every_minutes is not None
            and self.clock() - self._last_save_time >= self.every_minutes * 60
        )
        time_due, stop = self._any_rank_one_step_late(time_due, runtime.should_checkpoint())
        if stop:
            self.save(step, model=model, optimizer=optimizer, extras=extras, wait=True, **stateful)
            self._should_stop = True
            logger.info("step %d: checkpoint committed before the job stops", step)
            return True
        if steps_due or time_due:
            self.save(step, model=model, optimizer=optimizer, extras=extras, **stateful)
            return True
        return False

    def save(
        self, step: int, *, model=None, optimizer=None, extras: dict | None = None, wait: bool = False, **stateful
    ) -> None:
        """Saves now (asynchronously unless ``async_save=False`` or ``wait=True``).

        Saving the step that was saved last only waits for that save.

        Args:
            step: Index of the step just finished; restore resumes at ``step + 1``.
            model: The model (plain, DDP or FSDP).
            optimizer: Its optimizer, or a list of optimizers.
            extras: JSON values to keep in the checkpoint (``restored.extras``).
            wait: Return only once the checkpoint is committed.
            **stateful: Further objects with ``state_dict()``/``load_state_dict()``.

        Raises:
            ConfigurationError: An argument cannot be saved.
            CheckpointError: This or the previous save failed, or there is no room for it.
        """
        started = time.perf_counter()
        step = check_step(step)
        optimizers = check_objects(model, optimizer, stateful)
        extras = check_extras(extras)
        self._check_open()
        if step == self._last_saved_step:
            if wait:
                self.wait()
            return
        self.wait()

        state_dict, nbytes = self._build_state_dict(model, optimizers, stateful)
        path = self._run_on_rank0(functools.partial(self._prepare, step, nbytes))
        info = CheckpointInfo(
            step=step,
            path=path,
            world_size=self.world_size,
            created=0.0,
            extras=extras,
            has_model=model is not None,
            has_optimizer=bool(optimizers),
            stateful=tuple(stateful),
            has_rng=self.save_rng,
        )
        pending = _PendingSave(info=info, started=started, mlflow_run_id=_caller_mlflow_run_id())
        writer = self._store.writer(path, self.write_threads)
        import torch.distributed.checkpoint as dcp

        if self.async_save:
            try:
                future = dcp.async_save(
                    state_dict,
                    storage_writer=writer,
                    process_group=self._save_group,
                    async_stager=self._stager,
                    no_dist=not self._distributed,
                )
            except dcp_errors() as exc:
                raise save_failed(info, exc) from exc
            pending.blocking = time.perf_counter() - started
            self._pending = pending
            # Measured before the callback is attached: a save that already finished runs
            # the callback right here, and the marker records the blocking time.
            future.add_done_callback(functools.partial(self._on_written, pending))
        else:
            error = None
            try:
                dcp.save(state_dict, storage_writer=writer, process_group=self._save_group, no_dist=not self._distributed)
            except dcp_errors() as exc:
                error = exc
            pending.blocking = time.perf_counter() - started
            self._pending = pending
            self._on_written(pending, None, error=error)

        self.last_blocking_seconds = pending.blocking
        self._last_saved_step = step
        self._last_save_time = self.clock()
        logger.info(
            "step %d: checkpoint of %.1f MB (this rank) started, training blocked %.3f s",
            step,
            nbytes / 1e6,
            pending.blocking,
        )
        if wait or not self.async_save:
            self.wait()

    def wait(self) -> CheckpointInfo | None:
        """Waits until the last save is committed (collective).

        Returns:
            The committed checkpoint, or ``None`` when no save was pending.

        Raises:
            CheckpointError: The save failed on any rank.
        """
        pending = self._pending
        error = self._finish_pending_locally()
        if self._distributed:
            # Only rank 0 commits: every rank learns whether that worked.
            shared = [error if self.rank == 0 else None]
            import torch.distributed as dist

            dist.broadcast_object_list(shared, src=0, group=self._control_group)
            error = error or shared[0]
        if error is not None:
            raise error
        return None if pending is None else pending.info

    def close(self) -> None:
        """Waits for the last save and frees the staging memory (collective)."""
        if self._closed:
            return
        try:
            self._drain_flags()
            self.wait()
        finally:
            self._closed = True
            if self._stager is not None:
                self._stager.close()
            _LIVE.discard(self)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            # Other ranks may be gone, and with them the collectives a wait would need:
            # leave the write to finish or fail on its own, the marker decides.
            self._closed = True
            _LIVE.discard(self)

    # -- restoring ---------------------------------------------------------------------

    def restore(self, *, model=None, optimizer=None, step: int | None = None, **stateful) -> int:
        """Loads the newest complete checkpoint into the given objects (collective).

        Pass the same names as to :meth:`save`. Objects saved but not passed here are
        left alone; objects passed here but missing from the checkpoint are an error.
        With a different number of ranks than at save time, model and optimizer are
        resharded; the other objects take rank 0's state on the new ranks, which get no
        RNG state.

        Args:
            model: The model to load into.
            optimizer: Its optimizer, or a list of optimizers.
            step: Restore this step's checkpoint instead of the newest.
            **stateful: Further objects with ``load_state_dict()``.

        Returns:
            The step to resume from: the saved step + 1, or 0 when there is no checkpoint.

        Raises:
            ConfigurationError: An argument cannot be restored into.
            CheckpointError: ``step`` has no complete checkpoint, the checkpoint lacks a
                passed object, or it cannot be read.
        """
        started = time.perf_counter()
        optimizers = check_objects(model, optimizer, stateful)
        if step is not None:
            step = check_step(step)
        self._check_open()
        self.wait()
        info = self._run_on_rank0(functools.partial(self._choose, step))
        if info is None:
            logger.info("no complete checkpoint in %s: starting from step 0", self.directory)
            return 0
        check_compatible(info, model, optimizers, stateful)

        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        source_rank = self.rank if self.rank < info.world_size else 0
        app_key = f"rank{source_rank}"
        template: dict[str, Any] = {"app": {app_key: b""}}
        if model is not None:
            model_sd, optim_sd = get_state_dict(model, optimizers)
            template["model"] = model_sd
            if optimizers:
                template["optimizer"] = optim_sd
        try:
            dcp.load(
                template,
                storage_reader=self._store.reader(info.path),
                process_group=self._control_group,
                no_dist=not self._distributed,
            )
        except dcp_errors() as exc:
            raise CheckpointError(
                f"cannot read checkpoint {info.path!r} ({describe(exc)}); every rank "
                "must see the checkpoint directory (on several nodes, use a shared filesystem "
                "or an object-store URL)"
            ) from exc
        if model is not None:
            set_state_dict(
                model,
                optimizers,
                model_state_dict=template["model"],
                optim_state_dict=template.get("optimizer", {}),
            )
        app = torch.load(io.BytesIO(template["app"][app_key]), weights_only=False)
        for name, obj in stateful.items():
            obj.load_state_dict(app["stateful"][name])
        if self.save_rng and app.get("rng") is not None:
            if source_rank == self.rank:
                restore_rng_state(app["rng"])
            else:
                logger.warning("rank %d did not exist when step %d was saved: RNG state not restored", self.rank, info.step)

        self.restored = info
        self._last_saved_step = info.step
        self._last_save_time = self.clock()
        self.last_restore_seconds = time.perf_counter() - started
        logger.info(
            "restored step %d from %s in %.2f s: resuming at step %d",
            info.step,
            info.path,
            self.last_restore_seconds,
            info.step + 1,
        )
        return info.step + 1

    # -- internals ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one to save or restore again")

    def _run_on_rank0(self, fn):
        """Runs ``fn`` on rank 0 and hands its result (or its error) to every rank."""
        if not self._distributed:
            return fn()
        import torch.distributed as dist

        outcome: list[Any] = [None]
        if self.rank == 0:
            try:
                outcome = [(True, fn())]
            except SparkGPUError as exc:
                outcome = [(False, exc)]
            except Exception as exc:  # shipped to every rank, so none waits forever
                outcome = [(False, CheckpointError(f"checkpoint bookkeeping failed on rank 0: {exc!r}"))]
        dist.broadcast_object_list(outcome, src=0, group=self._control_group)
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def _any_rank_one_step_late(self, *flags: bool) -> tuple[bool, ...]:
        """Whether any rank raised each flag, as of the previous call.

        The reduction of this call's flags is started now and read at the next call, a
        whole training step later, so the loop never waits for the network here; every
        rank reads the same reduction at the same step, which is all agreement needs.
        """
        if not self._distributed:
            return flags
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._control_group, async_op=True)
        previous, self._flags_in_flight = self._flags_in_flight, (work, tensor)
        if previous is None:
            return tuple(False for _ in flags)
        previous[0].wait()
        return tuple(bool(v) for v in previous[1].tolist())

    def _drain_flags(self) -> None:
        if self._flags_in_flight is not None:
            self._flags_in_flight[0].wait()
            self._flags_in_flight = None

    def _prepare(self, step: int, nbytes: int) -> str:
        free = self._store.free_bytes()
        if free is not None and nbytes > free:
            raise CheckpointError(
                f"no room for the checkpoint of step {step}: it needs at least {nbytes / 1e9:.2f} GB, "
                f"{self.directory!r} has {free / 1e9:.2f} GB free; free space there, lower keep_last, "
                "or pass another directory"
            )
        return self._store.prepare(step)

    def _choose(self, step: int | None) -> CheckpointInfo | None:
        if step is None:
            return self._store.latest()
        info = self._store.get(step)
        if info is None:
            available = [i.step for i in self._store.list_complete()]
            raise CheckpointError(
                f"there is no complete checkpoint of step {step} in {self.directory!r}; "
                f"complete steps: {available or 'none'}; pass one of them or step=None for the newest"
            )
        return info

    def _build_state_dict(self, model, optimizers, stateful) -> tuple[dict[str, Any], int]:
        import torch

        state_dict: dict[str, Any] = {}
        if model is not None:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(model, optimizers)
            state_dict["model"] = model_sd
            if optimizers:
                state_dict["optimizer"] = optim_sd
        # Everything else is one opaque blob per rank, serialised now: later changes to
        # the live objects cannot leak into it, and its structure may change between
        # saves (DCP would need the old structure as a template to load it).
        app = {
            "stateful": {name: obj.state_dict() for name, obj in stateful.items()},
            "rng": capture_rng_state() if self.save_rng else None,
        }
        buffer = io.BytesIO()
        try:
            torch.save(app, buffer)
        except Exception as exc:
            raise ConfigurationError(
                f"the state of {', '.join(stateful) or 'the RNGs'} cannot be pickled ({exc}); "
                "state_dict() must return picklable values (numbers, strings, lists, dicts, tensors)"
            ) from exc
        blob = buffer.getvalue()
        state_dict["app"] = {f"rank{self.rank}": blob}
        return state_dict, local_nbytes(state_dict) + len(blob)

    def _on_written(self, pending: _PendingSave, future: Future | None, error: BaseException | None = None) -> None:
        """Runs once this rank's part of a save ended; rank 0 then commits and prunes."""
        if future is not None:
            error = future.exception()
        info = pending.info
        if error is None and self.rank == 0:
            try:
                info = dataclasses.replace(
                    info,
                    created=time.time(),
                    blocking_seconds=round(pending.blocking, 6),
                    write_seconds=round(time.perf_counter() - pending.started, 6),
                )
                self._store.commit(info)
                pending.info = info
                logger.info("step %d: checkpoint committed to %s in %.2f s", info.step, info.path, info.write_seconds)
            except Exception as exc:
                error = exc
            else:
                self._record_lineage(info, pending.mlflow_run_id)
                self._prune()
        if error is not None:
            if not isinstance(error, CheckpointError):
                wrapped = save_failed(info, error)
                wrapped.__cause__ = error
                error = wrapped
            pending.error = error
            logger.error("%s", error)
        self.last_write_seconds = time.perf_counter() - pending.started
        pending.done.set()

    @staticmethod
    def _record_lineage(info: CheckpointInfo, mlflow_run_id: str | None) -> None:
        """The job's MLflow run (or outside a job, the caller's active one) learns of the
        committed checkpoint: the registry tags model versions with its step."""
        from sparkgpu.tracking.autolog import log_checkpoint

        try:
            log_checkpoint(info.step, info.path, run_id=mlflow_run_id)
        except Exception as exc:  # the checkpoint is committed; lineage is a record of it
            logger.warning("step %d: checkpoint committed, but not recorded in the run: %s", info.step, exc)

    def _prune(self) -> None:
        try:
            removed = self._store.prune(self.keep_last)
        except OSError as exc:
            # The new checkpoint is committed; old ones are retried at the next commit.
            logger.warning("could not remove old checkpoints in %s: %s", self.directory, exc)
            return
        if removed:
            logger.info("removed checkpoints of steps %s (keep_last=%s)", removed, self.keep_last)

    def _finish_pending_locally(self) -> CheckpointError | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        pending.done.wait()
        return pending.error


# -- module helpers ----------------------------------------------------------------------


def list_checkpoints(directory: str | os.PathLike) -> list[CheckpointInfo]:
    """Every complete checkpoint under ``directory``, oldest step first."""
    return CheckpointStore(directory).list_complete()


def latest_checkpoint(directory: str | os.PathLike) -> CheckpointInfo | None:
    """The newest complete checkpoint under ``directory``, or ``None``."""
    return CheckpointStore(directory).latest()


def finish_pending_checkpoints() -> None:
    """Lets the background writes of every live Checkpointer of this process end.

    The launcher calls it after the training function returned and before it tears the
    process group down, so a save still in flight is committed rather than cut off.
    Not collective.

    Raises:
        CheckpointError: A pending save failed.
    """
    errors = [e for e in (c._finish_pending_locally() for c in list(_LIVE)) if e is not None]
    if errors:
        raise errors[0]


def _caller_mlflow_run_id() -> str | None:
    """Outside a job, the calling thread's active MLflow run, for the commit on the writer
    thread to record the checkpoint in (MLflow runs are per thread).

    Inside a job the lineage goes to the job's run through the tracking spool, so MLflow is
    not asked: its import may still be running in the background, and waiting for it here
    would count as the save's blocking time.
    """
    from sparkgpu.tracking.autolog import logs_to_job_run

    if logs_to_job_run():
        return None
    try:
        mlflow = imported("mlflow")  # never imported for this: no run can be active without it
        run = mlflow.active_run() if mlflow is not None else None
    except Exception as exc:  # a broken MLflow must not fail a save: the checkpoint is what matters
        logger.warning("this checkpoint is not recorded in an MLflow run: asking MLflow for the active run "
                       "failed (%s)", exc)
        return None
    return run.info.run_id if run is not None else None


def _make_stager():
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # Staging copies the state into host memory that is kept and reused by later saves
    # (10x less blocking than allocating it anew each time). Pinned memory and
    # non-blocking copies need an accelerator; shared memory only serves the
    # process-based writer, which this module does not use.
    accelerator = torch.accelerator.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=accelerator,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=accelerator,
        )
    )
