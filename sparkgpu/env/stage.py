"""Staging a snapshot: one content-addressed blob per component, uploaded once per content.

For each component the blob's hash is taken from a local pack index when its files (path,
size, mtime) have not changed since they were last hashed, or computed by streaming the
deterministic tar through sha256 (nothing written; skipped when the store is empty). Only
blobs the store does not hold are then streamed to it, hashed on the way and named by that
hash. A
second call with nothing changed therefore reads no file contents and uploads nothing; after
``pip install`` of one package only that package's blob is uploaded.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

from sparkgpu._util.sizes import human_bytes
from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.env._pack import tar_digest, write_blob
from sparkgpu.env.hydrate import MANIFEST_FORMAT
from sparkgpu.env.snapshot import Component, Snapshot, snapshot_environment
from sparkgpu.env.store import BlobStore
from sparkgpu.errors import ConfigurationError, EnvironmentTooLargeError

__all__ = ["StepReport", "StageReport", "StagedEnvironment", "stage_snapshot", "stage_environment", "check_size"]

_INDEX_FORMAT = 1
_INDEX_MAX_ENTRIES = 20_000


@dataclasses.dataclass(frozen=True)
class StepReport:
    """One step of staging: its wall time, the bytes it moved and the components it handled."""

    name: str
    seconds: float
    bytes: int = 0
    items: int = 0


@dataclasses.dataclass(frozen=True)
class StageReport:
    """What staging did.

    Attributes:
        steps: ``scan`` (list files), ``index`` (store listing, pack index), ``hash`` (read
            and hash unknown blobs), ``upload`` (write missing blobs), ``manifest``.
        uploaded_bytes: Bytes written to the store.
        skipped_bytes: Bytes of blobs the store already held.
        seconds: Wall time of all steps.
        uploaded: Names of the components whose blobs were uploaded.
    """

    steps: tuple[StepReport, ...]
    uploaded_bytes: int
    skipped_bytes: int
    seconds: float
    uploaded: tuple[str, ...] = ()

    def step(self, name: str) -> StepReport:
        return next(s for s in self.steps if s.name == name)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        steps = ", ".join(f"{s.name} {s.seconds:.2f} s" for s in self.steps)
        return (
            f"environment staged in {self.seconds:.2f} s ({steps}): uploaded {self.uploaded_bytes / 1e6:.1f} MB "
            f"({len(self.uploaded)} blobs), {self.skipped_bytes / 1e6:.1f} MB already in the store"
        )


@dataclasses.dataclass(frozen=True)
class StagedEnvironment:
    """A staged environment.

    Attributes:
        manifest: What the workers hydrate (JSON-ready; put it where the workers read it,
            signed with the job).
        manifest_name: The manifest's object name in the store.
        report: What staging did.
        snapshot: The snapshot that was staged.
    """

    manifest: dict
    manifest_name: str
    report: StageReport
    snapshot: Snapshot

    @property
    def lock(self) -> str:
        """``name==version`` lines of the client's environment (editable installs marked)."""
        return self.snapshot.lock


def check_size(snapshot: Snapshot, limit: int) -> None:
    """Raises before anything is read or uploaded when the snapshot is over ``limit`` bytes.

    Raises:
        EnvironmentTooLargeError: naming the largest components and how to leave them out.
    """
    if snapshot.size <= limit:
        return
    largest = snapshot.largest(5)
    listing = "\n".join(f"  {c.name} {c.version}: {human_bytes(c.size)}" for c in largest)
    names = [c.name for c in largest if c.kind != "code"][:3]
    raise EnvironmentTooLargeError(
        f"the environment to ship is {human_bytes(snapshot.size)}, over the {human_bytes(limit)} limit. "
        f"Largest parts:\n{listing}\n"
        f"Leave out what the workers' image already has: exclude={names!r} (or SPARKGPU_ENV_EXCLUDE="
        f"{','.join(names)}), or describe the image with worker_has= (SPARKGPU_ENV_WORKER_LOCK) so packages it has "
        f"at the same version are not shipped; or raise the limit with SPARKGPU_ENV_SIZE_LIMIT."
    )


