"""The last collective of each rank of a hung attempt, from torch's flight recorder.

Each rank dumps its recorder when its stacks are asked for (:mod:`sparkgpu.launch.rank.flight_recorder`).
The entries carry the group's collective sequence number: ranks of one group issue their
collectives in the same order, so a rank whose last sequence number is lower than its peers'
has not reached the collective they wait in, whatever its Python stack shows. That is the
fact that names the rank behind when every rank's stack is inside a collective (a rank stuck
in an earlier one, or one that issued a different one).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

__all__ = ["LastCollective", "last_collective", "read_record", "behind_by_sequence"]

#: The process group every rank of a job is in (torch names it so in the recorder).
_DEFAULT_GROUP = "default_pg"


@dataclasses.dataclass(frozen=True)
class LastCollective:
    """The last collective a rank issued on a group, as its flight recorder had it.

    Attributes:
        seq: Its sequence number in the group (``collective_seq_id``; the first is 1).
        name: What ran (``"gloo:all_reduce"``, ``"nccl:all_gather"``).
        completed: Whether it had finished when the recorder was dumped.
        group: The group's name (``"default_pg"`` for the job's).
    """

    seq: int
    name: str
    completed: bool
    group: str

    @property
    def words(self) -> str:
        return f"collective #{self.seq} ({self.name}, {'completed' if self.completed else 'not completed'})"


def read_record(path: str | Path) -> dict | None:
    """A rank's dump as JSON; ``None`` where there is none or it does not parse."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def last_collective(dump: Mapping | None) -> LastCollective | None:
    """The last collective of the job's group in a rank's dump (else of the group with the most
    entries); ``None`` where the dump holds none (an error, no collective yet)."""
    entries = [e for e in (dump or {}).get("entries") or () if isinstance(e, dict) and not e.get("is_p2p")]
    by_group: dict[str, list[dict]] = {}
    for entry in entries:
        group = entry.get("process_group") or ["", ""]
        by_group.setdefault(str(group[-1]), []).append(entry)
    if not by_group:
        return None
    name = _DEFAULT_GROUP if _DEFAULT_GROUP in by_group else max(by_group, key=lambda g: len(by_group[g]))
    last = max(by_group[name], key=lambda e: int(e.get("collective_seq_id") or 0))
    completed = bool(last.get("retired")) or last.get("state") == "completed"
    return LastCollective(
        int(last.get("collective_seq_id") or 0), str(last.get("profiling_name") or "?"), completed, name
    )


def behind_by_sequence(last: Mapping[int, LastCollective | None]) -> list[int]:
    """The ranks whose last collective on the job's group comes before their peers'; ``[]`` when
    any rank's is unknown, the ranks are on different groups, or all issued the same one."""
    known = {rank: c for rank, c in last.items() if c is not None}
    if not known or len(known) < len(last) or len({c.group for c in known.values()}) != 1:
        return []
    lowest = min(c.seq for c in known.values())
    if all(c.seq == lowest for c in known.values()):
        return []
    return sorted(rank for rank, c in known.items() if c.seq == lowest)
