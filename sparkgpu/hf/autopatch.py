"""Patches ``transformers.Trainer`` in a rank as soon as the user's code imports it.

The rank's entrypoint calls :func:`install` before it unpickles the user's function; nothing
of ``transformers`` is imported unless the user's code imports it (then ``Trainer.train``
gains the job's sealed checkpoints and resume, :mod:`sparkgpu.hf.resume`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys

__all__ = ["install", "TRAINER_MODULE"]

logger = logging.getLogger("sparkgpu.hf")

TRAINER_MODULE = "transformers.trainer"


def _patch(module) -> None:
    try:
        from sparkgpu.hf.resume import patch_trainer

        patch_trainer(module.Trainer)
    except Exception as exc:  # the user's training must not fail because the patch did
        logger.warning("transformers' Trainer runs without the job's checkpoints: %s", exc)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``transformers.trainer`` through the other finders and patches it once it has run."""

    def find_spec(self, name, path, target=None):
        if name != TRAINER_MODULE:
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
    """Patches ``Trainer`` now if ``transformers.trainer`` is loaded, else when it is imported."""
    loaded = sys.modules.get(TRAINER_MODULE)
    if loaded is not None:
        _patch(loaded)
        return
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
