"""System metrics per node with MLflow's own monitor, limited to the job's own GPUs.

One monitor runs per node (on local rank 0). Its metrics are keyed by node through MLflow's
``node_id`` (``system/node_0/cpu_utilization_percentage``), so nodes never overwrite each
other, and their steps count sampling intervals since the job started, so a resumed attempt
continues the curves instead of restarting them at step 0.

MLflow's ``GPUMonitor`` reports every GPU NVML sees, ignoring ``CUDA_VISIBLE_DEVICES``; on a
shared node that means other jobs' GPUs. :class:`JobGPUMonitor` keeps only the job's devices
(indices or UUIDs, as in ``CUDA_VISIBLE_DEVICES``) and names them in the job's own order
(``gpu_0`` is the job's first device). NVML numbers devices in PCI bus order, as
``nvidia-smi`` and Spark's GPU discovery do.
"""

from __future__ import annotations

import logging
import os
import time

from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

from sparkgpu.runtime import ENV_NODE_DEVICES

__all__ = ["NodeMetricsMonitor", "JobGPUMonitor", "job_gpu_devices", "DEVICES_ENV"]

_logger = logging.getLogger(__name__)

# The job's devices, comma-separated, set for workers by MLflowCallback when the client knows
# them (local backend). Ranks see every device of the job on their node, as under torchrun;
# CUDA_VISIBLE_DEVICES is empty for simulated GPUs, and SPARKGPU_NODE_DEVICES lists them there.
DEVICES_ENV = "SPARKGPU_TRACKING_DEVICES"


def job_gpu_devices(env=None) -> list[str] | None:
    """The node's devices of this job, or ``None`` for "every GPU of the node".

    Args:
        env: Environment to read (``os.environ`` by default): the node's device list that a
            node launcher exports (``SPARKGPU_NODE_DEVICES``: a Spark task's GPU addresses,
            known only on the node), else ``SPARKGPU_TRACKING_DEVICES``, else
            ``CUDA_VISIBLE_DEVICES``.
    """
    env = os.environ if env is None else env
    for name in (ENV_NODE_DEVICES, DEVICES_ENV, "CUDA_VISIBLE_DEVICES"):
        raw = env.get(name)
        if raw is not None:
            return [part.strip() for part in raw.split(",") if part.strip()]
    return None


class JobGPUMonitor(GPUMonitor):
    """MLflow's NVIDIA GPU monitor, restricted to ``devices``.

    Args:
        devices: Device indices (``"3"``) or UUIDs (``"GPU-..."``, ``"MIG-..."``), in the job's order.

    Raises:
        ImportError: ``nvidia-ml-py`` is not installed.
        RuntimeError: NVML cannot be initialised (no driver).
    """

    def __init__(self, devices: list[str]):
        super().__init__()
        import pynvml

        handles = []
        for device in devices:
            if device.isdigit():
                handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(device)))
            else:
                handles.append(pynvml.nvmlDeviceGetHandleByUUID(device))
        self.gpu_handles = handles
        self.num_gpus = len(handles)


class NodeMetricsMonitor(SystemMetricsMonitor):
    """CPU, memory, disk, network and the job's GPUs of one node, logged to the job's run.

    Args:
        run_id: The job's run.
        node_rank: Index of this node in the job; metrics are keyed ``system/node_<n>/...``.
        tracking_uri: Where the metrics go (the job's spool on workers).
        interval: Seconds between samples (``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL``
            overrides it, as in MLflow).
        job_started_at: Unix time the job started; steps count intervals since then.
        gpu_devices: Devices of the job on this node; ``None`` for every GPU of the node, an
            empty list for none (CPU ranks, simulated GPUs).
    """

    def __init__(
        self,
        run_id: str,
        *,
        node_rank: int,
        tracking_uri: str,
        interval: float = 10.0,
        job_started_at: float | None = None,
        gpu_devices: list[str] | None = None,
    ):
        self._gpu_devices = gpu_devices
        super().__init__(
            run_id,
            sampling_interval=interval,
            samples_before_logging=1,
            node_id=f"node_{node_rank}",
            tracking_uri=tracking_uri,
        )
        self._job_started_at = time.time() if job_started_at is None else job_started_at
        self._logging_step = self._step_now()

    def _step_now(self) -> int:
        return max(0, int((time.time() - self._job_started_at) // max(self.sampling_interval, 1e-3)))

    def _initialize_gpu_monitor(self):
        if self._gpu_devices is not None and not self._gpu_devices:
            return None
        try:
            if self._gpu_devices is None:
                return GPUMonitor()
            return JobGPUMonitor(self._gpu_devices)
        except ImportError:
            _logger.warning("sparkgpu: GPU metrics need NVML bindings: run `pip install nvidia-ml-py`")
        except Exception as exc:  # no driver, unknown device: CPU metrics still flow
            _logger.warning("sparkgpu: GPU metrics are off on this node: %s", exc)
        return None

    def publish_metrics(self, metrics):
        # Steps follow wall time since the job started: a resumed attempt continues the curve.
        self._logging_step = max(self._logging_step, self._step_now())
        super().publish_metrics(metrics)
