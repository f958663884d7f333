"""Use an optional module only when the process already imported it."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

__all__ = ["imported"]


def imported(name: str) -> ModuleType | None:
    """The module ``name`` if this process has imported it, else ``None``; never starts an import.

    ``sys.modules.get(name)`` is not enough: while another thread is still importing the
    module (ranks import MLflow in the background), it returns the half-initialised module
    and its attributes are missing. Going through the import system instead waits on that
    module's import lock until the other thread is done.
    """
    if name not in sys.modules:
        return None
    return importlib.import_module(name)
