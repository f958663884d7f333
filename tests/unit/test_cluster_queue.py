"""A Spark cluster's GPU queue on a shared folder: turns by class then arrival, preemption requests
judged by their target, dead clients' tickets ignored, places shown by ``sparkgpu jobs``.

The same code runs on the S3 server in ``tests/integration/test_cluster_queue_s3.py``; the
end-to-end preemption on a standalone cluster is ``test_spark_cluster_priorities.py``.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from sparkgpu.errors import CapacityError
from sparkgpu.launch.backends.spark.seats import ClusterSeats
from sparkgpu.launch.scheduling.cluster_queue import (
    ClusterQueue,
    QueueSeat,
    Ticket,
    TicketState,
    cluster_key,
    cluster_waiting_jobs,
    genuine_request,
    next_turn,
)
from sparkgpu.launch.scheduling.gpu_queue import PreemptionRequest
from sparkgpu.spec.priority import Priority
from sparkgpu.spec import JobSpec, Resources, RunPolicy

BE, NORMAL, CRITICAL = Priority.BEST_EFFORT, Priority.NORMAL, Priority.CRITICAL
WAITING, STARTING, RUNNING = TicketState.WAITING, TicketState.STARTING, TicketState.RUNNING


def ticket(job: str, priority: Priority, gpus: int, order: float, state: TicketState = WAITING) -> Ticket:
    return Ticket(job, priority, gpus, order, state, user="ana")


@pytest.fixture
def queue(tmp_path) -> ClusterQueue:
    return ClusterQueue(str(tmp_path / "queue"), cluster_key("spark://127.0.0.1:7077"))


# -- turns -------------------------------------------------------------------------------


def test_waiting_jobs_go_by_class_then_by_arrival():
    normal_old, normal_new = ticket("n1", NORMAL, 1, 1.0), ticket("n2", NORMAL, 1, 2.0)
    best_effort, critical = ticket("b", BE, 1, 0.0), ticket("c", CRITICAL, 1, 9.0)
    everyone = [normal_old, normal_new, best_effort, critical]
    assert next_turn(critical, everyone, 4).go
    assert next_turn(normal_old, everyone, 4).ahead == (critical,)
    assert next_turn(normal_new, everyone, 4).ahead == (critical, normal_old)
    assert next_turn(best_effort, everyone, 4).ahead == (critical, normal_old, normal_new)


def test_a_job_first_in_line_waits_until_the_queued_jobs_leave_it_room():
    running, starting = ticket("r", NORMAL, 2, 0.0, RUNNING), ticket("s", NORMAL, 1, 1.0, STARTING)
    mine = ticket("m", NORMAL, 2, 2.0)
    turn = next_turn(mine, [running, starting, mine], 4)
    assert (turn.go, turn.free, turn.ahead, turn.preempt) == (False, 1, (), ())  # starting GPUs count as held
    assert next_turn(mine, [running, mine], 4).go


def test_a_critical_job_asks_the_fewest_best_effort_jobs_and_never_a_normal_one():
    small, large = ticket("small", BE, 1, 1.0, RUNNING), ticket("large", BE, 2, 2.0, RUNNING)
    normal = ticket("normal", NORMAL, 1, 0.0, RUNNING)
    critical = ticket("c", CRITICAL, 2, 5.0)
    turn = next_turn(critical, [normal, small, large, critical], 4)
    assert not turn.go and turn.preempt == (large,)  # 0 free + 2 from one job: the fewest jobs
    needs_three = ticket("c3", CRITICAL, 3, 5.0)
    assert next_turn(needs_three, [normal, small, large, needs_three], 4).preempt == (large, small)
    needs_four = ticket("c4", CRITICAL, 4, 5.0)  # even both best-effort jobs leave it short: ask none
    assert next_turn(needs_four, [normal, small, large, needs_four], 4).preempt == ()
    starting = ticket("starting", BE, 2, 3.0, STARTING)  # not running yet: nothing to checkpoint
    assert next_turn(critical, [normal, starting, small, critical], 4).preempt == ()
    best_effort = ticket("b", BE, 2, 5.0)
    assert next_turn(best_effort, [normal, small, large, best_effort], 4).preempt == ()  # only critical jobs ask


def test_a_request_counts_only_from_a_live_critical_job_first_in_line_to_a_running_best_effort_one():
    target = ticket("bg", BE, 2, 1.0, RUNNING)
    critical, other = ticket("c", CRITICAL, 4, 5.0), ticket("c0", CRITICAL, 4, 1.0)
    request = PreemptionRequest("bg", "c", critical.file_name)
    assert genuine_request(request, target, [target, critical]) == critical
    assert genuine_request(request, target, [target]) is None  # its requester is gone or stale
    assert genuine_request(request, target, [target, critical, other]) is None  # not first in line
    assert genuine_request(request, ticket("bg", NORMAL, 2, 1.0, RUNNING), [critical]) is None
    assert genuine_request(request, ticket("bg", BE, 2, 1.0, WAITING), [critical]) is None  # gave way already
    forged = PreemptionRequest("bg", "n", "n.json")
    assert genuine_request(forged, target, [target, ticket("n", NORMAL, 4, 0.0)]) is None
    assert genuine_request(PreemptionRequest("x", "c", "c.json"), target, [target, critical]) is None


# -- the folder --------------------------------------------------------------------------


def test_dead_clients_and_foreign_files_hold_nobody_up(queue):
    queue.put(ticket("alive", NORMAL, 1, 1.0))
    stale = Ticket("dead", CRITICAL, 4, 0.0, beat_at=time.time() - 3600, user="bo")
    queue.put(stale)
    queue.store.write_bytes("jobs/other-name.json", ticket("lies", CRITICAL, 4, 0.0).to_json().encode())
    queue.store.write_bytes("jobs/garbage.json", b"{not json")
    assert [t.job_id for t in queue.tickets()] == ["alive"]


def test_two_clients_take_turns_and_a_best_effort_job_gives_way_to_a_critical_one(queue):
    background = QueueSeat(queue, ticket("bg", BE, 2, 1.0)).start()
    assert background.turn(4).go
    background.set_state(RUNNING)
    assert background.request() is None

    urgent = QueueSeat(queue, ticket("urgent", CRITICAL, 4, 2.0)).start()
    turn = urgent.turn(4)
    assert not turn.go and [t.job_id for t in turn.preempt] == ["bg"]
    assert queue.store.listdir("preempt") == ["bg.urgent.json"]
    request, requester = background.request()
    assert (request.requester_job_id, requester.gpus) == ("urgent", 4)

    background.set_state(WAITING)  # checkpointed and stopped
    assert background.request() is None  # a job that gave way is not asked again
    assert urgent.turn(4).go
    assert next_turn(background.ticket, queue.tickets(), 4).ahead == (urgent.ticket,)
    urgent.set_state(STARTING)
    assert queue.store.listdir("preempt") == []  # its requests go once it leaves the line
    assert not background.turn(4).go  # the critical job's GPUs count as held
    urgent.stop()
    assert [t.job_id for t in queue.tickets()] == ["bg"]
    assert background.turn(4).go  # it resumes by itself once they are free
    background.stop()
    assert queue.tickets() == []


def test_a_ticket_keeps_beating_and_says_its_state(queue, monkeypatch):
    monkeypatch.setattr("sparkgpu.launch.scheduling.cluster_queue.BEAT_SECONDS", 0.05)
    seat = QueueSeat(queue, ticket("job", NORMAL, 1, 1.0)).start()
    first = json.loads(queue.store.read_bytes("jobs/job.json"))["beat_at"]
    time.sleep(0.3)
    again = json.loads(queue.store.read_bytes("jobs/job.json"))
    assert again["beat_at"] > first and again["state"] == "waiting"
    seat.set_state(RUNNING)
    time.sleep(0.2)
    assert json.loads(queue.store.read_bytes("jobs/job.json"))["state"] == "running"  # a beat never puts it back
    seat.stop()
    assert not queue.store.exists("jobs/job.json")


def test_sparkgpu_jobs_finds_each_waiting_job_s_place_in_its_cluster(tmp_path):
    root = str(tmp_path / "queue")
    one, two = ClusterQueue(root, cluster_key("spark://a:7077")), ClusterQueue(root, cluster_key("spark://b:7077"))
    one.put(ticket("late", NORMAL, 1, 2.0))
    one.put(ticket("early", NORMAL, 1, 1.0))
    one.put(ticket("running", NORMAL, 1, 0.0, RUNNING))
    two.put(ticket("alone", BE, 1, 3.0))
    places = {job: place for job, (_, place) in cluster_waiting_jobs(root).items()}
    assert places == {"early": 1, "late": 2, "alone": 1}


def test_cluster_keys_tell_clusters_apart_and_local_masters_by_machine():
    assert cluster_key("spark://a:7077") != cluster_key("spark://b:7077")
    assert cluster_key("spark://a:7077") == cluster_key("spark://a:7077")
    assert len(cluster_key("local[4]")) == 16


# -- the backend's seats -----------------------------------------------------------------


def job(job_id: str, priority: str, gpus: int = 2) -> JobSpec:
    return JobSpec(job_id=job_id, name=job_id, resources=Resources(gpus, "A10"), policy=RunPolicy(priority=priority))


@pytest.fixture
def seats(tmp_path, monkeypatch):
    monkeypatch.setattr(ClusterSeats, "poll_seconds", 0.05)
    made = []

    def make() -> ClusterSeats:
        made.append(ClusterSeats(str(tmp_path / "staging"), lambda: open("/dev/null", "w")))
        return made[-1]

    yield make
    for one in made:
        for job_id in list(one._seats):
            one._seats[job_id].stop()


def test_a_job_that_never_gets_its_turn_gives_up_naming_the_jobs_ahead_and_leaves_the_line(seats):
    first, second = seats(), seats()
    first.await_turn(job("holder", "normal", 4), "spark://x:7077", 4, wait=1)
    first.started(job("holder", "normal", 4))
    with pytest.raises(CapacityError, match="the queued jobs hold 4 of the cluster's 4 GPUs"):
        second.await_turn(job("late", "normal"), "spark://x:7077", 4, wait=0.3)
    assert second.seat("late") is None
    queue = first.seat("holder").queue
    assert [t.job_id for t in queue.tickets()] == ["holder"]


def test_a_critical_job_waits_while_the_best_effort_one_gives_way_then_goes(seats):
    background_seats, urgent_seats = seats(), seats()
    background, urgent = job("bg", "best_effort"), job("urgent", "critical", 4)
    background_seats.await_turn(background, "spark://x:7077", 4, wait=1)
    background_seats.started(background)
    done = threading.Event()
    threading.Thread(
        target=lambda: (urgent_seats.await_turn(urgent, "spark://x:7077", 4, wait=30), done.set()), daemon=True
    ).start()
    deadline = time.monotonic() + 10
    reason = None
    while reason is None:
        assert time.monotonic() < deadline, "the best-effort job was never asked to give way"
        reason = background_seats.request(background)
        time.sleep(0.05)
    assert reason == "critical job urgent needs 4 GPU(s) of the Spark cluster"
    assert not done.is_set()
    background_seats.give_way(background)
    assert done.wait(10)
    assert urgent_seats.seat("urgent").state is STARTING


def test_both_queues_records_round_trip_through_their_json_files():
    from sparkgpu.launch.scheduling.gpu_queue import QueueEntry

    ticket = Ticket("j", CRITICAL, 4, 12.5, TicketState.RUNNING, beat_at=99.0, user="ana")
    assert Ticket.from_json(ticket.to_json()) == ticket
    entry = QueueEntry("k", Priority.BEST_EFFORT, 2, 3.0, gpu_kind="simulated-gpu")
    assert QueueEntry.from_json(entry.to_json()) == entry
    assert json.loads(entry.to_json())["priority"] == Priority.BEST_EFFORT.value  # plain strings on disk
    assert sorted([entry, ticket], key=lambda r: r.sort_key())[0] is ticket  # one line order for both
    with pytest.raises(KeyError):
        Ticket.from_json(json.dumps({"job_id": "j"}))  # a foreign file is not a record
