"""Libraries a node's agent imports before it forks the job's ranks, so that no rank imports them again.

A forked rank (:mod:`sparkgpu.launch.node.forked_ranks`) starts with what its agent imported:
torch, and sparkgpu's launch code. A fine-tuning job then imports transformers' ``Trainer`` in
every rank at every attempt: about 3.5 s of CPU each, more than the rest of a rank's start. So
the client notes which of a few well-known libraries the job's function imports or refers to
(:func:`modules_to_preload`, read from its code, not run), the run dir's spec carries the list
(``"preload"``, signed with it), and the agent imports them before it forks (:func:`preload`).

A job that wraps its model in DDP or FSDP2 imports ``torch._dynamo`` in every rank too (both
import it when they wrap a model: about 1 s of CPU a rank), so a function that imports or names
them has it preloaded (:data:`NEEDS_DYNAMO`). The job's own helpers are read wherever they live
in the caller's code (its other modules too) and in the job function's own module; the code of
other installed libraries is not read.

Only the libraries of :data:`PRELOADABLE` and the modules of :data:`PRELOADABLE_MODULES` are
ever imported by an agent: they read no rank variable at import and start no Python thread. The
agent checks that anyway: a process with a Python thread besides its main one, or CUDA
initialised, after the imports is no process to fork (:func:`preload_before_fork`), and its ranks
then start as new interpreters.
"""

from __future__ import annotations

import dis
import functools
import importlib
import logging
import os
import site
import sys
import sysconfig
import threading
import types
from collections.abc import Callable, Iterable

__all__ = [
    "NEEDS_DYNAMO",
    "PRELOADABLE",
    "PRELOADABLE_MODULES",
    "WARM_POOL_PRELOAD",
    "fork_hazard",
    "modules_to_preload",
    "preload",
    "preload_before_fork",
]

log = logging.getLogger(__name__)

#: Top-level packages an agent may import on a job's behalf.
PRELOADABLE = frozenset(
    {"transformers", "peft", "trl", "accelerate", "datasets", "lightning", "pytorch_lightning", "torchvision"}
)
_DYNAMO = "torch._dynamo"
#: Single modules an agent may import on a job's behalf (not their whole package).
PRELOADABLE_MODULES = frozenset({_DYNAMO})
#: Modules whose use imports ``torch._dynamo`` in the rank (DDP's and FSDP2's wrappers), and the
#: names by which a function may reach them through ``torch`` (``torch.nn.parallel.DistributedDataParallel``).
NEEDS_DYNAMO = ("torch.nn.parallel", "torch.distributed.fsdp", "torch.distributed._composable")
_DYNAMO_NAMES = frozenset({"DistributedDataParallel", "FullyShardedDataParallel", "fully_shard"})
#: What the warm pool imports for every job before it forks (it serves every job, so it reads no
#: one job's code): ``torch._dynamo``, which DDP and FSDP2 import when they wrap a model, about 1 s
#: of CPU in each rank at each call otherwise (11 s where no byte code is cached).
WARM_POOL_PRELOAD = [[_DYNAMO, []]]
_DEPTH = 3  # functions of the caller's own code followed from the job's function


def _preloadable(module: str) -> bool:
    return module.partition(".")[0] in PRELOADABLE or module in PRELOADABLE_MODULES


