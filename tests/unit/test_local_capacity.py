"""Capacity and gpu_type checks of the local backend, against injected host GPUs."""

import os
import subprocess

import pytest

from sparkgpu.errors import CapacityError, ConfigurationError
from sparkgpu.launch.backends.local.backend import LocalBackend
from sparkgpu.launch.node.hardware import HostGPUs, detect_host_gpus, parse_simulated
from sparkgpu.spec import JobSpec, Resources

H100_X2 = HostGPUs(names=("NVIDIA H100 80GB HBM3",) * 2, addresses=("0", "1"))
NO_GPUS = HostGPUs()


def job(gpus, gpu_type):
    return JobSpec(job_id="j", name="j", resources=Resources(gpus=gpus, gpu_type=gpu_type))


def test_more_gpus_than_the_host_has_names_what_exists(monkeypatch):
    def no_process(*args, **kwargs):
        raise AssertionError(f"resolving a job started a process: {args[:1]}")

    monkeypatch.setattr(subprocess, "Popen", no_process)  # refused from the host's GPUs as given, nothing probed
    monkeypatch.setattr(os, "fork", no_process)
    with pytest.raises(CapacityError) as err:
        LocalBackend(host_gpus=H100_X2).resolve(job(4, "H100"))
    assert "2 x NVIDIA H100 80GB HBM3" in str(err.value) and "gpus<=2" in str(err.value)


def test_gpu_type_that_does_not_match_the_host_is_refused():
    with pytest.raises(CapacityError, match=r"this host has 2 x NVIDIA H100.*gpu_type='H100'"):
        LocalBackend(host_gpus=H100_X2).resolve(job(1, "A10"))


def test_asking_for_gpus_on_a_host_without_any_points_to_cpu_and_remote():
    with pytest.raises(CapacityError, match="no GPUs; use gpu_type='cpu'.*remote=True"):
        LocalBackend(host_gpus=NO_GPUS).resolve(job(1, "A10"))


def test_matching_gpus_get_one_address_per_rank():
    resolved = LocalBackend(host_gpus=H100_X2).resolve(job(2, "H100")).job
    assert resolved.devices == ("0", "1") and resolved.uses_cuda


def test_no_gpu_type_means_the_host_gpus_or_cpu():
    assert LocalBackend(host_gpus=H100_X2).resolve(job(1, None)).job.resources.gpu_type == "H100"
    cpu = LocalBackend(host_gpus=NO_GPUS).resolve(job(2, None)).job
    assert cpu.resources.gpu_type == "cpu" and not cpu.uses_cuda and cpu.devices == ()


def test_cpu_ranks_are_capped():
    with pytest.raises(CapacityError, match="SPARKGPU_MAX_CPU_RANKS"):
        LocalBackend(host_gpus=NO_GPUS, max_cpu_ranks=4).resolve(job(5, "cpu"))


def test_simulated_gpus_run_on_cpu_with_real_addresses():
    resolved = LocalBackend(host_gpus=parse_simulated("A10:4")).resolve(job(3, "A10")).job
    assert resolved.devices == ("0", "1", "2") and resolved.simulated and not resolved.uses_cuda


@pytest.mark.parametrize("value", ["H100", "H100:0", "H100:x", "V100:2"])
def test_bad_simulation_setting_says_how_to_write_it(value):
    if value == "H100":
        assert parse_simulated(value).count == 1
        return
    with pytest.raises(ConfigurationError):
        parse_simulated(value)


def test_cuda_visible_devices_narrows_the_host(monkeypatch):
    import sparkgpu.launch.node.hardware as hw

    monkeypatch.setattr(hw, "_from_nvml", lambda: [(str(i), "NVIDIA A10G", 22.5) for i in range(3)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    host = detect_host_gpus()
    assert host.addresses == ("0", "2") and host.catalog_type() == "A10"
