"""Live output: the ranks' log files in the run dir, tailed to the caller with a rank prefix.

Files rather than sockets: a log connection that an idle timeout kills must never be able to
kill training, and the same files serve ``sparkgpu logs JOB_ID`` after the fact.
"""

from __future__ import annotations

import os

from sparkgpu.launch.payload import RunDir

__all__ = ["LogStreamer"]

_CHUNK = 1 << 16


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
        """Writes whatever complete lines appeared since the last call."""
        wrote = False
        for rank in self.ranks:
            path = self.run_dir.log_file(self.attempt, rank)
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                continue
            if size <= self._offsets[rank]:
                continue
            with open(path, "rb") as f:
                f.seek(self._offsets[rank])
                data = f.read(min(size - self._offsets[rank], 64 * _CHUNK))
            self._offsets[rank] += len(data)
            data = self._partial[rank] + data
            *lines, self._partial[rank] = data.split(b"\n")
            prefix = f"[rank{rank}] "
            for line in lines:
                self.out.write(prefix + line.decode(errors="replace") + "\n")
                wrote = True
        if wrote:
            self.out.flush()

    def finish(self) -> None:
        """Writes what is left, including a last line without a newline."""
        self.pump()
        for rank in self.ranks:
            if self._partial[rank]:
                self.out.write(f"[rank{rank}] " + self._partial[rank].decode(errors="replace") + "\n")
                self._partial[rank] = b""
        self.out.flush()
