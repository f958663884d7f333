"""Which catalog type a real device name is: on this host, on Spark executors, and for billing."""

from __future__ import annotations

import warnings

import pytest

import sparkgpu.launch.node.hardware as hardware
from sparkgpu.spec.catalog import GPU_CATALOG, classify_device
from sparkgpu.errors import CapacityError
from sparkgpu.launch.backends.local.backend import LocalBackend
from sparkgpu.launch.backends.spark.capacity import ExecutorInfo, RankPlacement, SparkCapacity, plan_placement
from sparkgpu.launch.node.hardware import HostGPUs, UnknownGPUWarning, detect_host_gpus
from sparkgpu.spec import JobSpec, Resources

# Names exactly as NVML / nvidia-smi report them.
REAL_DEVICES = [
    ("NVIDIA A10", "A10"),
    ("NVIDIA A10G", "A10"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("NVIDIA H100 80GB HBM3", "H100"),
    ("NVIDIA H100 PCIe", "H100"),
    ("NVIDIA H100 NVL", "H100"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA L40S", None),
    ("NVIDIA GH200 480GB", None),
    ("Tesla T4", None),
]


@pytest.fixture(autouse=True)
def _fresh_unknown_gpu_warnings(monkeypatch):
    monkeypatch.setattr(hardware, "_warned_devices", set())


def job(gpus, gpu_type):
    return JobSpec(job_id="j", name="j", resources=Resources(gpus=gpus, gpu_type=gpu_type))


@pytest.mark.parametrize("name, expected", REAL_DEVICES)
def test_real_device_names_get_their_catalog_type_by_model_not_substring(name, expected):
    found = classify_device(name)
    assert (found.name if found else None) == expected
    for gpu in GPU_CATALOG.values():
        assert gpu.matches_device(name) == (gpu.name == expected), gpu.name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownGPUWarning)
        assert HostGPUs(names=(name,), addresses=("0",)).catalog_type() == expected


def test_an_a100_without_a_size_in_its_name_is_told_apart_by_its_memory():
    assert classify_device("NVIDIA A100-PCIE", memory_gb=79.2).name == "A100-80GB"
    assert classify_device("NVIDIA A100-PCIE", memory_gb=39.4).name == "A100-40GB"
    assert classify_device("NVIDIA A100-PCIE") is None  # neither name nor memory says which
    # A size in the name wins over the memory a MIG slice or a driver may report.
    assert classify_device("NVIDIA A100-SXM4-80GB", memory_gb=39.4).name == "A100-80GB"


def test_nvidia_smi_memory_tells_the_a100_size(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0, NVIDIA A100-PCIE, 81920\\n1, NVIDIA A100-PCIE, 81920\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setattr(hardware, "_from_nvml", lambda: None)  # as on a host without nvidia-ml-py
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    host = detect_host_gpus()
    assert host.names == ("NVIDIA A100-PCIE",) * 2 and host.memory_gb == (80.0, 80.0)
    assert host.catalog_type() == "A100-80GB"


@pytest.mark.parametrize(
    "device, asked",
    [
        ("NVIDIA A100-SXM4-80GB", "A10"),
        ("NVIDIA A10G", "A100-40GB"),
        ("NVIDIA L40S", "L4"),
        ("NVIDIA GH200 480GB", "H200"),
    ],
)
def test_a_gpu_type_the_host_does_not_have_is_refused_naming_the_host(device, asked):
    host = HostGPUs(names=(device,) * 2, addresses=("0", "1"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownGPUWarning)
        with pytest.raises(CapacityError) as err:
            LocalBackend(host_gpus=host).resolve(job(1, asked))
    assert f"this host has 2 x {device}" in str(err.value)
    if classify_device(device) is None:
        assert "not a GPU type sparkgpu knows" in str(err.value)


def test_an_unknown_host_gpu_warns_once_that_its_usage_is_priced_at_the_default_rate():
    host = HostGPUs(names=("NVIDIA L40S",), addresses=("0",))
    with pytest.warns(UnknownGPUWarning, match=r"'NVIDIA L40S' is not in sparkgpu's GPU catalog.*SPARKGPU_USAGE_RATES"):
        resolved = LocalBackend(host_gpus=host).resolve(job(1, None)).job
    assert resolved.resources.gpu_type is None and resolved.devices == ("0",)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownGPUWarning)  # a second job on the same host says nothing
        LocalBackend(host_gpus=host).resolve(job(1, None))


def test_known_and_simulated_gpus_never_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownGPUWarning)
        assert HostGPUs(names=("NVIDIA A10G",), addresses=("0",)).catalog_type() == "A10"
        assert hardware.parse_simulated("A100-80GB:2").catalog_type() == "A100-80GB"


def executors(name):
    return tuple(ExecutorInfo(str(i), f"host-{i}", 4, (str(2 * i), str(2 * i + 1)), (name, name)) for i in range(2))


def test_spark_executors_with_a_gpu_outside_the_catalog_refuse_a_gpu_type_naming_it():
    capacity = SparkCapacity(
        master="spark://head:7077",
        executors=executors("NVIDIA L40S"),
        gpus_per_executor=2,
        gpu_type=None,
        gpu_type_source=None,
        simulated=False,
    )
    with pytest.raises(
        CapacityError,
        match=r"GPUs are 'NVIDIA L40S', which is not a GPU type sparkgpu knows.*"
        r"gpu_type='L4'.*spark.sparkgpu.gpuType",
    ):
        plan_placement(2, "L4", capacity)


def test_spark_executors_classify_their_driver_names_by_model():
    from sparkgpu.launch.backends.spark.capacity import _cluster_gpu_type

    assert _cluster_gpu_type({}, executors("NVIDIA A100-SXM4-80GB")) == ("A100-80GB", "driver")
    assert _cluster_gpu_type({}, executors("NVIDIA L40S")) == (None, None)
    declared = {"spark.sparkgpu.gpuType": "L4"}  # the admin's word beats the driver's name
    assert _cluster_gpu_type(declared, executors("NVIDIA L40S")) == ("L4", "conf")
    capacity = SparkCapacity(
        master="spark://head:7077",
        executors=executors("NVIDIA L40S"),
        gpus_per_executor=2,
        gpu_type="L4",
        gpu_type_source="conf",
        simulated=False,
    )
    assert plan_placement(2, "L4", capacity) == RankPlacement(1, 2, 2)
