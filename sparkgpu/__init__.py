"""sparkgpu: serverless-GPU training from a Spark session.

Public names only. Heavy modules (torch, pyspark, mlflow) are imported lazily so that
``import sparkgpu`` stays cheap on the client.
"""

from __future__ import annotations

import logging

from sparkgpu._util.modules import lazy_attributes

# Bound explicitly: on a worker, sparkgpu.env.hydrate loads this submodule before the package
# exists, and the import system binds a submodule to its package only when it loads it itself.
from sparkgpu import errors  # noqa: F401
from sparkgpu.errors import (
    CallNotFinishedError,
    CapacityError,
    CheckpointError,
    ConfigurationError,
    DataError,
    EnvironmentMismatchError,
    EnvironmentTooLargeError,
    HangError,
    HydrationError,
    PreflightError,
    JobCancelledError,
    JobStateError,
    JobTimeoutError,
    LocalExecutionTimeoutError,
    MissingDependencyError,
    NodeLostError,
    PayloadSignatureError,
    PermissionDeniedError,
    PolicyViolationError,
    RankFailure,
    RayClusterError,
    ResultError,
    SerializationError,
    SparkGPUError,
    WorkerFailedError,
)
from sparkgpu.rundir.states import AttemptStatus, JobStatus

__version__ = "0.1.0"

# The library logs under this one logger and stays silent until the application configures
# logging; what a user must see goes through sparkgpu._util.report instead.
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "distributed",
    "DistributedFunction",
    "ray_launch",
    "ray_init",
    "DistributedFunctionCall",
    "attach",
    "collect_outputs_or_raise",
    "log",
    "registry",
    "predict",
    "data",
    "runtime",
    "sweep",
    "JobStatus",
    "AttemptStatus",
    "SparkGPUError",
    "ConfigurationError",
    "JobStateError",
    "CapacityError",
    "SerializationError",
    "ResultError",
    "MissingDependencyError",
    "JobTimeoutError",
    "LocalExecutionTimeoutError",
    "JobCancelledError",
    "CallNotFinishedError",
    "WorkerFailedError",
    "NodeLostError",
    "RankFailure",
    "PayloadSignatureError",
    "DataError",
    "HangError",
    "PreflightError",
    "CheckpointError",
    "PolicyViolationError",
    "PermissionDeniedError",
    "EnvironmentTooLargeError",
    "EnvironmentMismatchError",
    "HydrationError",
    "RayClusterError",
    "__version__",
]

_LAZY = {
    "distributed": ("sparkgpu.api.decorator", "distributed"),
    "DistributedFunction": ("sparkgpu.api.decorator", "DistributedFunction"),
    "ray_launch": ("sparkgpu.ray", "ray_launch"),
    "ray_init": ("sparkgpu.ray", "ray_init"),
    "DistributedFunctionCall": ("sparkgpu.api.call", "DistributedFunctionCall"),
    "attach": ("sparkgpu.api.call", "attach"),
    "collect_outputs_or_raise": ("sparkgpu.api.call", "collect_outputs_or_raise"),
    "runtime": ("sparkgpu.runtime", None),
    "data": ("sparkgpu.data", None),
    "log": ("sparkgpu.tracking.autolog", "log"),
    "registry": ("sparkgpu.registry", None),
    "predict": ("sparkgpu.predict", None),
    "sweep": ("sparkgpu.sweeps.api", "sweep"),
}


__getattr__ = lazy_attributes(__name__, _LAZY)


def _attach_spark_gpu() -> None:
    # `import sparkgpu` gives Spark sessions a `spark.gpu` namespace, without importing pyspark.
    from sparkgpu.api.spark_gpu import attach

    attach()


_attach_spark_gpu()
