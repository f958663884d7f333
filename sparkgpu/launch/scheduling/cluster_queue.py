"""The GPU queue of one Spark cluster, shared by every client that submits jobs to it.

The host queue (:mod:`sparkgpu.launch.scheduling.gpu_queue`) orders jobs on one machine by ``flock``.
The clients of a Spark cluster run on many machines (each user's notebook) and share only
the staging store, where ``flock`` does not exist. So the queue is a folder of small files
there, one per job, kept alive by their writer's beat::

    <queue root>/<cluster>/jobs/<job id>.json                 a Ticket, rewritten every BEAT_SECONDS
    <queue root>/<cluster>/preempt/<target>.<requester>.json  a PreemptionRequest

``<queue root>`` is ``<staging root>/_queue`` (the staging root every client of the cluster
shares), or a machine-wide folder beside the GPU locks when no staging root is set (every
client then runs on one machine). ``<cluster>`` is a digest of the cluster's ``spark.master``.

**A ticket is alive while its client beats.** A client rewrites its job's ticket every
:data:`BEAT_SECONDS` with the time of the beat; a ticket whose beat is older than
:data:`STALE_SECONDS` belongs to a client that died or lost the store, and is ignored
(:meth:`ClusterQueue.tickets`). So the clients' clocks must agree to well under a minute (NTP).

**States** (:class:`TicketState`): ``waiting`` (not submitted), ``starting`` (its barrier stage
is submitted and waits for Spark to place it) and ``running`` (its ranks hold GPUs). A job that
gave way to a critical one is ``waiting`` again, with its first ``order``: it keeps its place.

**Turns** (:func:`next_turn`). Waiting tickets sort by class, then by ``order``, then job id. A
waiting job submits when no waiting ticket goes before it and the cluster's GPUs less those of
``starting`` and ``running`` tickets fit it; Spark's own barrier scheduling then places it. GPUs
held by work that is not in the queue (plain Spark jobs, another tool) are not counted: the
barrier stage waits for them, up to the job's ``capacity_wait=``.

**Preemption is a request, judged by its target**, under the host queue's rules: the first
waiting ticket, when it is ``critical`` and does not fit, asks as few ``running``
``best_effort`` jobs as make up what it needs (none when even all of them would not);
the target's client honours a request only if the requester's ticket is live, ``critical``,
``waiting`` and first in line (:func:`genuine_request`), then checkpoints and stops, as at the
runtime cap. Anyone who can write the queue folder may queue a critical job; the classes are
an agreement between the cluster's users, not an access control (see the security guide).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable

from sparkgpu.launch.scheduling.queue_record import QueueRecord
from sparkgpu.launch.scheduling.gpu_queue import PreemptionRequest
from sparkgpu.spec.priority import Priority, fewest_to_stop
from sparkgpu.store import Store

__all__ = [
    "BEAT_SECONDS",
    "STALE_SECONDS",
    "TicketState",
    "Ticket",
    "Turn",
    "ClusterQueue",
    "QueueSeat",
    "cluster_key",
    "queue_root",
    "next_turn",
    "genuine_request",
    "cluster_waiting_jobs",
]

logger = logging.getLogger(__name__)

#: Seconds between two beats of a job's ticket.
BEAT_SECONDS = 10.0
#: A ticket whose last beat is older than this is its dead client's, and ignored.
STALE_SECONDS = 60.0
JOBS_DIR, PREEMPT_DIR = "jobs", "preempt"
_SAFE = re.compile(r"^[A-Za-z0-9_.-]+$")


class TicketState(str, enum.Enum):
    """Where a job of the cluster queue is."""

    WAITING = "waiting"  # in line, nothing submitted
    STARTING = "starting"  # its barrier stage is submitted, Spark has not placed it yet
    RUNNING = "running"  # its ranks hold GPUs

    @property
    def holds_gpus(self) -> bool:
        """Whether the job's GPUs count as taken for the jobs behind it."""
        return self is not TicketState.WAITING


@dataclasses.dataclass(frozen=True)
class Ticket(QueueRecord):
    """One job in the cluster's queue (``gpus`` counts task slots for a CPU job; ``order`` is
    kept when it gives way).

    Attributes:
        state: Where it is.
        beat_at: Unix time of its client's last beat.
        user: Who submitted it (``SPARKGPU_USER``).
        host: Its client's machine.
        pid: Its client's process.
    """

    state: TicketState = TicketState.WAITING
    beat_at: float = dataclasses.field(default_factory=time.time)
    user: str = ""
    host: str = dataclasses.field(default_factory=socket.gethostname)
    pid: int = dataclasses.field(default_factory=os.getpid)

    @property
    def file_name(self) -> str:
        return f"{self.job_id}.json"

    def __str__(self) -> str:
        return f"{self.job_id} ({self.priority.value}, {self.gpus} GPU(s), {self.state.value}, user {self.user or '?'})"


def cluster_key(master: str) -> str:
    """The queue folder's name for the cluster at ``master``: a digest, since a master URL is no
    file name; a ``local[...]`` master is one machine's, so that machine's name goes in."""
    who = f"{socket.gethostname()}/{master}" if master.startswith("local") else master
    return hashlib.sha256(who.encode()).hexdigest()[:16]


