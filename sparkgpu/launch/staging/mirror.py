"""The staging store: run dirs mirrored through any fsspec URL, so executors need no shared mount.

With ``SPARKGPU_STAGING_ROOT=s3://bucket/runs`` (any fsspec URL) the client keeps its run dirs
local (``$SPARKGPU_HOME/runs``) and each Spark node task runs in a scratch copy on its
executor; this module moves files between those local dirs and ``<url>/<user>/<job_id>/``.
The user's prefix (:func:`store_prefix`) lets a bucket policy give each user a prefix of a
shared root that no one else may read or write; the prefix a job started under is recorded in
its run dir, so ``sparkgpu resume`` finds it again (jobs staged before the prefix existed
stay at ``<url>/<job_id>/``).
Everything that runs (agent, ranks, supervisor, log tailer) keeps reading and writing plain
local files, as with a shared folder.

Who writes what:

* client -> store: the signed payload and the job's tracking run (``tracking/run.json``),
  at the job's first submit; while an attempt runs, its control files (``attempts/<k>/STOP``,
  ``attempts/<k>/spark/CANCEL``, ``attempts/<k>/spark/client.heartbeat``), together as one
  object, ``attempts/<k>/spark/control``, put again when one of them changes.
* node -> store: every other file its agent and ranks leave in ``attempts/<k>/`` (logs,
  results, errors, environment reports, node markers) and their tracking records. Object
  stores cannot append, so logs go up as appended bundles (:mod:`sparkgpu.launch.staging.log_bundles`),
  one per node and round, each byte once, no more often than every ``log_interval`` seconds (30 by default, 2 for the ranks
  the client echoes live); the end markers go last, after results and errors, so the client
  never sees a node end without them.
* store -> client: while the attempt runs, the files of its ``spark/`` folder (the nodes' start
  and end markers, node 0's state) and the new bundles of the streams it follows (node 0's,
  which carries rank 0's logs and tracking records, and those of ``log_ranks=``); when the
  attempt ends, everything else. Logs arrive by their new bundles only, appended to the local files.
* store -> node: the payload; to node 0 alone, the client's control object, every
  ``control_interval`` seconds. The other nodes hear of a cancel, a stop request or a failed
  peer from node 0 (:mod:`sparkgpu.launch.backends.spark.executor.hub`), never from the store.

Visibility: a file pulled into a local dir appears complete or not at all (temp name, then
rename); an upload is one whole-object put (on a ``file://`` store: temp name, then rename).
The store is not trusted, as a shared folder is not: a node runs only a payload whose
signature holds, the client unpickles only results signed with the job's key, and no name
read from the store may leave the local run dir.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sparkgpu._util.files import atomic_write_bytes, is_temporary
from sparkgpu._util.report import report
from sparkgpu._util.urls import scheme_of
from sparkgpu.errors import ConfigurationError
from sparkgpu.rundir.control import pack_files, unpack_files
from sparkgpu.launch.staging.log_bundles import LogReader, LogShipper, parse_bundle_name
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.store import Store

__all__ = ["StagingStore", "ClientMirror", "NodeMirror", "StoreClock", "scratch_run_dir", "store_prefix", "user_prefix"]

#: Seconds between two shipments of one log's new bytes, unless someone follows it live.
LOG_INTERVAL = 30.0
#: The same for a log the client echoes live (``log_ranks=``).
FOLLOWED_LOG_INTERVAL = 2.0
#: Seconds between two pulls of the client's control object by node 0, by default
#: (``SPARKGPU_SPARK_CONTROL_INTERVAL``).
CONTROL_INTERVAL = 20.0


def _grows(rel: str) -> bool:
    # Rank and agent logs and tracking records only ever grow; the rest is written once.
    return rel.endswith((".log", ".jsonl"))


def _local(root: Path, rel: str) -> Path:
    """``root / rel``, refusing names from the (untrusted) store that would leave ``root``."""
    parts = rel.split("/")
    if any(part in ("", ".", "..") for part in parts) or "\\" in rel:
        raise ValueError(f"refusing the staging store's file name {rel!r}: it would leave the run dir {root}")
    return root.joinpath(*parts)


def _temporary(rel: str) -> bool:
    return is_temporary(rel) or rel.rsplit("/", 1)[-1].startswith(".")


# What a user's prefix may be named: one path segment that a bucket policy can spell as it is.
_USER_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._@+-]*$")


def user_prefix(url: str, user: str) -> str:
    """``<url>/<user>``: the prefix of the staging store under which ``user``'s jobs live.

    Raises:
        ConfigurationError: ``user`` cannot be one path segment of a URL (a ``/``, a space, ``..``).
    """
    if not _USER_SEGMENT.match(user) or user in (".", ".."):
        raise ConfigurationError(
            f"the user name {user!r} cannot name a prefix of the staging store {url}: set SPARKGPU_USER to a "
            "name of letters, digits and . _ @ + - (it is also the name usage is attributed to)"
        )
    return f"{url.rstrip('/')}/{user}"


def store_prefix(run_dir: RunDir, url: str, user: str, storage_options: dict | None = None) -> str:
    """The prefix of the staging store that holds the job's folder, ``<prefix>/<job_id>``.

    A job keeps the prefix it was first staged under, recorded in its run dir, whatever
    ``SPARKGPU_USER`` says when it resumes: ``<url>/<user>`` for a new job, ``<url>`` for one
    staged before user prefixes existed (found once, by its folder at ``<url>/<job_id>``).

    Raises:
        ConfigurationError: see :func:`user_prefix`.
    """
    record = run_dir.path / RunLayout.STAGING_PREFIX
    try:
        return record.read_text().strip()
    except FileNotFoundError:
        pass
    url = url.rstrip("/")
    if not run_dir.path.is_dir():
        return user_prefix(url, user)  # a dry run: nothing is written, nothing was staged
    staged_before = Store(url, storage_options, durable=False).exists(run_dir.job_id)
    prefix = url if staged_before else user_prefix(url, user)
    atomic_write_bytes(record, prefix.encode(), fsync=False)
    return prefix


class StagingStore(Store):
    """One job's folder on the staging store, ``<url>/<job_id>``: a :class:`~sparkgpu.store.Store`.

    Writes are not flushed to a local disk (``durable=False``): everything on the store is a
    copy of a file kept on the client or a node, and a run does not outlive a power loss.

    Args:
        url: The store's root (``SPARKGPU_STAGING_ROOT``), any fsspec URL.
        job_id: The job.
        storage_options: Extra options for the fsspec filesystem (credentials, endpoint).

    Raises:
        MissingDependencyError: The URL's filesystem is not installed here.
        ConfigurationError: fsspec knows no filesystem for the URL's scheme.
    """

    def __init__(self, url: str, job_id: str, storage_options: dict | None = None):
        super().__init__(
            f"{url.rstrip('/')}/{job_id}", storage_options, durable=False, what=f"the {scheme_of(url)}:// staging store"
        )

    def __repr__(self) -> str:
        return f"StagingStore({self.url!r})"


class StoreClock:
    """Seconds during which the store answered: the clock that silences are judged on.

    Each answered sync advances it by the time since the previous one, at most ``max_step``:
    while the store stalls (S3 ``SlowDown``, an outage) it stands still, so no beat that the
    store held back counts as missing, and after the stall every side has its full timeout
    to be heard again.
    """

    def __init__(self, max_step: float):
        self.max_step = max_step
        self._seconds = 0.0
        self._last: float | None = None
        self._lock = threading.Lock()

    def answered(self) -> None:
        with self._lock:
            now = time.monotonic()
            if self._last is not None:
                self._seconds += min(now - self._last, self.max_step)
            self._last = now

    def __call__(self) -> float:
        return self._seconds


class _Reporter:
    """Says each distinct sync failure once, and when the store answers again: a store that is
    down for a while must not flood the log, nor its end go unsaid.

    ``clock`` measures how long the store was gone (tests pass their own)."""

    def __init__(self, out, who: str, clock: Callable[[], float] = time.monotonic):
        self.out, self.who, self.clock = out, who, clock
        self.seen: set[str] = set()
        self.failing_since: float | None = None

    def __call__(self, exc: BaseException) -> None:
        if self.failing_since is None:
            self.failing_since = self.clock()
        text = f"{type(exc).__name__}: {exc}"
        if text not in self.seen:
            self.seen.add(text)
            report(f"{self.who} could not sync with the staging store (retrying, with backoff): {text}", self.out)

    def answered(self) -> None:
        if self.failing_since is not None:
            report(
                f"{self.who} reaches the staging store again, after {self.clock() - self.failing_since:.0f}s",
                self.out,
            )
            self.failing_since = None


#: Most seconds between two tries of a sync loop while the store does not answer.
MAX_BACKOFF = 8.0


class _Loop:
    """A daemon thread calling ``step`` every ``interval`` seconds until stopped; while ``step``
    fails, the wait doubles up to :data:`MAX_BACKOFF` (an S3 ``SlowDown`` asks for exactly that)."""

    def __init__(self, step, interval: float, name: str, reporter: _Reporter):
        self._stop, self._wake = threading.Event(), threading.Event()

        def run():
            wait = interval
            while not self._stopped_after(wait):
                try:
                    step()
                except Exception as exc:  # fsspec filesystems raise their own types; the next round retries
                    reporter(exc)
                    wait = min(wait * 2, max(MAX_BACKOFF, interval))
                    continue
                reporter.answered()
                wait = interval

        self._thread = threading.Thread(target=run, daemon=True, name=name)
        self._thread.start()

    def _stopped_after(self, wait: float) -> bool:
        """Waits ``wait`` seconds, or less when kicked; whether the loop is to stop."""
        self._wake.wait(wait)
        self._wake.clear()
        return self._stop.is_set()

    def kick(self) -> None:
        """Runs the next step now (something worth sending at once was written)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


