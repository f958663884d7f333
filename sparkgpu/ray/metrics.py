"""Ray's system metrics in the job's MLflow run, sampled by the driver while the function runs.

Two sources, both read on rank 0 (the driver) every ``interval`` seconds:

* Ray's logical resources, through the driver's own API (``ray.cluster_resources()`` and
  ``ray.available_resources()``): ``ray/resources/<name>_used`` and ``..._total`` for CPU,
  GPU, memory and object store. Works with plain ``ray``.
* Each node's Prometheus endpoint (``MetricsExportPort``, served by Ray's metrics agent, which
  comes with ``ray[default]``): hardware per Ray node — ``ray/node_<rank>/cpu_utilization_percentage``,
  ``memory_used_megabytes``, ``object_store_used_megabytes``, ``gpu_<i>/utilization_percentage``,
  ``gpu_<i>/memory_used_megabytes`` — and the cluster's ``ray/tasks/<state>`` and
  ``ray/actors/<state>`` counts. Nodes are named by the job rank that started them, so
  ``ray/node_0`` is always the head.

Steps count sampling intervals since the job started, as for the job's own system metrics
(:mod:`sparkgpu.tracking.system_metrics`), so a restarted attempt continues the curves. The
reporter takes one last sample when the function returns, so even a short job has one.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from typing import Callable, Iterable

from sparkgpu.ray.plan import RANK_LABEL

__all__ = ["RayMetricsReporter", "summarize_node_metrics", "summarize_resources", "RANK_LABEL"]

_logger = logging.getLogger(__name__)

_MB = 1e6  # MLflow's system metrics count megabytes of 10^6 bytes
_MIB = 1024 * 1024
_RESOURCES = {"CPU": "cpu", "GPU": "gpu", "memory": "memory_megabytes", "object_store_memory": "object_store_megabytes"}


def summarize_resources(total: dict, available: dict) -> dict[str, float]:
    """``ray/resources/*`` metrics from the cluster's total and available logical resources."""
    metrics = {}
    for name, key in _RESOURCES.items():
        if name not in total:
            continue
        scale = _MB if key.endswith("megabytes") else 1.0
        used = max(0.0, float(total[name]) - float(available.get(name, 0.0)))
        metrics[f"ray/resources/{key}_used"] = used / scale
        metrics[f"ray/resources/{key}_total"] = float(total[name]) / scale
    return metrics


def _samples(exposition: str) -> Iterable[tuple[str, dict, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            yield sample.name, sample.labels, float(sample.value)


def summarize_node_metrics(expositions: dict[str, str]) -> dict[str, float]:
    """MLflow metrics from the Prometheus text of each Ray node, keyed by node name.

    Args:
        expositions: ``{"node_0": "<text of /metrics>", ...}``.

    Returns:
        Hardware per node (``ray/node_0/cpu_utilization_percentage``, ...) and task and actor
        counts by state over the whole cluster (``ray/tasks/running``, ...).
    """
    metrics: dict[str, float] = {}
    counts: dict[str, float] = defaultdict(float)
    for node, text in expositions.items():
        prefix, object_store = f"ray/{node}", None
        for name, labels, value in _samples(text):
            if name == "ray_node_cpu_utilization":
                metrics[f"{prefix}/cpu_utilization_percentage"] = value
            elif name == "ray_node_mem_used":
                metrics[f"{prefix}/memory_used_megabytes"] = value / _MB
            elif name == "ray_node_mem_total":
                metrics[f"{prefix}/memory_total_megabytes"] = value / _MB
            elif name == "ray_node_gpus_utilization" and "GpuIndex" in labels:
                metrics[f"{prefix}/gpu_{labels['GpuIndex']}/utilization_percentage"] = value
            elif name == "ray_node_gram_used" and "GpuIndex" in labels:
                # Ray's GPU memory is in MiB whatever its unit says (gpu_providers: `// MB`).
                metrics[f"{prefix}/gpu_{labels['GpuIndex']}/memory_used_megabytes"] = value * _MIB / _MB
            elif name == "ray_object_store_memory":
                object_store = (object_store or 0.0) + value
            elif name in ("ray_tasks", "ray_actors") and "State" in labels:
                counts[f"ray/{name.removeprefix('ray_')}/{labels['State'].lower()}"] += value
        if object_store is not None:
            metrics[f"{prefix}/object_store_used_megabytes"] = object_store / _MB
    # Newer Ray splits ALIVE into ALIVE_IDLE / ALIVE_RUNNING_TASKS: keep one "alive" figure.
    if "ray/actors/alive" not in counts:
        alive = [v for k, v in counts.items() if k.startswith("ray/actors/alive_")]
        if alive:
            counts["ray/actors/alive"] = sum(alive)
    metrics.update(counts)
    return metrics


def _fetch(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # a loopback or cluster-internal URL
        return response.read().decode("utf-8", errors="replace")


def node_endpoints(nodes: list[dict]) -> dict[str, str]:
    """``{"node_<rank>": metrics URL}`` for the nodes of ``ray.nodes()`` that export metrics."""
    endpoints = {}
    for index, node in enumerate(nodes):
        port = node.get("MetricsExportPort")
        if not port or not node.get("NodeManagerAddress"):
            continue
        rank = (node.get("Labels") or {}).get(RANK_LABEL, f"x{index}")
        endpoints[f"node_{rank}"] = f"http://{node['NodeManagerAddress']}:{port}/metrics"
    return endpoints


class RayMetricsReporter:
    """A thread on the driver that writes Ray's metrics into the job's run every ``interval``.

    Args:
        ray: The ``ray`` module, connected to the cluster.
        write: Called with ``[(key, value, step, timestamp_ms), ...]`` (the job's spool writer).
        interval: Seconds between samples.
        started_at: Unix time the job started; steps count intervals since then.
        fetch: Reads one metrics URL (for tests of unreachable endpoints).
    """

    def __init__(
        self,
        ray,
        write: Callable[[list], None],
        *,
        interval: float,
        started_at: float,
        fetch: Callable[[str], str] = _fetch,
    ):
        self.ray = ray
        self.write = write
        self.interval = max(float(interval), 0.1)
        self.started_at = started_at
        self.fetch = fetch
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()
        self._answered: set[str] = set()
        self._silent: dict[str, str] = {}  # node -> last error, for nodes that never answered
        self.samples_written = 0

    def start(self) -> "RayMetricsReporter":
        self._thread = threading.Thread(target=self._run, name="sparkgpu-ray-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the thread and takes the last sample (while the cluster is still up)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(self.interval + 10)
        self._thread = None
        self.sample()
        for node, error in sorted(self._silent.items()):
            _logger.warning(
                "sparkgpu: Ray's hardware metrics of %s never came (%s); they need Ray's metrics "
                "agent: `pip install 'ray[default]'` on the workers",
                node,
                error,
            )

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        """Reads every source once and writes what it got; never raises."""
        try:
            metrics = summarize_resources(self.ray.cluster_resources(), self.ray.available_resources())
            metrics.update(summarize_node_metrics(self._expositions()))
        except Exception as exc:  # metrics are an extra: the driver's function goes on without them
            self._warn_once("sample", "sparkgpu: could not read Ray's metrics: %s", exc)
            return
        if not metrics:
            return
        now = time.time()
        step = max(0, int((now - self.started_at) // self.interval))
        self.write([(key, value, step, int(now * 1000)) for key, value in sorted(metrics.items())])
        self.samples_written += 1

    def _expositions(self) -> dict[str, str]:
        texts = {}
        for node, url in node_endpoints([n for n in self.ray.nodes() if n.get("Alive")]).items():
            try:
                texts[node] = self.fetch(url)
            except (OSError, urllib.error.URLError) as exc:  # agent still starting, or plain `ray`
                if node not in self._answered:
                    self._silent[node] = str(exc)
                continue
            self._answered.add(node)
            self._silent.pop(node, None)
        return texts

    def _warn_once(self, key: str, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _logger.warning(message, *args)
