"""Worker side of environment shipping: rehydrate a staged environment into a local cache.

This module uses the standard library only and can be loaded by file path, because it runs
before the overlay it builds is on ``sys.path`` (the overlay may be what brings ``sparkgpu``
itself to a bare worker)::

    spec = importlib.util.spec_from_file_location("_sparkgpu_hydrate", path_to_this_file)
    hydrate_module = importlib.util.module_from_spec(spec); spec.loader.exec_module(hydrate_module)
    overlay = hydrate_module.hydrate(manifest, cache_dir)
    hydrate_module.activate(overlay)

What it raises are :mod:`sparkgpu.errors`' own classes (:class:`HydrationError`,
:class:`EnvironmentMismatchError`), loaded from that module's file where sparkgpu is not
importable yet: a copy of this file needs ``_errors.py`` beside it (see
:func:`sparkgpu.env.worker_bootstrap_files`).

From a shell: ``python hydrate.py MANIFEST.json --cache DIR`` (prints the paths as JSON) and
``python hydrate.py --probe`` (prints what this interpreter has, for ``worker_has=``).

Cache layout under ``<cache_dir>/env/``::

    <sha256>/site/...        one distribution's files, laid out as in site-packages
    <sha256>/path/<i>/...    extra import roots (editable source trees, the caller's code)
    views/<key>/             a site-packages made of symlinks into the blobs of one job
    .tmp/  .locks/           extraction in progress, per-blob file locks

A blob appears under its hash only complete: it is extracted to ``.tmp`` and renamed, under
a file lock that concurrent ranks on the node share; its sha256 is verified while it streams.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fnmatch
import gzip
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import site
import sys
import sysconfig
import tarfile
import time
import urllib.parse
import urllib.request
from collections.abc import MutableMapping, Sequence

__all__ = [
    "MANIFEST_FORMAT",
    "HydrationError",
    "EnvironmentMismatchError",
    "HydrationReport",
    "Overlay",
    "normalize_name",
    "name_and_version",
    "is_gpu_stack",
    "describe_interpreter",
    "installed_distributions",
    "probe",
    "check_compatibility",
    "hydrate",
    "activate",
    "record_report",
    "default_cache_dir",
]

MANIFEST_FORMAT = 1

# The GPU stack belongs to the worker image: when a worker has one of these installed (any
# version), the client's copy never shadows it, and torch versions are compared instead.
_GPU_STACK_NAMES = frozenset({"torch", "torchvision", "torchaudio", "triton", "pytorch-triton", "pytorch-triton-rocm"})
_GPU_STACK_PATTERNS = ("nvidia-*", "cuda-*")
_READ_CHUNK = 1 << 20
_TAR_BUFSIZE = 64 * 1024  # tarfile slices its stream buffer on every read: keep it small


def _root_errors():
    """:mod:`sparkgpu.errors`, without importing the ``sparkgpu`` package when it is not imported yet.

    On a worker this module runs before the overlay it builds is on ``sys.path``, and that
    overlay may bring sparkgpu (or another version of it than the worker image's): importing
    the package here would pin the wrong one, or fail. The error module uses the standard
    library only, so it is loaded from its file instead: ``_errors.py``, shipped beside this
    module's copy in the run dir (:func:`sparkgpu.env.worker_bootstrap_files`), or
    ``errors.py`` of the package this file belongs to. It is registered under its own name,
    so the sparkgpu imported after hydration raises and catches these very classes.
    """
    loaded = sys.modules.get("sparkgpu.errors")
    if loaded is not None:
        return loaded
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.path.join(here, "_errors.py")]
    if os.path.basename(here) == "env":
        candidates.append(os.path.join(os.path.dirname(here), "errors.py"))
    for path in candidates:
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location("sparkgpu.errors", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules["sparkgpu.errors"] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules["sparkgpu.errors"]
                raise
            return module
    raise ImportError(
        f"sparkgpu's error module is missing: none of {candidates} exists; ship "
        f"sparkgpu.env.worker_bootstrap_files() beside this file"
    )


# The root's classes (see _root_errors): what this module raises.
_errors = _root_errors()
HydrationError = _errors.HydrationError
EnvironmentMismatchError = _errors.EnvironmentMismatchError


def normalize_name(name: str) -> str:
    """The PEP 503 form of a distribution name (``Foo_Bar.baz`` -> ``foo-bar-baz``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_gpu_stack(name: str) -> bool:
    """Whether ``name`` is part of the GPU stack a worker image owns (torch, CUDA wheels)."""
    name = normalize_name(name)
    return name in _GPU_STACK_NAMES or any(fnmatch.fnmatchcase(name, p) for p in _GPU_STACK_PATTERNS)


def _major_minor(version: str | None) -> str | None:
    if not version:
        return None
    match = re.match(r"(\d+)\.(\d+)", version)
    return f"{match.group(1)}.{match.group(2)}" if match else version


def name_and_version(dist) -> tuple[str | None, str | None]:
    """A distribution's name and version from the header of its metadata.

    ``dist.metadata`` parses the whole file (long descriptions included) on every access,
    which costs seconds over a few hundred distributions.
    """
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO")
    if text is None:
        return None, None
    header = text.split("\n\n", 1)[0]
    name = re.search(r"^Name:[ \t]*(\S+)", header, re.MULTILINE)
    version = re.search(r"^Version:[ \t]*(\S+)", header, re.MULTILINE)
    return (name.group(1) if name else None), (version.group(1) if version else None)


def installed_distributions(path: list[str] | None = None) -> dict[str, str]:
    """Normalized name -> version of every distribution on ``path`` (``sys.path``); first wins."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions(path=list(sys.path if path is None else path)):
        name, version = name_and_version(dist)
        if name and version:
            found.setdefault(normalize_name(name), version)
    return found


def _find_distribution(name: str, path: list[str] | None):
    return next(iter(importlib.metadata.distributions(name=name, path=list(sys.path if path is None else path))), None)


def _torch_cuda(dist) -> str | None:
    # Read torch/version.py as text: importing torch would cost seconds and load the very
    # module whose version is in question.
    try:
        text = open(dist.locate_file("torch/version.py"), encoding="utf-8").read()
    except OSError:
        return None
    match = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return match.group(1) if match else None


def describe_interpreter(path: list[str] | None = None) -> dict:
    """What matters for compatibility about this interpreter and the distributions on ``path``.

    Returns:
        ``{"python", "implementation", "platform", "torch", "torch_cuda"}``; ``torch`` is the
        installed version or ``None``, ``torch_cuda`` the CUDA version torch was built for or
        ``None`` for a CPU-only build.
    """
    torch = _find_distribution("torch", path)
    return {
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "platform": sysconfig.get_platform(),
        "torch": name_and_version(torch)[1] if torch else None,
        "torch_cuda": _torch_cuda(torch) if torch else None,
    }


def probe() -> dict:
    """This interpreter and its distributions, in the form ``worker_has=`` takes on the client."""
    return {**describe_interpreter(), "packages": installed_distributions()}


def _variant(cuda: str | None) -> str:
    return f"CUDA {cuda}" if cuda else "CPU-only"


def check_compatibility(client: dict, worker: dict, native: Sequence[str] = ()) -> list[str]:
    """Compares the client's interpreter with a worker's.

    Args:
        client: :func:`describe_interpreter` of the client (as recorded in the manifest).
        worker: The same for the worker.
        native: Shipped distributions with compiled code (they need the same platform).

    Returns:
        One message per incompatibility, each naming both versions and the fix; empty when
        they are compatible.
    """
    problems = []
    cpy, wpy = _major_minor(client.get("python")), _major_minor(worker.get("python"))
    if cpy and wpy and cpy != wpy:
        problems.append(
            f"Python differs: the client runs Python {client['python']}, the workers run Python {worker['python']}. "
            f"Packages installed for one do not load in the other: create the client's environment with "
            f"Python {wpy}, or run the workers on an image with Python {cpy}."
        )
    ctorch, wtorch = client.get("torch"), worker.get("torch")
    if ctorch and wtorch:
        if _major_minor(ctorch) != _major_minor(wtorch):
            problems.append(
                f"torch differs: the client has torch {ctorch} ({_variant(client.get('torch_cuda'))}), the workers have "
                f"torch {wtorch} ({_variant(worker.get('torch_cuda'))}). The workers' own torch is used, never replaced: "
                f"install it on the client (pip install 'torch=={_major_minor(wtorch)}.*'), or run the workers on an "
                f"image with torch {_major_minor(ctorch)}."
            )
        elif client.get("torch_cuda") and worker.get("torch_cuda") and client["torch_cuda"] != worker["torch_cuda"]:
            cuda = worker["torch_cuda"].replace(".", "")
            problems.append(
                f"torch's CUDA variant differs: the client has torch {ctorch} built for CUDA {client['torch_cuda']}, "
                f"the workers have torch {wtorch} built for CUDA {worker['torch_cuda']}; extensions built against one "
                f"do not load with the other. Install the workers' build on the client "
                f"(pip install torch=={wtorch.split('+')[0]} --index-url https://download.pytorch.org/whl/cu{cuda})."
            )
    if native and client.get("platform") and worker.get("platform") and client["platform"] != worker["platform"]:
        names = ", ".join(sorted(native)[:10]) + (" ..." if len(native) > 10 else "")
        problems.append(
            f"platform differs: the client is {client['platform']}, the workers are {worker['platform']}, and these "
            f"distributions hold code compiled for the client: {names}. Install them on the workers' image, or "
            f"exclude them from the snapshot (exclude=[...])."
        )
    return problems


@dataclasses.dataclass
class HydrationReport:
    """What one hydration did.

    Attributes:
        fetched_bytes: Bytes read from the store.
        extracted: Entries extracted into the cache by this call.
        cached: Entries found already extracted in the cache.
        skipped: ``{name: reason}`` for entries not used because the worker has them.
        seconds: Wall time of the whole call.
        steps: Seconds per step: ``check``, ``extract``, ``view``.
    """

    fetched_bytes: int = 0
    extracted: list[str] = dataclasses.field(default_factory=list)
    cached: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    steps: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """One line for a rank's log: bytes, entries and seconds per step."""
        steps = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in self.steps.items())
        return (
            f"environment rehydrated in {self.seconds:.2f}s ({steps}): fetched {_human_bytes(self.fetched_bytes)}, "
            f"{len(self.extracted)} extracted, {len(self.cached)} cached, "
            f"{len(self.skipped)} skipped (the worker has them)"
        )


def _human_bytes(count: int) -> str:
    if count < 1000:
        return f"{count} B"
    value = float(count)
    for unit in ("KB", "MB"):
        value /= 1000
        if value < 1000:
            return f"{value:.1f} {unit}"
    return f"{value / 1000:.1f} GB"


def default_cache_dir() -> str:
    """The node's cache that ranks rehydrate into: ``SPARKGPU_CACHE_DIR``, else ``~/.cache/sparkgpu``."""
    return os.environ.get("SPARKGPU_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sparkgpu")


def record_report(report: HydrationReport, report_path: str, log_path: str) -> None:
    """Saves ``report`` as JSON (complete or not at all) and adds its summary line to a log.

    Args:
        report: What a hydration did.
        report_path: JSON file to write (the rank's ``env-rank-<r>.json`` in the run dir).
        log_path: Log to append the one-line summary to (the rank's log, which the client tails).

    Raises:
        OSError: a file cannot be written.
    """
    os.makedirs(os.path.dirname(report_path), exist_ok=True)
    tmp = f"{report_path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report.to_dict(), f, indent=1, sort_keys=True)
    os.replace(tmp, report_path)
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"sparkgpu: {report.summary()}\n")


