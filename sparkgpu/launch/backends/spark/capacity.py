"""What GPUs a Spark session can reach, found through Spark Connect (no SparkContext there).

Two sources, both cheap:

* static confs through ``spark.conf`` (``spark.master``, ``spark.executor.resource.gpu.amount``,
  ``spark.sparkgpu.gpuType``, ``spark.dynamicAllocation.enabled``, ...);
* a probe job of tiny tasks without GPU requests (so busy GPUs never block it), each
  reporting the executor it ran on (id, host, cores) and the GPU addresses the cluster
  manager assigned to that executor. Spark hands tasks out round-robin over executors with
  free cores, so a probe with more tasks than executors reaches every executor that has a
  free core. The probe runs with a job tag, reports when it waits, and is cancelled after
  ``wait_timeout``.

An executor whose every core is busy never answers the probe. When the session says how many
executors it has (``spark.executor.instances``), the silent ones are counted as busy, with
the confs' cores and GPUs, so a request they could serve waits for them (the barrier stage
waits for free slots, up to ``wait_timeout``) instead of failing as one the cluster can
never satisfy.

The answer is cached per session for a minute: executors of a static GPU cluster rarely change.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import threading
import time
import uuid

from sparkgpu._util.report import report
from sparkgpu.spec.catalog import GPU_CATALOG, classify_device, lookup_gpu_type
from sparkgpu.errors import CapacityError, ConfigurationError, SparkGPUError
from sparkgpu.launch.backends.spark.executor.probe import (
    IMAGE_DDL,
    PROBE_DDL,
    ProbeOptions,
    probe_executor,
    probe_image,
)

__all__ = [
    "ExecutorInfo",
    "SparkCapacity",
    "RankPlacement",
    "discover_capacity",
    "plan_placement",
    "read_confs",
    "run_tagged",
    "GPU_TYPE_CONF",
    "SIMULATED_CONF",
    "clear_capacity_cache",
    "discover_worker_image",
    "common_image",
]

GPU_TYPE_CONF = "spark.sparkgpu.gpuType"  # catalog name of the cluster's GPUs, set by its admin
SIMULATED_CONF = "spark.sparkgpu.simulatedGpus"  # "true": the GPU addresses are fake, ranks run on CPU
_CONFS = (
    "spark.master",
    "spark.executor.resource.gpu.amount",
    "spark.task.resource.gpu.amount",
    "spark.executor.resource.gpu.discoveryScript",
    "spark.executor.cores",
    "spark.executor.instances",
    "spark.dynamicAllocation.enabled",
    "spark.task.cpus",
    GPU_TYPE_CONF,
    SIMULATED_CONF,
)
_CACHE_SECONDS = 60.0
_cache: dict[str, tuple[float, "SparkCapacity"]] = {}
_cache_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class ExecutorInfo:
    """One executor, as the probe saw it.

    Attributes:
        executor_id: Spark's executor id (``"driver"`` in local mode).
        host: Host name.
        cores: Task slots.
        gpu_addresses: GPU addresses the cluster manager assigned to it.
        gpu_names: Device names from NVML / ``nvidia-smi`` on that host (empty when unknown).
        busy: The session has this executor but it did not answer the probe (every core was
            busy); its cores and GPUs come from the static confs.
    """

    executor_id: str
    host: str
    cores: int
    gpu_addresses: tuple[str, ...] = ()
    gpu_names: tuple[str, ...] = ()
    busy: bool = False


@dataclasses.dataclass(frozen=True, repr=False)
class SparkCapacity:
    """What a Spark session can run: its executors and their GPUs.

    Attributes:
        master: ``spark.master`` of the session's cluster.
        executors: Executors that answered the probe, then the busy ones that did not.
        gpus_per_executor: ``spark.executor.resource.gpu.amount`` (0 for none).
        gpu_type: Catalog name of the GPUs, or ``None`` when neither a conf nor the driver says.
        gpu_type_source: Where ``gpu_type`` came from: ``"conf"``, ``"driver"`` or ``None``.
        simulated: The GPU addresses are fake; ranks run on CPU with gloo.
        dynamic_allocation: ``spark.dynamicAllocation.enabled``.
        probe_seconds: How long the probe took.
    """

    master: str
    executors: tuple[ExecutorInfo, ...]
    gpus_per_executor: int
    gpu_type: str | None
    gpu_type_source: str | None
    simulated: bool
    dynamic_allocation: bool = False
    probe_seconds: float = 0.0

    @property
    def local_mode(self) -> bool:
        return self.master.startswith("local")

    @property
    def total_gpus(self) -> int:
        return sum(self.gpus_of(e) for e in self.executors)

    @property
    def total_cores(self) -> int:
        return sum(e.cores for e in self.executors)

    def node_slots(self, gpus_per_node: int) -> int:
        """Barrier tasks of ``gpus_per_node`` GPUs each (0: CPU tasks) the executors can run at
        once, as Spark counts them: each takes its GPUs and one core."""
        return sum(self.executor_slots(e, gpus_per_node) for e in self.executors)

    def executor_slots(self, executor: ExecutorInfo, gpus_per_node: int) -> int:
        """Barrier tasks of ``gpus_per_node`` GPUs each (0: CPU tasks) one executor can run at once."""
        if not gpus_per_node:
            return executor.cores
        return min(self.gpus_of(executor) // gpus_per_node, executor.cores or 1)

    def gpus_of(self, executor: ExecutorInfo) -> int:
        """GPUs of one executor: its assigned addresses, else the static conf."""
        return len(executor.gpu_addresses) or (self.gpus_per_executor if not self.local_mode else 0)

    def describe(self) -> str:
        """One line naming what exists, for error messages."""
        kind = f"{'simulated ' if self.simulated else ''}{self.gpu_type or 'GPU'}"
        if self.total_gpus == 0:
            return f"{len(self.executors)} executor(s) with {self.total_cores} cores and no GPUs at {self.master}"
        parts = [
            f"executor {e.executor_id} on {e.host}: {self.gpus_of(e)} x {kind}"
            + (f" ({','.join(e.gpu_addresses)})" if e.gpu_addresses else "")
            for e in self.executors
            if not e.busy
        ]
        busy = [e for e in self.executors if e.busy]
        if busy:
            parts.append(
                f"{len(busy)} executor(s) with every core busy: {self.gpus_of(busy[0])} x {kind} each "
                "per spark.executor.resource.gpu.amount"
            )
        return f"{self.total_gpus} x {kind} at {self.master} ({'; '.join(parts)})"

    def __str__(self) -> str:
        lines = [
            f"Spark cluster {self.master}: {len(self.executors)} executor(s), {self.total_gpus} GPU(s)"
            f"{' of type ' + self.gpu_type if self.gpu_type else ''}"
            f"{' (simulated: ranks run on CPU)' if self.simulated else ''}"
        ]
        width = max([len(e.executor_id) for e in self.executors] + [8])
        lines.append(f"  {'executor':<{width}}  {'host':<20} {'cores':>5}  gpus")
        for e in self.executors:
            gpus = ",".join(e.gpu_addresses) or (str(self.gpus_of(e)) if self.gpus_of(e) else "-")
            names = (
                f"  [{e.gpu_names[0]}]" if e.gpu_names else ("  [every core busy: did not answer]" if e.busy else "")
            )
            lines.append(f"  {e.executor_id:<{width}}  {e.host:<20} {e.cores:>5}  {gpus}{names}")
        return "\n".join(lines)

    def __repr__(self) -> str:  # a REPL or notebook shows the table
        return str(self)


@dataclasses.dataclass(frozen=True)
class RankPlacement:
    """How a job's ranks map onto barrier tasks.

    Attributes:
        nodes: Barrier tasks, one agent each.
        ranks_per_node: Ranks each node starts.
        gpus_per_node: GPUs each task asks for through its ResourceProfile (0 for CPU ranks).
    """

    nodes: int
    ranks_per_node: int
    gpus_per_node: int


# -- confs and the probe -----------------------------------------------------------------


def read_confs(spark) -> dict[str, str | None]:
    """The static confs the backend needs, in one round trip where the session allows it."""
    try:
        everything = spark.conf.getAll
    except Exception:  # older servers: fall back to one request per key
        everything = None
    if isinstance(everything, dict) and "spark.master" in everything:
        return {key: everything.get(key) for key in _CONFS}
    return {key: spark.conf.get(key, None) for key in _CONFS}


def _truthy(value: str | None) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def run_tagged(spark, build, tag: str, *, timeout: float, what: str, out=None, notice_after: float = 10.0):
    """Runs ``build().collect()`` in a thread under a job tag, reporting while it waits.

    Args:
        spark: The session.
        build: Returns the DataFrame to collect (built in this thread, where the session is active).
        tag: Job tag, so the job can be interrupted.
        timeout: Seconds before the job is interrupted and :class:`CapacityError` raised.
        what: What is being waited for, for the messages.
        out: Stream for progress lines (``sys.stderr`` by default).
        notice_after: Seconds of silence before the first "waiting" line.

    Returns:
        The collected rows.
    """
    frame = build()
    box: dict = {}

    def target():
        spark.addTag(tag)
        try:
            box["rows"] = frame.collect()
        except BaseException as exc:  # handed to the caller's thread below
            box["error"] = exc
        finally:
            spark.removeTag(tag)

    thread = threading.Thread(target=target, name=f"sparkgpu-{tag}", daemon=True)
    started = time.monotonic()
    thread.start()
    next_notice = started + notice_after
    try:
        while thread.is_alive():
            thread.join(0.1)
            now = time.monotonic()
            if thread.is_alive() and now >= next_notice:
                report(f"still waiting for {what} ({now - started:.0f}s so far, giving up after {timeout:.0f}s)", out)
                next_notice = now + 15
            if thread.is_alive() and now - started > timeout:
                spark.interruptTag(tag)
                thread.join(30)
                raise CapacityError(
                    f"gave up waiting for {what} after {timeout:.0f}s: the cluster has no free task slot (busy with "
                    "other jobs, or no executors); try again later, or raise SPARKGPU_SPARK_WAIT_TIMEOUT"
                )
    except KeyboardInterrupt:
        spark.interruptTag(tag)
        raise
    if "error" in box:
        raise box["error"]
    return box["rows"]


def _probe(spark, confs, *, tasks: int, timeout: float, out) -> tuple[list[ExecutorInfo], float]:
    options = ProbeOptions(
        discovery_script=confs.get("spark.executor.resource.gpu.discoveryScript"),
        detect_names=not _truthy(confs.get(SIMULATED_CONF)),
    )
    started = time.monotonic()

    def build():
        return spark.range(0, tasks, 1, tasks).mapInArrow(functools.partial(probe_executor, options), PROBE_DDL)

    what = "the Spark executors to answer the capacity probe"
    default_task_gpus = float(confs.get("spark.task.resource.gpu.amount") or 0)
    if default_task_gpus > 0:
        # Then every task, this probe's too, waits for a free GPU.
        what += (
            f" (every task here asks for GPUs: spark.task.resource.gpu.amount={default_task_gpus:g}; set it to 0 "
            "on the cluster, sparkgpu asks for GPUs per stage)"
        )
    try:
        rows = run_tagged(spark, build, f"sparkgpu-probe-{uuid.uuid4().hex[:8]}", timeout=timeout, what=what, out=out)
    except SparkGPUError:
        raise
    except Exception as exc:
        if "No module named 'sparkgpu" in str(exc):
            raise ConfigurationError(
                "the Spark executors cannot import sparkgpu; install it in the executors' Python "
                f"(spark.pyspark.python) at the client's version: pip install sparkgpu ({exc.__class__.__name__})"
            ) from exc
        # An executor refused its set-up (a broken GPU discovery script): its message names the fix,
        # under Spark's wrapping of the remote traceback.
        remote = re.search(r"ConfigurationError: (.+)", str(exc))
        if remote:
            raise ConfigurationError(f"{remote.group(1).strip()} (reported by an executor)") from exc
        raise
    seen: dict[str, ExecutorInfo] = {}
    for row in rows:
        seen.setdefault(
            row.executor,
            ExecutorInfo(
                row.executor,
                row.host,
                int(row.cores),
                tuple(a for a in row.gpu_addresses.split(",") if a),
                tuple(n for n in row.gpu_names.split("|") if n),
            ),
        )
    return sorted(seen.values(), key=lambda e: (len(e.executor_id), e.executor_id)), time.monotonic() - started


def _static_executors(confs) -> tuple[int, int]:
    """``spark.executor.instances`` (0 when unset) and ``spark.executor.cores`` (1 when unset)."""
    try:
        return int(confs.get("spark.executor.instances") or 0), int(confs.get("spark.executor.cores") or 1)
    except ValueError:
        raise ConfigurationError(
            f"the cluster's spark.executor.instances={confs.get('spark.executor.instances')!r} and spark.executor.cores="
            f"{confs.get('spark.executor.cores')!r} must be whole numbers"
        ) from None


def _local_cores(master: str) -> int:
    inside = master[master.find("[") + 1 : master.find("]")] if "[" in master else "1"
    if inside.startswith("*") or not inside.split(",")[0].isdigit():
        import os

        return os.cpu_count() or 1
    return int(inside.split(",")[0])


def _cluster_gpu_type(confs, executors) -> tuple[str | None, str | None]:
    declared = confs.get(GPU_TYPE_CONF)
    if declared:
        try:
            return lookup_gpu_type(declared).name, "conf"
        except ConfigurationError as exc:
            raise ConfigurationError(
                f"the cluster's {GPU_TYPE_CONF}={declared!r} is not a known GPU type: {exc}"
            ) from None
    for executor in executors:
        if executor.gpu_names:
            found = classify_device(executor.gpu_names[0])
            if found:
                return found.name, "driver"
    return None, None


def discover_capacity(
    spark, *, wait_timeout: float, out=None, refresh: bool = False, max_age: float | None = None
) -> SparkCapacity:
    """What ``spark`` can reach: confs plus a probe job (cached per session for a minute).

    ``max_age`` (seconds) accepts an older cached answer: scoring jobs, whose tasks ask Spark
    for their GPUs one by one, use the last probe of the session rather than probe per call.

    Raises:
        CapacityError: no executor answered within ``wait_timeout``.
        ConfigurationError: the executors cannot import sparkgpu, or a conf is invalid.
    """
    key = _session_key(spark)
    with _cache_lock:
        cached = _cache.get(key)
    if cached and not refresh and time.monotonic() - cached[0] < (max_age or _CACHE_SECONDS):
        return cached[1]
    confs = read_confs(spark)
    master = confs.get("spark.master") or "unknown"
    instances, cores = _static_executors(confs)
    previous = len(cached[1].executors) if cached else 0
    executors, seconds = _probe(spark, confs, tasks=max(16, 2 * instances, 2 * previous), timeout=wait_timeout, out=out)
    if master.startswith("local"):
        executors = [dataclasses.replace(e, cores=e.cores or _local_cores(master), gpu_addresses=()) for e in executors]
    else:
        # A probe task needs a free core: executors with every core busy stayed silent.
        executors += [ExecutorInfo(f"busy-{i}", "?", cores, busy=True) for i in range(instances - len(executors))]
    gpu_type, source = _cluster_gpu_type(confs, executors)
    capacity = SparkCapacity(
        master=master,
        executors=tuple(executors),
        gpus_per_executor=int(float(confs.get("spark.executor.resource.gpu.amount") or 0)),
        gpu_type=gpu_type,
        gpu_type_source=source,
        simulated=_truthy(confs.get(SIMULATED_CONF)),
        dynamic_allocation=_truthy(confs.get("spark.dynamicAllocation.enabled")),
        probe_seconds=seconds,
    )
    with _cache_lock:
        _cache[key] = (time.monotonic(), capacity)
    return capacity


def clear_capacity_cache() -> None:
    with _cache_lock:
        _cache.clear()
        _images.clear()


_images: dict[str, dict | None] = {}


def common_image(images: list[dict]) -> dict:
    """What every executor has: the first one's interpreter and the distributions that all of
    them hold at the same version (a package one executor lacks is shipped to all)."""
    packages = dict(images[0].get("packages", {}))
    for image in images[1:]:
        theirs = image.get("packages", {})
        packages = {name: version for name, version in packages.items() if theirs.get(name) == version}
    return {**{k: v for k, v in images[0].items() if k != "packages"}, "packages": packages}


def discover_worker_image(spark, capacity: "SparkCapacity", *, wait_timeout: float, out=None) -> dict | None:
    """What the executors' Python already has, probed once per session (images do not change
    under a running session): the ``worker_has=`` of environment shipping.

    Returns ``None`` (ship everything) when the probe fails; the failure is reported on ``out``.
    """
    key = _session_key(spark)
    with _cache_lock:
        if key in _images:
            return _images[key]
    tasks = max(2, 2 * len(capacity.executors))

    def build():
        return spark.range(0, tasks, 1, tasks).mapInArrow(probe_image, IMAGE_DDL)

    try:
        rows = run_tagged(
            spark,
            build,
            f"sparkgpu-image-{uuid.uuid4().hex[:8]}",
            timeout=wait_timeout,
            what="the Spark executors to describe their Python",
            out=out,
        )
        by_executor = {row.executor: json.loads(row.image) for row in rows}
        image = common_image(list(by_executor.values()))
    except Exception as exc:  # shipping everything is slower, never wrong
        report(
            f"could not learn what the executors' Python has ({exc.__class__.__name__}: {exc}); "
            "the whole environment is shipped. Describe it with SPARKGPU_ENV_WORKER_LOCK to ship less.",
            out,
        )
        image = None
    with _cache_lock:
        _images[key] = image
    return image


def _session_key(spark) -> str:
    session_id = getattr(spark, "session_id", None) or getattr(spark, "_session_id", None)
    return str(session_id or id(spark))


# -- placement ---------------------------------------------------------------------------------


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, max(1, min(n, limit)) + 1) if n % d == 0)


def plan_placement(
    gpus: int,
    gpu_type: str,
    capacity: SparkCapacity,
    *,
    gpus_per_node: int | None = None,
    max_cpu_ranks_per_node: int = 64,
) -> RankPlacement:
    """Splits ``gpus`` ranks into equal nodes that fit the cluster, or says why they cannot.

    GPU jobs use as few nodes as possible: each node asks for the largest divisor of ``gpus``
    that one executor holds. CPU jobs spread over the executors.

    Raises:
        CapacityError: the request can never be satisfied; the message names what exists.
        ConfigurationError: ``gpus_per_node`` does not divide ``gpus``, or the cluster runs
            dynamic allocation (barrier stages are refused there, SPARK-24942).
    """
    if capacity.dynamic_allocation:
        raise ConfigurationError(
            "this Spark cluster runs with spark.dynamicAllocation.enabled=true, and Spark refuses barrier stages "
            "there (SPARK-24942); run GPU training on a cluster with static executors"
        )
    if gpus_per_node is not None and (gpus_per_node < 1 or gpus % gpus_per_node):
        raise ConfigurationError(f"gpus_per_node={gpus_per_node} must be a positive divisor of gpus={gpus}")
    if gpu_type == "cpu":
        slots = max(1, capacity.node_slots(0))
        per_node = gpus_per_node or gpus // _largest_divisor_at_most(gpus, max(1, len(capacity.executors)))
        nodes = gpus // per_node
        if per_node > max_cpu_ranks_per_node or nodes > slots:
            raise CapacityError(
                f"asked for {gpus} CPU ranks but the Spark session reaches {capacity.describe()}; at most "
                f"{max_cpu_ranks_per_node} CPU ranks run per node (SPARKGPU_MAX_CPU_RANKS); ask for fewer"
            )
        return RankPlacement(nodes, per_node, 0)
    _check_gpu_cluster(gpus, gpu_type, capacity)
    per_executor = max(capacity.gpus_of(e) for e in capacity.executors)
    per_node = gpus_per_node or _largest_divisor_at_most(gpus, per_executor)
    nodes = gpus // per_node
    slots = capacity.node_slots(per_node)
    if per_node > per_executor or nodes > slots:
        raise CapacityError(
            f"asked for {gpus} x {gpu_type} ({nodes} node(s) of {per_node}) but the Spark session reaches "
            f"{capacity.describe()}; ask for gpus<={capacity.total_gpus}, or add GPU executors to the cluster"
        )
    return RankPlacement(nodes, per_node, per_node)


def _check_gpu_cluster(gpus: int, gpu_type: str, capacity: SparkCapacity) -> None:
    if capacity.local_mode:
        raise CapacityError(
            f"asked for {gpus} x {gpu_type} but this Spark session runs in local mode ({capacity.master}), where "
            "Spark cannot hand out GPUs per task; use gpu_type='cpu', remote=False to use this host's GPUs, or "
            "connect to a GPU cluster (standalone or Kubernetes)"
        )
    if capacity.total_gpus == 0:
        raise CapacityError(
            f"asked for {gpus} x {gpu_type} but the Spark session reaches {capacity.describe()} "
            "(spark.executor.resource.gpu.amount is not set); use gpu_type='cpu', or connect to a GPU cluster"
        )
    unknown = sorted({e.gpu_names[0] for e in capacity.executors if e.gpu_names}) if capacity.gpu_type is None else []
    if unknown:
        known = ", ".join(g.name for g in GPU_CATALOG.values() if not g.is_cpu)
        raise CapacityError(
            f"asked for {gpus} x {gpu_type} but the Spark executors' GPUs are {', '.join(map(repr, unknown))}, which "
            f"is not a GPU type sparkgpu knows ({known}), so gpu_type={gpu_type!r} cannot be checked against it; "
            f"connect to a cluster of {gpu_type}, or have the cluster's admin declare the type with {GPU_TYPE_CONF}"
        )
    if capacity.gpu_type is not None and capacity.gpu_type != gpu_type:
        source = GPU_TYPE_CONF if capacity.gpu_type_source == "conf" else "the executors' driver"
        raise CapacityError(
            f"asked for gpu_type={gpu_type!r} but the Spark session reaches {capacity.describe()} (per {source}); "
            f"ask for gpu_type={capacity.gpu_type!r}, or connect to a cluster of {gpu_type}"
        )
