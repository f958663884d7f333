"""One conversion at a time per output folder: a claim taken before the first write, that others wait on.

Two processes converting the same data into the same folder at once (two users training on
one table) would clear each other's shards. Before it writes anything, a conversion therefore
*claims* the folder:

- A claim is a small JSON file, ``.sparkgpu-claim.<generation>``, in the folder, **created only
  if absent**: a hard link of a complete temporary file in a local folder (``O_EXCL`` where the
  filesystem has no hard links), a conditional PUT (``If-None-Match: *``) on S3, fsspec's
  ``mode="create"`` elsewhere. Of two processes creating the same generation, one succeeds.
- Its holder **renews** it (rewrites it) every third of its lease. A waiter judges a claim
  **stale** when its bytes have not changed for a whole lease as the waiter's own clock measures
  it (no clocks are compared across machines), or at once when the holder's process is gone
  from the waiter's own machine (same host, boot and PID namespace).
- A **waiter** polls. A released claim lets it take the next generation; a stale one is
  **taken over** by creating the next generation, again only if absent, so of several waiters
  one wins. Waiting is bounded; while it lasts the waiter reports who holds the folder and how
  far it got, and when it runs out the error names the holder and the fix.
- Before the conversion publishes its index it checks that the highest generation is still its
  own: a holder paused past its lease finds itself taken over and fails instead of publishing.
- **Release** removes the holder's claim and the stale ones before it.

Runs only where a conversion is started (a client or a Spark driver), never on executors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from sparkgpu._util.files import fsync_dir, temporary_name
from sparkgpu._util.process import ProcessRef, machine_id, start_ticks
from sparkgpu._util.report import report
from sparkgpu.errors import DataError
from sparkgpu.store import Store

__all__ = ["CLAIM_PREFIX", "DEFAULT_WAIT_S", "ClaimRecord", "FolderClaim", "is_claim"]

_logger = logging.getLogger(__name__)

CLAIM_PREFIX = ".sparkgpu-claim."
# How long a conversion waits, by default, for another one writing into the same folder. A
# claim whose holder died is taken over after its lease (a minute), long before this.
DEFAULT_WAIT_S = 3600.0

T = TypeVar("T")


def is_claim(name: str) -> bool:
    """Whether ``name`` (an entry of an output folder) is a conversion's claim on the folder."""
    return name.startswith(CLAIM_PREFIX) and name[len(CLAIM_PREFIX) :].isdigit()


def _claim_name(generation: int) -> str:
    return f"{CLAIM_PREFIX}{generation:010d}"


@dataclasses.dataclass(frozen=True)
class ClaimRecord:
    """The content of a claim file: who holds the folder, and how far it got.

    Attributes:
        run_id: The conversion's id (also in its marker and its index).
        generation: The claim's number; a takeover creates the next one.
        host: Host name of the holder, for people.
        machine: Host, boot and PID namespace (:func:`sparkgpu._util.process.machine_id`), or ``None``.
        pid: Process id of the holder.
        pid_started: Its start time in ticks since boot, to tell a reused pid apart.
        started: When the claim was taken (Unix time, the holder's clock; for people).
        beats: Renewals so far: every renewal changes the file.
        lease_s: Seconds the holder promises never to leave the claim unrenewed.
        progress: ``{"done": n, "total": t or None, "unit": "rows" | "Spark tasks"}`` or empty.
    """

    run_id: str
    generation: int
    host: str
    machine: str | None
    pid: int
    pid_started: str | None
    started: float
    beats: int
    lease_s: float
    progress: dict

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode("utf-8")

    @classmethod
    def parse(cls, data: bytes) -> ClaimRecord | None:
        """The record in ``data``, or ``None`` for a file being written or not a claim."""
        try:
            fields = json.loads(data)
            return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls)})
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self) -> str:
        """Who holds the claim and how far it got, in words."""
        since = time.strftime("%H:%M:%S UTC", time.gmtime(self.started))
        text = f"run {self.run_id[:12]} (pid {self.pid} on {self.host}, since {since}"
        done, total, unit = (self.progress.get(k) for k in ("done", "total", "unit"))
        if done is not None:
            text += f", {done:,}" + (f" of {total:,}" if total else "") + f" {unit or 'rows'} done"
        return text + ")"


@dataclasses.dataclass
class _Sight:
    """The highest claim of a folder as one look saw it."""

    generation: int
    raw: bytes
    record: ClaimRecord | None

    def describe(self) -> str:
        return self.record.describe() if self.record else f"an unreadable claim ({_claim_name(self.generation)})"