def queue_root(staging_url: str | None) -> str:
    """Where the clusters' queues live: ``<staging_url>/_queue``, else beside this machine's GPU locks."""
    if staging_url:
        return f"{staging_url.rstrip('/')}/_queue"
    from sparkgpu.launch.scheduling.gpu_lease import lock_dir
    from sparkgpu.launch.scheduling.gpu_queue import shared_dir

    return str(shared_dir(lock_dir(), "spark-queue"))


@dataclasses.dataclass(frozen=True)
class Turn:
    """What a waiting job may do now (:func:`next_turn`).

    Attributes:
        go: Submit now.
        ahead: Waiting tickets that go before it.
        free: The cluster's GPUs less those of queued jobs that hold or are about to hold them.
        preempt: Running best-effort jobs to ask to give way (only for a critical job first in line).
    """

    go: bool
    ahead: tuple[Ticket, ...] = ()
    free: int = 0
    preempt: tuple[Ticket, ...] = ()


def next_turn(mine: Ticket, tickets: list[Ticket], total_gpus: int) -> Turn:
    """Whether ``mine`` may submit, given the live ``tickets`` (its own may be among them) and the
    cluster's ``total_gpus``; see the module's rules."""
    others = [t for t in tickets if t.job_id != mine.job_id]
    ahead = tuple(
        sorted(
            (t for t in others if t.state is TicketState.WAITING and t.sort_key() < mine.sort_key()),
            key=Ticket.sort_key,
        )
    )
    free = total_gpus - sum(t.gpus for t in others if t.state.holds_gpus)
    if ahead:
        return Turn(False, ahead, free)
    if mine.gpus <= free:
        return Turn(True, (), free)
    if mine.priority is not Priority.CRITICAL:
        return Turn(False, (), free)
    preemptible = [t for t in others if t.state is TicketState.RUNNING and t.priority.preemptible]
    ordered = sorted(preemptible, key=lambda t: (-t.gpus, -t.order, t.job_id))  # fewest jobs, newest first
    chosen = fewest_to_stop([(t, t.gpus) for t in ordered], free=free, need=mine.gpus)
    return Turn(False, (), free, tuple(chosen))


def genuine_request(request: PreemptionRequest, target: Ticket, tickets: list[Ticket]) -> Ticket | None:
    """The requester's ticket when ``request`` may stop ``target``: the target is a running
    best-effort job; the requester is live, critical, waiting and first in line."""
    if request.target_job_id != target.job_id or not target.priority.preemptible:
        return None
    if target.state is not TicketState.RUNNING:
        return None
    waiting = sorted((t for t in tickets if t.state is TicketState.WAITING), key=Ticket.sort_key)
    if not waiting or waiting[0].job_id != request.requester_job_id:
        return None  # only the first in line may ask: the others would not get the GPUs
    requester = waiting[0]
    return requester if requester.priority is Priority.CRITICAL else None


