"""A sweep's folder: ``<staging_root>/sweeps/<sweep_id>/``, what a resume needs to go on.

Layout::

    sweep.json        the sweep's settings (trials, concurrency, budget, ...), its study's name
                      and storage, its MLflow parent run, the driver process
    study.journal     the default study storage: Optuna's JournalStorage, file backend
    driver.pkl        the training function and its fixed arguments (cloudpickled), for
                      ``sparkgpu sweep resume`` from a process that does not have them
    driver.lock       held (``flock``) by the one process that drives the sweep now
    driver.log        a detached sweep's keeper and drivers write here
    keeper.json       a detached sweep's keeper (``sparkgpu.sweeps.keeper``), written once by
                      the caller that started it

The folder sits beside the jobs' run dirs (which are folders with a ``spec.json``; this one has
none, so listing and retention of jobs pass it by).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu._util.process import ProcessRef
from sparkgpu.config import settings
from sparkgpu.errors import ConfigurationError, JobStateError

__all__ = ["SweepFolder", "new_sweep_id", "sweeps_root", "list_sweeps", "find_sweep"]

RECORD = "sweep.json"
JOURNAL = "study.journal"
DRIVER = "driver.pkl"
DRIVER_LOCK = "driver.lock"
DRIVER_LOG = "driver.log"
KEEPER = "keeper.json"


def sweeps_root() -> Path:
    return Path(settings().staging_root) / "sweeps"


def new_sweep_id(name: str) -> str:
    """``sweep-<name>-<utc timestamp>-<random>``: sorts by time, says what was tuned."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:32] or "fn"
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"sweep-{slug}-{stamp}-{secrets.token_hex(3)}"


class SweepFolder:
    """One sweep's folder (see the module docstring)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @property
    def sweep_id(self) -> str:
        return self.path.name

    @property
    def record_file(self) -> Path:
        return self.path / RECORD

    @property
    def journal(self) -> Path:
        return self.path / JOURNAL

    @property
    def driver_file(self) -> Path:
        return self.path / DRIVER

    @property
    def driver_log(self) -> Path:
        return self.path / DRIVER_LOG

    @property
    def keeper_file(self) -> Path:
        return self.path / KEEPER

    def create(self) -> "SweepFolder":
        self.path.mkdir(parents=True, mode=0o700)
        return self

    def read(self) -> dict[str, Any]:
        try:
            return json.loads(self.record_file.read_text())
        except FileNotFoundError:
            raise ConfigurationError(f"sweep {self.sweep_id} has no {RECORD} in {self.path}") from None

    def write(self, record: dict[str, Any]) -> None:
        atomic_write_bytes(self.record_file, json.dumps(record, indent=1, sort_keys=True).encode(), mode=0o600)

    def update(self, **fields: Any) -> dict[str, Any]:
        record = {**self.read(), **fields}
        self.write(record)
        return record

    def name_keeper(self, keeper: ProcessRef, started_at: float) -> None:
        """Names the sweep's keeper (its own file: the drivers rewrite ``sweep.json`` meanwhile)."""
        body = json.dumps({"keeper": keeper.record(), "started_at": started_at}).encode()
        atomic_write_bytes(self.keeper_file, body, mode=0o600)

    def keeper(self) -> ProcessRef | None:
        """The sweep's keeper while it lives (it restarts a driver that died), else ``None``."""
        try:
            record = json.loads(self.keeper_file.read_text()).get("keeper")
        except FileNotFoundError:
            return None
        except (ValueError, AttributeError):  # half a file can only be a crash's: no keeper wrote it whole
            return None
        if not isinstance(record, dict):
            return None
        keeper = ProcessRef.from_record(record)
        return None if keeper.is_gone() else keeper

    @contextlib.contextmanager
    def driving(self) -> Iterator[None]:
        """Holds the sweep's ``driver.lock`` while the block drives it: one driver at a time. The
        lock goes with the process holding it, however it dies, so the next driver may take it.

        Raises:
            JobStateError: another process drives the sweep now.
        """
        fd = os.open(self.path / DRIVER_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            driver = self.read().get("driver") or {}
            raise JobStateError(
                f"sweep {self.sweep_id} is driven by another process (pid {driver.get('pid', '?')}); "
                f"wait for it with sparkgpu.sweeps.DetachedSweep({self.sweep_id!r}).result()"
            ) from None
        try:
            yield
        finally:
            os.close(fd)  # releases the lock


def list_sweeps() -> list[SweepFolder]:
    """Every sweep of this machine's staging root, newest first."""
    root = sweeps_root()
    folders = [SweepFolder(p.parent) for p in root.glob(f"*/{RECORD}")] if root.is_dir() else []
    return sorted(folders, key=lambda f: f.record_file.stat().st_mtime, reverse=True)


def find_sweep(sweep_id: str) -> SweepFolder:
    """The sweep ``sweep_id`` (or the one sweep whose id starts with it).

    Raises:
        ConfigurationError: no sweep, or several, match; lists where it looked.
    """
    exact = sweeps_root() / sweep_id
    if (exact / RECORD).is_file():
        return SweepFolder(exact)
    matches = [f for f in list_sweeps() if f.sweep_id.startswith(sweep_id)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ConfigurationError(f"no sweep {sweep_id!r} under {sweeps_root()}; `sparkgpu sweeps` lists them")
    raise ConfigurationError(
        f"{sweep_id!r} matches {len(matches)} sweeps ({', '.join(f.sweep_id for f in matches[:5])}); give more of the id"
    )
