"""Patches ``transformers.Trainer``, ``TrainingArguments`` and TRL's ``SFTTrainer`` in a rank as soon as the user's code imports them.

The rank's entrypoint calls :func:`install` before it unpickles the user's function; nothing
of ``transformers`` is imported unless the user's code imports it. Then ``Trainer.train``
gains the job's sealed checkpoints and resume (:mod:`sparkgpu.hf.resume`),
``TrainingArguments`` uses the CPU on CPU ranks (:mod:`sparkgpu.hf.arguments`), and
``SFTTrainer`` takes a sparkgpu loader as its ``train_dataset`` as it is (:mod:`sparkgpu.hf.sft`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys

__all__ = ["install", "TRAINER_MODULE", "ARGUMENTS_MODULE", "SFT_TRAINER_MODULE"]

logger = logging.getLogger(__name__)

TRAINER_MODULE = "transformers.trainer"
ARGUMENTS_MODULE = "transformers.training_args"
SFT_TRAINER_MODULE = "trl.trainer.sft_trainer"


#: Module -> (the module holding its patch, the patch, the class it patches, what the user's
#: training goes without when the patch fails).
_PATCHES = {
    ARGUMENTS_MODULE: (
        "sparkgpu.hf.arguments",
        "patch_training_arguments",
        "TrainingArguments",
        "TrainingArguments are not told about CPU ranks",
    ),
    TRAINER_MODULE: (
        "sparkgpu.hf.resume",
        "patch_trainer",
        "Trainer",
        "transformers' Trainer runs without the job's checkpoints",
    ),
    SFT_TRAINER_MODULE: (
        "sparkgpu.hf.sft",
        "patch_sft_trainer",
        "SFTTrainer",
        "TRL's SFTTrainer takes sparkgpu loaders only through sparkgpu.hf.as_hf_dataset",
    ),
}
_MODULES = tuple(_PATCHES)


def _patch(module) -> None:
    where, patch, cls, without = _PATCHES[module.__name__]
    try:
        getattr(importlib.import_module(where), patch)(getattr(module, cls))
    except Exception as exc:  # the user's training must not fail because a patch did
        logger.warning("%s: %s", without, exc)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``transformers.trainer`` through the other finders and patches it once it has run."""

    def find_spec(self, name, path, target=None):
        if name not in _MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):  # get_source, is_package, ... as the real loader has them
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _patch(module)


def install() -> None:
    """Patches the modules loaded already, and the others when they are imported."""
    for name in _MODULES:
        loaded = sys.modules.get(name)
        if loaded is not None:
            _patch(loaded)
    if not all(name in sys.modules for name in _MODULES) and not any(
        isinstance(finder, _PatchOnImport) for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _PatchOnImport())
