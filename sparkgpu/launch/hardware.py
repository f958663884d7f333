"""What accelerators this host has, found without importing torch on the client.

NVML (``nvidia-ml-py``) when it is installed, else ``nvidia-smi``; ``CUDA_VISIBLE_DEVICES``
narrows the list the way CUDA would. ``SPARKGPU_SIMULATE_GPUS=TYPE:N`` replaces the answer
with N simulated GPUs of TYPE, whose ranks run on CPU with gloo.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

from sparkgpu.config import GPU_CATALOG, lookup_gpu_type
from sparkgpu.errors import ConfigurationError

__all__ = ["HostGPUs", "detect_host_gpus", "parse_simulated"]


@dataclasses.dataclass(frozen=True)
class HostGPUs:
    """The GPUs of one host.

    Attributes:
        names: Device names as the driver reports them, one per usable device.
        addresses: Device indices to put in ``CUDA_VISIBLE_DEVICES``, one per device.
        simulated: True when the devices come from ``SPARKGPU_SIMULATE_GPUS``.
    """

    names: tuple[str, ...] = ()
    addresses: tuple[str, ...] = ()
    simulated: bool = False

    @property
    def count(self) -> int:
        return len(self.addresses)

    def catalog_type(self) -> str | None:
        """Catalog name matching these devices, or ``None`` if none matches (or no GPUs)."""
        if not self.names:
            return None
        for gpu in GPU_CATALOG.values():
            if not gpu.is_cpu and gpu.matches_device(self.names[0]):
                return gpu.name
        return None

    def describe(self) -> str:
        if not self.names:
            return "no GPUs"
        kind = "simulated " if self.simulated else ""
        return f"{self.count} x {kind}{self.names[0]} (addresses {','.join(self.addresses)})"


def parse_simulated(value: str) -> HostGPUs:
    """``"H100:8"`` -> 8 simulated H100 at addresses 0..7."""
    type_name, _, count = value.partition(":")
    try:
        n = int(count or "1")
    except ValueError:
        n = -1
    if n < 1:
        raise ConfigurationError(
            f"SPARKGPU_SIMULATE_GPUS={value!r} must look like TYPE:COUNT, e.g. H100:8"
        )
    gpu = lookup_gpu_type(type_name)
    return HostGPUs(names=(gpu.name,) * n, addresses=tuple(str(i) for i in range(n)), simulated=True)


def _visible(indices: list[str]) -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return indices
    wanted = [v.strip() for v in visible.split(",") if v.strip() and v.strip() != "-1"]
    return [i for i in indices if i in wanted]


def _from_nvml() -> list[tuple[str, str]] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []  # library present, no driver: no GPUs
    try:
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            devices.append((str(i), name.decode() if isinstance(name, bytes) else name))
        return devices
    finally:
        pynvml.nvmlShutdown()


def _from_nvidia_smi() -> list[tuple[str, str]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    devices = []
    for line in out.splitlines():
        index, _, name = line.partition(",")
        if index.strip().isdigit():
            devices.append((index.strip(), name.strip()))
    return devices


def detect_host_gpus(simulate: str | None = None) -> HostGPUs:
    """The GPUs usable on this host.

    Args:
        simulate: A ``"TYPE:N"`` string (from ``SPARKGPU_SIMULATE_GPUS``) to simulate GPUs.
    """
    if simulate:
        return parse_simulated(simulate)
    devices = _from_nvml()
    if devices is None:
        devices = _from_nvidia_smi()
    visible = set(_visible([index for index, _ in devices]))
    devices = [(index, name) for index, name in devices if index in visible]
    return HostGPUs(names=tuple(n for _, n in devices), addresses=tuple(i for i, _ in devices))
