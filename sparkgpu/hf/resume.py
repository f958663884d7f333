"""A Trainer inside a job saves into the job's checkpoint store, signed, and resumes from it by itself.

The Trainer keeps saving in its own format (so its own ``resume_from_checkpoint`` restores
model, optimizer, scheduler, RNG states and data position exactly); :class:`JobCheckpointCallback`
then seals each ``checkpoint-N`` folder into ``<checkpoint_dir>/hf`` (every file's BLAKE3 digest in a
marker MAC'd with the job's checkpoint key, :mod:`sparkgpu.train.sealed_files`). A patched
``Trainer.train`` picks the newest checkpoint whose seal and files verify, copies it, checked,
into ``output_dir`` and passes it as ``resume_from_checkpoint``: no unverified pickle is loaded.

When ``runtime.should_checkpoint()`` turns true on any rank (runtime cap, preemption, budget,
SIGTERM), every rank learns it at the end of the step (one all-reduce of a flag), the Trainer
saves, the callback seals and every rank calls ``runtime.stop_for_restart()``.

Each checkpoint also records the world size that saved it and, for a sparkgpu loader as
``train_dataset``, the loader's position; a resumed Trainer counts its epochs and steps from
that position (:mod:`sparkgpu.hf.elastic`), right at any world size.

Outside a job (no job key) all of this stays out of the way: the Trainer is plain transformers.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
from typing import Any

from sparkgpu.hf._requirements import require_transformers

require_transformers("sparkgpu.hf")

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from sparkgpu import runtime  # noqa: E402
from sparkgpu.rundir import progress as _progress  # noqa: E402
from sparkgpu._util.report import report  # noqa: E402
from sparkgpu.errors import CheckpointError  # noqa: E402
from sparkgpu.store import Store  # noqa: E402
from sparkgpu.hf import datasets as loaders  # noqa: E402
from sparkgpu.hf import elastic  # noqa: E402
from sparkgpu.train import sealed_files  # noqa: E402

__all__ = ["JobCheckpointCallback", "PendingSeal", "resumable", "patch_trainer", "seal_checkpoint", "HF_FOLDER"]

logger = logging.getLogger(__name__)

HF_FOLDER = sealed_files.TRAINER_FOLDER
_PATCHED = "_sparkgpu_resumes"


def _job_store() -> Store | None:
    """The store of the job's sealed Trainer checkpoints; ``None`` outside a job."""
    directory = runtime.checkpoint_dir()
    if directory is None or sealed_files.job_key_for_sealing() is None:
        return None
    # Not flushed file by file (durable=False): the restore hashes every byte, so a copy that a
    # crash cut short is refused and the next older checkpoint used.
    return Store(directory, durable=False, what="the job's checkpoint store").child(HF_FOLDER)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _flag_device():
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank (every rank must call it)."""
    if not _distributed():
        return flag
    import torch.distributed as dist

    tensor = torch.tensor([1 if flag else 0], device=_flag_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def _gather(obj: Any, group=None) -> list[Any]:
    if not _distributed():
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast(obj: Any) -> Any:
    if not _distributed():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _files_under(folder: str) -> list[str]:
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                found.append(os.path.relpath(path, folder).replace(os.sep, "/"))
    return sorted(found)


def _node_leader() -> bool:
    return runtime.get_local_rank() == 0


_seal_groups: dict[int, Any] = {}


def _seal_group():
    """A gloo group of its own for the sealing thread (every rank creates it at its first seal):
    collectives on the training's group may run meanwhile on the main thread."""
    if not _distributed():
        return None
    import torch.distributed as dist

    key = id(dist.group.WORLD)
    if key not in _seal_groups:
        _seal_groups[key] = dist.new_group(backend="gloo")
    return _seal_groups[key]


