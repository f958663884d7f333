"""Checkpoint-and-restart for training functions, on torch.distributed.checkpoint (DCP).

A :class:`Checkpointer` saves the model, optimizer, any object with ``state_dict()`` /
``load_state_dict()`` (LR scheduler, data loader position, grad scaler...), the RNG states
and the step, and restores them in a later attempt of the same job::

    ckpt = Checkpointer(every_steps=100)                   # directory: the job's
    state = dict(model=model, optimizer=opt, scheduler=sched, loader=ds)
    start = ckpt.restore(**state)                          # steps done: 0 when nothing saved yet
    for step in range(start, total_steps):
        train_step(...)
        ckpt.maybe_save(step, **state)
        if ckpt.should_stop:                               # runtime cap, preemption
            runtime.stop_for_restart()                     # the job resumes in a new attempt
    ckpt.close()

How it behaves:

* Steps can be counted either way training loops do: ``maybe_save(step)`` takes the index of
  the step just finished (0 first, as above) or the number of steps done (``step += 1``
  before it, 1 first, as Lightning's and Hugging Face's ``global_step``). The first save of
  a job tells them apart (``first_step=`` says it up front) and is recorded in the
  checkpoint; :meth:`Checkpointer.restore` returns the number of steps done, which is the
  next index in the first habit and the counter's value in the second. A loop whose first
  save after a restore does not follow the restored step gets a ``CheckpointError`` naming
  the fix instead of silently skipping or repeating a step.

* Saves are asynchronous by default (``dcp.async_save``): the training loop waits only for
  the state to be copied into host memory (reused between saves); a background thread
  writes it. The next save first waits for the previous one. The time the loop was blocked
  is in :attr:`Checkpointer.last_blocking_seconds` and in the log; where the last save's
  time went, phase by phase (staging, planning, writing, hashing, fsync, commit), in
  :attr:`Checkpointer.last_save_phases`.
* A checkpoint exists only once rank 0 has written its completion marker, after every
  rank's data reached storage; a process killed at any moment never leaves a checkpoint
  that loads half (see ``checkpoint_directory``). :meth:`Checkpointer.restore` loads the
  newest complete one.
* Plain modules, DDP and FSDP models (``fully_shard``; tested on CPU with gloo): model
  and optimizer go through ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
  ``set_state_dict``, so DDP prefixes and FSDP shards are handled, each rank writes only
  its own shards, and a checkpoint loads into another number of ranks or a plain module.
* Inside a process group the calls are collective: every rank creates the Checkpointer
  and calls ``restore``/``maybe_save``/``save``/``wait``/``close`` at the same points.
  Checkpoint traffic uses two gloo groups of its own, so it never interleaves with the
  training's collectives. Without a process group everything runs in the one process.
* Inside a job, checkpoints are signed: the completion marker lists every file with its
  BLAKE3 digest and carries an HMAC under a key derived from the job's key (``_checkpoint_keys``,
  ``_checkpoint_signing``). :meth:`Checkpointer.restore` checks the marker and the files
  before anything is unpickled; a checkpoint that fails is skipped with a warning when
  restoring the newest (the job resumes from the newest genuine one) and refused when named
  by ``step=``. An unsigned checkpoint is never restored inside a job. Outside a job (a
  plain ``torchrun`` run, a script) there is no key: checkpoints are written and read
  unsigned, with pickle (as ``torch.load`` does), so restore only from a directory you trust.

This module holds the public API: :class:`Checkpointer` and the module helpers. What its
methods run on (agreement between ranks, building, writing and committing a save, loading
one back) is its base class in ``_checkpoint_internals``; argument checks are in
``_checkpoint_checks``, the directory layout in ``checkpoint_directory``.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import warnings
import weakref

from sparkgpu._util.modules import imported
from sparkgpu import runtime
from sparkgpu.rundir import progress as _progress
from sparkgpu.errors import CheckpointError, ConfigurationError
from sparkgpu.train._checkpoint_checks import (
    check_compatible,
    check_extras,
    check_first_step,
    check_objects,
    check_positive,
    check_resumed_step,
    check_step,
)
from sparkgpu.train._checkpoint_internals import CheckpointerInternals, PendingSave, make_stager
from sparkgpu.train._checkpoint_keys import required_key, signing_key
from sparkgpu.train.checkpoint_directory import CheckpointInfo, CheckpointDirectory

__all__ = ["Checkpointer", "CheckpointInfo", "list_checkpoints", "latest_checkpoint", "finish_pending_checkpoints"]

logger = logging.getLogger(__name__)

# DCP warns on every save and load without a process group; for a single process that is
# the intended mode, so only that exact message is silenced.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
)

_LIVE: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


class Checkpointer(CheckpointerInternals):
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
        first_step: The ``step`` the loop passes to :meth:`maybe_save` after its first step:
            0 when it passes the step's index, 1 when it passes the number of steps done.
            ``None`` (the default) learns it from the job's first :meth:`maybe_save`: 0 or 1
            there says which; any other value, or a :meth:`save` before any, counts as an
            index. A loop that counts steps done and only calls :meth:`save` passes 1.

    Inside a job, every checkpoint saved is signed with a key derived from the job's, and
    only checkpoints so signed are restored (see the module's notes); outside one, they are
    written and read unsigned.

    Raises:
        ConfigurationError: An argument is out of range.
        CheckpointError: No directory was given outside a job, or it cannot be created.
    """

    # Seams for tests: the directory layout (and the DCP writers it hands out) and the clock
    # that every_minutes is measured with.
    directory_cls = CheckpointDirectory
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
        first_step: int | None = None,
    ):
        check_positive("every_steps", every_steps, int)
        self._first_step = check_first_step(first_step)
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
        self._directory = self.directory_cls(directory, key=signing_key(os.fspath(directory)))
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self.world_size = dist.get_world_size() if self._distributed else 1
        self._control_group = self._save_group = None
        if self._distributed:
            # The background writer runs DCP's collectives while the loop runs its own
            # (stop agreement, restore): one group each keeps their order per group.
            self._control_group = dist.new_group(backend="gloo")
            self._save_group = dist.new_group(backend="gloo") if async_save else self._control_group
        self._run_on_rank0(self._directory.ensure_directory)
        self._stager = make_stager() if async_save else None
        if handle_sigterm:
            runtime.handle_sigterm_as_checkpoint_request()

        self._pending: PendingSave | None = None
        self._unsettled: PendingSave | None = None
        self._flags_in_flight = None
        self._last_saved_step: int | None = None
        self._resumed_at: int | None = None  # the step the loop must save first after restore()
        self._last_save_time = self.clock()
        self._should_stop = False
        self._closed = False
        self.last_blocking_seconds: float | None = None
        self.last_write_seconds: float | None = None
        self.last_save_phases: dict[str, float] | None = None
        self.last_restore_seconds: float | None = None
        self.restored: CheckpointInfo | None = None
        _LIVE.add(self)

    def __repr__(self):
        return (
            f"Checkpointer({self.directory!r}, every_steps={self.every_steps}, "
            f"every_minutes={self.every_minutes}, keep_last={self.keep_last}, async_save={self.async_save})"
        )

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
            step: The step just finished: its index (0 for the first) or the number of
                steps done (1 for the first), as the loop counts (``first_step``).
            model: The model (plain, DDP or FSDP).
            optimizer: Its optimizer, or a list of optimizers.
            extras: JSON values to keep in the checkpoint (``restored.extras``).
            **stateful: Further objects with ``state_dict()``/``load_state_dict()``.

        Returns:
            True when a checkpoint was started at this step.

        Raises:
            ConfigurationError: An argument cannot be saved.
            CheckpointError: This or the previous save failed, or the loop's counter does
                not follow the step restored (it would skip or repeat steps).
        """
        step = check_step(step)
        _progress.note(step)  # called after every step: what hang detection watches (sparkgpu.rundir.progress)
        first_step = self._counting(step, learn=True)
        if self._resumed_at is not None:
            resumed_at, self._resumed_at = self._resumed_at, None
            check_resumed_step(step, resumed_at, first_step)
        steps_due = self.every_steps is not None and (step + 1 - first_step) % self.every_steps == 0
        time_due = self.every_minutes is not None and self.clock() - self._last_save_time >= self.every_minutes * 60
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
            step: The step just finished, counted as for :meth:`maybe_save`.
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
        first_step = self._counting(step, learn=False)
        optimizers = check_objects(model, optimizer, stateful)
        extras = check_extras(extras)
        self._check_open()
        if step == self._last_saved_step:
            if wait:
                self.wait()
            return
        self.wait()
        self._settle()  # the last save's pruning, before this one's directory is prepared

        began = time.perf_counter()
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
            first_step=first_step,
        )
        pending = PendingSave(info=info, started=started, mlflow_run_id=_caller_mlflow_run_id())
        pending.marks.update(started=began, built=time.perf_counter())
        self._write(state_dict, pending)
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
            self._settle()
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

        Inside a job, "complete" includes "signed by this job, its files unchanged": the
        marker and every file are checked before anything is unpickled, and a checkpoint
        that fails is skipped, with a warning, for the newest one that passes.

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
            The number of steps done when the checkpoint was saved (0 when there is none):
            the index of the next step for a loop that passes indices, the counter's value
            for a loop that counts steps done.

        Raises:
            ConfigurationError: An argument cannot be restored into.
            CheckpointError: ``step`` has no complete checkpoint, or one that is not signed by
                this job or whose files changed since, the checkpoint lacks a passed object,
                or it cannot be read.
            ConfigurationError: ``first_step`` was given and differs from the one the
                checkpoint was saved with.
        """
        started = time.perf_counter()
        optimizers = check_objects(model, optimizer, stateful)
        if step is not None:
            step = check_step(step)
        self._check_open()
        self.wait()
        self._settle()
        found = self._genuine(self._run_on_rank0(functools.partial(self._choose, step)), step)
        if found is None:
            logger.info("no complete checkpoint in %s: starting from step 0", self.directory)
            return 0
        info = found.info
        if self._first_step is not None and self._first_step != info.first_step:
            raise ConfigurationError(
                f"checkpoint {info.path!r} was saved by a loop whose first step was {info.first_step}, "
                f"but this Checkpointer was made with first_step={self._first_step}: count steps as the "
                "saving loop did, or leave first_step out to take the checkpoint's"
            )
        check_compatible(info, model, optimizers, stateful)
        self._load(found, model, optimizers, stateful)

        self.restored = info
        self._first_step = info.first_step
        self._resumed_at = info.step + 1
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
        return info.steps_done

    def _counting(self, step: int, learn: bool) -> int:
        """How the loop counts steps (``first_step``).

        Learnt from the job's first :meth:`maybe_save`, which runs after the first step
        (0: an index, 1: steps done); a :meth:`save` before any says nothing and counts as
        an index.
        """
        if self._first_step is None:
            if not learn:
                return 0
            self._first_step = step if step in (0, 1) else 0
            if step > 1:
                logger.info("first save at step %d: steps are taken as indices (first_step=0)", step)
        elif step < self._first_step:
            raise ConfigurationError(
                f"step {step} saved by a loop that counts steps done (first_step=1): the first "
                "step finished is 1; pass first_step=0 if the loop passes each step's index"
            )
        return self._first_step


