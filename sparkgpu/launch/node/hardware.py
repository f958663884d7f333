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
import threading
import warnings

from sparkgpu.spec.catalog import GPU_CATALOG, classify_device, lookup_gpu_type
from sparkgpu.errors import ConfigurationError

__all__ = ["HostGPUs", "UnknownGPUWarning", "detect_host_gpus", "parse_simulated"]


class UnknownGPUWarning(UserWarning):
    """This host's GPU is not in the GPU catalog: usage on it is priced at the rate card's default."""


_warned_devices: set[str] = set()
_warned_lock = threading.Lock()


def _warn_unknown_device(name: str) -> None:
    with _warned_lock:
        if name in _warned_devices:
            return
        _warned_devices.add(name)
    known = ", ".join(g.name for g in GPU_CATALOG.values() if not g.is_cpu)
    warnings.warn(
        f"this host's GPU {name!r} is not in sparkgpu's GPU catalog ({known}): a job that leaves gpu_type unset "
        "runs on it but its usage is priced at the rate card's default rate, $0 per GPU-hour unless "
        "SPARKGPU_USAGE_RATES sets one (e.g. 'default=2.5'), and a gpu_type= cannot be checked against it",
        UnknownGPUWarning,
        stacklevel=3,
    )


@dataclasses.dataclass(frozen=True)
class HostGPUs:
    """The GPUs of one host.

    Attributes:
        names: Device names as the driver reports them, one per usable device.
        addresses: Device indices to put in ``CUDA_VISIBLE_DEVICES``, one per device.
        simulated: True when the devices come from ``SPARKGPU_SIMULATE_GPUS``.
        memory_gb: Memory of each device in GiB when the driver said (tells an A100 40GB
            from an 80GB one whose name does not); empty when unknown.
    """

    names: tuple[str, ...] = ()
    addresses: tuple[str, ...] = ()
    simulated: bool = False
    memory_gb: tuple[float, ...] = ()

    @property
    def count(self) -> int:
        return len(self.addresses)

    def _classify(self) -> str | None:
        if self.simulated:  # simulated devices carry their catalog name
            gpu = lookup_gpu_type(self.names[0])
            return None if gpu.is_cpu else gpu.name
        found = classify_device(self.names[0], self.memory_gb[0] if self.memory_gb else None)
        return found.name if found is not None else None

    def catalog_type(self) -> str | None:
        """Catalog name of these devices, or ``None`` (no GPUs, or a device outside the catalog).

        A device outside the catalog is reported once per process with an
        :class:`UnknownGPUWarning`, since its usage is priced at the rate card's default.
        """
        if not self.names:
            return None
        found = self._classify()
        if found is None:
            _warn_unknown_device(self.names[0])
        return found

    def describe(self) -> str:
        if not self.names:
            return "no GPUs"
        kind = "simulated " if self.simulated else ""
        unknown = ", not a GPU type sparkgpu knows" if self._classify() is None else ""
        return f"{self.count} x {kind}{self.names[0]} (addresses {','.join(self.addresses)}{unknown})"


def parse_simulated(value: str) -> HostGPUs:
    """``"H100:8"`` -> 8 simulated H100 at addresses 0..7."""
    type_name, _, count = value.partition(":")
    try:
        n = int(count or "1")
    except ValueError:
        n = -1
    if n < 1:
        raise ConfigurationError(f"SPARKGPU_SIMULATE_GPUS={value!r} must look like TYPE:COUNT, e.g. H100:8")
    gpu = lookup_gpu_type(type_name)
    return HostGPUs(names=(gpu.name,) * n, addresses=tuple(str(i) for i in range(n)), simulated=True)


def _visible(indices: list[str]) -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return indices
    wanted = [v.strip() for v in visible.split(",") if v.strip() and v.strip() != "-1"]
    return [i for i in indices if i in wanted]


def _from_nvml() -> list[tuple[str, str, float | None]] | None:
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
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            try:
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total / 1024**3
            except pynvml.NVMLError:
                memory = None  # the name alone still classifies every type but a size-less A100
            devices.append((str(i), name.decode() if isinstance(name, bytes) else name, memory))
        return devices
    finally:
        pynvml.nvmlShutdown()


def _from_nvidia_smi() -> list[tuple[str, str, float | None]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    devices = []
    for line in out.splitlines():
        index, _, rest = line.partition(",")
        name, _, memory_mib = rest.rpartition(",")
        if index.strip().isdigit():
            try:
                memory = float(memory_mib) / 1024
            except ValueError:  # "[N/A]" on some boards
                memory = None
            devices.append((index.strip(), name.strip(), memory))
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
    visible = set(_visible([index for index, _, _ in devices]))
    devices = [device for device in devices if device[0] in visible]
    memory = tuple(m for _, _, m in devices if m is not None)
    return HostGPUs(
        names=tuple(n for _, n, _ in devices),
        addresses=tuple(i for i, _, _ in devices),
        memory_gb=memory if len(memory) == len(devices) else (),
    )
