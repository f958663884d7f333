"""The package's import rules, checked on the source (every import, function-level ones included).

- the run dir's format (``sparkgpu.rundir``: its layout, states, exit codes, keys, signatures,
  pickling, control files, progress records), which the launcher writes and reads on both sides
  and the libraries of a rank read too, sits below all of them: it imports no other sub-package
  but the shared errors, settings and private helpers (``sparkgpu.errors``, ``sparkgpu.config``,
  ``sparkgpu._util``);
- data, train, tracking, usage, env and the runtime import nothing from the launcher
  (``sparkgpu.launch``): they read the run dir through ``sparkgpu.rundir``;
- the launcher reaches tracking and usage only through the callback interface
  (``sparkgpu.callbacks``), which imports none of them: only the run dir's states
  (``sparkgpu.rundir.states``, standard library only), which all of them share;
- what runs on a worker before sparkgpu may be importable (the error module, the hydration
  module, the payload's signature check) imports the standard library only;
- no two modules import each other, directly or around a circle (a function-level import
  does not hide a circle: it only delays it);
- the launcher's code says where it runs by its sub-package, and a side imports only what runs
  there too: rank, node and Spark executor code never imports client code (the caller's
  process: ``launch.client``, ``launch.scheduling``, the backends' client side, the decorator);
  a rank imports none of the node or executor code that starts it; the node agent imports no
  backend; the run dir's staging mirror (``launch.staging``), shared by both sides, and scheduling import
  no other part of the launcher's sides; every launcher module is on one side;
- a module imports no private module (a ``_name`` path component), and no private name
  (``from sparkgpu.launch.rank.entrypoint import _helper``), of another top-level sub-package; the
  modules of the private package ``sparkgpu._util`` (``sparkgpu._util.files``, ...) are the package's
  shared helpers, and every module may use their public names.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import sparkgpu

PACKAGE = Path(sparkgpu.__file__).resolve().parent

# Lower layers that must not import the launcher.
BELOW_LAUNCH = (
    "sparkgpu.data",
    "sparkgpu.train",
    "sparkgpu.hf",
    "sparkgpu.tracking",
    "sparkgpu.usage",
    "sparkgpu.env",
    "sparkgpu.runtime",
)
# The run dir's format, below the launcher and every library: what it may import of the package
# (``sparkgpu`` itself, imported first anyway, aside).
RUN_DIR_FORMAT = ("sparkgpu.rundir",)
FORMAT_MAY_IMPORT = RUN_DIR_FORMAT + ("sparkgpu.errors", "sparkgpu.config", "sparkgpu._util")
INTEGRATIONS = ("sparkgpu.tracking", "sparkgpu.usage")
CALLBACK_INTERFACE = ("sparkgpu.callbacks",)
# The run dir's states, below every sub-package: the callback interface hands them on.
STATES = "sparkgpu.rundir.states"
STDLIB_ONLY = (STATES, "sparkgpu.errors", "sparkgpu.env.hydrate", "sparkgpu.rundir.signature")
# Guarded imports a stdlib-only module may make: hydration reads a store of another scheme
# through fsspec, and names it in its error where fsspec is missing.
OPTIONAL = {"sparkgpu.env.hydrate": {"fsspec"}}

# Where the launcher's code runs: each of its modules is on one of these sides.
CLIENT_SIDE = (
    "sparkgpu.launch.client",  # the caller's process: supervisor, attempts read back, resume, CLI
    "sparkgpu.launch.scheduling",  # who gets GPUs when, decided on the client
    "sparkgpu.launch.backends",  # where a job runs (but for the worker-side modules below)
    "sparkgpu.api",  # the entry points a user calls: decorator, prepare, call, spark_gpu
    "sparkgpu.cli",  # the command line, every sub-command's module included
    "sparkgpu.spec.pools",
)
RANK = ("sparkgpu.launch.rank",)
NODE = ("sparkgpu.launch.node", "sparkgpu.launch.backends.local.zygote")  # the agent, the warm zygote
EXECUTOR = ("sparkgpu.launch.backends.spark.executor",)  # inside Spark tasks
WORKER_SIDE = RANK + NODE + EXECUTOR
STAGING = ("sparkgpu.launch.staging",)  # the run dir's mirror on a store: kept by the client and the Spark nodes
SCHEDULING = ("sparkgpu.launch.scheduling",)
SIDES = ("sparkgpu.launch.client", "sparkgpu.launch.backends") + SCHEDULING + WORKER_SIDE + STAGING
# (rule, the modules it binds, what they may not import); a module of the bound side itself
# is always allowed (the executor's modules sit inside the backends, the zygote in the local one).
WHERE_RULES = (
    ("rank, node and executor code imports no client code", WORKER_SIDE, CLIENT_SIDE),
    ("a rank imports none of the node or executor code that starts it", RANK, NODE + EXECUTOR),
    ("the node agent imports no backend", ("sparkgpu.launch.node",), ("sparkgpu.launch.backends",)),
    (
        "the staging mirror imports no other part of the launcher",
        STAGING,
        tuple(s for s in SIDES if s not in STAGING),
    ),
    (
        "scheduling imports no client, backend, node or rank code",
        SCHEDULING,
        ("sparkgpu.launch.client", "sparkgpu.launch.backends") + WORKER_SIDE,
    ),
)

# Known violations, as (importing module, imported module). Each entry is removed when its
# import goes; the test fails on a stale entry as on a new violation.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()

# Known import circles, each as the set of its modules (a strongly connected component).
KNOWN_CYCLES: set[frozenset[str]] = set()

# Known imports of another sub-package's private module, as (importing module, imported module).
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it: ``from x import y`` counts as ``x`` and ``x.y``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names if alias.name != "*")
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))
            )
        ):
            found.add(node.args[0].value)
    return found


def modules() -> dict[str, set[str]]:
    return {module_name(path): imports_of(path) for path in sorted(PACKAGE.rglob("*.py"))}


def within(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def is_module(name: str, graph: dict[str, set[str]]) -> bool:
    # "from sparkgpu.rundir.directory import RunDir" adds "sparkgpu.rundir.directory.RunDir": keep modules only.
    return name in graph


def violations(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    found = set()
    for name, imported in graph.items():
        for target in filter(lambda t: is_module(t, graph), imported):
            if within(name, BELOW_LAUNCH) and within(target, ("sparkgpu.launch",)):
                found.add((name, target))
            if within(name, ("sparkgpu.launch",)) and within(target, INTEGRATIONS):
                found.add((name, target))
            if (
                name in CALLBACK_INTERFACE
                and within(target, ("sparkgpu",))
                and target not in (*CALLBACK_INTERFACE, STATES)
            ):
                found.add((name, target))
            if within(name, RUN_DIR_FORMAT) and target != "sparkgpu" and not within(target, FORMAT_MAY_IMPORT):
                found.add((name, target))
    return found


def where_violations(graph: dict[str, set[str]]) -> set[tuple[str, str, str]]:
    """Imports that cross from one side of the launcher to another it may not reach, as (rule, importer, imported)."""
    found = set()
    for rule, bound, forbidden in WHERE_RULES:
        for name, imported in graph.items():
            if not within(name, bound):
                continue
            for target in filter(lambda t: is_module(t, graph), imported):
                if within(target, forbidden) and not within(target, bound):
                    found.add((rule, name, target))
    return found


def module_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Which modules each module's imports run: ``from x import y`` counts as ``x.y`` when that is a
    module, and as ``x`` too (its ``__init__`` runs first); a module's own packages are left out,
    being imported before it anyway."""
    return {
        name: {t for t in imported if is_module(t, graph) and t != name and not name.startswith(t + ".")}
        for name, imported in graph.items()
    }


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one module (Tarjan)."""
    edges = module_edges(graph)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in sorted(edges[name]):
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            component = {stack.pop()}
            while name not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.add(frozenset(component))

    for name in sorted(edges):
        if name not in index:
            visit(name)
    return found


def top_level(name: str) -> str:
    return ".".join(name.split(".")[:2])


def private_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports of a private module, or of a private name (``from m import _f``), of another sub-package."""
    found = set()
    for name, imported in graph.items():
        for target in imported:
            if not target.startswith("sparkgpu.") or top_level(name) == top_level(target):
                continue
            module, _, attribute = target.rpartition(".")
            if is_module(target, graph):
                module, attribute = target, ""
            elif not is_module(module, graph) or module == "sparkgpu" or attribute.startswith("__"):
                continue  # outside the package; directly under sparkgpu (shared); __version__, __all__
            # sparkgpu._util.files and its like (a private package directly under sparkgpu) are shared; deeper _modules are not
            parts = module.split(".")
            if any(part.startswith("_") for part in parts[2:]) or attribute.startswith("_"):
                found.add((name, target))
    return found


