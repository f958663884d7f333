"""Inside a job, Lightning's ``Trainer.fit`` checkpoints into the job's store and resumes, with no line of the user's.

:class:`LightningCheckpoints` (a default job callback; ``SPARKGPU_LIGHTNING_CHECKPOINTS=0``
turns it off) patches ``Trainer.fit`` on each rank: at once when the function's module
imported Lightning, else as soon as Lightning is imported (an import hook watches for it), so
the client never imports Lightning. The patched ``fit`` adds :class:`~sparkgpu.train.lightning.JobCheckpoints`
unless the trainer has one, and fills a missing ``ckpt_path`` with the job's newest genuine
checkpoint (unless that callback says ``resume=False``).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
import threading

from sparkgpu.callbacks import JobCallback

__all__ = ["LightningCheckpoints", "install", "patch_trainer"]

_TRAINER_MODULE = "lightning.pytorch.trainer.trainer"
_lock = threading.Lock()
_patched: set[int] = set()


class LightningCheckpoints(JobCallback):
    """Makes Lightning's ``Trainer.fit`` save to and resume from the job's checkpoints, on each rank."""

    def on_worker_start(self, ctx) -> None:
        install()


def install() -> None:
    """Patches ``Trainer.fit`` now if Lightning is imported, else when it is."""
    module = sys.modules.get(_TRAINER_MODULE)
    if module is not None and hasattr(module, "Trainer"):
        patch_trainer(module.Trainer)
        return
    with _lock:
        if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches Lightning's Trainer right after its module is executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TRAINER_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            patch_trainer(module.Trainer)

        spec.loader.exec_module = exec_module  # this file's own loader: no other import sees it
        return spec


def patch_trainer(trainer_cls) -> None:
    """Wraps ``trainer_cls.fit`` (once) so that it checkpoints into and resumes from the job's store."""
    with _lock:
        if id(trainer_cls) in _patched:
            return
        _patched.add(id(trainer_cls))
        original = trainer_cls.fit
        signature = inspect.signature(original)

        @functools.wraps(original)
        def fit(self, *args, **kwargs):
            from sparkgpu.train.lightning import JobCheckpoints, latest_checkpoint_path

            ours = next((c for c in self.callbacks if isinstance(c, JobCheckpoints)), None)
            if ours is None:
                ours = JobCheckpoints()
                self.callbacks.append(ours)
            if not ours.resume:
                return original(self, *args, **kwargs)
            if "ckpt_path" not in signature.parameters:  # not the fit this was written for: left as it is
                return original(self, *args, **kwargs)
            bound = signature.bind(self, *args, **kwargs)
            if bound.arguments.get("ckpt_path") is None:
                bound.arguments["ckpt_path"] = latest_checkpoint_path(ours.dirpath)
            return original(*bound.args, **bound.kwargs)

        trainer_cls.fit = fit
