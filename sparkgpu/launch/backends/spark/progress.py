"""A Spark attempt's ranks as the client's hang watch sees them: from node 0's state of the attempt.

The nodes' beats carry their ranks' progress to node 0, which writes every rank's into the
attempt's state (``attempts/<k>/spark/state``, :mod:`sparkgpu.launch.backends.spark.executor.node_progress`);
the client reads that one small object, which it reads anyway for lost nodes (with a staging
store its mirror pulls it with the rest of the ``spark/`` folder). No request per step, none per
rank. The stacks of a hung attempt are asked of the nodes with a sealed control file
(``spark/DUMP``), and come back as one file per rank in the same folder, with each rank's
flight-recorder dump beside it. The ranks are stopped
by the backend's cancel, as for any monitor's stop.
"""

from __future__ import annotations

import time

from sparkgpu.launch.backends.spark.attempt import SparkAttempt, sync_now
from sparkgpu.launch.client.flight_record import LastCollective, last_collective, read_record
from sparkgpu.launch.client.hang_diagnosis import RankStacks, parse_stacks
from sparkgpu.rundir import progress as _progress
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.rundir.progress import RankProgress

__all__ = ["SparkProgress", "relayed_progress"]

#: Seconds between two looks for the stacks the nodes copy back.
_STACKS_POLL = 0.25


def relayed_progress(state: object) -> dict[int, RankProgress]:
    """The ranks' progress records in node 0's state of an attempt, by rank."""
    rows = state.get("progress") if isinstance(state, dict) else None
    found = {}
    for rank, row in rows.items() if isinstance(rows, dict) else ():
        record = _progress.from_row(row)
        if record is not None and str(rank).isdigit():
            found[int(rank)] = record
    return found


class SparkProgress:
    """The progress source of one Spark attempt.

    Args:
        handle: The attempt.
        wait: Most seconds to wait for the nodes' stacks once asked for: node 0 reads the request
            within its control interval, the others hear it within a beat, the ranks take a few
            seconds to dump.
    """

    def __init__(self, handle: SparkAttempt, wait: float):
        self.handle, self.wait = handle, wait

    def records(self, attempt: int, world_size: int) -> dict[int, RankProgress]:
        rd = self.handle.run_dir
        found = relayed_progress(rd.read_control_json(rd.file(RunLayout.spark_state(attempt))))
        return {rank: record for rank, record in found.items() if rank < world_size}

    def stacks(self, attempt: int, records: dict[int, RankProgress]) -> dict[int, RankStacks | None]:
        rd = self.handle.run_dir
        rd.write_control(rd.file(RunLayout.spark_dump(attempt)), b"the attempt hung\n")
        paths = {rank: rd.file(RunLayout.spark_stacks(attempt, rank)) for rank in records}
        deadline = time.monotonic() + self.wait
        while True:
            sync_now(self.handle)  # with a store: puts the request, pulls the spark/ folder
            if all(path.exists() for path in paths.values()) or time.monotonic() >= deadline:
                break
            time.sleep(_STACKS_POLL)
        found: dict[int, RankStacks | None] = {}
        for rank, path in paths.items():
            try:
                found[rank] = parse_stacks(path.read_text(encoding="utf-8", errors="replace"))
            except OSError:
                found[rank] = None
        return found

    def arrivals(self, attempt: int, world_size: int) -> dict[int, list[list[float]]]:
        rd = self.handle.run_dir
        state = rd.read_control_json(rd.file(RunLayout.spark_state(attempt)))
        rows = state.get("arrivals") if isinstance(state, dict) else None
        found: dict[int, list[list[float]]] = {}
        for rank, samples in (rows or {}).items() if isinstance(rows, dict) else ():
            try:
                if int(rank) < world_size:
                    found[int(rank)] = [[int(seq), float(at)] for seq, at in samples]
            except (TypeError, ValueError):
                continue  # not a row of ours
        return found

    def flight_records(self, attempt: int, ranks: list[int]) -> dict[int, LastCollective | None]:
        rd = self.handle.run_dir  # the nodes copied them beside the stacks, which the mirror pulled
        return {r: last_collective(read_record(rd.file(RunLayout.spark_flight_record(attempt, r)))) for r in ranks}

    def stop(self, records: dict[int, RankProgress]) -> None:
        """Nothing here: the ranks run on the executors, and the backend's cancel stops them."""
