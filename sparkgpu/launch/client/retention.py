"""Old run dirs go, so a long session or a busy machine does not fill its disk.

Each new job prunes the run dirs of its user's finished jobs beyond ``SPARKGPU_KEEP_RUNS`` (by
default it keeps the newest 100 finished jobs, none older than 30 days), with their signing keys
and their copies on the staging store, and says which it removed. The staging root may be
shared: a job is its user's when its run dir belongs to this OS user and its key is in this
user's keyring; no one else's job is counted or removed. A job that may still continue is never
pruned by count: one running under a live client is kept whatever its age; one whose client
died (``sparkgpu resume`` continues it), that a budget stopped, or that failed, timed out or
was cancelled with checkpoints to resume from, only once it is older than the age limit. A
run dir is renamed
out of sight before it is deleted, so ``sparkgpu jobs`` never lists half of one; the deleting
happens on a background thread (a job's checkpoints may be large), and what an exiting process
left half deleted goes with the next prune.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

from sparkgpu.rundir.keyring import forget_key, key_file
from sparkgpu._util.report import report
from sparkgpu.config import Settings, settings
from sparkgpu.rundir.states import JobStatus
from sparkgpu.rundir.layout import RunLayout

__all__ = ["prune_runs"]

log = logging.getLogger(__name__)

_FINISHED = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.TIMED_OUT, JobStatus.CANCELLED}
_RESUMABLE_IF_CHECKPOINTED = _FINISHED - {JobStatus.SUCCEEDED}
_RESUMABLE = {JobStatus.STOPPED, JobStatus.RUNNING, JobStatus.PENDING}


def _read_state(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / RunLayout.STATE).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None  # being written, or not ours to judge


def _created_at(run_dir: Path, state: dict) -> float:
    return state.get("created_at") or (run_dir / RunLayout.SPEC).stat().st_mtime


def _owned(run_dir: Path, config: Settings) -> bool:
    """Whether the job is this user's: its run dir is this OS user's and its key is in this user's keyring."""
    try:
        return run_dir.stat().st_uid == os.getuid() and key_file(run_dir.name, config.home).is_file()
    except FileNotFoundError:
        return False


def _may_have_checkpoints(run_dir: Path, config: Settings) -> bool:
    """Whether ``sparkgpu resume`` could continue the job from a checkpoint (on a store: assumed so)."""
    if config.staging_url:
        return True
    try:
        return any((run_dir / RunLayout.CHECKPOINTS).iterdir())
    except FileNotFoundError:
        return False


def _verdict(run_dir: Path, state: dict, now: float, max_age: float | None, config: Settings) -> tuple[bool, bool]:
    """``(countable, too_old)``: may the count limit take it, is it past the age limit."""
    from sparkgpu.launch.client.resume import client_is_gone

    too_old = max_age is not None and now - _created_at(run_dir, state) > max_age
    status = state.get("status")
    if status in _RESUMABLE_IF_CHECKPOINTED and _may_have_checkpoints(run_dir, config):
        return False, too_old  # `sparkgpu resume` continues it from its checkpoint: only age takes it
    if status in _FINISHED:
        return True, too_old
    if status in _RESUMABLE:
        # Resumable by hand: only age takes it, and never while its client still drives it.
        gone = status == JobStatus.STOPPED or client_is_gone(state.get("client"))
        return False, too_old and gone
    return False, too_old  # staged and never started (a dry run, or a launch that died early)


def prune_runs(
    config: Settings | None = None, *, keep: str | None = None, now: float | None = None, wait: bool = False
) -> list[str]:
    """Removes the run dirs that ``SPARKGPU_KEEP_RUNS`` no longer keeps.

    Args:
        config: The settings (the process's by default).
        keep: A job id never to remove (the job being launched).
        now: The current time, for tests.
        wait: Delete before returning instead of on a background thread.

    Returns:
        The job ids removed.
    """
    config = config or settings()
    if config.keep_runs is None and config.keep_runs_days is None:
        return []
    now = time.time() if now is None else now
    max_age = config.keep_runs_days * 86400 if config.keep_runs_days is not None else None
    entries = []
    for spec_file in Path(config.staging_root).glob("*/spec.json"):
        run_dir = spec_file.parent
        state = _read_state(run_dir)
        if state is None or run_dir.name == keep or not _owned(run_dir, config):
            continue
        try:
            entries.append((_created_at(run_dir, state), run_dir, state))
        except FileNotFoundError:
            continue  # another process pruned it meanwhile
    entries.sort(key=lambda e: e[0], reverse=True)
    removed, finished_seen = [], 0
    for _, run_dir, state in entries:
        countable, too_old = _verdict(run_dir, state, now, max_age, config)
        over_count = countable and config.keep_runs is not None and finished_seen >= config.keep_runs
        finished_seen += countable
        if (too_old or over_count) and _hide(run_dir):
            removed.append(run_dir.name)
    leftovers = sorted(Path(config.staging_root).glob(".*.removing"))
    if leftovers:
        if wait:
            _delete(leftovers, config)
        else:
            threading.Thread(target=_delete, args=(leftovers, config), name="sparkgpu-prune-runs", daemon=True).start()
    if removed:
        shown = ", ".join(removed[:10]) + (f" and {len(removed) - 10} more" if len(removed) > 10 else "")
        report(
            f"removing {len(removed)} of your old run dirs under {config.staging_root} (SPARKGPU_KEEP_RUNS): {shown}"
        )
    return removed


def _hide(run_dir: Path) -> bool:
    try:
        run_dir.rename(run_dir.with_name(f".{run_dir.name}.removing"))  # out of every listing at once
        return True
    except FileNotFoundError:
        return False  # a concurrent pruner took it


def _delete(hidden_dirs: list[Path], config: Settings) -> None:
    for hidden in hidden_dirs:
        job_id = hidden.name[1 : -len(".removing")]
        prefix: str | None
        try:  # the prefix the job was staged under (sparkgpu.launch.staging.mirror.store_prefix)
            prefix = (hidden / RunLayout.STAGING_PREFIX).read_text().strip()
        except OSError:
            prefix = config.staging_url  # staged before prefixes were recorded, or never staged
        shutil.rmtree(hidden, onerror=_report)
        forget_key(job_id, config.home)
        if prefix:
            _remove_from_store(f"{prefix}/{job_id}")


def _remove_from_store(url: str) -> None:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    try:
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except OSError as exc:  # the local copy is gone; a stale store copy is only disk, said once
        log.warning("could not remove the staging store copy %s: %s", url, exc)


def _report(function, path, exc_info) -> None:
    log.warning("could not remove %s: %s", path, exc_info[1])