def test_the_layers_import_only_downwards():
    found = violations(modules())
    new, stale = found - KNOWN_VIOLATIONS, KNOWN_VIOLATIONS - found
    assert not new, "imports that break the layering (see this test's docstring):\n" + "\n".join(
        f"  {a} imports {b}" for a, b in sorted(new)
    )
    assert not stale, "these known violations are gone: remove them from KNOWN_VIOLATIONS:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in sorted(stale)
    )


def test_each_side_of_the_launcher_imports_only_what_runs_there_too():
    found = where_violations(modules())
    assert not found, "imports across the launcher's sides (see this test's docstring):\n" + "\n".join(
        f"  {a} imports {b}: {rule}" for rule, a, b in sorted(found)
    )


def test_every_module_of_the_launcher_says_where_it_runs():
    packages = ("sparkgpu.launch", "sparkgpu.launch.backends")  # the hop map; the backends' registry
    unplaced = [
        name
        for name in modules()
        if within(name, ("sparkgpu.launch",)) and name not in packages and not within(name, SIDES)
    ]
    assert unplaced == [], f"put these in the sub-package named for where they run: {unplaced}"


def test_the_side_checker_sees_what_it_claims():
    graph = {
        "sparkgpu.launch.node.agent": {"sparkgpu.launch.client.supervisor", "sparkgpu.launch.rank.entrypoint"},
        "sparkgpu.launch.rank.entrypoint": {"sparkgpu.launch.node.agent", "sparkgpu.launch.staging.mirror"},
        "sparkgpu.launch.backends.spark.executor.node": {
            "sparkgpu.launch.backends.spark.executor.hub",  # its own side, inside the backends
            "sparkgpu.launch.backends.spark.backend",
            "sparkgpu.launch.node.agent",
        },
        "sparkgpu.launch.backends.spark.executor.hub": set(),
        "sparkgpu.launch.backends.spark.backend": {"sparkgpu.launch.backends.spark.executor.node"},
        "sparkgpu.launch.staging.mirror": {"sparkgpu.launch.rank.entrypoint"},
        "sparkgpu.launch.client.supervisor": {"sparkgpu.launch.node.agent"},
    }
    assert {(a, b) for _, a, b in where_violations(graph)} == {
        ("sparkgpu.launch.node.agent", "sparkgpu.launch.client.supervisor"),
        ("sparkgpu.launch.rank.entrypoint", "sparkgpu.launch.node.agent"),
        ("sparkgpu.launch.backends.spark.executor.node", "sparkgpu.launch.backends.spark.backend"),
        ("sparkgpu.launch.staging.mirror", "sparkgpu.launch.rank.entrypoint"),
    }


