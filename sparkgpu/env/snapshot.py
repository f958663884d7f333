"""Client side of environment shipping: what the caller's interpreter has, as shippable parts.

A snapshot lists one :class:`Component` per installed distribution (every distribution on
``sys.path``: site-packages, user site, other path entries, editable installs) plus one for
the caller's own code, each with the files that make it up. Nothing is read or copied yet:
:mod:`sparkgpu.env.stage` turns components into content-addressed blobs.

What travels:

* a distribution with a ``RECORD`` (or ``installed-files.txt``): the files it lists under its
  site folder, except byte-code (``__pycache__``, ``*.pyc``: workers compile their own) and
  files outside that folder (console scripts in ``bin/``, data in ``share/``);
* a distribution without one: its ``top_level.txt`` packages and its metadata folder; one
  without either is skipped with a warning;
* an editable install: its metadata, plus its source tree as the installer mapped it
  (setuptools' finder ``MAPPING`` or the folders its ``.pth`` file names), instead of the
  ``.pth`` hook that points at this machine's paths;
* the caller's code: the importable modules of the working directory (``*.py`` and
  packages with ``__init__.py``), or ``code_paths``.

Source trees leave out ``.git``, ``__pycache__``, virtual environments, caches of the usual
tools, whatever the root's ``.gitignore`` names (simple patterns; no ``!`` negation), folder
symlinks, and files larger than ``max_code_file_bytes`` (each named in a warning).
"""

from __future__ import annotations

import ast
import csv
import dataclasses
import stat
import fnmatch
import importlib.metadata
import json
import logging
import os
import re
import site
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from sparkgpu.env._pack import FileEntry
from sparkgpu.env.hydrate import (
    check_compatibility,
    describe_interpreter,
    is_gpu_stack,
    name_and_version,
    normalize_name,
)
from sparkgpu.errors import ConfigurationError, EnvironmentMismatchError

__all__ = [
    "Component",
    "Excluded",
    "Snapshot",
    "snapshot_environment",
    "parse_worker_has",
    "DEFAULT_MAX_CODE_FILE_BYTES",
]

_logger = logging.getLogger(__name__)

DEFAULT_MAX_CODE_FILE_BYTES = 50 * 1000**2
_SKIPPED_DIRS = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        "__pycache__",
        ".venv",
        "venv",
        ".tox",
        ".nox",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        ".ipynb_checkpoints",
        "node_modules",
        ".eggs",
        ".idea",
        ".vscode",
    }
)


@dataclasses.dataclass(frozen=True)
class Component:
    """One shippable part: a distribution or the caller's code.

    Attributes:
        name: Distribution name (``"code"`` for the caller's code).
        version: Its version (``""`` for code).
        kind: ``"site"``, ``"user"`` (user site), ``"path"`` (another ``sys.path`` entry),
            ``"editable"`` or ``"code"``.
        files: Its files with their places in the blob.
        paths: Number of extra import roots in the blob (``path/0`` ...).
        pure: Whether it holds only pure-Python code (from its wheel tags; ``None``: unknown).
        location: Where it was found.
    """

    name: str
    version: str
    kind: str
    files: tuple[FileEntry, ...]
    paths: int = 0
    pure: bool | None = None
    location: str = ""

    @property
    def size(self) -> int:
        """Bytes of its files."""
        return sum(f.size for f in self.files)