@dataclasses.dataclass
class Overlay:
    """A rehydrated environment.

    Attributes:
        paths: Import roots to put first on ``sys.path``, in order (code, editable trees,
            then the merged site view).
        view: The merged site-packages view, or ``None`` when nothing needed one.
        report: What the hydration did.
    """

    paths: list[str]
    view: str | None
    report: HydrationReport

    @property
    def pythonpath(self) -> str:
        """``PYTHONPATH`` value that gives subprocesses the same overlay."""
        return os.pathsep.join(self.paths)


class _FileLock:
    """An exclusive ``flock`` on a file; ranks on one node serialize on it."""

    def __init__(self, path: str):
        self.path = path
        self._fd = -1

    def __enter__(self):
        import fcntl

        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        import fcntl

        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


class _HashingReader:
    """Reads through to ``raw`` and hashes (and counts) every byte it hands out."""

    def __init__(self, raw):
        self.raw = raw
        self.sha = hashlib.sha256()
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.sha.update(data)
        self.count += len(data)
        return data

    def drain(self) -> None:
        while self.read(_READ_CHUNK):
            pass


def _open_object(store_url: str, name: str, opener):
    if opener is not None:
        return opener(name)
    parsed = urllib.parse.urlparse(store_url)
    if parsed.scheme in ("", "file") or (len(parsed.scheme) == 1 and os.name == "nt"):
        root = urllib.request.url2pathname(parsed.path) if parsed.scheme == "file" else store_url
        return open(os.path.join(root, name), "rb", buffering=_READ_CHUNK)
    url = store_url.rstrip("/") + "/" + name
    if parsed.scheme in ("http", "https"):
        return urllib.request.urlopen(url, timeout=60)
    try:
        import fsspec
    except ImportError:
        raise HydrationError(
            f"the environment store {store_url} needs fsspec (and its {parsed.scheme}:// driver) on the workers: "
            f"install them in the workers' image, or stage the environment on a shared file system or HTTP server"
        ) from None
    return fsspec.open(url, "rb").open()


