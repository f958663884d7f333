"""A sweep trial as its ranks see it: the parameters it was given, and the values rank 0 reports.

Runs on every rank of a trial job (:func:`sparkgpu.runtime.trial` and
:func:`sparkgpu.runtime.report` are thin calls into here) and on the sweep's side, which reads
the reports back. Standard library only, but for the one collective that makes every rank agree
on a stop (torch, already loaded on a rank).

The parameters travel in the ranks' environment (:data:`ENV_TRIAL`, set by the trial job's
callback for every attempt): every rank reads the same JSON, so no rank samples its own. Rank 0
keeps its reports in ``attempts/<k>/trial-reports.json`` of the run dir, rewritten whole and
atomically at each report (a reader never sees half a file); the sweep polls that file, so a
report costs no request to any server. On Spark that file is in the run dir of node 0's executor:
node 0 reads it with its ranks' progress and writes the reports into the attempt's state, which
the client reads while the attempt runs (:func:`read_attempt_reports`); still no request per report.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ENV_TRIAL", "Report", "trial_params", "trial_number", "report", "read_reports", "read_attempt_reports"]

#: The ranks' environment: ``{"sweep": id, "number": n, "params": {...}}`` of the trial they run.
ENV_TRIAL = "SPARKGPU_TRIAL"

Report = tuple[int, float]  # (step, value)

_lock = threading.Lock()
_reported: dict[str, list[list[float]]] = {}  # path -> [[step, value, unix time], ...] written by this rank


def _trial() -> dict[str, Any] | None:
    raw = os.environ.get(ENV_TRIAL)
    if not raw:
        return None
    data = json.loads(raw)
    return data if isinstance(data, dict) else None


def trial_params(defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The trial's parameters over ``defaults``; outside a sweep trial, a copy of ``defaults`` (or ``{}``)."""
    trial = _trial()
    return {**(defaults or {}), **((trial or {}).get("params") or {})}


def trial_number() -> int | None:
    """The trial's number in its study, or ``None`` outside a sweep trial."""
    trial = _trial()
    return None if trial is None else int(trial["number"])


def _check(step, value) -> tuple[int, float]:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"runtime.report(step, value): step must be an int >= 0 (the training step), got {step!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"runtime.report(step, value): value must be a number (a loss, an accuracy), got {type(value).__name__}; "
            "pass a Python float or a one-element tensor"
        ) from None
    if not math.isfinite(number):
        raise ValueError(f"runtime.report({step}, {number}): the value must be finite")
    return step, number


def _write(path: str, rows: list[list[float]]) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=".trial-reports.", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"reports": rows}, f)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def _any_rank(flag: bool) -> bool:
    """``flag`` or'ed over every rank of the process group (every rank must call it), or as it is without one."""
    try:
        import torch.distributed as dist
    except ImportError:
        return flag
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def report(step, value, *, path: str | None, is_main: bool, stop_requested: Callable[[], bool]) -> bool:
    """Records ``value`` at ``step`` (rank 0 only writes it) and says whether every rank should stop now.

    Args:
        step: The training step.
        value: The value the study optimizes, at that step.
        path: The attempt's report file, or ``None`` outside a job.
        is_main: Whether this is rank 0.
        stop_requested: Whether the job asks this rank to stop (``runtime.should_checkpoint``).

    Returns:
        The same answer on every rank: whether any rank was asked to stop (the sweep pruned the
        trial, or the job must checkpoint). Every rank calls it at the same step.

    Raises:
        ValueError: ``step`` is no step, or ``value`` no finite number.
    """
    step, number = _check(step, value)
    if is_main and path is not None and _trial() is not None:
        with _lock:
            rows = _reported.setdefault(path, [])
            rows.append([step, number, time.time()])
            _write(path, rows)
    return _any_rank(stop_requested())


def read_reports(path: str) -> list[Report]:
    """The reports in one attempt's report file, in the order made; ``[]`` when there is none yet."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return []
    rows = data.get("reports") if isinstance(data, dict) else None
    return [(int(row[0]), float(row[1])) for row in rows or []]


def read_attempt_reports(run_dir: Path, attempt: int) -> list[Report]:
    """The reports of attempt ``attempt`` of the trial job in ``run_dir``, as the sweep sees them
    while the attempt runs: rank 0's file where the ranks write into this run dir (locally, a
    shared folder, or a Spark attempt that ended and came back), else those node 0 of a Spark
    attempt relays in the attempt's state; ``[]`` when there is none yet."""
    from sparkgpu.rundir.directory import RunDir
    from sparkgpu.rundir.layout import RunLayout

    path = run_dir / RunLayout.trial_reports(attempt)
    if path.exists():
        return read_reports(str(path))
    state = run_dir / RunLayout.spark_state(attempt)
    if not state.exists():
        return []
    relayed = RunDir(run_dir).read_control_json(state)  # sealed by node 0 under the job key
    rows = relayed.get("reports") if isinstance(relayed, dict) else None
    try:
        return [(int(row[0]), float(row[1])) for row in rows or []]
    except (TypeError, ValueError, IndexError):
        return []