@functools.cache
def _library_roots() -> tuple[str, ...]:
    """Folders of installed code: the standard library and site-packages (the user's included)."""
    paths = sysconfig.get_paths()
    roots = [paths.get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")]
    roots.append(site.getusersitepackages())
    return tuple(os.path.join(os.path.realpath(root), "") for root in roots if root)


def _callers_code(module_name: str) -> bool:
    """Whether a module is the caller's own code (a notebook's, a project's), not an installed
    library or sparkgpu: its functions are read for what they import."""
    if module_name == "__main__":
        return True
    if module_name.partition(".")[0] == "sparkgpu":
        return False
    path = getattr(sys.modules.get(module_name), "__file__", None)
    return isinstance(path, str) and not os.path.realpath(path).startswith(_library_roots())


def _imports(code: types.CodeType) -> Iterable[tuple[str, tuple[str, ...]]]:
    """``(module, names)`` of each absolute import statement in ``code`` and the code nested in it."""
    instructions = list(dis.get_instructions(code))
    for i, instruction in enumerate(instructions):
        if instruction.opname != "IMPORT_NAME" or i < 2:
            continue
        level, fromlist = instructions[i - 2].argval, instructions[i - 1].argval
        if level == 0:
            yield instruction.argval, tuple(fromlist or ())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _imports(const)


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def modules_to_preload(fn: Callable) -> list[list]:
    """The :data:`PRELOADABLE` modules ``fn`` imports or refers to, as ``[module, [names]]``.

    Read from the code of ``fn``, of the functions of its own module and of the caller's other
    code it refers to (a few levels deep) and of the objects it refers to; nothing is run. A
    function that uses DDP or FSDP2 (:data:`NEEDS_DYNAMO`) gets ``torch._dynamo``. ``names`` are
    what a ``from module import ...`` takes: transformers imports its classes' modules when they
    are asked for.
    """
    found: dict[str, set[str]] = {}

    def note(module: str, names: Iterable[str] = ()) -> None:
        if module.startswith(NEEDS_DYNAMO):
            found.setdefault(_DYNAMO, set())
        elif _preloadable(module):
            found.setdefault(module, set()).update(n for n in names if n != "*")

    seen: set[int] = set()

    def visit(function, depth: int) -> None:
        code = getattr(function, "__code__", None)
        if code is None or id(code) in seen:
            return
        seen.add(id(code))
        for module, names in _imports(code):
            note(module, names)
        scope = dict(getattr(function, "__globals__", {}))
        for cell in getattr(function, "__closure__", None) or ():
            try:
                scope[f"<cell {id(cell)}>"] = cell.cell_contents
            except ValueError:  # an empty cell
                continue
        referenced = _names(code)
        if referenced & _DYNAMO_NAMES:  # DDP or FSDP reached through ``torch``'s attributes
            found.setdefault(_DYNAMO, set())
        wanted = referenced | {name for name in scope if name.startswith("<cell ")}
        for name in wanted:
            value = scope.get(name)
            if value is None:
                continue
            try:  # a proxy may raise on any attribute, __class__ included: then there is nothing to learn
                function_here = isinstance(value, types.FunctionType)
                owner = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
            except Exception:  # noqa: BLE001
                log.debug("%s refers to %s, whose module cannot be read", function, name, exc_info=True)
                continue
            if not isinstance(owner, str):
                continue
            note(owner)
            own_module = owner == getattr(function, "__module__", None)
            if function_here and depth < _DEPTH and (own_module or _callers_code(owner)):
                visit(value, depth + 1)

    visit(fn, 0)
    return [[module, sorted(names)] for module, names in sorted(found.items())]


def preload(entries: list) -> list[str]:
    """Imports the spec's ``preload`` entries of :data:`PRELOADABLE` (the agent, before it forks).

    A library that fails to import is left to the ranks, which report the error as their own.

    Returns:
        The modules imported.
    """
    done = []
    for module, names in entries:
        if not _preloadable(module):
            continue  # a spec is signed, but only these are known to be safe to import here
        try:
            imported = importlib.import_module(module)
            for name in names:
                getattr(imported, name, None)  # a lazy module imports the name's own module now
        except Exception as exc:  # noqa: BLE001  # the ranks meet it again and report it
            log.info("could not preload %s for the ranks (%s): they import it themselves", module, exc)
            continue
        done.append(module)
    return done


def fork_hazard() -> str | None:
    """Why this process should not fork its ranks now, or ``None``: a Python thread besides the
    main one (a lock it holds would stay held in the child), or CUDA initialised (no child could
    use it). Native thread pools that handle a fork themselves (OpenBLAS, which numpy and scipy
    start at import, jemalloc's) are no hazard."""
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        return f"Python threads run in the agent: {', '.join(sorted(others))}"
    cuda = sys.modules.get("torch.cuda")
    if cuda is not None and cuda.is_initialized():
        return "CUDA is initialised in the agent"
    return None


def preload_before_fork(entries: list) -> str | None:
    """:func:`preload`, then :func:`fork_hazard`: why this process should no longer fork its ranks
    (naming what it imported), or ``None``. The node's agent and a job's standby call it."""
    preloaded = preload(entries)
    hazard = fork_hazard()
    return None if hazard is None else f"after importing {preloaded}, {hazard}"