def _check_member(member: tarfile.TarInfo) -> None:
    parts = member.name.split("/")
    if not (member.isfile() or member.isdir()) or member.name.startswith("/") or ".." in parts:
        raise HydrationError(f"refusing blob member {member.name!r}: only relative files and folders are allowed")
    if parts[0] not in ("site", "path"):
        raise HydrationError(f"refusing blob member {member.name!r}: outside site/ and path/")


def _extract_members(tar: tarfile.TarFile, dest: str) -> None:
    # A plain loop instead of TarFile.extract: members are only checked relative files and
    # folders, and per-file ownership, times and realpath checks cost more than the writes.
    made = {dest}
    for member in tar:
        _check_member(member)
        target = os.path.join(dest, *member.name.split("/"))
        if member.isdir():
            os.makedirs(target, exist_ok=True)
            made.add(target)
            continue
        parent = os.path.dirname(target)
        if parent not in made:
            os.makedirs(parent, exist_ok=True)
            made.add(parent)
        source = tar.extractfile(member)
        assert source is not None  # a checked member that is not a folder is a regular file
        with open(target, "wb") as out:
            shutil.copyfileobj(source, out, _READ_CHUNK)
        if member.mode & 0o111:
            os.chmod(target, 0o755)


def _extract(entry: dict, dest: str, store_url: str, opener) -> int:
    """Streams one blob into ``dest``, verifying its sha256; returns the bytes read."""
    try:
        raw = _open_object(store_url, entry["object"], opener)
    except FileNotFoundError:
        raise HydrationError(
            f"{entry['name']} ({entry['hash'][:12]}) is missing from the environment store {store_url}; "
            f"stage the environment again from the client"
        ) from None
    with raw:
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if entry["object"].endswith(".gz") else raw
        reader = _HashingReader(stream)
        # A stream ("r|") only calls read(): the reader need not be a whole file object.
        with tarfile.open(fileobj=reader, mode="r|", bufsize=_TAR_BUFSIZE) as tar:  # type: ignore[call-overload]
            _extract_members(tar, dest)
        reader.drain()  # tar stops at its end marker; the hash covers the padding after it
    if reader.sha.hexdigest() != entry["hash"]:
        raise HydrationError(
            f"{entry['name']}: the blob in {store_url} does not match its hash {entry['hash'][:12]} "
            f"(got {reader.sha.hexdigest()[:12]}); it is corrupt or was changed: stage the environment again"
        )
    return reader.count