class _PackIndex:
    """Remembers the hash of each component's blob, keyed by its files' paths, sizes and mtimes."""

    def __init__(self, path: Path | None):
        self.path = path
        self.entries: dict[str, list] = {}
        if path is not None:
            try:
                data = json.loads(path.read_text())
                if data.get("format") == _INDEX_FORMAT:
                    self.entries = data["entries"]
            except (OSError, ValueError, KeyError):
                self.entries = {}  # a cache: start over when it is missing or damaged

    @staticmethod
    def key(component: Component) -> str:
        files = [[f.source, f.arcname, f.size, f.mtime_ns, f.executable] for f in component.files]
        raw = json.dumps([_INDEX_FORMAT, component.name, component.version, component.kind, files])
        return hashlib.sha256(raw.encode()).hexdigest()

    def save(self) -> None:
        if self.path is None:
            return
        entries = dict(list(self.entries.items())[-_INDEX_MAX_ENTRIES:])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A cache of hashes: losing it to a power loss only costs hashing again.
        atomic_write_bytes(self.path, json.dumps({"format": _INDEX_FORMAT, "entries": entries}).encode(), fsync=False)


def _upload(store: BlobStore, component: Component, compression: str | None) -> tuple[str, str, int, int]:
    # Named by what was actually written: a file that changed since it was hashed yields a
    # blob under its new hash, never content under a wrong name.
    return store.put_blob(lambda out: write_blob(component.files, out, compression), compression)


def stage_snapshot(
    snapshot: Snapshot,
    store: BlobStore | str,
    *,
    size_limit: int | None = None,
    compression: str | None = None,
    threads: int = 4,
    pack_index: str | os.PathLike | None = None,
) -> StagedEnvironment:
    """Uploads the blobs the store lacks and writes the manifest.

    Args:
        snapshot: What to stage (:func:`~sparkgpu.env.snapshot.snapshot_environment`).
        store: A :class:`BlobStore` or its URL.
        size_limit: Most bytes of files to ship; checked before anything is read.
        compression: ``None`` (fastest where the store is near) or ``"gzip"`` (fewer bytes
            over a slow link; about 20-100 MB/s per thread to compress).
        threads: Components hashed and uploaded concurrently.
        pack_index: File remembering blob hashes between calls (``None``: always re-hash).

    Returns:
        The manifest and a report of bytes and seconds per step.

    Raises:
        EnvironmentTooLargeError: the snapshot is over ``size_limit`` (nothing was uploaded).
        ConfigurationError: unknown ``compression``.
    """
    if compression not in (None, "gzip"):
        raise ConfigurationError(f"compression={compression!r} is not supported; use None or 'gzip'")
    if size_limit is not None:
        check_size(snapshot, size_limit)
    store = store if isinstance(store, BlobStore) else BlobStore(store)
    steps = [StepReport("scan", snapshot.scan_seconds, snapshot.size, len(snapshot.components))]
    components = sorted(snapshot.components, key=lambda c: c.size, reverse=True)  # big ones first: better overlap

    mark = time.perf_counter()
    existing = store.list_blobs()
    index = _PackIndex(Path(pack_index) if pack_index is not None else None)
    keys = {id(c): _PackIndex.key(c) for c in components}
    digests = {id(c): tuple(index.entries[keys[id(c)]]) for c in components if keys[id(c)] in index.entries}
    steps.append(StepReport("index", time.perf_counter() - mark, 0, len(digests)))

    mark = time.perf_counter()
    # With an empty store there is nothing to deduplicate against: hashing before uploading
    # would only read everything twice.
    unknown = [c for c in components if id(c) not in digests] if existing else []
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for component, result in zip(unknown, pool.map(lambda c: tar_digest(c.files), unknown)):
            digests[id(component)] = result
            index.entries[keys[id(component)]] = list(result)
    steps.append(StepReport("hash", time.perf_counter() - mark, sum(digests[id(c)][1] for c in unknown), len(unknown)))

    mark = time.perf_counter()
    objects: dict[str, tuple[str, int]] = {}
    by_digest: dict[str, Component] = {}
    skipped_bytes = 0
    missing = [c for c in components if id(c) not in digests]
    for component in components:
        if id(component) not in digests:
            continue
        digest = digests[id(component)][0]
        if digest in existing:
            objects[digest] = existing[digest]
            skipped_bytes += existing[digest][1]
        else:
            by_digest.setdefault(digest, component)  # identical content is uploaded once
    missing += by_digest.values()
    uploaded_bytes = 0
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for component, (name, digest, tar_bytes, stored) in zip(
            missing, pool.map(lambda c: _upload(store, c, compression), missing)
        ):
            digests[id(component)] = (digest, tar_bytes)
            index.entries[keys[id(component)]] = [digest, tar_bytes]
            objects[digest] = (name, stored)
            uploaded_bytes += stored
    steps.append(StepReport("upload", time.perf_counter() - mark, uploaded_bytes, len(missing)))
    index.save()

    mark = time.perf_counter()
    manifest = {
        "format": MANIFEST_FORMAT,
        "store": store.url,
        "client": snapshot.client,
        "entries": [
            {
                "name": c.name,
                "version": c.version,
                "kind": c.kind,
                "hash": digests[id(c)][0],
                "object": objects[digests[id(c)][0]][0],
                "size": c.size,
                "tar_bytes": digests[id(c)][1],
                "paths": c.paths,
                "pure": c.pure,
            }
            for c in snapshot.components
        ],
        "excluded": [dataclasses.asdict(e) for e in snapshot.excluded],
        "lock": snapshot.lock,
    }
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    manifest_name = f"manifests/{hashlib.sha256(data).hexdigest()}.json"
    manifest_bytes = 0
    if not store.exists(manifest_name):
        store.write_bytes(manifest_name, data)
        manifest_bytes = len(data)
    steps.append(StepReport("manifest", time.perf_counter() - mark, manifest_bytes, 1))
    report = StageReport(
        steps=tuple(steps),
        uploaded_bytes=uploaded_bytes + manifest_bytes,
        skipped_bytes=skipped_bytes,
        seconds=sum(s.seconds for s in steps),
        uploaded=tuple(c.name for c in missing),
    )
    return StagedEnvironment(manifest, manifest_name, report, snapshot)


