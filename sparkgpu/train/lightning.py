"""Lightning in a job: signed checkpoints in the job's store, saved when the job must stop, resumed by itself.

Inside a job nothing is needed: ``Trainer.fit`` (patched on each rank, see
:mod:`.lightning_patch`) gets a :class:`JobCheckpoints` callback and, when no ``ckpt_path``
is given, resumes from the job's newest genuine checkpoint. Outside a job, or to set its
options, add the callback yourself::

    trainer = L.Trainer(strategy="ddp", callbacks=[JobCheckpoints(every_n_train_steps=500)])
    trainer.fit(model, datamodule=dm)  # in a job: resumes by itself

What it does on every rank: after each training batch, if :func:`sparkgpu.runtime.should_checkpoint`
is true on any rank (the ranks agree through one all-reduce), it saves with
``trainer.save_checkpoint`` into ``<runtime.checkpoint_dir()>/lightning/step-<n>.ckpt`` and calls
:func:`sparkgpu.runtime.stop_for_restart`; the next attempt resumes there. The strategy's
checkpoint IO becomes :class:`SignedCheckpointIO`: each ``.ckpt`` gets a marker with its SHA-256,
MAC'd with the job's checkpoint key, and a checkpoint in the job's store loads only once its
bytes match a marker the job signed (see :mod:`._lightning_signing`).

For exact resumption mid-epoch, the training data must carry its position (``state_dict()`` /
``load_state_dict()``, as sparkgpu's loaders and ``StatefulDataLoader`` do): Lightning saves it
in the checkpoint; a plain ``DataLoader`` starts its epoch over.
"""

from __future__ import annotations

import io
import logging
import os
import re
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from sparkgpu import runtime
from sparkgpu.rundir import progress as _progress
from sparkgpu.errors import CheckpointError
from sparkgpu.store import Store
from sparkgpu.train import _lightning_signing as signing

__all__ = ["JobCheckpoints", "SignedCheckpointIO", "latest_checkpoint_path"]

_logger = logging.getLogger(__name__)

FOLDER = "lightning"
_NAME = re.compile(r"step-(\d{10})\.ckpt")


def checkpoint_folder(dirpath: str | None = None) -> str | None:
    """Where :class:`JobCheckpoints` saves: ``dirpath``, else ``<job checkpoint dir>/lightning`` in a job."""
    if dirpath is not None:
        return str(dirpath)
    root = runtime.checkpoint_dir()
    return f"{root.rstrip('/')}/{FOLDER}" if root else None


def _committed_steps(folder: str) -> list[tuple[int, str]]:
    store = Store(folder, what="the checkpoint folder")
    if not store.exists():
        return []
    found = []
    for name in store.listdir():
        match = _NAME.fullmatch(name)
        if match and signing.is_committed(f"{folder}/{name}"):
            found.append((int(match.group(1)), f"{folder}/{name}"))
    return sorted(found, reverse=True)


def latest_checkpoint_path(dirpath: str | None = None) -> str | None:
    """The newest checkpoint in the folder that checks out against its marker (``None``: none).

    A checkpoint that fails its check (changed, or not signed by the job) is skipped with a
    warning, as ``Checkpointer.restore`` does: the job resumes from the newest genuine one.
    """
    folder = checkpoint_folder(dirpath)
    if folder is None:
        return None
    for _, path in _committed_steps(folder):
        try:
            signing.read_verified(path)
        except CheckpointError as exc:
            _logger.warning("sparkgpu: skipping a checkpoint: %s", exc)
            continue
        return path
    return None


