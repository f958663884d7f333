"""``spark.gpu`` on a Spark Connect ``local[2]`` session: CPU ranks, no resource profiles."""

from __future__ import annotations

import time

import pytest

from sparkgpu import CapacityError, ConfigurationError, runtime
from sparkgpu.config import settings

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("workers_share_this_image")]


@pytest.fixture
def local_spark(spark):
    from sparkgpu.api.spark_gpu import attach

    attach()
    return spark


def rank_and_sum():
    import torch
    import torch.distributed as dist

    t = torch.tensor([runtime.get_global_rank() + 1])
    dist.all_reduce(t)
    return runtime.get_global_rank(), runtime.get_node_rank(), t.item(), dist.get_backend()


def test_cpu_ranks_run_as_one_barrier_task_in_local_mode(local_spark):
    capacity = local_spark.gpu.capacity()
    assert capacity.local_mode and capacity.total_gpus == 0
    assert [e.executor_id for e in capacity.executors] == ["driver"] and capacity.executors[0].cores == 2

    results = local_spark.gpu.train(rank_and_sum, gpus=2, gpu_type="cpu")
    assert results == [(0, 0, 3, "gloo"), (1, 0, 3, "gloo")]


def test_gpu_request_in_local_mode_fails_fast_and_says_why(local_spark):
    started = time.monotonic()
    with pytest.raises(CapacityError, match=r"local mode .* gpu_type='cpu'"):
        local_spark.gpu.train(rank_and_sum, gpus=1, gpu_type="A10")
    assert time.monotonic() - started < 15


def count_and_sum_of_y(data_url):
    from streaming import StreamingDataset

    dataset = StreamingDataset(local=data_url, shuffle=False, batch_size=1)
    values = [float(sample["y"]) for sample in dataset]  # iteration splits the samples over the ranks
    return len(values), sum(values)


def test_data_frame_is_converted_once_and_handed_over_as_data_url(local_spark, tmp_path, capsys):
    frame = local_spark.range(0, 500, numPartitions=2).selectExpr("id", "cast(id * 2 as double) as y")
    volume = str(tmp_path / "volume")
    expected_sum = float(sum(2 * i for i in range(500)))

    first = local_spark.gpu.train(count_and_sum_of_y, gpus=2, gpu_type="cpu", data=frame, data_volume=volume)
    assert [count for count, _ in first] == [250, 250] and sum(total for _, total in first) == expected_sum
    assert "500 samples" in capsys.readouterr().err
    second = local_spark.gpu.train(count_and_sum_of_y, gpus=1, gpu_type="cpu", data=frame, data_volume=volume)
    assert second == [(500, expected_sum)]
    assert "reused" in capsys.readouterr().err


def no_data_parameter():
    return 1


def test_data_for_a_function_without_data_url_fails_before_anything_runs(local_spark, tmp_path):
    frame = local_spark.range(10)
    with pytest.raises(ConfigurationError, match="data_url"):
        local_spark.gpu.train(no_data_parameter, gpus=1, gpu_type="cpu", data=frame, data_volume=str(tmp_path / "v"))
    assert not (tmp_path / "v").exists()
    assert not settings().staging_root.exists() or not any(settings().staging_root.iterdir())


class CountsItsPickling:
    """An argument that counts how often this client pickles it."""

    pickled = 0

    def __reduce__(self):
        type(self).pickled += 1
        return CountsItsPickling, ()


def samples_seen(counter, data_url):
    from streaming import StreamingDataset

    return sum(1 for _ in StreamingDataset(local=data_url, shuffle=False, batch_size=1))


def test_train_with_data_probes_and_pickles_once_under_one_job_id(local_spark, tmp_path, monkeypatch):
    from sparkgpu.launch.backends.spark.backend import SparkBackend

    resolved = []
    real_resolve = SparkBackend.resolve

    def counting_resolve(self, job):
        resolved.append(job.job_id)
        return real_resolve(self, job)

    monkeypatch.setattr(SparkBackend, "resolve", counting_resolve)
    monkeypatch.setattr(CountsItsPickling, "pickled", 0)
    frame = local_spark.range(0, 40, numPartitions=2).selectExpr("id", "cast(id as double) as y")

    results = local_spark.gpu.train(
        samples_seen,
        gpus=1,
        gpu_type="cpu",
        args=(CountsItsPickling(),),
        data=frame,
        data_volume=str(tmp_path / "volume"),
    )

    assert results == [40]
    assert resolved == [local_spark.gpu.last_job_id]  # one capacity check, for the job that ran
    assert CountsItsPickling.pickled == 1
    assert [p.name for p in settings().staging_root.iterdir()] == [local_spark.gpu.last_job_id]