def stage_environment(
    *,
    store: BlobStore | str | None = None,
    code_paths=None,
    exclude=(),
    worker_has=None,
    size_limit: int | None = None,
    compression: str | None = None,
    paths: list[str] | None = None,
    threads: int = 4,
) -> StagedEnvironment:
    """Snapshots this environment and stages it: the client half of environment shipping.

    Settings fill what is not given: ``SPARKGPU_ENV_STORE``, ``SPARKGPU_ENV_SIZE_LIMIT``,
    ``SPARKGPU_ENV_EXCLUDE`` (added to ``exclude``), ``SPARKGPU_ENV_WORKER_LOCK``.

    Args:
        store: Blob store (a :class:`BlobStore` or URL).
        code_paths: See :func:`~sparkgpu.env.snapshot.snapshot_environment`.
        exclude: Distribution names or patterns not to ship.
        worker_has: What the workers already have (lock, probe or mapping).
        size_limit: Most bytes to ship.
        compression: ``None`` or ``"gzip"``.
        paths: Import paths to snapshot (``sys.path`` by default).
        threads: Components hashed and uploaded concurrently.

    Returns:
        The staged environment (manifest, lock and report).

    Raises:
        EnvironmentTooLargeError: over the size limit; nothing was uploaded.
        EnvironmentMismatchError: ``worker_has`` describes workers that cannot run this environment.
    """
    from sparkgpu.config import settings

    config = settings()
    exclude = [exclude] if isinstance(exclude, str) else list(exclude)
    snapshot = snapshot_environment(
        paths=paths,
        code_paths=code_paths,
        exclude=exclude + list(config.env_exclude),
        worker_has=worker_has if worker_has is not None else config.env_worker_lock,
    )
    return stage_snapshot(
        snapshot,
        store if store is not None else config.env_store,
        size_limit=size_limit if size_limit is not None else config.env_size_limit,
        compression=compression,
        threads=threads,
        pack_index=config.home / "env" / "pack-index.json",
    )