class SignedCheckpointIO(TorchCheckpointIO):
    """Lightning's ``torch.save`` checkpoints with a signed marker; loads check it before unpickling.

    A file outside the job's checkpoint store without a marker (a checkpoint of your own passed
    as ``ckpt_path``) loads as Lightning loads it.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        import torch

        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        signing.write_signed(str(path), buffer.getvalue(), {"global_step": checkpoint.get("global_step")})

    def load_checkpoint(self, path, map_location=None, weights_only: bool | None = None) -> dict[str, Any]:
        path = str(path)
        if signing.in_job_store(path) or signing.is_committed(path):
            return signing.load_verified(path, map_location=map_location)
        kwargs = {} if map_location is None else {"map_location": map_location}
        return super().load_checkpoint(path, weights_only=weights_only, **kwargs)

    def remove_checkpoint(self, path) -> None:
        store, name = signing.split(str(path))
        store.remove(name + signing.MARKER_SUFFIX)  # first: a half-removed checkpoint is never taken for whole
        store.remove(name)


class JobCheckpoints(pl.Callback):
    """Saves a signed checkpoint and stops for a restart when the job asks (:func:`runtime.should_checkpoint`).

    Args:
        dirpath: Folder of the checkpoints; by default ``<runtime.checkpoint_dir()>/lightning``
            in a job, ``<trainer.default_root_dir>/sparkgpu-checkpoints`` outside.
        every_n_train_steps: Also save every this many optimizer steps (a rank killed without
            warning then resumes from the last of them); ``None``: only when the job asks.
        keep_last: How many checkpoints to keep.
        resume: In a job, let ``Trainer.fit`` without ``ckpt_path`` resume from the newest
            genuine checkpoint of ``dirpath``.
        handle_sigterm: Turn SIGTERM into a checkpoint request in a job
            (``runtime.handle_sigterm_as_checkpoint_request``), as ``Checkpointer`` does.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        *,
        every_n_train_steps: int | None = None,
        keep_last: int = 2,
        resume: bool = True,
        handle_sigterm: bool = True,
    ):
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be >= 1 or None, got {every_n_train_steps}")
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.dirpath = checkpoint_folder(dirpath)
        self.every_n_train_steps = every_n_train_steps
        self.keep_last = keep_last
        self.resume = resume
        self.handle_sigterm = handle_sigterm
        self.active = False  # set in setup(): whether this trainer's strategy is one it handles
        self.last_saved: str | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        supported = isinstance(strategy, (pl.strategies.DDPStrategy, pl.strategies.SingleDeviceStrategy)) and not any(
            cls.__name__ == "DeepSpeedStrategy" for cls in type(strategy).__mro__
        )
        plain_io = type(strategy.checkpoint_io) in (TorchCheckpointIO, SignedCheckpointIO)
        if not (supported and plain_io):
            # Sharded (FSDP, DeepSpeed) and custom checkpoint IO write other files than one .ckpt:
            # they are left as they are rather than half-signed; the job does not resume them.
            _logger.warning(
                "sparkgpu: JobCheckpoints handles the single-file checkpoints of DDP and single-device "
                "strategies with Lightning's own checkpoint IO; this trainer has %s with %s, so it saves "
                "nothing for the job and does not stop it. Save and resume with sparkgpu.train.Checkpointer "
                "instead, or set SPARKGPU_LIGHTNING_CHECKPOINTS=0 to silence this",
                type(strategy).__name__,
                type(strategy.checkpoint_io).__name__,
            )
            self.active = False
            return
        self.active = True
        # Before Lightning restores ckpt_path: that load goes through the verifying IO too.
        if not isinstance(strategy.checkpoint_io, SignedCheckpointIO):
            strategy.checkpoint_io = SignedCheckpointIO()
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.default_root_dir, "sparkgpu-checkpoints")
        if self.handle_sigterm and runtime.checkpoint_dir():
            runtime.handle_sigterm_as_checkpoint_request()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        _progress.note(trainer.global_step)  # what hang detection watches (sparkgpu.rundir.progress)
        if not self.active:
            return
        # Between two batches of one gradient accumulation the accumulated gradients are in no
        # checkpoint: the ranks decide (and save) only once the optimizer stepped.
        accumulating = getattr(trainer.fit_loop.epoch_loop, "_should_accumulate", None)
        if accumulating is not None and accumulating():
            return
        stop = bool(trainer.strategy.reduce_boolean_decision(runtime.should_checkpoint(), all=False))
        step = trainer.global_step
        every = self.every_n_train_steps
        if stop or (every is not None and step % every == 0):
            self.save(trainer)
        if stop:
            _logger.info("sparkgpu: checkpointed step %d for the job's stop; it resumes in a new attempt", step)
            runtime.stop_for_restart()

    def save(self, trainer: pl.Trainer) -> str:
        """Saves the trainer's state now (on every rank: it is collective); returns the checkpoint's path."""
        path = f"{self.dirpath}/step-{trainer.global_step:010d}.ckpt"
        if path != self.last_saved:
            trainer.save_checkpoint(path)
            self.last_saved = path
            if trainer.is_global_zero:
                io_plugin = trainer.strategy.checkpoint_io
                for _, old in _committed_steps(str(self.dirpath))[self.keep_last :]:
                    io_plugin.remove_checkpoint(old)
        return path

    def state_dict(self) -> dict[str, Any]:
        return {"last_saved": self.last_saved}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_saved = state_dict.get("last_saved")