class PendingSeal:
    """A seal finishing on a thread: files linked or copied and hashed, then rank 0's marker."""

    def __init__(self, work, name: str):
        self.name = name
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"sparkgpu-seal-{name}", daemon=True)
        self._thread.start()

    def _run(self, work) -> None:
        try:
            work()
        except BaseException as exc:  # raised to the training thread by wait()
            self.error = exc

    def wait(self) -> None:
        """Blocks until the seal is written.

        Raises:
            CheckpointError: Sealing failed; the checkpoint cannot be resumed from.
        """
        self._thread.join()
        if self.error is not None:
            raise CheckpointError(
                f"checkpoint {self.name} could not be sealed into the job: {self.error}"
            ) from self.error


def seal_checkpoint(
    store: Store, folder: str, step: int, keep_last: int | None = None, *, background: bool = False
) -> PendingSeal | None:
    """Seals the Trainer's ``folder`` (saved for ``step``) into ``store``; every rank calls it.

    One rank per node lists the folder (so node-local and shared ``output_dir`` both work);
    each file is linked or copied by the first node that has it, and rank 0 writes the marker
    over every node's hashes.

    Args:
        store: The job's store of sealed Trainer checkpoints.
        folder: The Trainer's ``checkpoint-<step>`` folder.
        step: Its step.
        keep_last: Sealed checkpoints to keep (the Trainer's ``save_total_limit``).
        background: Hash and write the marker on a thread; the caller must ``wait()`` on the
            returned seal before the folder may change (the Trainer's next save rotates).
    """
    key = sealed_files.job_key_for_sealing()
    assert key is not None
    name = sealed_files.sealed_name(step)
    # The first exchange is also the barrier after which every rank's own files are written.
    _gather(None)
    listing = _files_under(folder) if _node_leader() and os.path.isdir(folder) else None
    listings = _gather(listing)
    group = _seal_group() if background else None
    owner: dict[str, int] = {}
    for rank, files in enumerate(listings):
        for rel in files or ():
            owner.setdefault(rel, rank)
    rank = runtime.get_global_rank()

    def work() -> None:
        mine = {}
        for rel, who in owner.items():
            if who == rank:
                source = os.path.join(folder, *rel.split("/"))
                # Copied, not linked: the Trainer may write the same path again (a step saved
                # anew after a restart, an output_dir that another run reuses), and a link
                # would carry that write into the sealed copy.
                mine[rel] = sealed_files.copy_hashed(source, store, f"{name}/{rel}")
        hashes: dict[str, tuple[int, str]] = {}
        for part in _gather(mine, group):
            hashes.update(part)
        if rank == 0:
            sealed_files.write_marker(store, name, step, hashes, key)
            if keep_last:
                for old_step, old in sealed_files.sealed_folders(store)[keep_last:]:
                    if old_step != step:
                        store.remove(old)
            logger.info("sealed checkpoint %s (%d files) into %s", name, len(hashes), store.path())

    if background:
        return PendingSeal(work, name)
    work()
    return None


def restore_latest(store: Store, output_dir: str) -> str | None:
    """Copies the newest genuine sealed checkpoint into ``output_dir``; its local path, or ``None``.

    Every rank calls it. Rank 0 picks the candidates whose seals verify; each node's first
    rank copies a candidate, checking every file; a candidate that fails anywhere is skipped
    with a warning and the next older one is tried.
    """
    key = sealed_files.job_key_for_sealing()
    assert key is not None
    candidates = None
    if runtime.get_global_rank() == 0:
        candidates = []
        for step, name in sealed_files.sealed_folders(store):
            try:
                _, files = sealed_files.read_marker(store, name, key)
            except CheckpointError as exc:
                logger.warning("checkpoint %s is skipped: %s", store.path(name), exc)
                continue
            candidates.append((step, name, files))
    candidates = _broadcast(candidates)
    for step, name, files in candidates:
        local = os.path.join(output_dir, name)
        problem = None
        if _node_leader():
            try:
                sealed_files.restore_folder(store, name, files, local)
            except (CheckpointError, OSError) as exc:
                problem = str(exc)
        problems = [p for p in _gather(problem) if p]
        if not problems:
            if runtime.is_main_process():
                report(f"the Trainer resumes from step {step} (the job's sealed checkpoint {store.path(name)})")
            return local
        logger.warning("checkpoint %s is skipped: %s", store.path(name), problems[0])
    if runtime.is_main_process():
        report("the Trainer starts from the start: the job has no genuine checkpoint")
    return None


