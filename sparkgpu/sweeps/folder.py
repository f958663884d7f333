"""A sweep's folder: ``<staging_root>/sweeps/<sweep_id>/``, what a resume needs to go on.

Layout::

    sweep.json        the sweep's settings (trials, concurrency, budget, ...), its study's name
                      and storage, its MLflow parent run, the driver process
    study.journal     the default study storage: Optuna's JournalStorage, file backend
    driver.pkl        the training function and its fixed arguments (cloudpickled), for
                      ``sparkgpu sweep resume`` from a process that does not have them

The folder sits beside the jobs' run dirs (which are folders with a ``spec.json``; this one has
none, so listing and retention of jobs pass it by).
"""

from __future__ import annotations

import json
import re
import secrets
import datetime as _dt
from pathlib import Path
from typing import Any

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.config import settings
from sparkgpu.errors import ConfigurationError

__all__ = ["SweepFolder", "new_sweep_id", "sweeps_root", "list_sweeps", "find_sweep"]

RECORD = "sweep.json"
JOURNAL = "study.journal"
DRIVER = "driver.pkl"


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