@dataclasses.dataclass(frozen=True)
class Excluded:
    """A distribution left out of the snapshot, and why."""

    name: str
    version: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The caller's environment as shippable components.

    Attributes:
        components: What is shipped.
        excluded: Distributions left out (by name or because the workers have them).
        client: :func:`~sparkgpu.env.hydrate.describe_interpreter` of the snapshotted environment.
        lock: ``name==version`` of every distribution found, editable ones marked.
        warnings: Everything skipped that a user may miss on the workers.
        scan_seconds: Time the scan took.
    """

    components: tuple[Component, ...]
    excluded: tuple[Excluded, ...]
    client: dict
    lock: str
    warnings: tuple[str, ...] = ()
    scan_seconds: float = 0.0

    @property
    def size(self) -> int:
        """Bytes of every shipped file."""
        return sum(c.size for c in self.components)

    def largest(self, n: int = 5) -> list[Component]:
        return sorted(self.components, key=lambda c: c.size, reverse=True)[:n]


# -- the worker's image ----------------------------------------------------------------------
def parse_worker_has(value) -> tuple[dict[str, str], dict | None]:
    """Reads what the workers already have.

    Args:
        value: A :func:`~sparkgpu.env.hydrate.probe` dict (or a JSON file of one), a
            ``{name: version}`` mapping, a lock file path, lock text (``name==version`` lines,
            ``#`` comments), or an iterable of ``"name==version"``.

    Returns:
        ``(packages, interpreter)``: normalized name -> version, and the probe's interpreter
        description (``None`` when only packages are known).

    Raises:
        ConfigurationError: ``value`` cannot be read as any of these.
    """
    if value is None:
        return {}, None
    if isinstance(value, (str, os.PathLike)) and "\n" not in str(value) and "==" not in str(value):
        path = Path(value)
        if not path.is_file():
            raise ConfigurationError(
                f"worker_has={str(value)!r} is not a file; pass a lock file (name==version lines), the JSON that "
                "`python -m sparkgpu.env.hydrate --probe` prints on a worker, or a {name: version} dict"
            )
        text = path.read_text()
        value = json.loads(text) if path.suffix == ".json" else text
    if isinstance(value, dict) and "packages" in value:
        interpreter = {k: v for k, v in value.items() if k != "packages"}
        return {normalize_name(k): str(v) for k, v in value["packages"].items()}, interpreter
    if isinstance(value, dict):
        return {normalize_name(k): str(v) for k, v in value.items()}, None
    lines = value.splitlines() if isinstance(value, str) else list(value)
    packages = {}
    for raw in lines:
        line = str(raw).split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise ConfigurationError(f"worker_has line {raw!r} is not 'name==version'")
        packages[normalize_name(name.strip())] = version.strip()
    return packages, None


# -- source trees ---------------------------------------------------------------------------
class _IgnoreRules:
    """The fixed exclusions plus the simple patterns of one ``.gitignore``."""

    def __init__(self, root: Path):
        self.root = root
        self.patterns: list[tuple[str, bool, bool]] = []
        try:
            text = (root / ".gitignore").read_text(errors="replace")
        except OSError:
            text = ""
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith(("#", "!")):
                continue
            dir_only = line.endswith("/")
            line = line.strip("/").removeprefix("**/")
            if line:
                self.patterns.append((line, dir_only, "/" in line))

    def ignored(self, path: Path, is_dir: bool) -> bool:
        if is_dir and (path.name in _SKIPPED_DIRS or (path / "pyvenv.cfg").exists()):
            return True
        if not is_dir and path.suffix in (".pyc", ".pyo"):
            return True
        try:
            rel = path.relative_to(self.root).as_posix()
        except ValueError:
            rel = path.name
        for pattern, dir_only, anchored in self.patterns:
            if dir_only and not is_dir:
                continue
            if fnmatch.fnmatch(rel if anchored else path.name, pattern):
                return True
        return False


def _entry(source: Path | str, arcname: str) -> FileEntry:
    st = os.stat(source)
    return FileEntry(str(source), arcname, st.st_size, st.st_mtime_ns, bool(st.st_mode & 0o111))


def _listed_files(dist) -> list[str] | None:
    """Paths a distribution lists, relative to its location; ``None`` when it lists none.

    RECORD is parsed here as plain strings: ``Distribution.files`` builds a path object per
    line, which costs seconds over a large environment.
    """
    record = dist.read_text("RECORD")
    if record is None:
        files = dist.files
        return None if files is None else [p.as_posix() for p in files]
    return [row[0] for row in csv.reader(record.splitlines()) if row]


def _walk_tree(
    top: Path, arc_prefix: str, rules: _IgnoreRules, max_file_bytes: int, warnings: list[str]
) -> list[FileEntry]:
    """Files of ``top`` (a folder or one file) under ``arc_prefix``, minus the exclusions."""
    if top.is_file():
        return [_entry(top, arc_prefix)]
    files = []
    for dirpath, dirnames, filenames in os.walk(top):
        base = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames if not (base / d).is_symlink() and not rules.ignored(base / d, is_dir=True)
        )
        for name in sorted(filenames):
            path = base / name
            if rules.ignored(path, is_dir=False) or not path.is_file():
                continue
            entry = _entry(path, f"{arc_prefix}/{path.relative_to(top).as_posix()}")
            if entry.size > max_file_bytes:
                warnings.append(
                    f"{path} ({entry.size / 1e6:.0f} MB) is not shipped: source files over "
                    f"{max_file_bytes / 1e6:.0f} MB are left out; put data on a volume, or raise max_code_file_bytes"
                )
                continue
            files.append(entry)
    return files


def _cwd_modules(cwd: Path, rules: _IgnoreRules, already: set[str]) -> list[Path]:
    found = []
    for child in sorted(cwd.iterdir()):
        if os.path.realpath(child) in already or rules.ignored(child, child.is_dir()):
            continue
        if child.is_file() and child.suffix == ".py" and child.stem.isidentifier():
            found.append(child)
        elif child.is_dir() and child.name.isidentifier() and (child / "__init__.py").is_file():
            found.append(child)
    return found


def _code_component(code_paths, max_file_bytes: int, already: set[str], warnings: list[str]) -> Component | None:
    cwd = Path.cwd()
    shared_rules = None
    if code_paths is None:
        shared_rules = _IgnoreRules(cwd)  # the working directory's .gitignore covers its modules
        roots = _cwd_modules(cwd, shared_rules, already)
    else:
        roots = []
        for raw in code_paths:
            path = Path(raw).expanduser()
            path = path if path.is_absolute() else cwd / path
            if not path.exists():
                raise ConfigurationError(
                    f"code_paths entry {str(raw)!r} does not exist; list files or folders to ship, absolute or "
                    f"relative to {cwd}"
                )
            roots.append(path)
        names = [p.name for p in roots]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigurationError(
                f"code_paths has several entries named {', '.join(duplicates)}; each lands at the top of the workers' "
                "import path, so give entries distinct names"
            )
    files: list[FileEntry] = []
    for root in roots:
        rules = shared_rules or _IgnoreRules(root.parent if root.is_file() else root)
        files += _walk_tree(root, f"path/0/{root.name}", rules, max_file_bytes, warnings)
    if not files:
        return None
    return Component("code", "", "code", tuple(files), paths=1, pure=True, location=str(cwd))


# -- distributions --------------------------------------------------------------------------
def _is_bytecode(rel: str) -> bool:
    return "__pycache__/" in rel or rel.endswith((".pyc", ".pyo"))


def _direct_url(dist) -> dict:
    try:
        return json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        return {}


def _url_path(url: str) -> Path | None:
    parsed = urllib.parse.urlparse(url)
    return Path(urllib.request.url2pathname(parsed.path)) if parsed.scheme == "file" else None


def _pure(dist) -> bool | None:
    wheel = dist.read_text("WHEEL")
    if not wheel:
        return None
    tags = [line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.lower().startswith("tag:")]
    return bool(tags) and all(tag.endswith("-none-any") for tag in tags)


def _finder_mapping(module_file: Path) -> dict[str, str]:
    """The ``MAPPING`` literal of a setuptools editable finder module."""
    try:
        tree = ast.parse(module_file.read_text())
    except (OSError, SyntaxError):
        return {}
    for node in tree.body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) else None)
        )
        if (
            isinstance(target, ast.Name)
            and target.id == "MAPPING"
            and isinstance(node, (ast.Assign, ast.AnnAssign))
            and node.value is not None
        ):
            try:
                return dict(ast.literal_eval(node.value))
            except ValueError:
                return {}
    return {}


def _editable_layout(dist, location: Path, rels: list[str]) -> tuple[set[str], dict[str, str], list[str]]:
    """``(hook files, {top-level name: source path}, extra import roots)`` of an editable install."""
    hooks, mapping, roots = set(), {}, []
    for rel in rels:
        if "/" in rel or not rel.endswith(".pth"):
            continue
        hooks.add(rel)
        for line in (location / rel).read_text(errors="replace").splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith(("import ", "import\t")):
                for module in re.findall(r"import\s+([\w.]+)", line):
                    finder = f"{module.split('.')[0]}.py"
                    hooks.add(finder)
                    mapping.update(_finder_mapping(location / finder))
            elif (location / line).is_dir():
                roots.append(str((location / line).resolve()))
    if not mapping and not roots:  # an installer we do not know: fall back on the project folder
        project = _url_path(_direct_url(dist).get("url", ""))
        if project and (project / "src").is_dir():
            roots.append(str(project / "src"))
        elif project:
            for name in (dist.read_text("top_level.txt") or "").split():
                for candidate in (project / name, project / f"{name}.py"):
                    if candidate.exists():
                        mapping[name] = str(candidate)
    return hooks, mapping, roots


def _location_kind(location: Path, user_site: str | None) -> str:
    if user_site and os.path.realpath(location) == os.path.realpath(user_site):
        return "user"
    return "site" if location.name in ("site-packages", "dist-packages") else "path"


def _distribution_component(
    dist, name: str, version: str, location: Path, editable: bool, max_file_bytes: int, warnings: list[str]
) -> tuple[Component | None, set[str]]:
    """The component of one distribution, and the real paths of source trees it ships."""
    listed = _listed_files(dist)
    if listed is None:
        top_level = (dist.read_text("top_level.txt") or "").split()
        if not top_level:
            warnings.append(
                f"{name}=={version} lists no files (no RECORD, no top_level.txt) and is not shipped: "
                f"install it on the workers' image, or reinstall it with pip"
            )
            return None, set()
        meta = getattr(dist, "_path", None)  # the metadata folder of a distribution found on a path
        tops = [location / t for t in top_level] + [location / f"{t}.py" for t in top_level]
        entries = []
        for top_path in [t for t in tops if t.exists()] + ([Path(meta)] if meta else []):
            entries += _walk_tree(
                top_path,
                f"site/{top_path.relative_to(location).as_posix()}",
                _IgnoreRules(location),
                max_file_bytes,
                warnings,
            )
        return Component(
            name,
            version,
            _location_kind(location, site.getusersitepackages()),
            tuple(entries),
            pure=_pure(dist),
            location=str(location),
        ), set()

    root = str(location)
    rels = []
    for rel in listed:
        full = os.path.normpath(os.path.join(root, rel))
        if not full.startswith(root + os.sep) or _is_bytecode(rel):
            continue  # console scripts and data outside site-packages; byte-code is rebuilt
        rels.append(full[len(root) + 1 :].replace(os.sep, "/"))
    hooks: set[str] = set()
    mapping: dict[str, str] = {}
    roots: list[str] = []
    shipped_trees: set[str] = set()
    if editable:
        hooks, mapping, roots = _editable_layout(dist, location, rels)
    entries = []
    for rel in dict.fromkeys(rels):
        if rel in hooks:
            continue
        source = os.path.join(root, rel)
        try:
            st = os.stat(source)
        except FileNotFoundError:
            continue  # listed but deleted since installation
        if stat.S_ISREG(st.st_mode):
            entries.append(FileEntry(source, f"site/{rel}", st.st_size, st.st_mtime_ns, bool(st.st_mode & 0o111)))
    for top, source in sorted(mapping.items()):
        source_path = Path(source)
        if not source_path.exists():
            warnings.append(f"editable {name}: {source} does not exist and is not shipped")
            continue
        suffix = source_path.suffix if source_path.is_file() else ""
        project = _url_path(_direct_url(dist).get("url", "")) or source_path.parent
        entries += _walk_tree(source_path, f"site/{top}{suffix}", _IgnoreRules(project), max_file_bytes, warnings)
        shipped_trees.add(os.path.realpath(source_path))
    for i, tree in enumerate(roots):
        entries += _walk_tree(Path(tree), f"path/{i}", _IgnoreRules(Path(tree)), max_file_bytes, warnings)
        shipped_trees.add(os.path.realpath(tree))
    kind = "editable" if editable else _location_kind(location, site.getusersitepackages())
    return Component(
        name, version, kind, tuple(entries), paths=len(roots), pure=_pure(dist), location=str(location)
    ), shipped_trees


def _exclusion(name: str, version: str, editable: bool, patterns: list[str], worker: dict[str, str]) -> str | None:
    normalized = normalize_name(name)
    for pattern in patterns:
        if fnmatch.fnmatchcase(normalized, pattern):
            return f"excluded by name ({pattern})"
    if editable:
        return None  # its source changes without a version bump: the workers' copy may be stale
    have = worker.get(normalized)
    if have == version:
        return f"the workers have {name}=={have}"
    if have is not None and is_gpu_stack(normalized):
        return f"the workers' own GPU stack is used ({name}=={have})"
    return None


def _distributions(search: list[str]):
    """``(dist, name, version)`` in path order, sorted by name within each path entry.

    Sorting keeps the manifest (and so its hash) independent of directory listing order.
    """
    for entry in search:
        found = []
        for dist in importlib.metadata.distributions(path=[entry]):
            name, version = name_and_version(dist)
            if name and version:
                found.append((normalize_name(name), dist, name, version))
        for _, dist, name, version in sorted(found, key=lambda item: item[0]):
            yield dist, name, version


def _lock_line(dist, name: str, version: str, editable: bool) -> str:
    line = f"{name}=={version}"
    return f"{line}  # editable: {_direct_url(dist).get('url', '')}" if editable else line


def snapshot_environment(
    *,
    paths: list[str] | None = None,
    code_paths=None,
    exclude=(),
    worker_has=None,
    max_code_file_bytes: int = DEFAULT_MAX_CODE_FILE_BYTES,
) -> Snapshot:
    """Lists what the workers need of this environment.

    Args:
        paths: Import paths whose distributions are shipped (``sys.path`` by default).
        code_paths: Files and folders of the caller's own code, each put at the top of the
            workers' import path; ``None`` ships the working directory's importable modules,
            ``[]`` ships none.
        exclude: Distribution names (or ``fnmatch`` patterns such as ``"nvidia-*"``) not to ship.
        worker_has: What the workers already have (see :func:`parse_worker_has`): those
            distributions at the same version are not shipped, nor the GPU stack (torch,
            CUDA wheels) when the workers have their own.
        max_code_file_bytes: Larger files of source trees are left out (with a warning).

    Returns:
        The snapshot; nothing has been read or copied yet.

    Raises:
        EnvironmentMismatchError: ``worker_has`` describes workers whose Python, torch or
            platform cannot run this environment.
        ConfigurationError: a ``code_paths`` entry does not exist, or ``worker_has`` is unreadable.
    """
    started = time.perf_counter()
    search = list(sys.path if paths is None else paths)
    worker_packages, worker_interpreter = parse_worker_has(worker_has)
    patterns = [normalize_name(p) for p in ([exclude] if isinstance(exclude, str) else exclude)]
    client = describe_interpreter(search)
    warnings: list[str] = []
    components, excluded, lock, seen, trees = [], [], [], set(), set()
    # The working directory is shipped as code; metadata a build left there (an .egg-info next
    # to setup.py) is not an installation and would shadow the real one.
    cwd = os.path.realpath(os.getcwd())
    for dist, name, version in _distributions([p for p in search if p and os.path.realpath(p) != cwd]):
        if normalize_name(name) in seen:
            continue  # shadowed by an earlier path entry, as for imports
        seen.add(normalize_name(name))
        editable = bool(_direct_url(dist).get("dir_info", {}).get("editable"))
        lock.append(_lock_line(dist, name, version, editable))
        reason = _exclusion(name, version, editable, patterns, worker_packages)
        if reason:
            excluded.append(Excluded(name, version, reason))
            continue
        component, shipped = _distribution_component(
            dist, name, version, Path(dist.locate_file("")).resolve(), editable, max_code_file_bytes, warnings
        )
        trees |= shipped
        if component is not None:
            components.append(component)
    trees |= {os.path.realpath(p) for p in search if p}  # never ship a site folder as "code"
    code = _code_component(code_paths, max_code_file_bytes, trees, warnings)
    if code is not None:
        components.insert(0, code)
    worker = worker_interpreter or {"torch": worker_packages.get("torch")}
    native = [c.name for c in components if c.kind != "code" and not c.pure]
    problems = check_compatibility(client, worker, native if worker_interpreter else [])
    if problems:
        raise EnvironmentMismatchError("this environment cannot run on the workers:\n- " + "\n- ".join(problems))
    for message in warnings:
        _logger.warning(message)
    header = f"# python {client['python']} on {client['platform']}"
    return Snapshot(
        components=tuple(components),
        excluded=tuple(excluded),
        client=client,
        lock="\n".join([header] + sorted(lock, key=str.lower)) + "\n",
        warnings=tuple(warnings),
        scan_seconds=time.perf_counter() - started,
    )
