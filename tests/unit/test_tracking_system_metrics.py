"""GPU metrics limited to the job's own devices (with a fake NVML: there is no GPU here)."""

from __future__ import annotations

import sys
import time

import pytest

from tests.fakes.nvml import make_fake_nvml


def _uri(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/mlflow.db"  # MLflow opens the store; the monitors are not started


@pytest.fixture
def fake_nvml(monkeypatch):
    from mlflow.system_metrics.metrics import gpu_monitor

    nvml = make_fake_nvml(device_count=4)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(gpu_monitor, "pynvml", nvml, raising=False)
    return nvml


def test_job_devices_come_from_the_tracking_variable_then_cuda_visible_devices():
    from sparkgpu.tracking.system_metrics import job_gpu_devices

    assert job_gpu_devices({"SPARKGPU_TRACKING_DEVICES": "2,3", "CUDA_VISIBLE_DEVICES": "2"}) == ["2", "3"]
    assert job_gpu_devices({"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b"}) == ["GPU-a", "GPU-b"]
    assert job_gpu_devices({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert job_gpu_devices({}) is None


def test_a_spark_node_reports_all_its_gpus_not_only_local_rank_0s():
    from sparkgpu.tracking.system_metrics import job_gpu_devices

    # A Spark node task exports the task's GPU addresses; the entrypoint then narrows local
    # rank 0's CUDA_VISIBLE_DEVICES to the first one, and the job spec carries no devices.
    assert job_gpu_devices({"SPARKGPU_NODE_DEVICES": "4,5,6,7", "CUDA_VISIBLE_DEVICES": "4"}) == ["4", "5", "6", "7"]
    assert job_gpu_devices({"SPARKGPU_NODE_DEVICES": "2,3", "SPARKGPU_TRACKING_DEVICES": "0,1"}) == ["2", "3"]


def test_gpu_monitor_reports_only_the_jobs_devices_in_job_order(fake_nvml):
    from sparkgpu.tracking.system_metrics import JobGPUMonitor

    monitor = JobGPUMonitor(["2", "GPU-fake-0"])
    monitor.collect_metrics()
    metrics = monitor.aggregate_metrics()
    # The job's first device is physical device 2 (30 %), its second is device 0 (10 %).
    assert metrics["gpu_0_utilization_percentage"] == 30
    assert metrics["gpu_1_utilization_percentage"] == 10
    assert not any(key.startswith(("gpu_2", "gpu_3")) for key in metrics)


def test_node_monitor_uses_the_job_devices_and_none_on_cpu(fake_nvml, tmp_path):
    from sparkgpu.tracking.system_metrics import JobGPUMonitor, NodeMetricsMonitor

    on_gpus = NodeMetricsMonitor("r" * 32, node_rank=1, tracking_uri=_uri(tmp_path), gpu_devices=["1"])
    gpu_monitors = [m for m in on_gpus.monitors if isinstance(m, JobGPUMonitor)]
    assert len(gpu_monitors) == 1 and gpu_monitors[0].num_gpus == 1
    assert on_gpus.node_id == "node_1"
    on_cpu = NodeMetricsMonitor("r" * 32, node_rank=0, tracking_uri=_uri(tmp_path), gpu_devices=[])
    assert {type(m).__name__ for m in on_cpu.monitors} == {"CPUMonitor", "DiskMonitor", "NetworkMonitor"}


def test_unknown_device_turns_gpu_metrics_off_but_keeps_cpu_metrics(fake_nvml, caplog, tmp_path):
    from sparkgpu.tracking.system_metrics import NodeMetricsMonitor

    monitor = NodeMetricsMonitor("r" * 32, node_rank=0, tracking_uri=_uri(tmp_path), gpu_devices=["9"])
    assert {type(m).__name__ for m in monitor.monitors} == {"CPUMonitor", "DiskMonitor", "NetworkMonitor"}
    assert "GPU metrics are off" in caplog.text


def test_steps_count_intervals_since_the_job_started(tmp_path):
    from sparkgpu.tracking.system_metrics import NodeMetricsMonitor

    started = time.time() - 125
    before = time.time()
    monitor = NodeMetricsMonitor(
        "r" * 32, node_rank=0, tracking_uri=_uri(tmp_path), interval=10, job_started_at=started, gpu_devices=[]
    )
    after = time.time()
    # A resumed attempt starting 125 s into the job continues the curves at step 12 (or
    # later, when building the monitor itself took seconds on a busy machine).
    assert 12 == int((before - started) // 10) <= monitor._logging_step <= int((after - started) // 10)
