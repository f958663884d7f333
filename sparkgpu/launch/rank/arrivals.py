"""A rank's side of straggler detection: when it reached each of its latest collectives.

Ranks of a synchronous job wait for one another in every collective, so their step times are
the same and tell nothing: what tells a slow rank is *when it arrives*. A rank that computes
its step 1.5x slower than its peers reaches each collective after them, and they wait for it.
torch's flight recorder (turned on in every rank, :mod:`sparkgpu.launch.rank.flight_recorder`)
stamps each collective with the wall-clock time the rank issued it (``time_created_ns``), for
gloo as for NCCL.

Every :data:`LOOK_ENV` seconds the rank's flight-recorder thread reads the recorder and
rewrites ``attempts/<k>/arrivals/rank-<r>.json`` with its latest :data:`SAMPLES` collectives
on the job's group, ``[[sequence number, Unix time], ...]``: a few hundred bytes. The
supervisor lines the ranks' files up by sequence number
(:mod:`sparkgpu.launch.client.stragglers`); on Spark the nodes' beats carry them to node 0.

A read of the recorder costs the rank tens of milliseconds (its ring holds
:data:`~sparkgpu.launch.rank.flight_recorder.FR_ENTRIES` entries), once a look: the look is a
quarter of the straggler window (at most :data:`MOST_LOOK` seconds), so the cost stays under a
per mille of a rank's time. No store request is made.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from pathlib import Path

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout

__all__ = [
    "LOOK_ENV",
    "SAMPLES",
    "MOST_LOOK",
    "look_seconds",
    "latest_arrivals",
    "write_arrivals",
    "read_arrivals",
    "read_ranks_arrivals",
]

#: The ranks' variable holding the seconds between two looks at the recorder (absent or 0: none).
LOOK_ENV = "SPARKGPU_STRAGGLER_LOOK"
#: Collectives each look keeps: the latest, on the job's group.
SAMPLES = 16
#: Most seconds between two looks.
MOST_LOOK = 15.0
#: The process group every rank of a job is in (torch names it so in the recorder).
_DEFAULT_GROUP = "default_pg"


def look_seconds(window: float) -> float:
    """The seconds between two looks for a straggler window of ``window`` seconds (four looks a window)."""
    return min(MOST_LOOK, max(0.25, window / 4))


def _entries(backend: str) -> list[dict]:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return []
    from torch._C import _distributed_c10d as c10d

    if backend == "nccl" and hasattr(c10d, "_dump_nccl_trace"):
        raw = c10d._dump_nccl_trace(True, False, False)
    else:
        raw = c10d._dump_fr_trace(True, False, False)  # type: ignore[attr-defined]
    return list(pickle.loads(raw).get("entries") or ())


def latest_arrivals(entries: list[dict], samples: int = SAMPLES) -> list[list[float]]:
    """``[[seq, unix time], ...]``: the latest ``samples`` collectives of the job's group in a recorder's
    entries (else of the group with the most), oldest first; point-to-point operations left out."""
    by_group: dict[str, dict[int, float]] = {}
    for entry in entries:
        if not isinstance(entry, dict) or entry.get("is_p2p"):
            continue
        seq, created = entry.get("collective_seq_id"), entry.get("time_created_ns")
        if not seq or not created:
            continue
        group = entry.get("process_group") or ("", "")
        by_group.setdefault(str(group[-1]), {})[int(seq)] = int(created) / 1e9
    if not by_group:
        return []
    name = _DEFAULT_GROUP if _DEFAULT_GROUP in by_group else max(by_group, key=lambda g: len(by_group[g]))
    found = by_group[name]
    return [[seq, found[seq]] for seq in sorted(found)[-samples:]]


def write_arrivals(out: Path, backend: str) -> None:
    """Rewrites ``out`` with this rank's latest arrivals (nothing when it issued no collective yet)."""
    arrivals = latest_arrivals(_entries(backend))
    if arrivals:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out, json.dumps({"at": time.time(), "arrivals": arrivals}).encode(), fsync=False)


def read_arrivals(path: str | os.PathLike) -> list[list[float]] | None:
    """A rank's arrivals file as written (``None``: none yet, or it does not read whole)."""
    try:
        data = json.loads(Path(path).read_bytes())
        return [[int(seq), float(at)] for seq, at in data["arrivals"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_ranks_arrivals(rd: RunDir, attempt: int, ranks) -> dict[int, list[list[float]]]:
    """The arrivals files of ``ranks`` in attempt ``attempt`` of ``rd``, by rank; a rank without one yet is absent."""
    found = {}
    for rank in ranks:
        rows = read_arrivals(rd.file(RunLayout.arrivals(attempt, rank)))
        if rows:
            found[rank] = rows
    return found