class JobCheckpointCallback(TrainerCallback):
    """Seals every checkpoint a Trainer saves into the job, and saves and stops when the job must stop.

    Args:
        store: Where to seal; the job's ``<checkpoint_dir>/hf`` by default. Outside a job
            (no store) the callback does nothing.
    """

    def __init__(self, store: Store | None = None, dataset: Any = None):
        self.store = store if store is not None else _job_store()
        self.dataset = dataset  # a sparkgpu loader whose position is saved beside each checkpoint
        self.stopping = False
        self.pending: PendingSeal | None = None

    def wait(self) -> None:
        """Waits for the seal in progress, if any (before the Trainer saves, rotates or ends)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()

    def on_train_begin(self, args, state, control, **kwargs):
        if self.store is not None:
            runtime.handle_sigterm_as_checkpoint_request()
        return control

    def on_prediction_step(self, args, state, control, **kwargs):
        _progress.note()  # an evaluation's batches are progress too, for hang detection
        return control

    def on_step_end(self, args, state, control, **kwargs):
        _progress.note(state.global_step)  # what hang detection watches (sparkgpu.rundir.progress)
        if self.store is None:
            return control
        # One flag for all: SIGTERM or a stop file may reach one rank a step before another.
        if _any_rank(runtime.should_checkpoint()):
            self.stopping = True
            control.should_save = True
            control.should_training_stop = True
        if control.should_save:
            self._before_save(args, state)
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.store is not None and control.should_save:
            self._before_save(args, state)
        return control

    def _before_save(self, args, state) -> None:
        """Every rank, before the Trainer saves ``checkpoint-<step>``: the previous seal is finished
        (the save may rotate its folder), and the folder holds nothing from an earlier run (the
        Trainer writes into an existing folder without clearing it, and a stale file, such as a
        full model beside an adapter, would be sealed and loaded with it)."""
        self.wait()
        if _node_leader():
            shutil.rmtree(
                os.path.join(args.output_dir, sealed_files.sealed_name(state.global_step)), ignore_errors=True
            )
        _gather(None)  # no rank saves before every node cleared its folder

    def on_train_end(self, args, state, control, **kwargs):
        self.wait()
        return control

    def on_save(self, args, state, control, **kwargs):
        if self.store is None:
            return control
        folder = os.path.join(args.output_dir, sealed_files.sealed_name(state.global_step))
        if runtime.is_main_process():
            elastic.save_world(folder, args.world_size)
            if self.dataset is not None:
                loaders.save_position(self.dataset, folder)
        self.wait()
        self.pending = seal_checkpoint(self.store, folder, state.global_step, args.save_total_limit, background=True)
        if self.stopping:
            self.wait()
            logger.info("checkpointed at step %d; stopping for a new attempt", state.global_step)
            runtime.stop_for_restart()
        return control


def _attach(trainer) -> JobCheckpointCallback | None:
    dataset = trainer.train_dataset if loaders.is_loader(trainer.train_dataset) else None
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, JobCheckpointCallback):
            callback.dataset = dataset
            return callback
    store = _job_store()
    if store is None:
        return None
    callback = JobCheckpointCallback(store, dataset)
    trainer.add_callback(callback)
    return callback


def _resuming_train(train):
    @functools.wraps(train)
    def wrapper(self, resume_from_checkpoint=None, *args, **kwargs):
        callback = _attach(self)
        if callback is not None and resume_from_checkpoint in (None, True):
            # True asks for the last checkpoint: inside a job that is the newest genuine one.
            resume_from_checkpoint = restore_latest(callback.store, self.args.output_dir)
        resume = None
        if isinstance(resume_from_checkpoint, str):
            positioned = loaders.is_loader(self.train_dataset) and loaders.load_position(
                self.train_dataset, resume_from_checkpoint
            )
            # Epochs and steps counted from the loader's position: right at any world size.
            resume = elastic.resume_point(self, resume_from_checkpoint, positioned)
        elastic.set_resume(self, resume)
        try:
            return train(self, resume_from_checkpoint, *args, **kwargs)
        finally:
            elastic.set_resume(self, None)

    setattr(wrapper, _PATCHED, True)
    return wrapper


def _loader_aware(get_train_dataloader):
    @functools.wraps(get_train_dataloader)
    def wrapper(self):
        if loaders.is_loader(self.train_dataset):
            loaders.keep_documents_apart(self.model, self.train_dataset)
            # Each rank reads its own share: no sampler, no re-batching, no dispatch by Accelerate.
            return loaders.dataloader_for(self.train_dataset)
        return get_train_dataloader(self)

    setattr(wrapper, _PATCHED, True)
    return wrapper


def _skip_unless_positioned(skip_first_batches):
    """The Trainer's batch skipping on resume, except for a loader that resumed at its position."""

    @functools.wraps(skip_first_batches)
    def wrapper(dataloader, num_batches=0):
        if getattr(dataloader, "sparkgpu_positioned", False):
            return dataloader
        return skip_first_batches(dataloader, num_batches)

    setattr(wrapper, _PATCHED, True)
    return wrapper


