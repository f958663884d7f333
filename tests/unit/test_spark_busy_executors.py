"""Executors with every core busy (silent in the capacity probe) still count for the layout."""

from __future__ import annotations

import pytest

from sparkgpu.errors import CapacityError
from sparkgpu.launch.backends.spark.capacity import ExecutorInfo, RankPlacement, SparkCapacity, plan_placement

ANSWERED = ExecutorInfo("0", "host-0", 2, ("0", "1"))
BUSY = ExecutorInfo("busy-0", "?", 2, busy=True)


def cluster(*executors):
    return SparkCapacity(
        master="spark://head:7077",
        executors=executors,
        gpus_per_executor=2,
        gpu_type="A10",
        gpu_type_source="conf",
        simulated=False,
    )


def test_a_busy_executor_counts_with_the_confs_gpus_so_the_job_waits_for_it():
    assert plan_placement(4, "A10", cluster(ANSWERED, BUSY)) == RankPlacement(2, 2, 2)
    # Without it the same request reads as one the cluster can never satisfy.
    with pytest.raises(CapacityError, match="gpus<=2"):
        plan_placement(4, "A10", cluster(ANSWERED))


def test_more_than_the_busy_executors_could_give_still_fails_at_once_naming_them():
    with pytest.raises(CapacityError) as err:
        plan_placement(6, "A10", cluster(ANSWERED, BUSY))
    text = str(err.value)
    assert "gpus<=4" in text and "executor 0 on host-0: 2 x A10 (0,1)" in text
    assert "1 executor(s) with every core busy: 2 x A10 each" in text
