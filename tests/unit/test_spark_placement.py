"""How the Spark backend maps ranks onto barrier tasks, and the errors that name what exists."""

from __future__ import annotations

import pytest

from sparkgpu.errors import CapacityError, ConfigurationError
from sparkgpu.launch.backends.spark.capacity import (
    ExecutorInfo,
    RankPlacement,
    SparkCapacity,
    plan_placement,
    read_confs,
)


def cluster(*addresses, gpu_type="A10", cores=8, master="spark://head:7077", per_executor=None, **extra):
    executors = tuple(ExecutorInfo(str(i), f"host-{i}", cores, tuple(a)) for i, a in enumerate(addresses))
    per_executor = per_executor if per_executor is not None else max((len(a) for a in addresses), default=0)
    return SparkCapacity(
        master=master,
        executors=executors,
        gpus_per_executor=per_executor,
        gpu_type=gpu_type,
        gpu_type_source="conf",
        simulated=False,
        **extra,
    )


TWO_BY_TWO = cluster(("0", "1"), ("2", "3"))


@pytest.mark.parametrize(
    "gpus, expected",
    [
        (4, RankPlacement(2, 2, 2)),  # a whole executor per node
        (2, RankPlacement(1, 2, 2)),  # fits one executor: one node, no network between its ranks
        (1, RankPlacement(1, 1, 1)),
        (3, RankPlacement(3, 1, 1)),  # 3 does not split into 2s: one GPU per task
    ],
)
def test_gpu_jobs_use_as_few_nodes_as_fit(gpus, expected):
    assert plan_placement(gpus, "A10", TWO_BY_TWO) == expected


def test_eight_gpu_executors_take_an_eight_gpu_job_on_one_node():
    big = cluster(tuple(str(i) for i in range(8)), tuple(str(i) for i in range(8)), gpu_type="H100")
    assert plan_placement(8, "H100", big) == RankPlacement(1, 8, 8)
    assert plan_placement(16, "H100", big) == RankPlacement(2, 8, 8)
    assert plan_placement(12, "H100", big) == RankPlacement(2, 6, 6)


def test_too_many_gpus_names_what_exists():
    with pytest.raises(CapacityError) as err:
        plan_placement(6, "A10", TWO_BY_TWO)
    text = str(err.value)
    assert "asked for 6 x A10" in text and "4 x A10 at spark://head:7077" in text
    assert "executor 0 on host-0: 2 x A10 (0,1)" in text and "gpus<=4" in text


def test_wrong_gpu_type_names_the_clusters_type():
    with pytest.raises(CapacityError, match=r"gpu_type='H100' .*spark.sparkgpu.gpuType.*gpu_type='A10'"):
        plan_placement(2, "H100", TWO_BY_TWO)


def test_unknown_gpu_type_is_not_held_against_the_request():
    assert plan_placement(2, "H100", cluster(("0", "1"), gpu_type=None)) == RankPlacement(1, 2, 2)


def test_no_gpus_and_local_mode_say_what_to_do_instead():
    with pytest.raises(CapacityError, match=r"no GPUs .*spark.executor.resource.gpu.amount is not set"):
        plan_placement(1, "A10", cluster((), (), gpu_type=None))
    with pytest.raises(CapacityError, match=r"local mode \(local\[2\]\).*gpu_type='cpu'"):
        plan_placement(1, "A10", cluster((), master="local[2]"))


def test_dynamic_allocation_is_refused_with_the_reason():
    with pytest.raises(ConfigurationError, match="SPARK-24942"):
        plan_placement(2, "A10", cluster(("0", "1"), dynamic_allocation=True))


def test_executor_gpus_come_from_the_conf_when_the_probe_saw_no_addresses():
    unseen = cluster((), (), per_executor=4)
    assert unseen.total_gpus == 8
    assert plan_placement(8, "A10", unseen) == RankPlacement(2, 4, 4)


