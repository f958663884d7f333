"""``@ray_launch``: a Ray cluster on the ranks of a ``@distributed`` job, the function as its driver.

```python
from sparkgpu import ray_launch

@ray_launch(gpus=8, gpu_type="H100", remote=True)
def score():
    import ray
    ...                       # Ray tasks, actors, Ray Data, Ray Train: the cluster is yours
    return metrics

metrics = score.distributed()   # the driver's return value
```

One call is an ordinary ``@distributed`` job whose every rank runs :func:`sparkgpu.ray.rank.run_rank`:

1. The ranks gather what each holds (node, GPU address, CPUs, memory) over torch.distributed
   and derive the same plan everywhere: which ranks start a Ray node, with which resources.
2. Rank 0 starts the head (``ray start --head --block``) and broadcasts its address; the other
   planned ranks join it (``ray start --address=...``) and report back.
3. Rank 0 connects as the driver (``ray.init``, ``RAY_ADDRESS`` set) and runs the function;
   the other ranks wait for its completion broadcast.
4. While the function runs, a tracked job samples Ray's system metrics (logical resources;
   with ``ray[default]`` also each node's CPU, memory, GPUs, object store and the task and
   actor counts) into the job's MLflow run (:mod:`sparkgpu.ray.metrics`).
5. Every rank stops the Ray processes it started — on success, on failure and on SIGTERM —
   and keeps their logs in the run dir (``attempts/<k>/ray/``).

Results: ``.distributed()`` returns the driver's (rank 0's) return value, as Databricks'
``@ray_launch`` does; the other ranks return ``None``. A failure in the function or in one of
its Ray tasks is raised as :class:`~sparkgpu.errors.WorkerFailedError` naming rank 0, with the
driver's traceback, which holds the ``RayTaskError`` text of the failed task.

:func:`ray_init` is the other way in, as in ``databricks.air``: ``ray.init`` for a notebook or a
process that wants a Ray cluster of its own, or that runs inside a ``@ray_launch`` job and
joins that job's cluster.

Only ``ray`` itself is needed (``pip install 'sparkgpu[ray]'``); this package never imports it
on the client before one of these is used.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from typing import Any, Callable

from sparkgpu.api.decorator import DistributedFunction, distributed
from sparkgpu.errors import ConfigurationError, MissingDependencyError
from sparkgpu.errors import RayClusterError
from sparkgpu.ray.plan import NODE_LAYOUTS, RankResources, RayNodeSpec, plan_ray_nodes
from sparkgpu.ray.rank import INSTALL_HINT, RayOptions, read_cluster_info, run_rank
from sparkgpu.spec.units import parse_duration

__all__ = [
    "ray_launch",
    "ray_init",
    "RayLaunchFunction",
    "RayClusterError",
    "RankResources",
    "RayNodeSpec",
    "plan_ray_nodes",
    "read_cluster_info",
    "INSTALL_HINT",
]


_DISTRIBUTED_OPTIONS = frozenset(inspect.signature(distributed).parameters)
_RAY_OPTIONS = ("ray_nodes", "ray_start_timeout", "metrics_interval")
_UNSET = object()


class RayLaunchFunction:
    """A function that runs as the driver of a Ray cluster spanning a job's ranks.

    Calling it runs the plain function here (no cluster is started; Ray's own ``ray.init()``
    then starts a local one if the function needs it); ``.distributed(...)`` runs it on the
    cluster and returns its value. Built by :func:`ray_launch`.
    """

    def __init__(
        self,
        fn: Callable,
        options: RayOptions,
        distributed_options: dict[str, Any],
        ray_arguments: dict[str, Any] | None = None,
    ):
        if not callable(fn):
            raise ConfigurationError(f"@ray_launch decorates a function, got {fn!r}")
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.options = options
        self._arguments = {**(ray_arguments or {}), **distributed_options}  # for with_overrides()
        distributed_options = {"name": getattr(fn, "__name__", None) or "ray_job", **distributed_options}
        self.job: DistributedFunction = distributed(**distributed_options)(functools.partial(run_rank, fn, options))

    @property
    def func(self) -> Callable:
        """The undecorated function."""
        return self.fn

    @property
    def num_accelerators(self) -> int:
        return self.job.num_accelerators

    @property
    def accelerator_type(self) -> str | None:
        return self.job.accelerator_type

    def with_overrides(
        self,
        num_accelerators: int | None = None,
        accelerator_type: str | None = None,
        remote: bool | None = None,
        timeout=_UNSET,
        **options,
    ) -> "RayLaunchFunction":
        """A new function with some settings changed (any :func:`ray_launch` argument); see
        :meth:`sparkgpu.DistributedFunction.with_overrides`."""
        overrides = dict(options)
        for name, value in (
            ("num_accelerators", num_accelerators),
            ("accelerator_type", accelerator_type),
            ("remote", remote),
        ):
            if value is not None:
                overrides[name] = value
        if timeout is not _UNSET:
            overrides["timeout"] = timeout
        unknown = sorted(set(overrides) - _DISTRIBUTED_OPTIONS - set(_RAY_OPTIONS))
        if unknown:
            raise ConfigurationError(f"with_overrides got unknown argument(s) {', '.join(unknown)}")
        merged = dict(self._arguments)
        for group in (("num_accelerators", "gpus", "num_gpus"), ("accelerator_type", "gpu_type")):
            if set(group) & overrides.keys():
                for name in group:
                    merged.pop(name, None)
        merged.update(overrides)
        return ray_launch(**merged)(self.fn)

    @property
    def resources(self):
        return self.job.resources

    @property
    def policy(self):
        return self.job.policy

    @property
    def last_job_id(self) -> str | None:
        return getattr(self.job, "last_job_id", None)

    @property
    def last_run_dir(self) -> str | None:
        return getattr(self.job, "last_run_dir", None)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        r = self.job.resources
        return (
            f"<ray_launch {self.job.name} gpus={r.gpus} gpu_type={r.gpu_type!r} remote={r.remote} "
            f"ray_nodes={self.options.layout!r}>"
        )

    def _check_picklable(self) -> None:
        # The job pickles a partial around the function, whose errors cannot name the global
        # at fault; pickling the function alone first gives the precise message.
        from sparkgpu.rundir.serialization import serialize_payload

        serialize_payload(self.fn, (), {}, [])

    def distributed(self, *args, **kwargs) -> Any:
        """Starts the cluster, runs the function as its driver and returns the function's value.

        Raises:
            WorkerFailedError: the function, one of its Ray tasks (the ``RayTaskError`` text is
                in the message) or a Ray node failed.
            SerializationError: the function or an argument cannot be sent to the workers.
            CapacityError: more (or other) GPUs were asked for than the backend has.
            JobTimeoutError: the call ran past ``timeout``.
        """
        self._check_picklable()
        return self.job.distributed(*args, **kwargs)[0]

    def dryrun(self, *args, **kwargs):
        """What ``.distributed(*args, **kwargs)`` would launch, validated but not started."""
        self._check_picklable()
        return self.job.dryrun(*args, **kwargs)


def ray_launch(
    num_accelerators: int | Callable | None = None,
    accelerator_type: str | None = None,
    remote: bool = False,
    timeout=None,
    *,
    ray_nodes: str = "per_node",
    ray_start_timeout="5m",
    metrics_interval="10s",
    **distributed_options,
):
    """Decorates a function so that ``fn.distributed(...)`` runs it as the driver of a Ray cluster.

    The cluster spans the ranks of a ``@distributed`` job: usable bare (``@ray_launch``) or
    with arguments, the first four positional as in ``databricks.air``.

    Args:
        num_accelerators: Number of ranks (``gpus=`` works too); bare ``@ray_launch`` passes
            the function here. See :func:`sparkgpu.distributed` for this and the next three.
        accelerator_type: Node shape (``"GPU_8xH100"``) or GPU type.
        remote: Run on a remote GPU pool through Spark.
        timeout: Limit on the whole call.
        ray_nodes: ``"per_node"`` (default): one Ray node per job node with all of that node's
            GPUs, so a task may ask for several and the node has one object store.
            ``"per_rank"``: one Ray node per rank, with that rank's GPU and an even share of
            the host's CPUs and memory.
        ray_start_timeout: How long one Ray node may take to start (seconds or ``"5m"``).
        metrics_interval: How often a tracked job samples Ray's system metrics into its MLflow
            run (:mod:`sparkgpu.ray.metrics`; seconds or ``"30s"``); ``None`` for none.
        **distributed_options: Any argument of :func:`sparkgpu.distributed` — ``gpus``,
            ``gpu_type``, ``remote``, ``timeout``, ``max_runtime``, ``max_restarts``, ``tags``, ...

    Returns:
        A :class:`RayLaunchFunction` (or a decorator making one).

    Raises:
        MissingDependencyError: Ray is not installed here; the message holds the pip command.
        ConfigurationError: an argument is invalid (raised here, at decoration time).
    """
    if importlib.util.find_spec("ray") is None:
        raise MissingDependencyError("@ray_launch", INSTALL_HINT)
    fn = None
    if callable(num_accelerators):  # bare @ray_launch
        fn, num_accelerators = num_accelerators, None
    unknown = sorted(set(distributed_options) - _DISTRIBUTED_OPTIONS)
    if unknown:
        known = ", ".join(sorted(_DISTRIBUTED_OPTIONS | set(_RAY_OPTIONS)))
        raise ConfigurationError(f"@ray_launch got unknown argument(s) {', '.join(unknown)}; it takes {known}")
    if ray_nodes not in NODE_LAYOUTS:
        raise ConfigurationError(f"ray_nodes={ray_nodes!r}: use one of {', '.join(map(repr, NODE_LAYOUTS))}")
    start_timeout = parse_duration(ray_start_timeout, name="ray_start_timeout")
    if start_timeout is None:  # the ranks would fail on it only once their Ray nodes start
        raise ConfigurationError(
            "ray_start_timeout=None: give how long one Ray node may take to start, e.g. ray_start_timeout='5m'"
        )
    options = RayOptions(ray_nodes, start_timeout, parse_duration(metrics_interval, name="metrics_interval"))
    for name, value, default in (
        ("num_accelerators", num_accelerators, None),
        ("accelerator_type", accelerator_type, None),
        ("remote", remote, False),
        ("timeout", timeout, None),
    ):
        if value is not default:
            distributed_options[name] = value
    distributed(**distributed_options)  # validates every @distributed argument now, before any call
    ray_arguments = {
        "ray_nodes": ray_nodes,
        "ray_start_timeout": ray_start_timeout,
        "metrics_interval": metrics_interval,
    }

    def wrap(f: Callable) -> RayLaunchFunction:
        return RayLaunchFunction(f, options, dict(distributed_options), ray_arguments)

    if fn is not None:
        return wrap(fn)
    return wrap


def ray_init(*args, **kwargs):
    """``ray.init`` for a notebook or script, as ``databricks.air.ray_init``; returns Ray's context.

    Inside a ``@ray_launch`` function (``RAY_ADDRESS`` is set there) it joins the job's cluster;
    elsewhere it starts a single-node cluster on this host, as ``ray.init()`` does, its dashboard
    on Ray's default ``127.0.0.1`` (Databricks binds it to every interface for its driver proxy;
    pass ``dashboard_host="0.0.0.0"`` for that). Calling it again, say from a re-run notebook
    cell, returns the running cluster's context instead of failing.

    Args:
        *args: Passed to ``ray.init``.
        **kwargs: Passed to ``ray.init``.

    Raises:
        MissingDependencyError: Ray is not installed here; the message holds the pip command.
    """
    if importlib.util.find_spec("ray") is None:
        raise MissingDependencyError("ray_init", INSTALL_HINT)
    import ray

    kwargs.setdefault("ignore_reinit_error", True)
    return ray.init(*args, **kwargs)
