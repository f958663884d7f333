"""databricks.air's names beside serverless_gpu's: decorator arguments, node shapes, overrides, runtime."""

from __future__ import annotations

import subprocess
import sys

import pytest

import sparkgpu
from sparkgpu import (
    CapacityError,
    ConfigurationError,
    JobTimeoutError,
    LocalExecutionTimeoutError,
    distributed,
    runtime,
)
from sparkgpu.spec.catalog import ACCELERATOR_TYPES, GPU_CATALOG, classify_device, lookup_accelerator_type
from sparkgpu.config import reset_settings
from sparkgpu.usage.rates import RateCard


def train(x):
    return x


# -- the catalog and node shapes -------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, gpu, per_node",
    [
        ("GPU_1xA10", "A10", 1),
        ("GPU_1xH100", "H100", 1),
        ("GPU_8xH100", "H100", 8),
        ("GPU_8xB300", "B300", 8),
        ("gpu_8xh100", "H100", 8),
        ("Gpu_4xA100-80GB", "A100-80GB", 4),
    ],
)
def test_node_shapes_name_a_catalog_gpu_and_gpus_per_node(shape, gpu, per_node):
    found = lookup_accelerator_type(shape)
    assert (found.gpu.name, found.gpus_per_node) == (gpu, per_node)


@pytest.mark.parametrize("bad", ["GPU_16xH100", "GPU_2xT4", "H100x8", "GPU_0xA10"])
def test_unknown_shapes_list_the_valid_ones(bad):
    with pytest.raises(ConfigurationError, match="GPU_1xA10.*GPU_8xB300") as err:
        lookup_accelerator_type(bad)
    assert repr(bad) in str(err.value)


def test_a_cpu_shape_points_at_gpu_type_cpu():
    with pytest.raises(ConfigurationError, match="gpu_type='cpu'"):
        lookup_accelerator_type("GPU_2xCPU")


def test_blackwell_gpus_are_in_the_catalog_classified_and_priced():
    assert {"B200", "B300"} <= set(GPU_CATALOG)
    assert classify_device("NVIDIA B200").name == "B200"
    assert classify_device("NVIDIA B300 SXM6 AC").name == "B300"
    card = RateCard()
    assert card.rate("B300") > card.rate("B200") > card.rate("H200") > 0
    assert all(lookup_accelerator_type(shape) for shape in ACCELERATOR_TYPES)


# -- @distributed's arguments -------------------------------------------------------------------


def test_air_names_and_serverless_gpu_names_build_the_same_job():
    air = distributed(num_accelerators=8, accelerator_type="GPU_8xH100", remote=True)(train)
    legacy = distributed(gpus=8, gpu_type="H100", remote=True)(train)
    assert air.resources.gpus == legacy.resources.gpus == air.num_accelerators == 8
    assert air.resources.gpu_type == legacy.resources.gpu_type == "H100"
    assert air.accelerator_type == "GPU_8xH100" and air.resources.gpus_per_node == 8
    assert legacy.accelerator_type is None  # a bare GPU type leaves the node split to the backend
    assert air.func is train and air(3) == 3


