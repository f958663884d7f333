"""Modules imported late: an optional one only when the process already imported it, and a
package's public names on first use."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

__all__ = ["imported", "lazy_attributes"]


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


def lazy_attributes(package: str, names: dict[str, tuple[str, str | None]]):
    """The module ``__getattr__`` (PEP 562) of a package whose public names are imported on first use.

    Args:
        package: The package's ``__name__``.
        names: Public name -> (the module defining it, the attribute there; ``None`` for the
            module itself).
    """

    def __getattr__(name: str):
        try:
            module_name, attribute = names[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        module = importlib.import_module(module_name)
        value = module if attribute is None else getattr(module, attribute)
        setattr(sys.modules[package], name, value)  # the next lookup finds it without this hook
        return value

    return __getattr__
