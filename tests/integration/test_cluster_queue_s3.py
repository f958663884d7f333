"""A Spark cluster's GPU queue on the S3 server, as clients on two machines share it through the
staging root: turns, a critical job's request that a best-effort job give way, and a planted
request that nobody obeys."""

from __future__ import annotations

import pytest

from sparkgpu.launch.scheduling.cluster_queue import (
    ClusterQueue,
    QueueSeat,
    Ticket,
    TicketState,
    cluster_key,
    cluster_waiting_jobs,
    queue_root,
)
from sparkgpu.launch.scheduling.gpu_queue import PreemptionRequest
from sparkgpu.spec.priority import Priority

pytestmark = pytest.mark.integration


def test_clients_sharing_an_s3_staging_root_take_turns_and_give_way(s3_bucket):
    root = queue_root(f"{s3_bucket}/runs")
    assert root == f"{s3_bucket}/runs/_queue"
    # Each client opens the queue on its own, as two notebooks would.
    queue_a, queue_b = (ClusterQueue(root, cluster_key("spark://cluster:7077")) for _ in range(2))
    background = QueueSeat(queue_a, Ticket("bg", Priority.BEST_EFFORT, 2, 1.0, user="ana")).start()
    assert background.turn(4).go
    background.set_state(TicketState.RUNNING)

    # A planted request, from a job that is not first in line (not in line at all), is not obeyed.
    queue_b.store.write_bytes(
        "preempt/bg.mallory.json", PreemptionRequest("bg", "mallory", "mallory.json").to_json().encode()
    )
    assert background.request() is None

    urgent = QueueSeat(queue_b, Ticket("urgent", Priority.CRITICAL, 4, 2.0, user="bob")).start()
    normal = QueueSeat(queue_b, Ticket("later", Priority.NORMAL, 1, 0.5, user="bob")).start()
    assert [t.job_id for t in urgent.turn(4).preempt] == ["bg"]
    assert {job: place for job, (_, place) in cluster_waiting_jobs(root).items()} == {"urgent": 1, "later": 2}
    request, requester = background.request()
    assert (request.requester_job_id, requester.user) == ("urgent", "bob")

    background.set_state(TicketState.WAITING)
    assert urgent.turn(4).go
    urgent.set_state(TicketState.STARTING)
    assert not normal.turn(4).go and not background.turn(4).go
    urgent.stop()
    assert normal.turn(4).go  # first in line among the waiting: normal before best effort
    for seat in (normal, background):
        seat.stop()
    assert queue_a.tickets() == []
