"""What :class:`~sparkgpu.train.checkpoint.Checkpointer`'s public methods run on.

:class:`CheckpointerInternals`, the Checkpointer's base class, holds what its public methods
run on: agreement between ranks (rank 0's bookkeeping handed to every rank, flags reduced
one step late), building the state each rank saves, writing it with DCP (in the background
by default: :class:`PendingSave`, and the reused staging memory of :func:`make_stager`),
committing it on rank 0 once every rank's data is written, pruning old checkpoints, and
loading a checkpoint back. With a key (inside a job), saves are signed and a checkpoint is
loaded only once its files match its signed list (``_checkpoint_signing``). Files are written
through ``_checkpoint_writes``: hashed beside the write, fsynced once, each phase timed
(:attr:`CheckpointerInternals.last_save_phases`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

from sparkgpu.errors import CheckpointError, ConfigurationError, SparkGPUError
from sparkgpu.tracking.autolog import unrecorded_optimizer_steps
from sparkgpu.train._checkpoint_checks import dcp_errors, describe, local_nbytes, save_failed
from sparkgpu.train._checkpoint_signing import SaveSigner, check_app_blob, refusal_of, weights_only_planner
from sparkgpu.train._checkpoint_writes import SaveTimings, attach_streams, without_torch_crc32
from sparkgpu.train._digests import digest_of
from sparkgpu.train.checkpoint_directory import CheckpointInfo, CheckpointDirectory, SignedCheckpoint
from sparkgpu.train._rng_state import capture_rng_state, restore_rng_state

__all__ = ["CheckpointerInternals", "PendingSave", "make_stager"]

# The Checkpointer's own logger, as in checkpoint_directory: one name for all its records.
logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PendingSave:
    """A save whose data may still be being written."""

    info: CheckpointInfo
    started: float
    blocking: float = 0.0
    done: threading.Event = dataclasses.field(default_factory=threading.Event)  # committed, or failed
    # Old checkpoints pruned after the commit: the next save, restore and close wait for it,
    # wait() does not (the checkpoint is committed before).
    settled: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: CheckpointError | None = None
    mlflow_run_id: str | None = None  # the caller's active MLflow run (runs are per thread)
    signer: SaveSigner | None = None  # lists and signs this rank's files, when the store has a key
    timings: SaveTimings = dataclasses.field(default_factory=SaveTimings)
    # perf_counter() at the points of the save that split it into phases (see phases()).
    marks: dict[str, float] = dataclasses.field(default_factory=dict)

    def mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter()

    def phases(self) -> dict[str, float]:
        """Seconds per phase of this save on this rank, as far as it got.

        ``build_s`` (the state dict and the pickled app state), ``stage_s`` (the copy into
        staging memory, async saves), ``plan_s`` (DCP's planning), ``data_s`` (DCP writing
        the data files: ``write_s`` into the files, ``hash_s`` beside it, ``hash_wait_s`` of
        it not hidden by the writes, ``writeback_s`` handing pages to the disk between them, and
        ``fsync_s``), ``lists_s``
        (signed file lists), ``metadata_s`` (DCP's ``.metadata``), ``commit_s`` (the marker),
        ``committed_s`` (from the start of the save to its commit), and once the old
        checkpoints are removed after it, ``prune_s``.
        """
        m = self.marks
        spans = {
            "build_s": ("started", "built"),
            "stage_s": ("built", "staged"),
            "plan_s": ("staged", "data"),
            "data_s": ("data", "data_written"),
            "lists_s": ("data_written", "listed"),
            "metadata_s": ("listed", "written"),
            "commit_s": ("written", "committed"),
            "committed_s": ("started", "committed"),
        }
        out = {name: m[b] - m[a] for name, (a, b) in spans.items() if a in m and b in m}
        out["blocking_s"] = self.blocking
        out.update({k: v for k, v in self.timings.as_dict().items()})
        return out


class CheckpointerInternals:
    """Base class of :class:`~sparkgpu.train.checkpoint.Checkpointer` with its internals.

    The methods use the state that ``Checkpointer.__init__`` sets up (the store, the rank,
    the process groups, the stager, the pending save) and its options, declared here.
    """

    # Options.
    keep_last: int | None
    async_save: bool
    save_rng: bool
    write_threads: int
    # What __init__ sets up.
    _directory: CheckpointDirectory
    _distributed: bool
    rank: int
    world_size: int
    _control_group: Any  # a torch ProcessGroup, or None without one
    _save_group: Any
    _stager: Any  # torch's DefaultStager with async_save
    _pending: PendingSave | None
    _unsettled: PendingSave | None  # a committed save whose pruning may still run
    _flags_in_flight: tuple[Any, Any] | None  # (torch Work, tensor) of the last flag reduction
    _closed: bool
    last_write_seconds: float | None
    last_save_phases: dict[str, float] | None

    @property
    def directory(self) -> str:
        """The checkpoint directory (path or URL)."""
        return self._directory.directory

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
        free = self._directory.free_bytes()
        if free is not None and nbytes > free:
            raise CheckpointError(
                f"no room for the checkpoint of step {step}: it needs at least {nbytes / 1e9:.2f} GB, "
                f"{self.directory!r} has {free / 1e9:.2f} GB free; free space there, lower keep_last, "
                "or pass another directory"
            )
        return self._directory.prepare(step)

    def _choose(self, step: int | None) -> SignedCheckpoint | None:
        """On rank 0: the checkpoint to restore, its marker verified when the store has a key."""
        if step is None:
            return self._directory.latest_signed()
        found = self._directory.get_signed(step)
        if found is None:
            available = [i.step for i in self._directory.list_complete()]
            raise CheckpointError(
                f"there is no complete checkpoint of step {step} in {self.directory!r}; "
                f"complete steps: {available or 'none'}; pass one of them or step=None for the newest"
            )
        return found

    def _genuine(self, found: SignedCheckpoint | None, step: int | None) -> SignedCheckpoint | None:
        """``found`` once its files match its signed list (collective); when restoring the
        newest (``step`` None), a checkpoint whose files do not is skipped for the next older one.

        Raises:
            CheckpointError: The checkpoint of ``step`` has a changed or missing file.
        """
        while found is not None and found.manifest is not None:
            problems = self._check_files_on_every_rank(found)
            if not problems:
                return found
            reason = "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
            if step is not None:
                raise CheckpointError(
                    f"checkpoint {found.info.path!r} is refused: {reason}. The job did not write it, or it was "
                    "changed since; nothing of it was loaded. Restore another step (step=None takes the newest "
                    "genuine one), and check who else can write to the checkpoint directory"
                )
            if self.rank == 0:
                logger.warning(
                    "ignoring checkpoint %s: %s; it was changed since the job wrote it (check who else can "
                    "write to the checkpoint directory)",
                    found.info.path,
                    reason,
                )
            found = self._run_on_rank0(functools.partial(self._directory.latest_signed, found.info.step))
        return found

    def _check_files_on_every_rank(self, found: SignedCheckpoint) -> list[str]:
        """Hashes the checkpoint's files, each rank its share; every rank gets every problem."""
        problems = self._directory.check_files(found, self.rank, self.world_size)
        if not self._distributed:
            return problems
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, problems, group=self._control_group)
        return sorted(problem for part in gathered for problem in part)

    def _build_state_dict(self, model, optimizers, stateful) -> tuple[dict[str, Any], int]:
        import torch

        state_dict: dict[str, Any] = {}
        if model is not None:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            with unrecorded_optimizer_steps():  # saved before the first step: its state is made by one
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
            "buffers": rank_buffers(model) if model is not None else {},
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

    def _on_written(self, pending: PendingSave, future: Future | None, error: BaseException | None = None) -> None:
        """Runs once this rank's part of a save ended; rank 0 then commits and prunes.

        The save counts as done once committed; old checkpoints are pruned after that, on the
        same thread (``pending.settled``).
        """
        if future is not None:
            error = future.exception()
        pending.mark("written")
        info = pending.info
        if error is None and self.rank == 0:
            try:
                info = dataclasses.replace(
                    info,
                    created=time.time(),
                    blocking_seconds=round(pending.blocking, 6),
                    write_seconds=round(time.perf_counter() - pending.started, 6),
                )
                manifest = pending.signer.manifest(self.world_size) if pending.signer is not None else None
                self._directory.commit(info, manifest)
                pending.mark("committed")
                pending.info = info
                logger.info("step %d: checkpoint committed to %s in %.2f s", info.step, info.path, info.write_seconds)
            except Exception as exc:
                error = exc
            else:
                self._record_lineage(info, pending.mlflow_run_id)
        if error is not None:
            if not isinstance(error, CheckpointError):
                wrapped = save_failed(info, error)
                wrapped.__cause__ = error
                error = wrapped
            pending.error = error
            logger.error("%s", error)
        self.last_write_seconds = time.perf_counter() - pending.started
        self.last_save_phases = phases = pending.phases()
        pending.done.set()
        if error is None and self.rank == 0:
            # On a thread of its own: a synchronous save runs this on the training loop's.
            threading.Thread(
                target=self._prune_after, args=(pending, phases), name="sparkgpu-checkpoint-prune", daemon=True
            ).start()
        else:
            pending.settled.set()

    def _prune_after(self, pending: PendingSave, phases: dict[str, float]) -> None:
        started = time.perf_counter()
        try:
            self._prune()
            phases["prune_s"] = time.perf_counter() - started
            logger.debug("step %d: checkpoint phases %s", pending.info.step, phases)
        finally:
            pending.settled.set()

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
            removed = self._directory.prune(self.keep_last)
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
        self._unsettled = pending
        return pending.error

    def _settle(self) -> None:
        """Waits for the pruning that followed the last commit (see :meth:`_on_written`)."""
        unsettled, self._unsettled = self._unsettled, None
        if unsettled is not None:
            unsettled.settled.wait()

    def _write(self, state_dict: dict[str, Any], pending: PendingSave) -> None:
        """Writes this rank's ``state_dict`` into ``pending.info.path``.

        With ``async_save`` the write is started in the background and ``pending`` commits
        when it ends; otherwise it is written and committed before this returns. Either way
        ``pending.blocking`` is the time the caller was held since the save started.
        """
        info, path, started = pending.info, pending.info.path, pending.started
        writer = self._directory.writer(path, self.write_threads)
        signer = None
        if self._directory.key is not None:
            blob = state_dict["app"][f"rank{self.rank}"]
            signer = pending.signer = SaveSigner(
                self._directory.store,
                self._directory.name_of(path),
                self.rank,
                self._directory.key,
                digest_of(blob),
            )
        attach_streams(
            writer, pending.timings, hashed=signer is not None, on_written=signer.record if signer is not None else None
        )
        _mark_write_data(writer, pending)
        import torch.distributed.checkpoint as dcp

        if self.async_save:
            try:
                future = dcp.async_save(
                    state_dict,
                    storage_writer=writer,
                    process_group=self._save_group,
                    async_stager=_MarkedStager(self._stager, pending),
                    no_dist=not self._distributed,
                )
            except dcp_errors() as exc:
                raise save_failed(info, exc) from exc
            pending.blocking = time.perf_counter() - started
            self._pending = pending
            # Measured before the callback is attached: a save that already finished runs
            # the callback right here, and the marker records the blocking time.
            assert isinstance(future, Future), "with synchronous staging DCP returns a plain Future"
            future.add_done_callback(functools.partial(self._on_written, pending))
        else:
            error = None
            pending.mark("staged")  # nothing to stage: DCP writes from the live state
            try:
                dcp.save(
                    state_dict, storage_writer=writer, process_group=self._save_group, no_dist=not self._distributed
                )
            except dcp_errors() as exc:
                error = exc
            pending.blocking = time.perf_counter() - started
            self._pending = pending
            self._on_written(pending, None, error=error)

    def _load(self, found: SignedCheckpoint, model, optimizers, stateful) -> None:
        """Loads the checkpoint ``found`` into the given objects (collective).

        Model and optimizer are resharded by DCP; the other objects and the RNG states come
        from this rank's part, or rank 0's on a rank that did not exist at save time. A
        signed checkpoint's files were checked (:meth:`_genuine`); what is unpickled is
        checked again as it is read.
        """
        info, manifest = found
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        source_rank = self.rank if self.rank < info.world_size else 0
        app_key = f"rank{source_rank}"
        template: dict[str, Any] = {"app": {app_key: b""}}
        if model is not None:
            with unrecorded_optimizer_steps():  # a fresh optimizer's state is made by a step with lr=0
                model_sd, optim_sd = get_state_dict(model, optimizers)
            template["model"] = model_sd
            if optimizers:
                template["optimizer"] = optim_sd
        reader = self._directory.reader(info.path, manifest)
        try:
            dcp.load(
                template,
                storage_reader=reader,
                planner=weights_only_planner() if manifest is not None else None,
                process_group=self._control_group,
                no_dist=not self._distributed,
            )
        except dcp_errors() as exc:
            refusal = refusal_of(reader)
            if refusal is not None:
                raise refusal from exc
            raise CheckpointError(
                f"cannot read checkpoint {info.path!r} ({describe(exc)}); every rank "
                "must see the checkpoint directory (on several nodes, use a shared filesystem "
                "or an object-store URL)"
            ) from exc
        blob = template["app"][app_key]
        if manifest is not None:
            check_app_blob(manifest, app_key, blob, info.path)
        if model is not None:
            with unrecorded_optimizer_steps():
                set_state_dict(
                    model,
                    optimizers,
                    model_state_dict=template["model"],
                    optim_state_dict=template.get("optimizer", {}),
                )
        app = torch.load(io.BytesIO(blob), weights_only=False)
        if model is not None:
            load_rank_buffers(model, app.get("buffers", {}))
        for name, obj in stateful.items():
            obj.load_state_dict(app["stateful"][name])
        if self.save_rng and app.get("rng") is not None:
            if source_rank == self.rank:
                restore_rng_state(app["rng"])
            else:
                logger.warning(
                    "rank %d did not exist when step %d was saved: RNG state not restored", self.rank, info.step
                )


