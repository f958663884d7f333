"""Attempts in progress, journaled on local disk so usage survives a client that dies mid-attempt.

The ledger row of an attempt is written when the attempt ends. If the client is killed
before that (its ranks die with it), the row would be lost. So each running attempt keeps a
small JSON file here with a heartbeat; a later client (any job's start, or ``sparkgpu
usage``) finds files whose owner is gone and bills them up to their last heartbeat with
status ``client_lost``. A file is claimed by an atomic rename first, so two clients
recovering at once never bill it twice. The same files also hold rows whose ledger write
failed (store unreachable), to be written on the next try.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu._util.process import ProcessRef, pid_gone

__all__ = ["AttemptJournal"]

_SUFFIX = ".json"


class AttemptJournal:
    """One JSON file per running attempt under ``directory``.

    Args:
        directory: Local folder (created on demand).
        stale_after: Seconds without a heartbeat after which an entry from another host
            counts as abandoned (entries from this host are checked by process id at once).
    """

    def __init__(self, directory: str | os.PathLike, stale_after: float = 300.0):
        self.directory = Path(directory)
        self.stale_after = stale_after

    def _path(self, job_id: str, attempt: int) -> Path:
        return self.directory / f"{job_id}.{attempt}{_SUFFIX}"

    def open(self, job_id: str, attempt: int, record: dict[str, Any]) -> Path:
        """Journals a running attempt; ``record`` holds the :meth:`~sparkgpu.usage.ledger.UsageRecord.priced` arguments but ``ended_at``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        entry = {
            "record": record,
            "owner": ProcessRef.current().record(),
            "heartbeat": time.time(),
            "ended_at": None,
        }
        path = self._path(job_id, attempt)
        atomic_write_bytes(path, json.dumps(entry).encode())
        return path

    def beat(self, path: Path) -> None:
        """Moves the entry's heartbeat to now."""
        entry = self._read(path)
        if entry is not None:
            entry["heartbeat"] = time.time()
            atomic_write_bytes(path, json.dumps(entry).encode())

    def finish(self, path: Path, record: dict[str, Any]) -> None:
        """Keeps a finished attempt whose ledger write failed, so :meth:`recover` writes it later."""
        entry = self._read(path) or {"owner": {}}
        entry.update(record=record, ended_at=record["ended_at"], heartbeat=time.time())
        entry["owner"] = {}  # no owner: anyone may write it
        atomic_write_bytes(path, json.dumps(entry).encode())

    def close(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    @staticmethod
    def _read(path: Path) -> dict | None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def _abandoned(self, entry: dict, now: float) -> bool:
        if entry.get("ended_at") is not None:
            return True
        owner = ProcessRef.from_record(entry.get("owner") or {})
        if owner.on_this_machine() and owner.pid:
            return owner.is_gone()
        return now - entry.get("heartbeat", now) > self.stale_after

    def _release_dead_claims(self) -> None:
        # A client that died between claiming an entry and writing it leaves a claim behind.
        for claim in self.directory.glob(f"*{_SUFFIX}.claimed-*"):
            pid = claim.name.rsplit("-", 1)[-1]
            if pid.isdigit() and int(pid) != os.getpid() and pid_gone(int(pid)):
                try:
                    os.rename(claim, claim.with_name(claim.name.split(".claimed-")[0]))
                except FileNotFoundError:
                    continue

    def recover(self, write) -> list[dict]:
        """Hands every abandoned attempt to ``write`` and removes it once written.

        Args:
            write: Called with a list of ``UsageRecord.priced`` keyword dicts (``ended_at`` and
                ``status`` filled in); raises when the rows could not be stored.

        Returns:
            The records written.
        """
        if not self.directory.is_dir():
            return []
        self._release_dead_claims()
        now, claimed = time.time(), []
        for path in sorted(self.directory.glob(f"*{_SUFFIX}")):
            entry = self._read(path)
            if entry is None or not self._abandoned(entry, now):
                continue
            claim = path.with_name(f"{path.name}.claimed-{os.getpid()}")
            try:
                os.rename(path, claim)  # atomic: only one recovering client wins the entry
            except FileNotFoundError:
                continue
            record = dict(entry["record"])
            if entry.get("ended_at") is None:
                record.update(ended_at=max(entry["heartbeat"], record["started_at"]), status="client_lost")
            claimed.append((path, claim, record))
        if not claimed:
            return []
        try:
            write([record for _, _, record in claimed])
        except BaseException:
            for path, claim, _ in claimed:
                os.replace(claim, path)  # give the entries back for the next try
            raise
        for _, claim, _ in claimed:
            claim.unlink(missing_ok=True)
        return [record for _, _, record in claimed]