def test_the_implementations_of_callbacks_import_the_interface_not_the_launcher():
    graph = modules()
    assert "sparkgpu.callbacks" in graph["sparkgpu.tracking.mlflow_run"]
    assert "sparkgpu.callbacks" in graph["sparkgpu.usage.meter"]
    assert not any(within(m, ("sparkgpu",)) and not within(m, (STATES,)) for m in graph["sparkgpu.callbacks"])


@pytest.mark.parametrize("name", STDLIB_ONLY)
def test_what_runs_before_sparkgpu_is_importable_uses_the_standard_library_only(name):
    path = PACKAGE.parent.joinpath(*name.split(".")).with_suffix(".py")
    outside = {m for m in imports_of(path) if m.split(".")[0] not in sys.stdlib_module_names | {"__future__"}}
    assert not outside - OPTIONAL.get(name, set()), (
        f"{name} imports {sorted(outside)}; it must load where only the standard library is"
    )


def test_the_rule_checker_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    package = tmp_path / "sparkgpu" / "tracking"
    package.mkdir(parents=True)
    (tmp_path / "sparkgpu" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "late.py").write_text(
        "def f():\n    from ..launch import payload\n    import sparkgpu.launch.node.agent\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "sparkgpu")
    found = imports_of(package / "late.py")
    assert {"sparkgpu.launch", "sparkgpu.launch.payload", "sparkgpu.launch.node.agent"} <= found
    graph = {"sparkgpu.tracking.late": found, "sparkgpu.launch.payload": set(), "sparkgpu.launch.node.agent": set()}
    assert violations(graph) == {
        ("sparkgpu.tracking.late", "sparkgpu.launch.payload"),
        ("sparkgpu.tracking.late", "sparkgpu.launch.node.agent"),
    }


def test_the_format_checker_sees_what_it_claims():
    graph = {
        "sparkgpu": set(),
        "sparkgpu.errors": set(),
        "sparkgpu._util.files": set(),
        "sparkgpu.api.prepare": set(),
        "sparkgpu.train.checkpoint": set(),
        "sparkgpu.launch.rank.entrypoint": set(),
        "sparkgpu.rundir.states": set(),
        "sparkgpu.rundir.directory": {
            "sparkgpu",  # the package itself
            "sparkgpu.errors",
            "sparkgpu._util.files",
            "sparkgpu.rundir.states",
            "sparkgpu.api.prepare",
            "sparkgpu.train.checkpoint",
            "sparkgpu.launch.rank.entrypoint",
        },
    }
    assert violations(graph) == {
        ("sparkgpu.rundir.directory", "sparkgpu.api.prepare"),
        ("sparkgpu.rundir.directory", "sparkgpu.train.checkpoint"),
        ("sparkgpu.rundir.directory", "sparkgpu.launch.rank.entrypoint"),
    }


def test_no_module_imports_itself_around_a_circle():
    found = cycles(modules())
    new, stale = found - KNOWN_CYCLES, KNOWN_CYCLES - found
    assert not new, (
        "import circles (move what both sides need into a module below them; a "
        "function-level import does not break a circle):\n"
        + "\n".join("  " + " <-> ".join(sorted(c)) for c in sorted(new, key=sorted))
    )
    assert not stale, "these known circles are gone: remove them from KNOWN_CYCLES:\n" + "\n".join(
        "  " + " <-> ".join(sorted(c)) for c in sorted(stale, key=sorted)
    )


def test_no_module_imports_a_private_module_of_another_sub_package():
    found = private_imports(modules())
    new, stale = found - KNOWN_PRIVATE_IMPORTS, KNOWN_PRIVATE_IMPORTS - found
    assert not new, (
        "imports of another sub-package's private module (make the name public there, or "
        "move the helper directly under sparkgpu):\n" + "\n".join(f"  {a} imports {b}" for a, b in sorted(new))
    )
    assert not stale, "these known private imports are gone: remove them from KNOWN_PRIVATE_IMPORTS:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in sorted(stale)
    )


