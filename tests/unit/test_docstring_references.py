"""Every cross-reference in the package's docstrings and comments names something that exists.

The documentation site renders these (mkdocstrings), but only for the modules it shows; this
test reads them all, so that a rename cannot leave a reference behind.
"""

from __future__ import annotations

import builtins
import importlib
import pkgutil
import re
from pathlib import Path

import sparkgpu

#: ``:class:`Name```, ``:meth:`~pkg.Class.method```, ``:func:`f()```, ...
_ROLE = re.compile(r":(?:class|func|meth|data|mod|attr|exc|obj):`~?([^`<>]+?)`")


def _modules() -> list[str]:
    """Every module of the package but ``__main__`` ones: those are scripts, which importing runs."""
    found = (info.name for info in pkgutil.walk_packages(sparkgpu.__path__, "sparkgpu."))
    return sorted(name for name in found if not name.endswith(".__main__"))


def _lookup(start: object, parts: list[str]) -> bool:
    obj = start
    for part in parts:
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _absolute(parts: list[str]) -> bool:
    for split in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        if _lookup(module, parts[split:]):
            return True
    return False


def _resolves(ref: str, module, source: str) -> bool:
    """Whether ``ref`` names something from ``module``: absolute, relative to its package
    (``.sibling``), or in its namespace, a class of it, a field or an attribute set on ``self``."""
    ref = ref.strip().removesuffix("()")
    if ref.startswith("."):
        package = module.__name__ if hasattr(module, "__path__") else module.__name__.rpartition(".")[0]
        return _absolute(f"{package}{ref}".split("."))
    parts = ref.split(".")
    if _absolute(parts) or hasattr(builtins, parts[0]):
        return True
    classes = [value for value in vars(module).values() if isinstance(value, type)]
    if any(_lookup(scope, parts) for scope in [module, *classes]):
        return True
    # An instance attribute or a dataclass field: ``Class.attr`` or ``attr`` set as ``self.attr``.
    owner_ok = len(parts) == 1 or any(c.__name__ == parts[-2] for c in classes)
    return owner_ok and (
        re.search(rf"\bself\.{re.escape(parts[-1])}\s*[:=]", source) is not None
        or any(parts[-1] in getattr(c, "__dataclass_fields__", {}) for c in classes)
    )


def test_every_docstring_reference_names_something_that_exists():
    unresolved = []
    for name in _modules():
        module = importlib.import_module(name)
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py"):
            continue
        source = Path(path).read_text()
        for ref in sorted(set(_ROLE.findall(source))):
            if not _resolves(ref, module, source):
                unresolved.append(f"{name}: {ref}")
    assert unresolved == [], "stale references:\n" + "\n".join(unresolved)


def test_a_stale_reference_is_caught():
    from sparkgpu.launch.client import supervisor

    source = Path(supervisor.__file__).read_text()
    assert _resolves("Supervisor", supervisor, source)
    assert _resolves("sparkgpu.spec.RunPolicy", supervisor, source)
    assert not _resolves("sparkgpu.spec.JobPolicy", supervisor, source)
    assert not _resolves("Supervisor.no_such_method", supervisor, source)
