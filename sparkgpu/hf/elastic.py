"""A Trainer that reads a sparkgpu loader resumes where the loader is, at whatever world size.

The Trainer places a resumed run by its step alone: ``global_step // steps_per_epoch`` epochs
are done, the rest of the step count is batches done in the current one, and training ends
at ``num_train_epochs * steps_per_epoch`` steps. That holds only while every attempt has the
same world size. When an elastic job's next attempt has more or fewer ranks, a step covers
more or fewer samples than the steps saved, and those figures would skip or repeat data.

A sparkgpu loader knows better: its position counts the samples of the epoch that all ranks
together consumed, and each rank reads its share of the rest at the new world size. So, for a
Trainer resuming with such a loader (:mod:`sparkgpu.hf.resume` loads its position first):

* the epochs done are the loader's epoch, and the batches done in it are those of a whole
  epoch at the new size less the batches each rank has left: the Trainer's epoch figure and
  its loop over the epoch follow the data;
* with ``num_train_epochs`` (no ``max_steps``), ``max_steps`` becomes the step this
  attempt ends at: the steps done plus the steps left at the new size. The learning-rate
  schedule is made for that total, with its saved step restored: it still ends at the last
  step, and the rate may jump where the size changed (the steps left changed);
* with ``max_steps``, it stays a count of optimizer steps; each step after a shrink covers
  fewer samples, so the job ends having trained on fewer of them.

With the same world size the figures are the Trainer's own. Two methods of
``transformers.Trainer`` are wrapped for this (``set_initial_training_values`` and
``_init_training_state``, transformers 5); where they are missing the Trainer's own figures
stand, right only at the world size a checkpoint was saved at (the rank warns when patching).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any

from sparkgpu._util.report import report
from sparkgpu.hf import datasets as loaders

__all__ = ["WORLD_FILE", "Resume", "patch_training_values", "save_world", "resume_point"]

WORLD_FILE = "sparkgpu_world.json"  # in each checkpoint-N folder, written by rank 0
_PATCHED = "_sparkgpu_elastic"
_RESUME = "_sparkgpu_resume"


def save_world(folder: str, world_size: int) -> None:
    """Writes the world size a checkpoint was saved at into its folder."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, WORLD_FILE), "w") as f:
        json.dump({"world_size": world_size}, f)


def _saved_world(folder: str) -> int | None:
    try:
        with open(os.path.join(folder, WORLD_FILE)) as f:
            return int(json.load(f)["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _saved_step(folder: str) -> int | None:
    try:
        with open(os.path.join(folder, "trainer_state.json")) as f:
            return int(json.load(f)["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclasses.dataclass
class Resume:
    """Where a resumed Trainer stands, from its checkpoint's step and its loader's position.

    Attributes:
        global_step: The checkpoint's step.
        epoch: The epoch the loader reads next.
        batches_left: Batches this rank reads of it, at this attempt's world size.
        steps_in_epoch: Batches of a whole epoch at this size (the Trainer's figure, once known).
    """

    global_step: int
    epoch: int
    batches_left: int
    steps_in_epoch: int | None = None

    def training_values(self, values: tuple, args: Any) -> tuple:
        """The Trainer's ``set_initial_training_values`` with ``num_train_epochs`` and
        ``max_steps`` counted from here."""
        num_train_epochs, per_epoch, *rest, steps_in_epoch, max_steps = values
        self.steps_in_epoch = steps_in_epoch
        accumulation = max(1, args.gradient_accumulation_steps)
        steps_left_in_epoch = math.ceil(self.batches_left / accumulation)
        if args.max_steps > 0:
            after_this_epoch = max(0, max_steps - self.global_step - steps_left_in_epoch)
            num_train_epochs = self.epoch + 1 + math.ceil(after_this_epoch / per_epoch)
        else:
            # Steps to the end of num_train_epochs (fractional ones too), less those of this epoch done.
            to_the_end = math.ceil((args.num_train_epochs - self.epoch) * per_epoch) - (per_epoch - steps_left_in_epoch)
            max_steps = self.global_step + max(0, to_the_end)
        return (num_train_epochs, per_epoch, *rest, steps_in_epoch, max_steps)

    def training_state(self, args: Any) -> tuple[int, int]:
        """``(epochs_trained, steps_trained_in_current_epoch)`` as the Trainer's ``_init_training_state`` returns them."""
        if args.ignore_data_skip or self.steps_in_epoch is None:
            return self.epoch, 0
        return self.epoch, max(0, self.steps_in_epoch - self.batches_left)


def resume_point(trainer: Any, checkpoint: str, positioned: bool) -> Resume | None:
    """Where ``trainer`` resumes from ``checkpoint``; ``None`` where the Trainer's own figures
    stand (no sparkgpu loader, or one whose position the checkpoint did not hold). Reports a
    change of world size.

    Args:
        positioned: Whether the loader's position was loaded from the checkpoint.
    """
    world = trainer.args.world_size
    saved = _saved_world(checkpoint)
    loader = trainer.train_dataset
    if not positioned:
        if saved is not None and saved != world and trainer.is_world_process_zero():
            report(
                f"the checkpoint was saved at world size {saved} and this attempt's is {world}: the Trainer's "
                "sampler splits its train_dataset anew, so samples of the current epoch may be skipped or "
                "repeated; a sparkgpu loader as train_dataset trains each sample once across a change of world size"
            )
        return None
    step = _saved_step(checkpoint)
    position = loaders.position(loader)
    if step is None or position is None:
        return None
    epoch, left = position
    resume = Resume(step, epoch, left)
    if saved is not None and saved != world and trainer.is_world_process_zero():
        report(
            f"the checkpoint of step {step} was saved at world size {saved} and this attempt's is {world}: the rest "
            f"of epoch {epoch} is split over its {world} rank(s), {left} batch(es) each, and the step count goes on"
        )
    return resume


def _with_resume(method, adjust):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        values = method(self, *args, **kwargs)
        resume = getattr(self, _RESUME, None)
        return values if resume is None else adjust(resume, values, self.args)

    setattr(wrapper, _PATCHED, True)
    return wrapper


_ADJUSTMENTS = {
    "set_initial_training_values": lambda resume, values, args: resume.training_values(values, args),
    "_init_training_state": lambda resume, values, args: resume.training_state(args),
}


def patch_training_values(target: Any) -> bool:
    """Makes a Trainer class (and its subclasses), or one Trainer, count a resumed run's epochs and
    steps from its :class:`Resume`; False where the Trainer has no such methods (its own figures stand)."""
    cls = target if isinstance(target, type) else type(target)
    if not all(callable(getattr(cls, name, None)) for name in _ADJUSTMENTS):
        return False
    for name, adjust in _ADJUSTMENTS.items():
        method = getattr(cls, name)
        if getattr(method, _PATCHED, False):
            continue
        if target is cls:
            setattr(cls, name, _with_resume(method, adjust))
        else:
            setattr(target, name, _with_resume(method, adjust).__get__(target))
    return True


def set_resume(trainer: Any, resume: Resume | None) -> None:
    """Sets (or clears, with ``None``) what the patched methods count from, for one ``train()``."""
    setattr(trainer, _RESUME, resume)
