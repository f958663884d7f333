"""A hung attempt's record in its folder: ``hang.json`` (the diagnosis) and ``hang.txt`` (it and every rank's stacks).

The supervisor writes both when it finds an attempt hung (:mod:`~sparkgpu.launch.client.progress_watch`);
:func:`~sparkgpu.launch.client.attempt_verdict.read_attempt` reads ``hang.json`` back to fail the
rank(s) behind with a :class:`~sparkgpu.errors.HangError`, whose class is ``hang``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.errors import HangError, RankFailure
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout

__all__ = ["HangRecord", "HANG_ERROR_TYPE"]

#: The exception type a hung rank's failure names (``RankFailure.exc_type``).
HANG_ERROR_TYPE = f"{HangError.__module__}.{HangError.__qualname__}"


@dataclasses.dataclass(frozen=True)
class HangRecord:
    """What the supervisor found when it judged an attempt hung.

    Attributes:
        detected_at: Unix time it found the hang.
        timeout: The progress timeout that passed, in seconds.
        behind: The ranks behind.
        summary: One sentence: who is behind and where, who waits where.
        stacks: The path of ``hang.txt``.
        ranks: Per rank: its node, state, place and progress record.
    """

    detected_at: float
    timeout: float
    behind: list[int]
    summary: str
    stacks: str
    ranks: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def unrecorded(cls, ranks: list[int], stacks: str) -> HangRecord:
        """What stands for a hung attempt whose record could not be read back: its unfinished ranks."""
        return cls(time.time(), 0.0, ranks, "the attempt hung; its diagnosis could not be read back", stacks)

    @property
    def message(self) -> str:
        return f"{self.summary}. Every rank's stacks: {self.stacks}"

    def failures(self) -> tuple[list[RankFailure], dict[int, BaseException]]:
        """The failures of the ranks behind, and their exceptions, as read_attempt reports them."""
        failures = [RankFailure(r, HANG_ERROR_TYPE, self.message, timestamp=self.detected_at) for r in self.behind]
        return failures, {r: HangError(self.message) for r in self.behind}

    def write(self, rd: RunDir, attempt: int, stacks_text: str) -> None:
        atomic_write_bytes(rd.file(RunLayout.hang_stacks(attempt)), stacks_text.encode())
        atomic_write_bytes(rd.file(RunLayout.hang(attempt)), json.dumps(dataclasses.asdict(self), indent=1).encode())

    @classmethod
    def read(cls, rd: RunDir, attempt: int) -> HangRecord | None:
        """The attempt's record; ``None`` when it has none (or it is unreadable)."""
        try:
            data = json.loads(rd.file(RunLayout.hang(attempt)).read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None