def test_a_plain_gpu_type_is_accepted_as_accelerator_type_as_databricks_still_does():
    job = distributed(1, "h100_80gb", True)(train)
    assert job.resources.gpu_type == "H100" and job.accelerator_type is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_accelerators": 2, "gpus": 4}, "num_accelerators=2 and gpus=4 disagree"),
        ({"num_accelerators": 2, "num_gpus": 3}, "disagree"),
        ({"accelerator_type": "GPU_8xH100", "gpu_type": "A10"}, "name different GPUs"),
        ({"accelerator_type": "GPU_8xH100", "num_accelerators": 12, "remote": True}, "whole number of 8-GPU nodes"),
        ({"accelerator_type": "GPU_3xA10G", "num_accelerators": 4, "remote": True}, "multiple of 3"),
        ({"num_accelerators": 0}, "at least 1"),
    ],
)
def test_contradictory_or_bad_settings_fail_at_decoration(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        distributed(**kwargs)


def test_agreeing_names_and_the_same_gpu_spelled_twice_are_fine():
    job = distributed(num_accelerators=8, gpus=8, accelerator_type="GPU_8xH100", gpu_type="h100", remote=True)(train)
    assert (job.num_accelerators, job.accelerator_type) == (8, "GPU_8xH100")


def test_without_a_count_a_local_job_takes_every_gpu_of_this_host(monkeypatch):
    monkeypatch.setenv("SPARKGPU_SIMULATE_GPUS", "H100:4")
    reset_settings()
    assert distributed()(train).num_accelerators == 4
    assert distributed(accelerator_type="GPU_8xH100")(train).num_accelerators == 4
    assert distributed(gpu_type="cpu")(train).num_accelerators == 1  # CPU: one rank
    assert distributed(gpus=2)(train).num_accelerators == 2
    monkeypatch.delenv("SPARKGPU_SIMULATE_GPUS")
    reset_settings()
    assert distributed(train).num_accelerators == 1  # no GPU here: one CPU rank


def test_without_a_count_a_remote_job_takes_one_node_of_its_shape():
    assert distributed(accelerator_type="GPU_8xB300", remote=True)(train).num_accelerators == 8
    assert distributed(gpu_type="A10", remote=True)(train).num_accelerators == 1


# -- with_overrides ----------------------------------------------------------------------------


def test_with_overrides_returns_a_new_function_and_leaves_the_original_alone():
    base = distributed(8, "GPU_8xH100", True, 600, tags={"team": "ml"}, max_restarts=2)(train)
    bigger = base.with_overrides(num_accelerators=16, timeout=60)
    assert bigger is not base and bigger.func is train and bigger.__name__ == "train"
    assert (bigger.num_accelerators, bigger.accelerator_type, bigger.policy.timeout) == (16, "GPU_8xH100", 60)
    assert bigger.tags == {"team": "ml"} and bigger.policy.max_restarts == 2  # the rest carries over
    assert (base.num_accelerators, base.policy.timeout) == (8, 600)

    # A new count or type replaces the old one whichever API's name either used.
    local = base.with_overrides(gpus=2, gpu_type="cpu", remote=False)
    assert (local.num_accelerators, local.resources.gpu_type, local.accelerator_type) == (2, "cpu", None)
    assert local.with_overrides(accelerator_type="GPU_1xA10", remote=True).resources.gpu_type == "A10"
    assert base.with_overrides(max_restarts=0, name="again").policy.max_restarts == 0


def test_with_overrides_validates_like_the_decorator():
    base = distributed(8, "GPU_8xH100", True)(train)
    with pytest.raises(ConfigurationError, match="whole number of 8-GPU nodes"):
        base.with_overrides(num_accelerators=4)
    with pytest.raises(ConfigurationError, match="unknown argument.*accelerators.*num_accelerators"):
        base.with_overrides(accelerators=4)
    with pytest.raises(ConfigurationError, match="unknown accelerator_type 'GPU_8xT4'"):
        base.with_overrides(accelerator_type="GPU_8xT4")


# -- names elsewhere ---------------------------------------------------------------------------


def test_local_execution_timeout_error_is_the_job_timeout():
    with pytest.raises(LocalExecutionTimeoutError):
        raise JobTimeoutError("ran past its timeout")
    assert issubclass(LocalExecutionTimeoutError, TimeoutError) and "LocalExecutionTimeoutError" in sparkgpu.__all__


def test_registry_imports_as_a_module():
    # A fresh interpreter: in this one another test may have imported it already.
    code = (
        "import sparkgpu.registry, sparkgpu.tracking.registry as t; "
        "from sparkgpu import registry; "
        "assert registry is sparkgpu.registry and registry.register is t.register; "
        "assert set(registry.__all__) == set(t.__all__)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- runtime -----------------------------------------------------------------------------------


@pytest.fixture
def clean_rank_env(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "REPLICA_RANK", "MASTER_ADDR", "MASTER_PORT", "SPARKGPU_SIMULATED_GPUS"):
        monkeypatch.delenv(name, raising=False)


def test_get_global_rank_of_a_group_asks_the_group(clean_rank_env, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "3")
    assert runtime.get_global_rank() == 3
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        assert runtime.get_global_rank(group) == 0
    finally:
        dist.destroy_process_group()


def test_replica_rank_and_node_ip(clean_rank_env, monkeypatch):
    assert runtime.get_replica_rank() == 0
    monkeypatch.setenv("REPLICA_RANK", "2")
    assert runtime.get_replica_rank() == 2
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert runtime.get_node_ip() == "127.0.0.1"  # the address the rendezvous is reached from


def test_device_is_cuda_local_rank_as_under_torchrun(clean_rank_env, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no GPU on this machine
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the node's GPUs, all visible to every rank
    assert runtime.device() == torch.device("cuda", 3)
    monkeypatch.setenv("SPARKGPU_SIMULATED_GPUS", "1")
    assert runtime.device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("SPARKGPU_SIMULATED_GPUS")
    assert runtime.device() == torch.device("cpu")


# -- a node shape on a Spark pool ----------------------------------------------------------------


def test_a_node_shape_sets_the_ranks_per_spark_task():
    from sparkgpu.launch.backends.spark.backend import SparkBackend
    from sparkgpu.launch.backends.spark.capacity import ExecutorInfo, SparkCapacity
    from sparkgpu.spec import JobSpec

    two_by_two = SparkCapacity(
        master="spark://head:7077",
        gpus_per_executor=2,
        gpu_type="A10",
        simulated=False,
        gpu_type_source="conf",
        executors=(ExecutorInfo("0", "host-0", 8, ("0", "1")), ExecutorInfo("1", "host-1", 8, ("0", "1"))),
    )
    backend = SparkBackend(spark=object(), client_timeout=None, staging_url="")

    def placement(**asked):
        job = distributed(remote=True, **asked)(train)
        spec = JobSpec(job_id="j", name="j", resources=job.resources, backend="spark")
        return backend._placement(spec, two_by_two)

    assert placement(gpus=2, gpu_type="A10").gpus_per_node == 2  # the backend packs both on one executor
    assert placement(num_accelerators=2, accelerator_type="GPU_1xA10").gpus_per_node == 1  # one GPU per node
    spec = JobSpec(job_id="j", name="j", resources=distributed(4, "GPU_4xA10", True)(train).resources, backend="spark")
    assert JobSpec.from_dict(spec.to_dict()) == spec  # the shape survives the run dir
    with pytest.raises(CapacityError):
        backend._placement(spec, two_by_two)  # no executor holds 4 A10s