def _ensure_blob(env_dir: str, entry: dict, store_url: str, opener) -> int | None:
    """Extracts ``entry`` into the cache unless it is there; returns bytes read, ``None`` if cached."""
    final = os.path.join(env_dir, entry["hash"])
    if os.path.isdir(final):
        return None
    with _FileLock(os.path.join(env_dir, ".locks", entry["hash"] + ".lock")):
        if os.path.isdir(final):  # another rank finished it while we waited
            return None
        tmp_root = os.path.join(env_dir, ".tmp")
        os.makedirs(tmp_root, exist_ok=True)
        for stale in os.listdir(tmp_root):  # left by a rank that died holding this lock
            if stale.startswith(entry["hash"] + "."):
                shutil.rmtree(os.path.join(tmp_root, stale), ignore_errors=True)
        tmp = os.path.join(tmp_root, f"{entry['hash']}.{os.getpid()}")
        os.makedirs(tmp)
        try:
            fetched = _extract(entry, tmp, store_url, opener)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return fetched


def _farm(sources: list[str], target: str) -> None:
    """Links the children of ``sources`` into ``target``; shared folders are merged (first wins)."""
    children: dict[str, list[os.DirEntry]] = {}
    for source in sources:
        for child in os.scandir(source):
            children.setdefault(child.name, []).append(child)
    for name, entries in children.items():
        if len(entries) > 1 and all(e.is_dir() for e in entries):
            # Namespace folders that several distributions fill (nvidia/, google/).
            os.mkdir(os.path.join(target, name))
            _farm([e.path for e in entries], os.path.join(target, name))
        else:
            os.symlink(entries[0].path, os.path.join(target, name))