# -- the client's side -------------------------------------------------------------------


class ClientMirror:
    """The client's local run dir, kept in step with the job's folder on the store.

    Args:
        run_dir: The client's (local) run dir.
        store: The job's folder on the store.
        out: Where sync failures are reported (``sys.stderr`` by default).
    """

    def __init__(self, run_dir: RunDir, store: StagingStore, out=None):
        self.run_dir, self.store = run_dir, store
        self._lock = threading.Lock()
        self._pushed: bytes | None = None  # the control object last put
        self._followed: tuple[int, ...] = (0,)  # nodes whose log streams are read while the attempt runs
        self._nodes, self._ranks_per_node = 1, 1
        self._stamps: dict[str, tuple] = {}  # whole file -> the store's (size, stamp) last fetched
        self._offsets: dict[str, int] = {}  # growing file -> bytes appended so far
        self._report = _Reporter(out, "the client")
        self._logs = LogReader(lambda rel: _local(self.run_dir.path, rel), self._report)
        self._loop: _Loop | None = None
        #: Seconds the store answered this client's syncs (nodes' silences are judged on it).
        self.clock = StoreClock(max_step=3.0)
        # The quiet clock (see start()): whether the caller reads logs live, the seconds between
        # two full syncs when nobody does, when the next one is due, and the urgent control files
        # (stop, cancel) as last put.
        self._live = True
        self._quiet_interval = 0.0
        self._next_full = 0.0
        self._pushed_urgent: dict[str, bytes] = {}

    def upload_payload(self) -> None:
        """Puts the signed payload and the job's tracking run (when it has one) on the store."""
        spec = json.loads(self.run_dir.spec_file.read_text())
        names = RunLayout.payload_files(spec)
        if (self.run_dir.path / RunLayout.TRACKING_RUN).exists():
            names.append(RunLayout.TRACKING_RUN)
        for rel in names:
            self.store.upload(_local(self.run_dir.path, rel), rel)

    def sync(self, attempt: int, everything: bool = False) -> int:
        """Pushes the attempt's control files (one object) when they changed, then pulls what its nodes wrote.

        Args:
            attempt: The attempt.
            everything: Pull every file of the attempt (it ended), not only its ``spark/``
                folder and the log streams followed live.

        Returns:
            How many local files changed.
        """
        with self._lock:
            control = self._control(attempt)
            body = json.dumps(pack_files(control), sort_keys=True).encode()
            if body != self._pushed:
                self.store.write_bytes(RunLayout.spark_control(attempt), body)
                self._pushed = body
            self._pushed_urgent = self._urgent(control)
            changed = self._pull(attempt) if everything else self._pull_live(attempt)
            self.clock.answered()
            return changed

    def _control(self, attempt: int) -> dict[str, bytes]:
        """The attempt's control files as they are here (local reads only)."""
        control = {}
        for rel in RunLayout.control_files(attempt):
            try:
                control[rel] = _local(self.run_dir.path, rel).read_bytes()
            except FileNotFoundError:
                continue
        return control

    @staticmethod
    def _urgent(control: dict[str, bytes]) -> dict[str, bytes]:
        """The control files a quiet client still sends at once: all but its heartbeat (stop, cancel)."""
        return {rel: data for rel, data in control.items() if not rel.endswith(RunLayout.SPARK_CLIENT_HEARTBEAT)}

    def _round(self, attempt: int) -> None:
        """One round of the background loop.

        Syncs fully when someone reads the attempt live (log lines echoed to the caller, or a
        ``sparkgpu logs --follow``), until every node has started, and once every quiet
        interval; in between it only puts a changed stop or cancel request, which costs no
        request at all while there is none.
        """
        now = time.monotonic()
        live = self._live or bool(self._asked(attempt)) or len(self.run_dir.started_nodes(attempt)) < self._nodes
        if live or now >= self._next_full:
            self.sync(attempt)
            self._next_full = now + self._quiet_interval
        elif self._urgent(self._control(attempt)) != self._pushed_urgent:
            self.sync(attempt)

    def try_sync(self, attempt: int) -> bool:
        """:meth:`sync`, reporting a failure instead of raising it (for callers busy stopping an attempt)."""
        try:
            self.sync(attempt)
        except Exception as exc:  # whatever the filesystem raises: said once, retried by the next call
            self._report(exc)
            return False
        return True

    def _pull_live(self, attempt: int) -> int:
        """The files of the attempt's ``spark/`` folder that changed (one listing) and the new
        bundles of the followed streams (one read each when nothing is new): a number of
        requests that does not grow with the attempt's nodes."""
        changed = self._pull_listed(attempt, self.store.list(RunLayout.spark(attempt), recursive=False))
        for node in sorted({*self._followed, *self._asked(attempt)}):
            changed += self._logs.follow(self.store, RunLayout.log_stream(attempt, node))
        return changed

    def _asked(self, attempt: int) -> set[int]:
        """Nodes whose ranks ``sparkgpu logs --follow`` (another process) asks for, while it asks."""
        try:
            request = json.loads(_local(self.run_dir.path, RunLayout.follow_request(attempt)).read_text())
            if float(request["until"]) < time.time():
                return set()
            ranks = request["ranks"]
            if ranks is None:
                return set(range(self._nodes))
            return {int(r) // self._ranks_per_node for r in ranks if 0 <= int(r) // self._ranks_per_node < self._nodes}
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return set()

    def _pull(self, attempt: int) -> int:
        """Every file of the attempt that changed."""
        listed = self.store.list(RunLayout.attempt(attempt))
        records = self.store.list(RunLayout.TRACKING_RECORDS, recursive=False)
        ours = RunLayout.tracking_records_of(attempt)
        listed.update((rel, v) for rel, v in records.items() if rel.rsplit("/", 1)[-1].startswith(ours))
        return self._pull_listed(attempt, listed)

    def _pull_listed(self, attempt: int, listed: dict[str, tuple]) -> int:
        skip = {*RunLayout.control_files(attempt), RunLayout.spark_control(attempt)}
        changed = 0
        bundles: dict[str, dict[int, int]] = {}
        for rel, (size, stamp) in sorted(listed.items()):
            if rel in skip or _temporary(rel):
                continue
            if (bundle := parse_bundle_name(rel)) is not None:
                bundles.setdefault(bundle[0], {})[bundle[1]] = size
                continue
            try:
                local = _local(self.run_dir.path, rel)
            except ValueError as exc:
                self._report(exc)
                continue
            if _grows(rel):
                offset = self._offsets.get(rel, 0)
                if size > offset:
                    data = self.store.read_bytes(rel, offset, size)
                    local.parent.mkdir(parents=True, exist_ok=True)
                    with open(local, "ab") as f:
                        f.write(data)
                    self._offsets[rel] = offset + len(data)
                    changed += 1
            elif self._stamps.get(rel) != (size, stamp):
                self.store.download(rel, local)
                self._stamps[rel] = (size, stamp)
                changed += 1
        return changed + self._logs.fetch(self.store, bundles)

    def start(
        self,
        attempt: int,
        interval: float = 1.0,
        followed: tuple[int, ...] = (0,),
        nodes: int = 1,
        ranks_per_node: int = 1,
        live: bool = True,
        quiet_interval: float = 20.0,
    ) -> None:
        """Syncs in a background thread until :meth:`finish`, reading the log streams of the
        ``followed`` nodes as they grow, and of the nodes whose ranks ``sparkgpu logs --follow``
        asks for (the attempt has ``nodes`` of ``ranks_per_node``).

        ==================================================  =======================================
        the attempt                                         a full sync (a listing, the followed
                                                            streams, the control files if changed)
        ==================================================  =======================================
        ``live`` (its caller echoes rank output), a         every ``interval`` seconds
        ``logs --follow`` asks, or a node not started yet
        running with nobody reading it live                 every ``quiet_interval`` seconds, and
                                                            at once for a stop or cancel request
        ==================================================  =======================================

        ``quiet_interval`` is node 0's own pace at the client's files (its control interval):
        a quiet client reads what node 0 says no more often than node 0 reads what it says.
        """
        self._followed = tuple(sorted(set(followed)))
        self._nodes, self._ranks_per_node = nodes, max(1, ranks_per_node)
        self._live, self._quiet_interval = live, max(interval, quiet_interval)
        self._next_full = time.monotonic() + self._quiet_interval
        self._loop = _Loop(
            lambda: self._round(attempt), interval, f"sparkgpu-store-{self.run_dir.job_id}-{attempt}", self._report
        )

    def finish(self, attempt: int, tries: int = 3) -> BaseException | None:
        """Stops the background sync and syncs once more (retried), for the results of a finished attempt.

        Returns:
            ``None``, or the error of the last try when every try failed.
        """
        if self._loop is not None:
            self._loop.stop()
        for tried in range(1, tries + 1):
            try:
                self.sync(attempt, everything=True)
                return None
            except Exception as exc:  # whatever the filesystem raises: tried again, then returned
                if tried == tries:
                    return exc
                time.sleep(tried)
        return None


# -- a node's side --------------------------------------------------------------------------


def scratch_run_dir(job_id: str, attempt: int, node: int) -> Path:
    """A fresh, node-local run dir for one node of one attempt (its name is the job id).

    Under the executor's first local dir (``SPARK_LOCAL_DIRS``, which Spark sets for its
    Python workers and removes with the executor), else the system's temp dir.
    """
    import tempfile

    base = (os.environ.get("SPARK_LOCAL_DIRS") or "").split(",")[0] or tempfile.gettempdir()
    Path(base).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"sparkgpu-{job_id}-a{attempt}-n{node}-", dir=base)) / job_id


