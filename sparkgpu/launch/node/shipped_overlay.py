"""Forked ranks for a job that ships its environment.

A rank of such a job rehydrates the job's overlay and puts it first on its import path
(``_air.py`` does, before it imports anything of sparkgpu's). A rank forked from the node's agent
starts with the agent's modules imported already; it runs what a new interpreter would run only
if the overlay gives none of them other bytes. So the agent rehydrates the overlay first (its
ranks then find it in the node's cache) and compares: every module it has imported from a
top-level package or module that the overlay also holds must be in the overlay, byte for byte.
That is the case where the workers run the client's image (the editable sparkgpu the client
always ships is the workers' own); where it is not, the ranks start as new interpreters.

A forked rank then points those packages at the overlay's copies (:meth:`SharedModules.rebase`):
``__file__``, ``__path__`` and the loaders. What it imports afterwards resolves as in a new
interpreter, from the overlay first.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import logging
import os
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["SharedModules", "forkable_overlay", "shared_with_overlay"]

log = logging.getLogger(__name__)

_EXTENSION_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)


@dataclasses.dataclass(frozen=True)
class SharedModules:
    """The agent's imported top-level modules that the overlay holds too, with the same bytes.

    Attributes:
        roots: Top-level name -> (where the agent imported it from, the overlay's copy): a
            package's folder, or a module's file.
        hydration: What the agent's rehydration did (``HydrationReport.to_dict()``), the node's
            cost of the environment, which its first rank reports.
    """

    roots: Mapping[str, tuple[str, str]]
    hydration: dict | None = None

    def enter_rank(self) -> None:
        """In a forked rank, before ``_air.py``: :meth:`rebase`, and on the node's first rank hand
        ``_air.py`` the agent's rehydration report to record as its own (``_air.py``'s own
        rehydration finds everything in the cache)."""
        self.rebase()
        if self.hydration is not None and os.environ.get("LOCAL_RANK") == "0":
            sys.modules["__main__"].__dict__["_sparkgpu_node_hydration"] = self.hydration

    def rebase(self, modules: dict[str, types.ModuleType] | None = None) -> None:
        """In a forked rank: the shared modules become the overlay's copies, as a new interpreter
        would have imported them."""
        modules = sys.modules if modules is None else modules
        for name, module in list(modules.items()):
            root = self.roots.get(name.partition(".")[0])
            if root is None or module is None:
                continue
            agent, overlay = root
            file = getattr(module, "__file__", None)
            if file:
                module.__file__ = _moved(file, agent, overlay)
                module.__cached__ = None  # type: ignore[attr-defined]  # the rank writes its own byte code
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.origin:
                spec.origin = _moved(spec.origin, agent, overlay)
            if spec is not None and spec.submodule_search_locations is not None:
                spec.submodule_search_locations[:] = [
                    _moved(p, agent, overlay) for p in spec.submodule_search_locations
                ]
            path = getattr(module, "__path__", None)
            if isinstance(path, list):
                path[:] = [_moved(p, agent, overlay) for p in path]
            loader = getattr(module, "__loader__", None)
            if isinstance(getattr(loader, "path", None), str):
                loader.path = _moved(loader.path, agent, overlay)  # type: ignore[union-attr]


def _moved(path: str, agent: str, overlay: str) -> str:
    path = os.path.realpath(path)  # as compared (shared_with_overlay)
    if path == agent:
        return overlay
    return os.path.join(overlay, os.path.relpath(path, agent)) if path.startswith(agent + os.sep) else path


def _top_level(entry: os.DirEntry) -> str | None:
    """The top-level module name an entry of an import root provides, if any."""
    name = entry.name
    if entry.is_dir():
        return name if name.isidentifier() and name != "__pycache__" else None  # not *.dist-info either
    if name.endswith(".py"):
        return name[:-3] if name[:-3].isidentifier() else None
    for suffix in _EXTENSION_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def _provided(paths: list[str]) -> Iterator[tuple[str, str]]:
    """(top-level name, location) of what the overlay's import roots provide, the first root winning."""
    seen: set[str] = set()
    for root in paths:
        try:
            entries = sorted(os.scandir(root), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            name = _top_level(entry)
            if name and name not in seen:
                seen.add(name)
                yield name, entry.path


def _same_bytes(a: str, b: str) -> bool:
    try:
        if os.path.getsize(a) != os.path.getsize(b):
            return False
        return Path(a).read_bytes() == Path(b).read_bytes()
    except OSError:
        return False


def shared_with_overlay(
    paths: list[str], modules: Mapping[str, types.ModuleType] | None = None
) -> SharedModules | None:
    """What the overlay at ``paths`` shares with this process's imported modules, or ``None`` when
    it would give one of them other bytes (a forked rank would then run other code).

    Compared: each imported module under a top-level name the overlay provides, against the
    overlay's file at the same place. A namespace package, or a module with no file, counts as a
    difference."""
    modules = sys.modules if modules is None else modules
    loaded = [(name, module) for name, module in modules.items() if module is not None]
    roots: dict[str, tuple[str, str]] = {}
    for top, location in _provided(paths):
        top_module = modules.get(top)
        if top_module is None:
            continue  # the rank imports it from the overlay, as a new interpreter would
        package_path = getattr(top_module, "__path__", None)
        if package_path is not None:
            folders = list(package_path)
            if len(folders) != 1 or not os.path.isdir(location):
                log.info("%s is a namespace package or not a package in the overlay: ranks start anew", top)
                return None
            agent = os.path.realpath(folders[0])
        else:
            file = getattr(top_module, "__file__", None)
            if not file or os.path.isdir(location):
                log.info("the overlay shadows %s, which has no file here: ranks start anew", top)
                return None
            agent = os.path.realpath(file)
        for name, module in loaded:
            if name != top and not name.startswith(top + "."):
                continue
            file = getattr(module, "__file__", None)
            real = os.path.realpath(file) if file else None
            if real is None or not (real == agent or real.startswith(agent + os.sep)):
                log.info("%s was not imported from %s: ranks start anew", name, agent)
                return None
            theirs = location if real == agent else os.path.join(location, os.path.relpath(real, agent))
            if not _same_bytes(real, theirs):
                log.info("the overlay's %s differs from the agent's: ranks start anew", name)
                return None
        roots[top] = (agent, location)
    return SharedModules(roots)


def forkable_overlay(hydrate_text: bytes, filename: str, manifest: dict) -> SharedModules | None:
    """Rehydrates the job's overlay with the job's own (checked) hydration module into the node's
    cache, as its ranks would, and compares it with what the agent imported
    (:func:`shared_with_overlay`).

    ``None`` when the ranks must start as new interpreters: the overlay differs, or it could not
    be rehydrated (the ranks then meet that error and report it as their own).
    """
    hydration = types.ModuleType("_sparkgpu_hydrate")  # the name _air.py gives it
    hydration.__file__ = filename
    sys.modules[hydration.__name__] = hydration  # its dataclasses look their module up
    try:
        exec(compile(hydrate_text, filename, "exec"), hydration.__dict__)
        overlay = hydration.hydrate(manifest, hydration.default_cache_dir())
    except Exception as exc:  # noqa: BLE001  # the ranks report it: each rehydrates for itself
        log.info("the agent could not rehydrate the job's environment (%s): ranks start anew", exc)
        return None
    finally:
        del sys.modules[hydration.__name__]
    shared = shared_with_overlay(list(overlay.paths))
    return dataclasses.replace(shared, hydration=overlay.report.to_dict()) if shared is not None else None