class ClusterQueue:
    """The queue folder of one cluster: ``<root>/<cluster>`` on any store.

    Args:
        root: :func:`queue_root`.
        cluster: :func:`cluster_key` of the cluster.
        storage_options: fsspec options of the store.
        stale_after: Seconds without a beat after which a ticket is ignored.
    """

    def __init__(
        self, root: str, cluster: str, storage_options: dict | None = None, *, stale_after: float = STALE_SECONDS
    ):
        self.store = Store(f"{root.rstrip('/')}/{cluster}", storage_options, durable=False, what="the cluster queue")
        self.stale_after = stale_after

    def __repr__(self) -> str:
        return f"ClusterQueue({self.store.url!r})"

    def tickets(self) -> list[Ticket]:
        """The live tickets, in queue order; stale, unreadable and misnamed ones are left out."""
        now = time.time()
        found = []
        for name in self.store.listdir(JOBS_DIR):
            if not name.endswith(".json") or not _SAFE.match(name):
                continue
            try:
                ticket = Ticket.from_json(self.store.read_bytes(f"{JOBS_DIR}/{name}"))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # gone since the listing, half-written on a store without atomic writes, or foreign
            if ticket.file_name != name or now - ticket.beat_at > self.stale_after:
                continue
            found.append(ticket)
        return sorted(found, key=Ticket.sort_key)

    def put(self, ticket: Ticket) -> None:
        self.store.write_bytes(f"{JOBS_DIR}/{ticket.file_name}", ticket.to_json().encode())

    def remove(self, job_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.store.remove(f"{JOBS_DIR}/{job_id}.json")

    def ask(self, target: Ticket, requester: Ticket) -> None:
        """Writes the request that ``target`` give way to ``requester``."""
        request = PreemptionRequest(target.job_id, requester.job_id, requester.file_name)
        self.store.write_bytes(f"{PREEMPT_DIR}/{request.file_name}", request.to_json().encode())

    def requests_for(self, job_id: str) -> list[PreemptionRequest]:
        """The requests that ``job_id`` give way, as written (judge them with :func:`genuine_request`)."""
        found = []
        for name in self.store.listdir(PREEMPT_DIR):
            if not name.startswith(f"{job_id}.") or not name.endswith(".json"):
                continue
            try:
                found.append(PreemptionRequest.from_json(self.store.read_bytes(f"{PREEMPT_DIR}/{name}").decode()))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return found

    def withdraw(self, requester_job_id: str, targets: set[str]) -> None:
        """Removes the requests ``requester_job_id`` wrote to ``targets``."""
        for target in targets:
            with contextlib.suppress(FileNotFoundError):
                self.store.remove(f"{PREEMPT_DIR}/{target}.{requester_job_id}.json")


class QueueSeat:
    """One job's place in a cluster queue, from its first wait to its end: beats its ticket in a
    thread, changes its state, asks best-effort jobs to give way and withdraws what it asked.

    Args:
        queue: The cluster's queue.
        ticket: The job's ticket (its state and beat are kept here).
        on_error: Called with an exception a beat raised (a store that is down); the beat goes on.
    """

    def __init__(self, queue: ClusterQueue, ticket: Ticket, on_error: Callable[[BaseException], None] | None = None):
        self.queue = queue
        self._ticket = ticket
        self._lock = threading.Lock()
        self._asked: set[str] = set()
        self._stopped = threading.Event()
        self._on_error = on_error
        self._thread: threading.Thread | None = None

    @property
    def ticket(self) -> Ticket:
        return self._ticket

    @property
    def state(self) -> TicketState:
        return self._ticket.state

    def start(self) -> QueueSeat:
        """Writes the ticket and starts its beat."""
        self._write()
        self._thread = threading.Thread(target=self._beat_loop, daemon=True, name=f"queue-{self._ticket.job_id}")
        self._thread.start()
        return self

    def set_state(self, state: TicketState) -> None:
        """Moves the ticket to ``state`` (written at once); leaving ``waiting`` withdraws the job's requests."""
        self._write(state=state)
        if state is not TicketState.WAITING and self._asked:
            self.queue.withdraw(self._ticket.job_id, self._asked)
            self._asked = set()

    def set_gpus(self, gpus: int) -> None:
        """Says the job now holds ``gpus`` (an elastic job's attempt on fewer, or all again)."""
        if gpus != self._ticket.gpus:
            self._write(gpus=gpus)

    def held_by_others(self) -> int:
        """GPUs that the other live jobs of the queue hold or are about to hold."""
        return sum(t.gpus for t in self.queue.tickets() if t.job_id != self._ticket.job_id and t.state.holds_gpus)

    def turn(self, total_gpus: int) -> Turn:
        """What the job may do now; asks the best-effort jobs :func:`next_turn` names to give way."""
        turn = next_turn(self._ticket, self.queue.tickets(), total_gpus)
        for target in turn.preempt:
            if target.job_id not in self._asked:
                self.queue.ask(target, self._ticket)
                self._asked.add(target.job_id)
                logger.info("job %s asks best-effort job %s to checkpoint and give way", self._ticket.job_id, target)
        return turn

    def request(self) -> tuple[PreemptionRequest, Ticket] | None:
        """A genuine request that this (running, best-effort) job give way, with its requester's ticket."""
        if not self._ticket.priority.preemptible or self._ticket.state is not TicketState.RUNNING:
            return None
        requests = self.queue.requests_for(self._ticket.job_id)
        if not requests:
            return None
        tickets = self.queue.tickets()
        for request in requests:
            requester = genuine_request(request, self._ticket, tickets)
            if requester is not None:
                return request, requester
        return None

    def stop(self) -> None:
        """Ends the beat and removes the ticket and the requests this job wrote."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.queue.withdraw(self._ticket.job_id, self._asked)
        self.queue.remove(self._ticket.job_id)

    def _write(self, **changes) -> None:
        """Writes the ticket with ``changes`` and a fresh beat."""
        with self._lock:  # held while writing: a beat never puts back a state set meanwhile
            self._ticket = dataclasses.replace(self._ticket, **changes, beat_at=time.time())
            self.queue.put(self._ticket)

    def _beat_loop(self) -> None:
        while not self._stopped.wait(BEAT_SECONDS):
            try:
                self._write()
            except Exception as exc:  # a store that is down: the ticket goes stale, the job does not stop
                if self._on_error is not None:
                    self._on_error(exc)
                else:
                    logger.warning("could not beat the queue ticket of job %s: %s", self._ticket.job_id, exc)


def cluster_waiting_jobs(root: str, storage_options: dict | None = None) -> dict[str, tuple[Ticket, int]]:
    """The jobs waiting in every cluster queue under ``root``: job id -> (its ticket, its 1-based place)."""
    places: dict[str, tuple[Ticket, int]] = {}
    for cluster in Store(root, storage_options, what="the cluster queues").listdir():
        if not _SAFE.match(cluster):
            continue
        waiting = [t for t in ClusterQueue(root, cluster, storage_options).tickets() if t.state is TicketState.WAITING]
        for place, ticket in enumerate(waiting, start=1):
            places[ticket.job_id] = (ticket, place)
    return places
