"""The GPU catalog: the GPU types a job can ask for, node shapes, and naming a detected device.

``gpu_type=`` strings (``"H100"``, ``"a10g"``, ``"h100_80gb"``) resolve through
:func:`lookup_gpu_type`; ``accelerator_type=`` node shapes (``"GPU_8xH100"``) through
:func:`lookup_accelerator_type`; a device name reported by ``nvidia-smi`` or an executor through
:func:`classify_device`.
"""

from __future__ import annotations

import dataclasses
import re

from sparkgpu.errors import ConfigurationError

__all__ = [
    "GPUType",
    "GPU_CATALOG",
    "AcceleratorShape",
    "ACCELERATOR_TYPES",
    "lookup_accelerator_type",
    "lookup_gpu_type",
    "classify_device",
]


@dataclasses.dataclass(frozen=True)
class GPUType:
    """One entry of the GPU catalog.

    Attributes:
        name: Canonical name users pass as ``gpu_type``.
        memory_gb: Memory per device.
        max_per_node: Most devices of this type one node carries.
        models: Model tokens of the names the driver reports (NVML / ``nvidia-smi``), matched
            whole: ``"A10"`` and ``"A10G"`` are an A10, ``"A100"`` is not.
    """

    name: str
    memory_gb: int
    max_per_node: int
    models: tuple[str, ...] = ()

    @property
    def is_cpu(self) -> bool:
        return self.name == "cpu"

    def matches_device(self, device_name: str, memory_gb: float | None = None) -> bool:
        """Whether the driver's ``device_name`` (and memory, when known) is this type."""
        found = classify_device(device_name, memory_gb)
        return found is not None and found.name == self.name


GPU_CATALOG: dict[str, GPUType] = {
    gpu.name: gpu
    for gpu in (
        GPUType("A10", 24, 8, ("A10", "A10G")),
        GPUType("A100-40GB", 40, 8, ("A100",)),
        GPUType("A100-80GB", 80, 8, ("A100",)),
        GPUType("H100", 80, 8, ("H100",)),
        GPUType("H200", 141, 8, ("H200",)),
        GPUType("B200", 180, 8, ("B200",)),
        GPUType("B300", 288, 8, ("B300",)),
        GPUType("L4", 24, 8, ("L4",)),
        # Ranks on CPU processes with gloo: laptops, CI, and this project's own tests.
        GPUType("cpu", 0, 64, ()),
    )
}
# "H100_80GB" is how Databricks' serverless GPU API spells an H100 (its GPUType value).
_ALIASES = {"A100": "A100-40GB", "A10G": "A10", "CPU": "cpu", "H100_80GB": "H100"}
# Brand words drivers put before the model ("NVIDIA A10G", "Tesla T4", "GRID A100D-80C").
_BRANDS = {"NVIDIA", "TESLA", "GEFORCE", "QUADRO", "GRID"}
_SIZE_TOKEN = re.compile(r"^(\d+)GB$")


def classify_device(device_name: str, memory_gb: float | None = None) -> GPUType | None:
    """The catalog type of a device name as NVML / ``nvidia-smi`` report it, or ``None``.

    The name is split on spaces, hyphens and underscores and its model token (the first one
    after the brand) must equal a catalog model: "NVIDIA L40S" is not an L4 and "NVIDIA GH200
    480GB" is not an H200. A model sold in several memory sizes (A100) is told apart by a
    size token ("80GB") in the name, else by ``memory_gb`` when it is known.

    Args:
        device_name: E.g. ``"NVIDIA A100-SXM4-80GB"``.
        memory_gb: Device memory in GiB (NVML / ``nvidia-smi``), ``None`` when unknown.

    Returns:
        The catalog entry, or ``None`` for a device outside the catalog or an A100 whose size
        neither the name nor ``memory_gb`` tells.
    """
    tokens = [t for t in re.split(r"[\s\-_]+", str(device_name).upper()) if t]
    while tokens and tokens[0] in _BRANDS:
        tokens.pop(0)
    if not tokens:
        return None
    candidates = [gpu for gpu in GPU_CATALOG.values() if tokens[0] in gpu.models]
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    sizes = {int(m.group(1)) for m in map(_SIZE_TOKEN.match, tokens[1:]) if m}
    sized = [gpu for gpu in candidates if gpu.memory_gb in sizes]
    if len(sized) == 1:
        return sized[0]
    if memory_gb:
        return min(candidates, key=lambda gpu: abs(gpu.memory_gb - memory_gb))
    return None


def lookup_gpu_type(name: str) -> GPUType:
    """Returns the catalog entry for ``name`` (case-insensitive, a few aliases).

    Raises:
        ConfigurationError: ``name`` is not in the catalog; the message lists the known types.
    """
    if not isinstance(name, str):
        raise ConfigurationError(f"gpu_type must be a string such as 'H100', got {name!r}")
    key = _ALIASES.get(name, _ALIASES.get(name.upper(), name))
    for candidate in (key, key.upper()):
        if candidate in GPU_CATALOG:
            return GPU_CATALOG[candidate]
    known = ", ".join(repr(n) for n in GPU_CATALOG)
    raise ConfigurationError(f"unknown gpu_type {name!r}; use one of {known}")


@dataclasses.dataclass(frozen=True)
class AcceleratorShape:
    """A node shape named the Databricks way: ``"GPU_8xH100"`` is nodes of 8 H100s.

    Attributes:
        gpu: The catalog entry of the node's GPUs.
        gpus_per_node: GPUs each node of this shape carries.
    """

    gpu: GPUType
    gpus_per_node: int

    @property
    def name(self) -> str:
        return f"GPU_{self.gpus_per_node}x{self.gpu.name}"


# The shapes Databricks serverless GPU compute offers (databricks.air's AcceleratorType values);
# any "GPU_<N>x<catalog type>" with N up to the type's max_per_node is accepted as well.
ACCELERATOR_TYPES = ("GPU_1xA10", "GPU_1xH100", "GPU_8xH100", "GPU_8xB300")
_SHAPE = re.compile(r"^GPU_(\d+)X(.+)$")


def lookup_accelerator_type(name: str) -> AcceleratorShape:
    """Returns the node shape ``name`` stands for (case-insensitive): ``"gpu_8xh100"`` -> 8 x H100.

    Raises:
        ConfigurationError: ``name`` is no ``GPU_<N>x<TYPE>`` of a catalog type, or ``N`` is more
            than one node of that type carries; the message lists the valid shapes.
    """
    valid = ", ".join(repr(n) for n in ACCELERATOR_TYPES)
    hint = (
        f"use one of {valid}, or GPU_<N>x<TYPE> with a catalog type "
        f"({', '.join(n for n in GPU_CATALOG if n != 'cpu')}), or gpu_type='cpu' for CPU ranks"
    )
    match = _SHAPE.match(name.strip().upper()) if isinstance(name, str) else None
    if match is None:
        raise ConfigurationError(f"unknown accelerator_type {name!r}; {hint}")
    try:
        gpu = lookup_gpu_type(match.group(2))
    except ConfigurationError:
        raise ConfigurationError(f"unknown accelerator_type {name!r}: no GPU type {match.group(2)!r}; {hint}") from None
    per_node = int(match.group(1))
    if gpu.is_cpu:
        raise ConfigurationError(f"accelerator_type {name!r} names no GPU; pass gpu_type='cpu' for CPU ranks")
    if not 1 <= per_node <= gpu.max_per_node:
        raise ConfigurationError(
            f"accelerator_type {name!r}: a node carries 1 to {gpu.max_per_node} {gpu.name} GPUs; {hint}"
        )
    return AcceleratorShape(gpu, per_node)
