"""Ray's system metrics into the job's run: what is read from Ray and what the run gets.

The node endpoints are real HTTP servers serving Prometheus text as Ray's metrics agent
does; the Ray API is a stand-in (starting Ray takes 10-20 s; the integration tests in
tests/integration/test_ray_launch.py sample a real cluster).
"""

from __future__ import annotations

import http.server
import logging
import threading
import time
import types

import pytest

pytest.importorskip("prometheus_client", reason="Ray's node metrics come with ray[default]")

from sparkgpu.ray.metrics import (  # noqa: E402
    RayMetricsReporter,
    node_endpoints,
    summarize_node_metrics,
    summarize_resources,
)
from sparkgpu.ray.plan import RANK_LABEL  # noqa: E402

HEAD_TEXT = """\
# HELP ray_node_cpu_utilization Total CPU usage on a ray node
# TYPE ray_node_cpu_utilization gauge
ray_node_cpu_utilization{SessionName="s",ip="10.0.0.1"} 37.5
# TYPE ray_node_mem_used gauge
ray_node_mem_used{SessionName="s",ip="10.0.0.1"} 2.5e+09
# TYPE ray_node_gpus_utilization gauge
ray_node_gpus_utilization{GpuDeviceName="NVIDIA H100",GpuIndex="0",ip="10.0.0.1"} 91.0
ray_node_gpus_utilization{GpuDeviceName="NVIDIA H100",GpuIndex="1",ip="10.0.0.1"} 88.0
# TYPE ray_node_gram_used gauge
ray_node_gram_used{GpuDeviceName="NVIDIA H100",GpuIndex="0",ip="10.0.0.1"} 40000.0
# TYPE ray_object_store_memory gauge
ray_object_store_memory{Location="MMAP_SHM",ObjectState="SEALED"} 3e+06
ray_object_store_memory{Location="SPILLED",ObjectState="SEALED"} 1e+06
# TYPE ray_tasks gauge
ray_tasks{Name="square",State="RUNNING",IsRetry="0"} 2.0
ray_tasks{Name="square",State="FINISHED",IsRetry="0"} 4.0
ray_tasks{Name="total",State="FINISHED",IsRetry="0"} 1.0
# TYPE ray_actors gauge
ray_actors{Name="Trainer",State="ALIVE"} 1.0
"""

WORKER_TEXT = """\
# TYPE ray_node_cpu_utilization gauge
ray_node_cpu_utilization{ip="10.0.0.2"} 12.0
# TYPE ray_tasks gauge
ray_tasks{Name="square",State="RUNNING",IsRetry="0"} 1.0
"""


def test_logical_resources_become_used_and_total_with_bytes_in_megabytes():
    total = {"CPU": 8.0, "GPU": 2.0, "memory": 4e9, "object_store_memory": 1e9, "node:10.0.0.1": 1.0}
    available = {"CPU": 6.0, "memory": 4e9, "object_store_memory": 7.5e8}  # every GPU taken
    metrics = summarize_resources(total, available)
    assert metrics == {
        "ray/resources/cpu_used": 2.0,
        "ray/resources/cpu_total": 8.0,
        "ray/resources/gpu_used": 2.0,
        "ray/resources/gpu_total": 2.0,
        "ray/resources/memory_megabytes_used": 0.0,
        "ray/resources/memory_megabytes_total": 4000.0,
        "ray/resources/object_store_megabytes_used": 250.0,
        "ray/resources/object_store_megabytes_total": 1000.0,
    }


def test_node_hardware_is_per_node_and_task_counts_add_up_over_nodes():
    metrics = summarize_node_metrics({"node_0": HEAD_TEXT, "node_1": WORKER_TEXT})
    assert metrics["ray/node_0/cpu_utilization_percentage"] == 37.5
    assert metrics["ray/node_1/cpu_utilization_percentage"] == 12.0
    assert metrics["ray/node_0/memory_used_megabytes"] == 2500.0
    assert metrics["ray/node_0/gpu_0/utilization_percentage"] == 91.0
    assert metrics["ray/node_0/gpu_1/utilization_percentage"] == 88.0
    assert metrics["ray/node_0/gpu_0/memory_used_megabytes"] == pytest.approx(41943.04)  # Ray's GRAM is in MiB
    assert metrics["ray/node_0/object_store_used_megabytes"] == 4.0  # every location counts
    assert "ray/node_1/object_store_used_megabytes" not in metrics  # not reported, not made up
    assert metrics["ray/tasks/running"] == 3.0 and metrics["ray/tasks/finished"] == 5.0
    assert metrics["ray/actors/alive"] == 1.0


def test_alive_actors_are_counted_when_ray_splits_them_into_idle_and_busy():
    # Ray 2.60 exports ALIVE_IDLE / ALIVE_RUNNING_TASKS where older releases said ALIVE.
    text = (
        "# TYPE ray_actors gauge\n"
        'ray_actors{Name="Holder",State="ALIVE_IDLE"} 3.0\n'
        'ray_actors{Name="Holder",State="ALIVE_RUNNING_TASKS"} 1.0\n'
        'ray_actors{Name="Gone",State="DEAD"} 2.0\n'
    )
    metrics = summarize_node_metrics({"node_0": text})
    assert metrics["ray/actors/alive"] == 4.0
    assert metrics["ray/actors/alive_idle"] == 3.0 and metrics["ray/actors/dead"] == 2.0


