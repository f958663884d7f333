"""Former name of :mod:`sparkgpu.spark_gpu` (the ``spark.gpu`` namespace), kept for old imports."""

from __future__ import annotations

import warnings

from sparkgpu.spark_gpu import GPUNamespace, attach

__all__ = ["GPUNamespace", "attach"]

warnings.warn(
    "sparkgpu.session is now sparkgpu.spark_gpu; import GPUNamespace and attach from there",
    DeprecationWarning,
    stacklevel=2,
)