class _MarkedStager:
    """The Checkpointer's stager, marking when a save's staging copy is done."""

    def __init__(self, stager, pending: PendingSave):
        self._stager = stager
        self._pending = pending

    def stage(self, state_dict, **kwargs):
        staged = self._stager.stage(state_dict, **kwargs)
        self._pending.mark("staged")
        return staged

    def __getattr__(self, name):
        return getattr(self._stager, name)


def _mark_write_data(writer, pending: PendingSave) -> None:
    """Marks when DCP's ``write_data`` of ``writer`` starts and ends, and once it has, has the
    save's signer (if any) list the files it wrote."""
    write_data = writer.write_data

    def marked(plan, planner):
        pending.mark("data")
        # Signed: every byte is hashed, so torch's own checksum of each tensor is skipped.
        with without_torch_crc32() if pending.signer is not None else contextlib.nullcontext():
            future = write_data(plan, planner)
            results = future.wait()
        pending.mark("data_written")
        if pending.signer is not None:
            pending.signer.write_rank_files(results)
        pending.mark("listed")
        return future

    writer.write_data = marked


def _buffer_key(name: str) -> str:
    # The same buffer whether the model is wrapped in DDP or torch.compile or not.
    return ".".join(part for part in name.split(".") if part not in ("module", "_orig_mod"))


def rank_buffers(model) -> dict[str, Any]:
    """This rank's own copies of the model's buffers (batch-norm statistics...).

    DCP saves a tensor that every rank holds under one name once, from one rank; buffers are
    not replicated like parameters: under DDP each rank updates its batch-norm statistics from
    its own batch after rank 0's were broadcast, and FSDP does not synchronise them at all. A
    restart that loaded one rank's copy into every rank would change the statistics the model
    ends with, so each rank keeps its own beside its other state. Sharded buffers (DTensors)
    are left to DCP.
    """
    from torch.distributed.tensor import DTensor

    return {
        _buffer_key(name): buf.detach().clone() for name, buf in model.named_buffers() if not isinstance(buf, DTensor)
    }


def load_rank_buffers(model, saved: dict[str, Any]) -> None:
    """Puts back what :func:`rank_buffers` kept, after DCP loaded the model."""
    import torch

    with torch.no_grad():
        for name, buf in model.named_buffers():
            value = saved.get(_buffer_key(name))
            if value is not None and value.shape == buf.shape:
                buf.copy_(value)


def make_stager():
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