def test_the_cycle_and_privacy_checkers_see_what_they_claim():
    graph = {
        "sparkgpu": {"sparkgpu.data"},
        "sparkgpu.data": set(),
        "sparkgpu.data.a": {"sparkgpu", "sparkgpu.data", "sparkgpu.data.b", "sparkgpu.data.b.f"},
        "sparkgpu.data.b": {"sparkgpu.data.c"},
        "sparkgpu.data.c": {"sparkgpu.data.a", "sparkgpu.launch._x", "sparkgpu._util.files", "sparkgpu.data._y"},
        "sparkgpu.data.d": {"sparkgpu.launch.x", "sparkgpu.launch.x._helper", "sparkgpu.data.a._own"},
        "sparkgpu.launch.x": set(),
        "sparkgpu.launch._x": set(),
        "sparkgpu._util.files": set(),
        "sparkgpu.data._y": set(),
    }
    # a -> b -> c -> a is a circle; a module importing its own package ("sparkgpu", "sparkgpu.data") is not
    assert cycles(graph) == {frozenset({"sparkgpu.data.a", "sparkgpu.data.b", "sparkgpu.data.c"})}
    assert private_imports(graph) == {
        ("sparkgpu.data.c", "sparkgpu.launch._x"),
        ("sparkgpu.data.d", "sparkgpu.launch.x._helper"),  # a private name of a public module
    }


def test_every_library_logger_is_named_by_its_module():
    # docs/guides/tests.md: diagnostics go through logging.getLogger(__name__), so a user silences
    # or raises one module, or a sub-package, by the name they import.
    hand_named = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "getLogger"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith("sparkgpu")
            ):
                hand_named.append(f"{module_name(path)}:{node.lineno} names its logger {node.args[0].value!r}")
    assert not hand_named, "use logging.getLogger(__name__):\n" + "\n".join(hand_named)
