"""``spark.gpu``: GPU training from a Spark session (Spark Connect or classic).

```python
spark = SparkSession.builder.remote("sc://host:15002").getOrCreate()
import sparkgpu                                   # attaches spark.gpu
spark.gpu.capacity()                              # executors, hosts, GPU addresses and type
results = spark.gpu.train(train_fn, gpus=4, gpu_type="A10", args=(...), data=features_df)
scored = spark.gpu.predict(features_df, "main.ml.ctr@champion", gpus=4, gpu_type="A10")
```

``import sparkgpu`` calls :func:`attach`, which adds a ``gpu`` property to both SparkSession
classes without importing pyspark: if pyspark is not loaded yet, an import hook patches the
classes when it is.
"""

from __future__ import annotations

import importlib.abc
import inspect
import sys
import threading
from typing import Any, Callable

from sparkgpu._util.report import report
from sparkgpu.errors import ConfigurationError

__all__ = ["GPUNamespace", "attach"]

_SESSION_MODULES = ("pyspark.sql.session", "pyspark.sql.connect.session")
_NAMESPACE_ATTR = "_sparkgpu_gpu_namespace"
_lock = threading.Lock()


class GPUNamespace:
    """The ``spark.gpu`` namespace of one session.

    Attributes:
        last_job_id: Id of the last job ``train`` ran (``None`` before the first).
        last_run_dir: Its run directory (logs, results, checkpoints).
    """

    def __init__(self, spark):
        self._spark = spark
        self.last_job_id: str | None = None
        self.last_run_dir: str | None = None

    def __repr__(self) -> str:
        return f"<spark.gpu of {type(self._spark).__module__}.SparkSession>"

    def backend(self, **options):
        """A :class:`~sparkgpu.launch.backends.spark.backend.SparkBackend` on this session.

        Args:
            **options: ``wait_timeout``, ``gpus_per_node``, ``simulated``, ``client_timeout``, ``out``,
                ``staging_url``.
        """
        from sparkgpu.launch.backends.spark.backend import SparkBackend

        return SparkBackend(self._spark, **options)

    def capacity(self, refresh: bool = False):
        """What this session can run on: executors, hosts, GPU addresses and GPU type.

        Args:
            refresh: Probe again instead of using the answer of the last minute.

        Returns:
            A :class:`~sparkgpu.launch.backends.spark.capacity.SparkCapacity`; it prints as a table.
        """
        return self.backend().capacity(refresh=refresh)

    def usage(self, since="30d", until=None, by="team", ledger=None):
        """GPU-hours and cost from the usage ledger, as a Spark DataFrame of this session.

        The same report as ``sparkgpu usage --since 30d --by team``, to join or filter with Spark.

        Args:
            since: Window start: a duration back from now (``"30d"``, ``"12h"``), an ISO date, a
                datetime, or ``None`` for all time.
            until: Window end, same forms; ``None`` for now.
            by: Grouping keys, ``"team,gpu_type"`` or a list: tag names, ``user``, ``gpu_type``,
                ``backend``, ``job_id``, ``job_name``, ``status``, ``host``, ``day`` / ``week`` /
                ``month``. ``None`` for one row per attempt, clipped to the window, with its tags
                as a map.
            ledger: A :class:`~sparkgpu.usage.ledger.UsageLedger` or its URI
                (``SPARKGPU_USAGE_LEDGER`` by default).

        Returns:
            A ``pyspark.sql.DataFrame``: the keys, then ``jobs``, ``attempts``, ``gpus_max``,
            ``gpu_hours``, ``cost_usd``, largest GPU-hours first (time keys sort by time).

        Raises:
            ConfigurationError: ``since``, ``until`` or ``by`` does not parse; raised before the
                ledger is read.
        """
        from sparkgpu.usage.report import usage_dataframe

        return usage_dataframe(self._spark, since=since, by=by, until=until, ledger=ledger)

    def distributed(self, fn: Callable | None = None, **options):
        """``@spark.gpu.distributed(gpus=..., gpu_type=...)``: :func:`sparkgpu.distributed` on this session."""
        from sparkgpu.api.decorator import distributed

        if "backend" in options:
            raise ConfigurationError("spark.gpu.distributed runs on this session's Spark backend; drop backend=")
        backend_options = {
            k: options.pop(k) for k in ("wait_timeout", "gpus_per_node", "client_timeout") if k in options
        }
        return distributed(fn, remote=True, backend=self.backend(**backend_options), **options)

    def train(
        self,
        fn: Callable,
        *,
        gpus: int | tuple[int, int],
        gpu_type: str,
        args: tuple = (),
        kwargs: dict | None = None,
        data=None,
        data_volume: str | None = None,
        data_options: dict | None = None,
        data_format: str = "mds",
        gpus_per_node: int | None = None,
        wait_timeout: float | None = None,
        **distributed_options,
    ) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on ``gpus`` ranks on this session's Spark executors.

        Args:
            fn: The training function; runs once per rank with a process group set up.
            gpus: Number of ranks, one GPU each; a ``(min, max)`` pair asks for ``max`` and lets
                the job go on with as few as ``min`` while lost nodes are not replaced (``min_gpus=``).
            gpu_type: GPU type (``"A10"``, ``"H100"``, ...) or ``"cpu"`` for CPU ranks.
            args: Positional arguments for ``fn``.
            kwargs: Keyword arguments for ``fn``.
            data: A Spark DataFrame, a table name, or a path of a Delta table or Parquet files.
                It is converted to MDS shards once per data version
                (:func:`sparkgpu.data.convert.conversion.ensure_mds`) and ``fn`` gets the shards' URL as
                keyword argument ``data_url``. The job is checked first (capacity, usage policy,
                picklability), so a refused job never pays for the conversion.
            data_volume: Where conversions are kept (``SPARKGPU_DATA_VOLUME`` by default); the
                ranks must reach it.
            data_options: More arguments for ``ensure_mds`` (``columns``, ``compression``, ...).
            data_format: ``"mds"`` (convert, as above) or ``"table"``: when ``data`` is a path of
                a Delta table or Parquet files, or a DataFrame that is a plain scan of one (plus
                column selections and filters), ``data_url`` is a
                :class:`~sparkgpu.data.tables.plan.TableRef` for
                :func:`sparkgpu.data.table_dataset` and nothing is converted; any other
                DataFrame is converted as with ``"mds"`` (a log line says why).
            gpus_per_node: Ranks per barrier task (default: as many as one executor holds).
            wait_timeout: Seconds to wait for busy GPUs (``SPARKGPU_SPARK_WAIT_TIMEOUT``).
            **distributed_options: As for :func:`sparkgpu.distributed` (``timeout``,
                ``max_runtime``, ``max_restarts``, ``priority``, ``min_gpus``, ``elastic_wait``, ``log_ranks``,
                ``name``, ``tags``, ``callbacks``).

        Returns:
            One return value per rank, ordered by rank.

        Raises:
            CapacityError: the cluster can never give these GPUs (raised within seconds), or
                they stayed busy longer than ``wait_timeout``.
            ConfigurationError: bad arguments, e.g. ``data=`` for a function without ``data_url``.
            PolicyViolationError: the usage policy refuses the job.
            SerializationError: ``fn`` or an argument cannot be sent to the executors.
            WorkerFailedError: a rank failed; names it, with its remote traceback.
        """
        from sparkgpu.api.decorator import distributed

        if "backend" in distributed_options or "remote" in distributed_options:
            raise ConfigurationError(
                "spark.gpu.train always runs on this session's Spark executors; drop backend=/remote="
            )
        kwargs = dict(kwargs or {})
        if data_format not in ("mds", "table"):
            raise ConfigurationError(
                f"data_format={data_format!r} must be 'mds' (convert to MDS shards) or 'table' (read Delta/Parquet in place)"
            )
        options = dict(data_options or {})
        if data is not None:
            _check_accepts_data_url(fn, kwargs)
            # What data is gets decided here, once: a bad source fails before the job is prepared.
            source = self._resolve(data, options)
        backend = self.backend(wait_timeout=wait_timeout, gpus_per_node=gpus_per_node)
        job = distributed(fn, gpus=gpus, gpu_type=gpu_type, remote=True, backend=backend, **distributed_options)
        try:
            if data is None:
                return job.distributed(*args, **kwargs)
            # Prepared once: capacity and gpu_type, usage policy and picklability are checked
            # before the possibly long conversion, and the job launched after it is this one,
            # with data_url added to its already pickled arguments.
            prepared = job.prepare(args, kwargs)
            reference = self._table_ref(source) if data_format == "table" else None
            data_url = reference or self._convert(source, data_volume, options)
            return job.launch(prepared.with_kwargs(data_url=data_url))
        finally:
            self.last_job_id = getattr(job, "last_job_id", None)
            self.last_run_dir = getattr(job, "last_run_dir", None)

    def predict(self, df, model, *, gpus: int, gpu_type: str, **options):
        """Scores ``df`` with ``model`` on this session's GPU executors.

        Args:
            df: The rows to score (a Spark DataFrame).
            model: ``"main.ml.ctr@champion"`` (a registry version, pinned here), an MLflow model
                URI, a transformers or PEFT adapter directory, or a function returning a predict
                function (``predict_batch_udf``'s ``make_predict_fn``).
            gpus: GPUs the job uses at once: ``gpus // gpus_per_task`` tasks run together (the
                input is coalesced to that many partitions when it has more).
            gpu_type: GPU type (``"A10"``, ``"H100"``, ...), checked against the executors', or ``"cpu"``.
            **options: As for :func:`sparkgpu.predict.predict`: ``input_cols``, ``output_col``,
                ``result_type``, ``batch_size``, ``chunk_rows``, ``gpus_per_task``, ``output`` (a
                Delta table: written exactly once, returns a
                :class:`~sparkgpu.predict.PredictionResult`), ``mode``, ``run_id``, ``metric``,
                ``label_col``, ``experiment``, ``name``, ``tags``, ``priority``, ``callbacks``.

        Returns:
            A lazy DataFrame of ``df``'s columns plus ``output_col``; with ``output=``, a
            :class:`~sparkgpu.predict.PredictionResult` once the rows are committed.

        Raises:
            CapacityError: the executors have another GPU type, or fewer GPUs than a task needs.
            ConfigurationError: bad arguments (named), or the model version does not exist.
            PolicyViolationError: the usage policy refuses the job.
        """
        from sparkgpu.predict.job import predict

        return predict(self._spark, df, model, gpus=gpus, gpu_type=gpu_type, **options)

    def generate(self, df, model, *, gpus: int, gpu_type: str, prompt_col: str = "prompt", **options):
        """Completions of ``df``'s ``prompt_col`` by a causal LM or PEFT adapter: :meth:`predict` with
        ``task="generate"``; ``generation=`` takes a :class:`~sparkgpu.predict.GenerationConfig` or its
        fields as a dict (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``seed``, ``batch_size``); ``key_col=`` seeds each row's sampling (default: its prompt)."""
        from sparkgpu.predict.job import predict

        return predict(
            self._spark, df, model, gpus=gpus, gpu_type=gpu_type, task="generate", prompt_col=prompt_col, **options
        )

    def _resolve(self, data, options: dict):
        from sparkgpu.data.tables.resolve import resolve_source

        return resolve_source(
            data,
            version=options.get("version"),
            timestamp=options.get("timestamp"),
            storage_options=options.get("storage_options"),
            spark=self._spark,  # a catalog table name such as "main.ml.clicks" reads through it
        )

    def _table_ref(self, source):
        from sparkgpu.data.tables.plan import TableRef

        if source.path is not None:  # a Delta table or Parquet files, as a path or URL
            reference, why = TableRef(source.path), ""
        elif source.kind.is_spark:
            reference, why = source.scan, source.why
        else:
            reference, why = None, f"it is {source.kind.value} data in this process; the ranks read a table by its path"
        if reference is None:
            report(f"data_format='table' cannot read this DataFrame in place ({why}); converting it to MDS")
        else:
            report(f"data read in place by the ranks: {reference!r}")
        return reference

    def _convert(self, source, volume: str | None, options: dict) -> str:
        from sparkgpu.config import settings
        from sparkgpu.data.convert.conversion import ensure_mds

        result = ensure_mds(source, volume or settings().data_volume, **options)
        state = "reused" if result.reused else f"converted in {result.seconds:.1f}s"
        report(f"data as MDS at {result.url} ({result.samples} samples, {result.shards} shards, {state})")
        return result.url