# -- module helpers ----------------------------------------------------------------------


def list_checkpoints(directory: str | os.PathLike) -> list[CheckpointInfo]:
    """Every complete checkpoint under ``directory``, oldest step first.

    Where a key applies (a job's own checkpoint directory, in its ranks or on the client
    that launched it), only checkpoints whose marker is signed with it count; their files
    are checked when one is loaded.
    """
    return _listing_directory(directory).list_complete()


def latest_checkpoint(directory: str | os.PathLike) -> CheckpointInfo | None:
    """The newest complete checkpoint under ``directory``, or ``None`` (signed, where a key
    applies, as for :func:`list_checkpoints`)."""
    return _listing_directory(directory).latest()


def _listing_directory(directory: str | os.PathLike) -> CheckpointDirectory:
    store = CheckpointDirectory(directory)
    store.key = required_key(store.directory)
    return store


def finish_pending_checkpoints() -> None:
    """Lets the background writes of every live Checkpointer of this process end.

    The launcher calls it after the training function returned and before it tears the
    process group down, so a save still in flight is committed rather than cut off.
    Not collective.

    Raises:
        CheckpointError: A pending save failed.
    """
    live = list(_LIVE)
    errors = [e for e in (c._finish_pending_locally() for c in live) if e is not None]
    for checkpointer in live:
        checkpointer._settle()
    if errors:
        raise errors[0]


# Kept in this module with its ``imported``, which tests replace to fake a broken MLflow.
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
        logger.warning(
            "this checkpoint is not recorded in an MLflow run: asking MLflow for the active run failed (%s)", exc
        )
        return None
    return run.info.run_id if run is not None else None