class FolderClaim:
    """This conversion's claim on its output folder (see the module docstring).

    The lease, the polling interval, how often a waiter reports, and the clock and pause a
    waiter measures its wait with are class attributes: tests shorten them, or advance time
    themselves.

    Args:
        store: The output folder.
        run_id: The conversion's id.
    """

    lease_s: float = 60.0
    poll_s: float = 1.0
    report_every_s: float = 30.0
    clock = staticmethod(time.monotonic)
    sleep = staticmethod(time.sleep)

    def __init__(self, store: Store, run_id: str):
        self.store = store
        self.run_id = run_id
        self.generation: int | None = None
        self.waited_s = 0.0
        self._machine = machine_id()
        self._pid = os.getpid()
        self._started = time.time()
        self._beats = 0
        self._progress: dict = {}
        self._lost: _Sight | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        # What a waiter saw of the current claim, and since when by its own clock.
        self._seen: tuple[int, bytes] | None = None
        self._seen_since = 0.0

    # -- acquiring ---------------------------------------------------------------------

    def acquire(self, wait_s: float, finished: Callable[[bool], T | None]) -> T | None:
        """Takes the claim, waiting up to ``wait_s`` seconds while another conversion holds it.

        Args:
            wait_s: Longest wait for a live claim of another conversion; 0 fails at once.
            finished: Called once the claim is taken, with whether this conversion waited for
                another one: what it returns, when not ``None``, is returned instead of
                converting (the claim is then released).

        Returns:
            ``None`` when the claim is held (convert now, then :meth:`release`), else what
            ``finished`` returned.

        Raises:
            DataError: Another conversion still holds a live claim after ``wait_s``.
        """
        began = self.clock()
        deadline = began + wait_s
        holder: _Sight | None = None
        last_report = began
        while True:
            taken, seen = self._try_take()
            if taken:
                self.waited_s = self.clock() - began if holder is not None else 0.0
                # Only now: while another conversion holds the folder, an index there may be
                # the old dataset it is replacing.
                try:
                    result = finished(holder is not None)
                except BaseException:
                    self.release()
                    raise
                if result is not None:
                    self.release()
                    return result
                self._renewer = threading.Thread(target=self._renew, name="sparkgpu-claim", daemon=True)
                self._renewer.start()
                return None
            now = self.clock()
            if seen is not None:
                if holder is None:
                    report(
                        f"{self.store.url} is being converted by {seen.describe()}; waiting for it (up to {wait_s:g} s)"
                    )
                    last_report = now
                elif now - last_report >= self.report_every_s:
                    report(f"still waiting for {seen.describe()} to convert {self.store.url} ({now - began:.0f} s)")
                    last_report = now
                holder = seen
            if now >= deadline:
                raise self._timeout_error(wait_s, holder)
            pause = self._poll(seen) if seen is not None else 0.05  # 0.05: the folder changed under the look
            self.sleep(max(0.0, min(pause, deadline - now)))

    def _poll(self, seen: _Sight) -> float:
        lease = seen.record.lease_s if seen.record else self.lease_s
        return min(self.poll_s, lease / 4)

    def _try_take(self) -> tuple[bool, _Sight | None]:
        """One attempt: ``(True, None)`` when taken, else ``(False, the live claim)``;
        ``(False, None)`` when the folder changed under this look (try again)."""
        sight = self._look()
        generation, why = 1, None
        if sight is not None:
            if sight.record is not None and sight.record.run_id == self.run_id:
                self.generation = sight.generation  # ours: the answer to our create got lost
                return True, None
            why = self._stale(sight)
            if why is None:
                return False, sight
            generation = sight.generation + 1
        else:
            self._seen = None
        try:
            self._create(_claim_name(generation), self._record(generation).to_bytes())
        except FileExistsError:
            pass  # another process created it first, or the answer to our create got lost
        # Read back: where create-if-absent is not atomic (fsspec's generic check-then-write),
        # the last writer wins and the others see it here.
        mine = self._read(_claim_name(generation))
        record = ClaimRecord.parse(mine) if mine is not None else None
        if record is None or record.run_id != self.run_id:
            return False, None
        self.generation = generation
        if sight is not None:
            report(f"took over {self.store.url} from {sight.describe()}: {why}")
        return True, None

    def _stale(self, sight: _Sight) -> str | None:
        """Why the claim ``sight`` may be taken over, or ``None`` while it is live."""
        record = sight.record
        if record is not None and ProcessRef(record.machine, record.pid, record.pid_started).is_gone():
            return f"its process (pid {record.pid}) is gone from this machine"
        now = self.clock()
        key = (sight.generation, sight.raw)
        if key != self._seen:
            self._seen, self._seen_since = key, now
            return None
        lease = record.lease_s if record is not None else self.lease_s
        if now - self._seen_since >= lease:
            return f"it was not renewed for {now - self._seen_since:.1f} s (its lease is {lease:g} s)"
        return None

    def _timeout_error(self, wait_s: float, holder: _Sight | None) -> DataError:
        who = holder.describe() if holder is not None else "another conversion"
        unchanged = self.clock() - self._seen_since if self._seen is not None else 0.0
        path = self.store.path(_claim_name(holder.generation)) if holder is not None else self.store.url
        return DataError(
            f"{self.store.url} is still being converted by {who} after waiting {wait_s:g} s (its claim "
            f"last changed {unchanged:.0f} s ago; a claim not renewed for its lease is taken over at "
            f"once). Wait longer with wait= (spark.gpu.train: data_options={{'wait': '2h'}}), or "
            f"convert into another folder; if no conversion runs there any more, delete {path}"
        )

    # -- holding -------------------------------------------------------------------------

    def note_progress(self, done: int, total: int | None, unit: str) -> None:
        """How far the conversion got, written into the claim at its next renewal for waiters."""
        self._progress = {"done": int(done), "total": int(total) if total else None, "unit": unit}

    def raise_if_lost(self) -> None:
        """Raises when the renewals found the claim taken over (cheap: no request).

        Raises:
            DataError: Another conversion took the folder over.
        """
        if self._lost is not None:
            raise self._lost_error(self._lost)

    def check_held(self) -> None:
        """Looks at the folder: the highest claim must still be this conversion's.

        Raises:
            DataError: Another conversion took the folder over (this one was not renewing
                its claim: paused, or cut off from the store, for a whole lease).
        """
        sight = self._look()
        if sight is None or sight.generation != self.generation or self._foreign(sight):
            raise self._lost_error(sight)

    def _foreign(self, sight: _Sight) -> bool:
        return sight.record is None or sight.record.run_id != self.run_id

    def _lost_error(self, sight: _Sight | None) -> DataError:
        by = f"by {sight.describe()}" if sight is not None else "and released"
        return DataError(
            f"this conversion's claim on {self.store.url} (run {self.run_id[:12]}) was taken over {by}: "
            f"it was not renewed for a whole lease ({self.lease_s:g} s); was this process paused or "
            "cut off from the store? Run the conversion again"
        )

    def release(self) -> None:
        """Stops renewing and removes this claim and the stale ones before it.

        A failure is logged, not raised: the claim then expires after its lease.
        """
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if self.generation is None:
            return
        try:
            for name in self.store.listdir():
                if is_claim(name) and int(name[len(CLAIM_PREFIX) :]) <= self.generation:
                    self.store.remove(name)
        except Exception as exc:  # network clients raise their own types
            _logger.warning(
                "sparkgpu: could not remove the claim on %s (%s); it expires in %g s", self.store.url, exc, self.lease_s
            )
        self.generation = None

    def _renew(self) -> None:
        assert self.generation is not None
        name = _claim_name(self.generation)
        while not self._stop.wait(self.lease_s / 3):
            try:
                sight = self._look()
                if sight is None or sight.generation != self.generation or self._foreign(sight):
                    self._lost = sight or _Sight(0, b"", None)
                    _logger.warning("sparkgpu: the claim on %s was taken over", self.store.url)
                    return
                self._beats += 1
                self.store.write_bytes(name, self._record(self.generation).to_bytes())
            except Exception as exc:  # keep trying: a renewal that works in time keeps the claim
                _logger.warning("sparkgpu: renewing the claim on %s failed: %s", self.store.url, exc)

    # -- the files -----------------------------------------------------------------------

    def _record(self, generation: int) -> ClaimRecord:
        return ClaimRecord(
            run_id=self.run_id,
            generation=generation,
            host=socket.gethostname(),
            machine=self._machine,
            pid=self._pid,
            pid_started=start_ticks(self._pid),
            started=self._started,
            beats=self._beats,
            lease_s=self.lease_s,
            progress=dict(self._progress),
        )

    def _look(self) -> _Sight | None:
        """The highest claim in the folder, or ``None`` when there is none."""
        for _ in range(5):
            generations = [int(n[len(CLAIM_PREFIX) :]) for n in self.store.listdir() if is_claim(n)]
            if not generations:
                return None
            top = max(generations)
            raw = self._read(_claim_name(top))
            if raw is not None:
                return _Sight(top, raw, ClaimRecord.parse(raw))
        return None  # released between listing and reading, again and again: as good as none

    def _read(self, name: str) -> bytes | None:
        try:
            return self.store.read_bytes(name)
        except FileNotFoundError:
            return None

    def _create(self, name: str, data: bytes) -> None:
        """Writes ``name`` only if it does not exist yet.

        Raises:
            FileExistsError: It exists.
        """
        if self.store.is_local:
            _create_local(self.store.path(name), data)
        else:
            self.store.fs.pipe_file(f"{self.store.root}/{name}", data, mode="create")


def _create_local(path: str, data: bytes) -> None:
    """Creates ``path`` with ``data``, complete, only if absent (a hard link cannot replace a file)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = temporary_name(path)
    with open(tmp, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # no hard links on this filesystem: exclusive create (briefly empty to readers)
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    finally:
        os.remove(tmp)
    fsync_dir(os.path.dirname(path))