class NodeMirror:
    """A node task's scratch run dir, kept in step with the job's folder on the store.

    Args:
        store: The job's folder on the store.
        run_dir: The node's scratch run dir (see :func:`scratch_run_dir`).
        attempt: The attempt the node runs.
        node: The node's rank.
        log_interval: Least seconds between two shipments of one growing log's new bytes.
        followed: Logs (names relative to the run dir) someone echoes live: shipped every
            ``followed_interval`` seconds instead.
        out: Where sync failures are reported (the executor's stderr by default).
        control_interval: Seconds between two pulls of the client's control object by node 0
            (a cancel reaches the ranks within about this long).
    """

    def __init__(
        self,
        store: StagingStore,
        run_dir: RunDir,
        attempt: int,
        node: int,
        log_interval: float = LOG_INTERVAL,
        out=None,
        followed: frozenset[str] = frozenset(),
        followed_interval: float = FOLLOWED_LOG_INTERVAL,
        control_interval: float = CONTROL_INTERVAL,
    ):
        self.store, self.run_dir, self.attempt, self.node = store, run_dir, attempt, node
        self.control_interval = control_interval
        #: Seconds the store answered this node's pulls (the client's silence is judged on it).
        self.clock = StoreClock(max_step=2 * control_interval)
        self.log_interval, self.followed, self.followed_interval = log_interval, followed, followed_interval
        self._lock = threading.Lock()
        self._pulled: dict[str, bytes] = {}  # control files that came from the store: never pushed back
        self._pushed: dict[str, tuple] = {}  # local (size, mtime_ns) last put
        self._logs = LogShipper(store, f"{RunLayout.logs(attempt)}/node-{node}")
        self._last_ship = -float("inf")
        self._report = _Reporter(out, f"node {node}")
        self._loop: _Loop | None = None

    def download_payload(self) -> None:
        """Fetches the signed payload and the job's tracking run into the scratch run dir.

        Raises:
            FileNotFoundError: The store holds no payload for the job.
        """
        self.store.download(RunLayout.SPEC, self.run_dir.spec_file)
        names = [
            n for n in RunLayout.payload_files(json.loads(self.run_dir.spec_file.read_text())) if n != RunLayout.SPEC
        ]
        if self.store.exists(RunLayout.TRACKING_RUN):
            names.append(RunLayout.TRACKING_RUN)
        for rel in names:
            self.store.download(rel, _local(self.run_dir.path, rel))  # a planted "../x" raises ValueError

    def claimed_before(self) -> bool:
        """Whether the store already has this node's start marker (Spark is re-running the stage)."""
        return self.store.exists(RunLayout.node_marker(self.attempt, self.node, "started"))

    def pull_control(self) -> None:
        """Fetches the client's control object and writes the files in it that changed (node 0 only:
        the other nodes hear of them from node 0)."""
        if self.node != 0:
            return
        with self._lock:
            try:
                packed = json.loads(self.store.read_bytes(RunLayout.spark_control(self.attempt)))
            except FileNotFoundError:
                packed = {}
            except ValueError as exc:
                self._report(ValueError(f"the client's control object is not JSON: {exc}"))
                packed = {}
            files, malformed = unpack_files(packed)
            for rel in malformed:
                self._report(ValueError(f"the client's control object holds a malformed {rel}"))
            self.run_dir.write_control_copies(self.attempt, files, self._pulled)
            self.clock.answered()

    def push(self, final: bool = False) -> None:
        """Puts the node's new and changed files; end markers only when ``final``, and after the rest."""
        with self._lock:
            outputs = self._outputs()
            self._ship_logs({rel: path for rel, path in outputs.items() if _grows(rel)}, final)
            for rel, path in sorted(outputs.items(), key=lambda item: _push_order(item[0])):
                if _grows(rel) or (RunLayout.is_node_end_marker(rel) and not final):
                    continue
                try:
                    stat = path.stat()
                except FileNotFoundError:
                    continue
                stamp = (stat.st_size, stat.st_mtime_ns)
                if self._pushed.get(rel) == stamp:
                    continue
                self.store.upload(path, rel)
                self._pushed[rel] = stamp

    def _ship_logs(self, growing: dict[str, Path], final: bool) -> None:
        """One bundle of what grew, when its interval is up (all of it when ``final``)."""
        if final:
            self._logs.ship_all(growing)
            return
        followed = self._logs.pending({rel: path for rel, path in growing.items() if rel in self.followed})
        interval = self.followed_interval if followed else self.log_interval
        if time.monotonic() - self._last_ship >= interval and self._logs.ship(growing):
            if not self._logs.pending(growing):  # a backlog (a big log) goes on next round
                self._last_ship = time.monotonic()

    def _outputs(self) -> dict[str, Path]:
        root = self.run_dir.path
        found = {}
        skip = set(RunLayout.control_files(self.attempt)) | set(self._pulled)
        for folder, pattern in (
            (self.run_dir.file(RunLayout.attempt(self.attempt)), "*"),
            (self.run_dir.file(RunLayout.TRACKING_RECORDS), f"{RunLayout.tracking_records_of(self.attempt)}*"),
        ):
            for path in folder.rglob(pattern) if folder.is_dir() else ():
                rel = path.relative_to(root).as_posix()
                if path.is_file() and rel not in skip and not _temporary(rel):
                    found[rel] = path
        return found

    def start(self, interval: float = 1.0) -> None:
        """Pulls the control files now, then pulls and pushes every ``interval`` seconds until :meth:`finish`."""
        self.pull_control()
        self.push()
        next_pull = time.monotonic() + self.control_interval

        def step():
            nonlocal next_pull
            if time.monotonic() >= next_pull:
                next_pull = time.monotonic() + self.control_interval
                self.pull_control()
            self.push()

        self._loop = _Loop(step, interval, f"sparkgpu-store-node-{self.node}", self._report)

    def kick(self) -> None:
        """Pushes now rather than at the next round (node 0's state changed: a node is lost)."""
        if self._loop is not None:
            self._loop.kick()

    def finish(self, tries: int = 3) -> None:
        """Stops the background sync and pushes everything left, end markers last.

        Raises:
            Exception: Whatever the filesystem raised on the last of ``tries`` tries.
        """
        if self._loop is not None:
            self._loop.stop()
        for tried in range(1, tries + 1):
            try:
                self.push(final=True)
                return
            except Exception:  # whatever the filesystem raises: tried again, then raised
                if tried == tries:
                    raise
                time.sleep(tried)


def _push_order(rel: str) -> int:
    # Results, errors and logs first; then the agent's exit file; the end marker last of all.
    if RunLayout.is_node_end_marker(rel):
        return 2
    return 1 if RunLayout.is_node_exits(rel) else 0