def _check_accepts_data_url(fn: Callable, kwargs: dict) -> None:
    if "data_url" in kwargs:
        raise ConfigurationError("pass either data= or kwargs={'data_url': ...}, not both")
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return  # builtins and C functions: let the call itself tell
    if not any(p.name == "data_url" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        raise ConfigurationError(
            f"data= hands the function the MDS shards' URL as keyword argument data_url, but "
            f"{getattr(fn, '__qualname__', fn)!r} does not accept it; add a data_url parameter"
        )


# -- attaching spark.gpu ----------------------------------------------------------------------


def _gpu(self) -> GPUNamespace:
    namespace = self.__dict__.get(_NAMESPACE_ATTR)
    if namespace is None:
        namespace = self.__dict__[_NAMESPACE_ATTR] = GPUNamespace(self)
    return namespace


def _patch(session_class) -> None:
    if not isinstance(session_class.__dict__.get("gpu"), property):
        session_class.gpu = property(_gpu, doc="GPU training on this session's executors (sparkgpu).")


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then adds ``gpu`` to the module's SparkSession."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _patch(module.SparkSession)


class _AttachOnImport(importlib.abc.MetaPathFinder):
    """Patches a SparkSession module when pyspark imports it after sparkgpu was imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _SESSION_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def attach() -> None:
    """Adds ``spark.gpu`` to Spark Connect and classic sessions, now or when pyspark is imported.

    Idempotent, and never imports pyspark itself.
    """
    with _lock:
        missing = False
        for name in _SESSION_MODULES:
            module = sys.modules.get(name)
            if module is not None and hasattr(module, "SparkSession"):
                _patch(module.SparkSession)
            else:
                missing = True
        if missing and not any(isinstance(f, _AttachOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _AttachOnImport())