def test_nodes_are_named_by_the_rank_that_started_them():
    nodes = [
        {"NodeManagerAddress": "10.0.0.2", "MetricsExportPort": 9002, "Labels": {RANK_LABEL: "4"}},
        {"NodeManagerAddress": "10.0.0.1", "MetricsExportPort": 9001, "Labels": {RANK_LABEL: "0"}},
        {"NodeManagerAddress": "10.0.0.3", "MetricsExportPort": 0},  # exports nothing
    ]
    assert node_endpoints(nodes) == {"node_4": "http://10.0.0.2:9002/metrics", "node_0": "http://10.0.0.1:9001/metrics"}


class _Endpoint:
    """A real HTTP server answering /metrics with the text it holds."""

    def __init__(self, text: str):
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's naming)
                body = endpoint.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                return

        self.text = text
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _ray_with(nodes):
    return types.SimpleNamespace(
        cluster_resources=lambda: {"CPU": 2.0},
        available_resources=lambda: {"CPU": 1.0},
        nodes=lambda: nodes,
    )


class _Written(list):
    """The batches a reporter wrote; :meth:`wait_for` waits for its thread's samples themselves."""

    def __init__(self):
        super().__init__()
        self._changed = threading.Condition()

    def append(self, batch) -> None:
        with self._changed:
            super().append(batch)
            self._changed.notify_all()

    def wait_for(self, count: int) -> None:
        with self._changed:  # 30 s only guards against a hang
            assert self._changed.wait_for(lambda: len(self) >= count, timeout=30), f"{len(self)} samples in 30 s"


def test_reporter_samples_until_stopped_and_takes_a_last_sample_with_steps_since_the_job_started():
    endpoint = _Endpoint(HEAD_TEXT)
    try:
        ray = _ray_with(
            [
                {
                    "Alive": True,
                    "NodeManagerAddress": "127.0.0.1",
                    "MetricsExportPort": endpoint.port,
                    "Labels": {RANK_LABEL: "0"},
                }
            ]
        )
        written = _Written()
        reporter = RayMetricsReporter(ray, written.append, interval=0.2, started_at=time.time() - 10).start()
        written.wait_for(3)
        endpoint.text = HEAD_TEXT.replace("} 37.5", "} 80.0")
        reporter.stop()
    finally:
        endpoint.close()
    assert reporter.samples_written == len(written) >= 4  # the thread's, and the last one at stop()
    cpu = [
        (value, step)
        for batch in written
        for key, value, step, _ in batch
        if key == "ray/node_0/cpu_utilization_percentage"
    ]
    assert cpu[-1][0] == 80.0  # the last sample is taken at stop()
    steps = [step for _, step in cpu]
    assert steps == sorted(steps) and steps[0] >= 50  # 10 s into the job at 0.2 s per step
    assert ("ray/resources/cpu_used", 1.0) in {(k, v) for batch in written for k, v, _, _ in batch}


def test_a_node_without_metrics_agent_costs_its_metrics_only_and_is_named_once(caplog):
    endpoint = _Endpoint(WORKER_TEXT)
    try:
        ray = _ray_with(
            [
                {
                    "Alive": True,
                    "NodeManagerAddress": "127.0.0.1",
                    "MetricsExportPort": endpoint.port,
                    "Labels": {RANK_LABEL: "1"},
                },
                {"Alive": True, "NodeManagerAddress": "127.0.0.1", "MetricsExportPort": 1, "Labels": {RANK_LABEL: "0"}},
            ]
        )
        written = _Written()
        reporter = RayMetricsReporter(ray, written.append, interval=0.1, started_at=time.time()).start()
        written.wait_for(3)  # the silent node is said once, not once per sample
        with caplog.at_level(logging.WARNING, logger="sparkgpu.ray.metrics"):
            reporter.stop()
    finally:
        endpoint.close()
    keys = {key for batch in written for key, *_ in batch}
    assert "ray/node_1/cpu_utilization_percentage" in keys and "ray/resources/cpu_used" in keys
    assert not any(key.startswith("ray/node_0/") for key in keys)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "node_0" in warnings[0] and "pip install 'ray[default]'" in warnings[0]


def test_a_ray_api_error_skips_the_sample_and_the_driver_goes_on(caplog):
    def broken():
        raise ConnectionError("GCS unreachable")

    ray = types.SimpleNamespace(cluster_resources=broken, available_resources=dict, nodes=list)
    written = []
    reporter = RayMetricsReporter(ray, written.append, interval=1, started_at=time.time())
    with caplog.at_level(logging.WARNING, logger="sparkgpu.ray.metrics"):
        reporter.sample()
        reporter.sample()
    assert written == [] and reporter.samples_written == 0
    assert [r.getMessage() for r in caplog.records] == ["sparkgpu: could not read Ray's metrics: GCS unreachable"]