def test_cpu_jobs_spread_over_the_executors():
    assert plan_placement(4, "cpu", TWO_BY_TWO) == RankPlacement(2, 2, 0)
    assert plan_placement(3, "cpu", TWO_BY_TWO) == RankPlacement(1, 3, 0)
    local = cluster((), master="local[2]", gpu_type=None, cores=2)
    assert plan_placement(4, "cpu", local) == RankPlacement(1, 4, 0)
    with pytest.raises(CapacityError, match="at most 4 CPU ranks run per node"):
        plan_placement(6, "cpu", local, max_cpu_ranks_per_node=4)


def test_gpus_per_node_is_honoured_and_checked():
    assert plan_placement(4, "A10", TWO_BY_TWO, gpus_per_node=1) == RankPlacement(4, 1, 1)
    with pytest.raises(ConfigurationError, match="divisor"):
        plan_placement(4, "A10", TWO_BY_TWO, gpus_per_node=3)
    with pytest.raises(CapacityError):
        plan_placement(4, "A10", TWO_BY_TWO, gpus_per_node=4)  # no executor holds 4


def test_tasks_per_executor_are_limited_by_its_cores():
    one_core = cluster(("0", "1"), ("2", "3"), cores=1)
    assert plan_placement(2, "A10", one_core) == RankPlacement(1, 2, 2)
    with pytest.raises(CapacityError):
        plan_placement(4, "A10", one_core, gpus_per_node=1)  # 4 tasks, 2 task slots


def test_capacity_prints_as_a_table():
    table = str(TWO_BY_TWO)
    assert table.splitlines()[0] == "Spark cluster spark://head:7077: 2 executor(s), 4 GPU(s) of type A10"
    assert "host-1" in table and "2,3" in table
    assert repr(TWO_BY_TWO) == table


class _Conf:
    def __init__(self, values, get_all=True):
        self.values, self.get_all, self.calls = values, get_all, 0

    @property
    def getAll(self):
        if not self.get_all:
            raise RuntimeError("not supported by this server")
        return dict(self.values)

    def get(self, key, default=None):
        self.calls += 1
        return self.values.get(key, default)


class _Session:
    def __init__(self, conf):
        self.conf = conf


def test_confs_are_read_in_one_round_trip_when_possible():
    values = {"spark.master": "spark://h:7077", "spark.executor.resource.gpu.amount": "8", "spark.other": "x"}
    conf = _Conf(values)
    confs = read_confs(_Session(conf))
    assert conf.calls == 0
    assert confs["spark.master"] == "spark://h:7077" and confs["spark.executor.resource.gpu.amount"] == "8"
    assert confs["spark.sparkgpu.gpuType"] is None and "spark.other" not in confs
    fallback = _Conf(values, get_all=False)
    assert read_confs(_Session(fallback))["spark.executor.resource.gpu.amount"] == "8" and fallback.calls > 1


def test_a_tagged_action_that_waits_too_long_is_interrupted_and_named():
    import io
    import time

    from sparkgpu.launch.backends.spark.capacity import run_tagged
    from tests.fakes.spark_session import BlockingFrame, TaggedSession

    session, out = TaggedSession(), io.StringIO()
    started = time.monotonic()
    with pytest.raises(CapacityError, match="gave up waiting for the probe after 1s.*SPARKGPU_SPARK_WAIT_TIMEOUT"):
        run_tagged(
            session, lambda: BlockingFrame(session), "probe-1", timeout=1.0, what="the probe", out=out, notice_after=0.2
        )
    assert 1.0 <= time.monotonic() - started < 5
    assert session.interrupted == ["probe-1"]
    assert "still waiting for the probe" in out.getvalue()


def test_a_tagged_action_returns_its_rows_and_runs_under_its_tag():
    from sparkgpu.launch.backends.spark.capacity import run_tagged
    from tests.fakes.spark_session import BlockingFrame, TaggedSession

    session = TaggedSession()
    frame = BlockingFrame(session, rows=["a", "b"], seconds=0.05)
    assert run_tagged(session, lambda: frame, "probe-2", timeout=10, what="x") == ["a", "b"]
    assert session._running[0][0] == {"probe-2"} and session.interrupted == []