def _patch_skipping() -> None:
    import transformers.trainer as trainer_module

    if not getattr(trainer_module.skip_first_batches, _PATCHED, False):
        trainer_module.skip_first_batches = _skip_unless_positioned(trainer_module.skip_first_batches)


def _patch_counting(target: Any) -> None:
    """Resumed epochs and steps counted from a sparkgpu loader's position (:mod:`sparkgpu.hf.elastic`)
    for a Trainer class, or one Trainer; inert for a Trainer that is not resuming with a loader."""
    if not elastic.patch_training_values(target):
        logger.warning(
            "%s has no set_initial_training_values/_init_training_state: a resumed run counts its epochs and "
            "steps by the Trainer's own figures, right only at the world size the checkpoint was saved at",
            getattr(target, "__name__", type(target).__name__),
        )


def patch_trainer(trainer_class: Any = Trainer) -> None:
    """Makes every ``trainer_class`` (and subclass) inside a job seal its checkpoints and resume,
    and read a sparkgpu loader given as ``train_dataset`` rank by rank; its ``hyperparameter_search``
    is refused there (:mod:`sparkgpu.hf.search`)."""
    from sparkgpu.hf.search import patch_hyperparameter_search

    patch_hyperparameter_search(trainer_class)
    if not getattr(trainer_class.train, _PATCHED, False):
        trainer_class.train = _resuming_train(trainer_class.train)
    if not getattr(trainer_class.get_train_dataloader, _PATCHED, False):
        trainer_class.get_train_dataloader = _loader_aware(trainer_class.get_train_dataloader)
    _patch_counting(trainer_class)
    _patch_skipping()


def resumable(trainer):
    """Makes one Trainer seal its checkpoints into the job and resume from them; returns it.

    Needed only where the automatic patch is off (``SPARKGPU_HF_RESUME=0``), outside a job
    (there it only lets a sparkgpu loader be the ``train_dataset``), or where the Trainer
    class overrides ``train``.
    """
    if not getattr(type(trainer).train, _PATCHED, False):
        trainer.train = _resuming_train(type(trainer).train).__get__(trainer)
    if not getattr(type(trainer).get_train_dataloader, _PATCHED, False):
        trainer.get_train_dataloader = _loader_aware(type(trainer).get_train_dataloader).__get__(trainer)
    _patch_counting(trainer)
    _patch_skipping()
    _attach(trainer)
    return trainer
