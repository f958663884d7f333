"""A fake NVML (``pynvml``) for tests of GPU metrics on machines without an NVIDIA driver.

It offers the calls MLflow's GPU monitor makes, over a few fake devices whose readings differ
per device (utilisation 10 % for device 0, 20 % for device 1, ...), so a test can tell which
physical device a metric came from.
"""

from __future__ import annotations

import types


class NVMLError(Exception):
    pass


class _Device:
    def __init__(self, index: int):
        self.index = index
        self.uuid = f"GPU-fake-{index}"


def make_fake_nvml(device_count: int = 4) -> types.ModuleType:
    """A module standing in for ``pynvml`` with ``device_count`` devices."""
    devices = [_Device(i) for i in range(device_count)]
    module = types.ModuleType("pynvml")
    module.NVMLError = NVMLError
    module.nvmlInit = lambda: None
    module.nvmlDeviceGetCount = lambda: len(devices)

    def by_index(index):
        if not 0 <= index < len(devices):
            raise NVMLError(f"invalid device index {index}")
        return devices[index]

    def by_uuid(uuid):
        for device in devices:
            if device.uuid == uuid:
                return device
        raise NVMLError(f"no device with UUID {uuid}")

    module.nvmlDeviceGetHandleByIndex = by_index
    module.nvmlDeviceGetHandleByUUID = by_uuid
    module.nvmlDeviceGetMemoryInfo = lambda d: types.SimpleNamespace(used=(d.index + 1) * 10**9, total=80 * 10**9)
    module.nvmlDeviceGetUtilizationRates = lambda d: types.SimpleNamespace(gpu=10 * (d.index + 1))
    module.nvmlDeviceGetPowerUsage = lambda d: 100_000 * (d.index + 1)
    module.nvmlDeviceGetEnforcedPowerLimit = lambda d: 700_000
    return module
