"""Live output: the ranks' log files in the run dir, tailed to the caller with a rank prefix.

Files rather than sockets: a log connection that an idle timeout kills must never be able to
kill training, and the same files serve ``sparkgpu logs JOB_ID`` after the fact.
"""

from __future__ import annotations

import os

from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout

__all__ = ["LogStreamer"]

_MAX_READ = 4 << 20  # bytes of one rank's log read per pass


class LogStreamer:
    """Copies complete new lines of the selected ranks' logs to ``out``, prefixed ``[rankN]``.

    Args:
        run_dir: The job's run directory.
        attempt: Attempt whose logs to follow.
        world_size: Number of ranks.
        ranks: Ranks to stream; ``None`` for all.
        out: A text stream.
    """

    def __init__(self, run_dir: RunDir, attempt: int, world_size: int, ranks, out):
        self.run_dir = run_dir
        self.attempt = attempt
        self.ranks = list(range(world_size)) if ranks is None else [r for r in ranks if r < world_size]
        self.out = out
        self._offsets = {r: 0 for r in self.ranks}
        self._partial = {r: b"" for r in self.ranks}

    def pump(self) -> None:
        """Writes complete lines that appeared since the last call (up to a bounded amount per
        rank, so one chatty rank cannot hold the others' lines back for long)."""
        wrote = False
        for rank in self.ranks:
            size = self._size(rank)
            if size is not None:
                wrote |= self._copy(rank, min(size, self._offsets[rank] + _MAX_READ))
        if wrote:
            self.out.flush()

    def finish(self) -> None:
        """Writes everything left, however much it is, including a last line without a newline."""
        for rank in self.ranks:
            # The ranks have ended: read to the size seen now, in bounded reads, whatever the burst.
            size = self._size(rank)
            while size is not None and self._offsets[rank] < size:
                self._copy(rank, min(size, self._offsets[rank] + _MAX_READ))
            if self._partial[rank]:
                self.out.write(f"[rank{rank}] " + self._partial[rank].decode(errors="replace") + "\n")
                self._partial[rank] = b""
        self.out.flush()

    def _size(self, rank: int) -> int | None:
        try:
            return os.path.getsize(self.run_dir.file(RunLayout.rank_log(self.attempt, rank)))
        except FileNotFoundError:
            return None

    def _copy(self, rank: int, end: int) -> bool:
        """Writes the complete lines of ``rank``'s log up to byte ``end``; True if any."""
        start = self._offsets[rank]
        if end <= start:
            return False
        with open(self.run_dir.file(RunLayout.rank_log(self.attempt, rank)), "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        if not data:  # the file shrank (truncated by hand): nothing more to read
            self._offsets[rank] = end
            return False
        self._offsets[rank] += len(data)
        *lines, self._partial[rank] = (self._partial[rank] + data).split(b"\n")
        prefix = f"[rank{rank}] "
        for line in lines:
            self.out.write(prefix + line.decode(errors="replace") + "\n")
        return bool(lines)