def _ensure_view(env_dir: str, site_dirs: list[str]) -> str:
    key = hashlib.sha256("\n".join(site_dirs).encode()).hexdigest()[:32]
    view = os.path.join(env_dir, "views", key)
    if os.path.isdir(view):
        return view
    with _FileLock(os.path.join(env_dir, ".locks", f"view-{key}.lock")):
        if not os.path.isdir(view):
            tmp = os.path.join(env_dir, ".tmp", f"view-{key}.{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            try:
                _farm(site_dirs, tmp)
                os.makedirs(os.path.dirname(view), exist_ok=True)
                os.rename(tmp, view)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return view


def _plan(entries: list[dict], installed: dict[str, str]) -> tuple[list[dict], dict[str, str]]:
    needed, skipped = [], {}
    for entry in entries:
        name = normalize_name(entry["name"])
        have = installed.get(name)
        if entry["kind"] in ("code", "editable") or have is None:
            needed.append(entry)  # source trees change without a version bump: always shipped
        elif have == entry["version"]:
            skipped[entry["name"]] = f"the worker has {entry['name']}=={have}"
        elif is_gpu_stack(name):
            skipped[entry["name"]] = f"the worker's own GPU stack is used ({entry['name']}=={have})"
        else:
            needed.append(entry)
    return needed, skipped


def hydrate(
    manifest: dict,
    cache_dir: str | os.PathLike,
    *,
    store_url: str | None = None,
    installed: dict[str, str] | None = None,
    worker: dict | None = None,
    opener=None,
    threads: int = 4,
) -> Overlay:
    """Rehydrates a staged environment into ``<cache_dir>/env`` and returns its import paths.

    Distributions this interpreter already has at the same version are skipped, and so is the
    client's GPU stack when the worker has its own; the compatibility of Python, torch and
    platform is checked before anything is fetched.

    Args:
        manifest: The manifest the client staged (a dict, as parsed from JSON).
        cache_dir: Node-local cache folder; ranks on one node share it.
        store_url: Where the blobs are, as seen from this worker (the manifest's ``store`` by
            default): a path, ``file://``, ``http(s)://`` or, with fsspec installed, any URL.
        installed: Name -> version of what this worker has (discovered on ``sys.path`` by default).
        worker: :func:`describe_interpreter` of this worker (discovered by default).
        opener: ``opener(object_name)`` returning a binary file object, to fetch blobs some
            other way.
        threads: Blobs fetched and extracted concurrently.

    Returns:
        The overlay; pass it to :func:`activate` (or put ``overlay.paths`` first on ``sys.path``).

    Raises:
        EnvironmentMismatchError: Python, torch or platform are incompatible (nothing was fetched).
        HydrationError: the manifest is unreadable, or a blob is missing or corrupt.
    """
    started = time.perf_counter()
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise HydrationError(
            f"unsupported environment manifest (format {manifest.get('format') if isinstance(manifest, dict) else None!r},"
            f" this worker reads format {MANIFEST_FORMAT}): use the same sparkgpu version on the client and the workers"
        )
    report = HydrationReport()
    installed = installed_distributions() if installed is None else {normalize_name(k): v for k, v in installed.items()}
    worker = describe_interpreter() if worker is None else worker
    needed, report.skipped = _plan(manifest["entries"], installed)
    native = [e["name"] for e in needed if e["kind"] != "code" and not e.get("pure")]
    problems = check_compatibility(manifest.get("client", {}), worker, native)
    if problems:
        raise EnvironmentMismatchError(
            "the client's environment cannot run on this worker:\n- " + "\n- ".join(problems)
        )
    report.steps["check"] = time.perf_counter() - started

    mark = time.perf_counter()
    env_dir = os.path.join(os.fspath(cache_dir), "env")
    store_url = store_url or manifest["store"]
    unique = list({entry["hash"]: entry for entry in needed}.values())
    # Threads overlap the file creation that dominates extraction; tarfile itself holds the GIL.
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for entry, fetched in zip(unique, pool.map(lambda e: _ensure_blob(env_dir, e, store_url, opener), unique)):
            if fetched is None:
                report.cached.append(entry["name"])
            else:
                report.extracted.append(entry["name"])
                report.fetched_bytes += fetched
    report.steps["extract"] = time.perf_counter() - mark

    mark = time.perf_counter()
    code_roots: list[str] = []
    tree_roots: list[str] = []
    site_dirs: list[str] = []
    for entry in needed:
        blob = os.path.join(env_dir, entry["hash"])
        roots = [os.path.join(blob, "path", str(i)) for i in range(entry.get("paths", 0))]
        (code_roots if entry["kind"] == "code" else tree_roots).extend(roots)
        if os.path.isdir(os.path.join(blob, "site")):
            site_dirs.append(os.path.join(blob, "site"))
    view = _ensure_view(env_dir, site_dirs) if site_dirs else None
    report.steps["view"] = time.perf_counter() - mark
    report.seconds = time.perf_counter() - started
    return Overlay(paths=code_roots + tree_roots + ([view] if view else []), view=view, report=report)


def activate(overlay: Overlay, environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Puts the overlay first on ``sys.path`` and on ``PYTHONPATH`` (for subprocesses).

    ``.pth`` files of the shipped distributions are processed in this process, as the site
    module would; subprocesses that only inherit ``PYTHONPATH`` do not process them.

    Returns:
        The paths added, in order.
    """
    environ = os.environ if environ is None else environ
    for path in reversed(overlay.paths):
        while path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)
    if overlay.view:
        site.addsitedir(overlay.view)  # already on sys.path, so only its .pth files take effect
    importlib.invalidate_caches()
    previous = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in overlay.paths]
    environ["PYTHONPATH"] = os.pathsep.join(overlay.paths + previous)
    return list(overlay.paths)


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Rehydrate a staged sparkgpu environment, or probe this one.")
    parser.add_argument("manifest", nargs="?", help="manifest JSON file (or a spec.json with an 'env' key)")
    parser.add_argument("--cache", help="node-local cache folder")
    parser.add_argument("--store", help="store URL as seen from this worker (default: the manifest's)")
    parser.add_argument("--probe", action="store_true", help="print this interpreter's description and packages")
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(), indent=2, sort_keys=True))
        return 0
    if not args.manifest or not args.cache:
        parser.error("give a MANIFEST and --cache, or --probe")
    with open(args.manifest, encoding="utf-8") as f:
        document = json.load(f)
    manifest = document["env"] if "entries" not in document and "env" in document else document
    try:
        overlay = hydrate(manifest, args.cache, store_url=args.store)
    except (HydrationError, EnvironmentMismatchError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"paths": overlay.paths, "pythonpath": overlay.pythonpath, "report": overlay.report.to_dict()}))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
