"""``@distributed``: run a function on N GPUs (or CPU ranks) and get one result per rank.

```python
from sparkgpu import distributed

@distributed(gpus=2, gpu_type="cpu")
def step(x): ...

step.distributed(10)   # list, one result per rank, ordered by rank
step(10)               # a plain local call, no processes
```

Code written for Databricks' serverless GPU API runs by changing only the import line: the
``serverless_gpu`` names (``@distributed(gpus=..., gpu_type=..., remote=...)``) and those of its
successor ``databricks.air`` (``@distributed(8, "GPU_8xH100")``, ``num_accelerators=``,
``accelerator_type=``, ``fn.with_overrides(...)``, ``fn.func``) are both accepted.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable

from sparkgpu._util.report import PREFIX, report
from sparkgpu.config import settings
from sparkgpu.errors import ConfigurationError
from sparkgpu.launch.backends.base import Backend, LaunchPlan, backend_name, create_backend
from sparkgpu.launch.backends.capabilities import Reattachable
from sparkgpu.callbacks import JobCallback
from sparkgpu.api.prepare import PreparedJob, prepare
from sparkgpu.spec import JobSpec, Resources, RunPolicy, log_rank_selection, new_job_id, requested_resources

__all__ = ["distributed", "DistributedFunction", "default_callbacks", "REMOTE_MAX_RUNTIME"]

REMOTE_MAX_RUNTIME = "7d"
_UNSET = object()  # with_overrides(timeout=None) means "the default timeout", so None cannot mean "unchanged"
_COUNT_NAMES = frozenset({"num_accelerators", "gpus", "num_gpus"})
_TYPE_NAMES = frozenset({"accelerator_type", "gpu_type"})


def default_callbacks(fn: Callable | None = None, experiment: str | None = None) -> list[JobCallback]:
    """Callbacks every job gets unless the caller passes ``callbacks=`` explicitly:
    usage metering (ledger, policies), unless ``SPARKGPU_TRACKING=0`` one MLflow run, and unless
    ``SPARKGPU_LIGHTNING_CHECKPOINTS=0`` Lightning's checkpoints in the job's store."""
    from sparkgpu.usage.meter import UsageMeter

    callbacks: list[JobCallback] = [UsageMeter()]
    if settings().lightning_checkpoints:
        from sparkgpu.train.lightning_patch import LightningCheckpoints

        callbacks.append(LightningCheckpoints())
    if settings().tracking:
        from sparkgpu.tracking.mlflow_run import MLflowCallback

        callbacks.append(MLflowCallback(experiment, fn=fn, system_metrics_interval=settings().system_metrics_interval))
    return callbacks


class DistributedFunction:
    """A function bound to the resources it runs on.

    Calling it runs the plain function in this process; ``.distributed(...)`` runs it on
    every rank and returns the per-rank results. Built by :func:`distributed`.
    """

    def __init__(
        self,
        fn: Callable,
        *,
        resources: Resources,
        policy: RunPolicy,
        backend: str | Backend | None,
        log_ranks,
        name: str | None,
        tags: dict[str, str] | None,
        callbacks: list[JobCallback] | None,
        experiment: str | None = None,
        register_as: str | None = None,
        ship_environment: bool | None = None,
        run_async: bool = False,
        options: dict[str, Any] | None = None,
        detach: bool | None = None,
        idempotency_key: str | None = None,
    ):
        if not callable(fn):
            raise ConfigurationError(f"@distributed decorates a function, got {fn!r}")
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.resources = resources
        self.policy = policy
        self.backend = backend
        self.log_ranks = log_ranks
        self.name: str = name or str(getattr(fn, "__name__", "job"))
        self.tags = dict(tags or {})
        self.callbacks = callbacks
        self.experiment = experiment
        self.register_as = register_as
        self.ship_environment = ship_environment
        self.run_async = run_async
        self.detach = detach
        self.idempotency_key = idempotency_key
        # The @distributed arguments this was built from, for with_overrides().
        self._options = dict(options or {})
        # What the last .distributed() call left behind (None before the first call).
        self.last_job_id: str | None = None
        self.last_run_dir: str | None = None
        self.last_results: list[Any] | None = None
        self.last_model_version = None
        if register_as is not None:
            from sparkgpu.tracking.names import parse_model_name

            parse_model_name(register_as)  # a bad name fails at decoration time, not after training

    def __call__(self, *args, **kwargs):
        """Runs the function here, as rank 0 of a world of one.

        Collectives work (a single-process gloo group is set up for the call when none
        exists), so the same function runs plainly and distributed.
        """
        with _world_of_one():
            return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        r = self.resources
        shape = f" accelerator_type={self.accelerator_type!r}" if self.accelerator_type else ""
        return f"<distributed {self.name} gpus={r.gpus} gpu_type={r.gpu_type!r}{shape} remote={r.remote}>"

    @property
    def func(self) -> Callable:
        """The undecorated function."""
        return self.fn

    @property
    def num_accelerators(self) -> int:
        """Number of ranks (one GPU each); ``databricks.air``'s name for :attr:`resources` ``.gpus``."""
        return self.resources.gpus

    @property
    def accelerator_type(self) -> str | None:
        """The node shape asked for (``"GPU_8xH100"``), or ``None`` when only a GPU type (or
        none) was given and the backend chooses how the ranks spread over nodes."""
        r = self.resources
        return f"GPU_{r.gpus_per_node}x{r.gpu_type}" if r.gpus_per_node else None

    def with_overrides(
        self,
        num_accelerators: int | None = None,
        accelerator_type: str | None = None,
        remote: bool | None = None,
        timeout=_UNSET,
        **options,
    ) -> "DistributedFunction":
        """A new decorated function with some settings changed; this one is left as it is.

        Takes every :func:`distributed` argument. A new count (``num_accelerators``, ``gpus`` or
        ``num_gpus``) replaces the old one whichever name either used, and likewise a new
        ``accelerator_type`` or ``gpu_type``. ``timeout=None`` means the default timeout.

        Raises:
            ConfigurationError: an unknown argument, or settings that are invalid together.
        """
        unknown = sorted(set(options) - _OVERRIDABLE)
        if unknown:
            raise ConfigurationError(
                f"with_overrides got unknown argument(s) {', '.join(unknown)}; it takes "
                f"{', '.join(sorted(_OVERRIDABLE | {'num_accelerators', 'accelerator_type', 'remote', 'timeout'}))}"
            )
        merged = dict(self._options)
        if num_accelerators is not None:
            options["num_accelerators"] = num_accelerators
        if accelerator_type is not None:
            options["accelerator_type"] = accelerator_type
        if remote is not None:
            options["remote"] = remote
        if timeout is not _UNSET:
            options["timeout"] = timeout
        for group in (_COUNT_NAMES, _TYPE_NAMES):
            if group & options.keys():
                for name in group:
                    merged.pop(name, None)
        merged.update(options)
        return distributed(**merged)(self.fn)

    # -- the distributed call --------------------------------------------------------------
    def _backend(self) -> Backend:
        if isinstance(self.backend, Backend):
            return self.backend
        name = self.backend or (
            "spark" if self.resources.remote else ("warm_pool" if settings().warm_pool else "local")
        )
        return create_backend(name)

    def _ships_environment(self) -> bool:
        # Local ranks run in this very environment; remote ones get it shipped.
        return self.ship_environment if self.ship_environment is not None else self.resources.remote

    def prepare(self, args: tuple, kwargs: dict, *, detached: bool | None = None) -> PreparedJob:
        """Resolves, checks and pickles one call of the function once; writes and starts nothing.

        ``detached``: the job's own supervisor registers its model (``register_as``), not the
        caller; by default as a blocking call of it (:meth:`launch`) would run it.
        """
        if detached is None:
            detached = self._detaches(submitting=False)
        backend = self._backend()
        spec = JobSpec(
            job_id=new_job_id(self.name),
            name=self.name,
            resources=self.resources,
            policy=self.policy,
            backend=backend.name,
            log_ranks=self.log_ranks,
            tags=self.tags,
        )
        callbacks = default_callbacks(self.fn, self.experiment) if self.callbacks is None else list(self.callbacks)
        if detached and self.register_as is not None:
            from sparkgpu.tracking.registration import ModelRegistration

            callbacks.append(ModelRegistration(self.register_as))
        return prepare(
            spec,
            self.fn,
            args,
            kwargs,
            backend=backend,
            callbacks=callbacks,
            ship_environment=self._ships_environment(),
        )

    def distributed(self, *args, **kwargs) -> Any:
        """Runs the function on every rank with these arguments.

        With ``run_async=True`` (a setting of :func:`distributed`) it returns at once, as
        :meth:`submit` does. With ``register_as``, rank 0's return value is registered once the job succeeded; if
        that fails, the registration's error is raised, and the job's results stay reachable:
        on :attr:`last_results` and on the error's ``results`` attribute.

        Returns:
            One return value per rank, ordered by rank; with ``run_async=True``, the job's
            :class:`~sparkgpu.api.call.DistributedFunctionCall`.

        Raises:
            WorkerFailedError: a rank raised or died; names each failing rank with its remote
                traceback (the original exception is chained when it unpickles).
            SerializationError: the function or an argument cannot be sent to the workers.
            CapacityError: more (or other) GPUs were asked for than the backend has.
            JobTimeoutError: the call ran past ``timeout``.
            ConfigurationError: ``register_as`` was given and rank 0 returned no
                ``torch.nn.Module`` or transformers model (the job itself succeeded; see above).
        """
        if self.run_async:
            return self.submit(*args, **kwargs)
        self.last_results = self.last_model_version = None
        return self.launch(self.prepare(args, kwargs))

    def launch(self, prepared: PreparedJob) -> list[Any]:
        """Writes a prepared call of this function, runs it to the end and registers its model.

        With ``detach=True`` its own processes supervise it (:meth:`prepare` it the same way),
        and this call follows its logs to the end; Ctrl-C cancels it.
        """
        if self._detaches(submitting=False):
            return self._follow(self.submit_prepared(lambda: prepared))
        prepared = prepared.write()
        self.last_job_id, self.last_run_dir = prepared.job.job_id, str(prepared.run_dir.path)
        results = prepared.supervisor().run()
        run_id = next((getattr(c, "run_id", None) for c in prepared.callbacks if getattr(c, "run_id", None)), None)
        return self._registered(results, prepared.job.job_id, run_id)

    def _registered(self, results: list[Any], job_id: str, run_id: str | None) -> list[Any]:
        """``results``, once rank 0's model is registered (with ``register_as``) here."""
        from sparkgpu.tracking.registration import register_result

        # Set before registering: a registry that fails must not cost the results of a job
        # that may have trained for days.
        self.last_results = results
        if self.register_as is not None:
            try:
                self.last_model_version = register_result(results[0], self.register_as, job_id, run_id)
            except Exception as exc:
                exc.results = results  # type: ignore[attr-defined]  # documented: the results ride on the error
                note = (
                    f"job {job_id} succeeded, only registering its model as "
                    f"{self.register_as!r} failed; its per-rank results are on this error's `.results` "
                    "and on the decorated function's `.last_results`: register them with "
                    f"sparkgpu.registry.register(results[0], {self.register_as!r})"
                )
                if hasattr(exc, "add_note"):  # Python >= 3.11
                    exc.add_note(PREFIX + note)
                else:
                    report(note)
                raise
        return results

    def submit(self, *args, **kwargs):
        """Starts ``.distributed(*args, **kwargs)`` and returns its
        :class:`~sparkgpu.api.call.DistributedFunctionCall` at once.

        A local job is supervised by processes of its own (``detach``): it runs on when this
        process exits or is killed, and ``sparkgpu.attach(call.job_id)`` finds it again.
        Everything ``.distributed()`` checks before it starts (arguments that pickle, capacity,
        usage policy) is checked here, so those errors raise from ``submit`` itself.

        Raises:
            ConfigurationError: the function has ``register_as`` and its caller supervises it
                (``detach=False``, a remote job): register ``call.result()[0]`` with
                ``sparkgpu.registry.register`` instead; or as for ``.distributed()``.
        """

        detached = self._detaches(submitting=True)
        if not detached and self.register_as is not None:
            raise ConfigurationError(
                f"submit() of a job its caller supervises does not register models; drop "
                f"register_as={self.register_as!r} and call sparkgpu.registry.register(call.result()[0], "
                f"{self.register_as!r}), or submit it detached (detach=True)"
            )
        # A detached job's own supervisor registers its model (register_as).
        return self.submit_prepared(lambda: self.prepare(args, kwargs, detached=detached))

    @property
    def submit_detaches(self) -> bool:
        """Whether :meth:`submit` hands the job to processes of its own, so that it outlives this one."""
        return self._detaches(submitting=True)

    def _detaches(self, submitting: bool) -> bool:
        """Whether this call's job is supervised by processes of its own (``detach``).

        Raises:
            ConfigurationError: ``detach=True`` with a backend given as an object, which another
                process cannot rebuild; raised before anything is prepared.
        """
        if self.detach is None:
            return submitting and self._detach_refusal() is None
        if self.detach and (refusal := self._detach_refusal()) is not None:
            raise ConfigurationError(
                f"detach=True supervises the job in processes of its own, and this one cannot be: {refusal}; "
                "or drop detach (this process then supervises the job, and it ends with this process)"
            )
        return self.detach

    def _detach_refusal(self) -> str | None:
        """Why another process could not supervise this function's job; ``None`` when one can.

        A named backend is built there anew; a backend object only when it can be rebuilt from the
        run dir (a Spark backend on a Spark Connect session).
        """
        backend = self.backend
        if isinstance(backend, Reattachable):
            return backend.detach_refusal()
        if isinstance(backend, Backend):
            return (
                f"it runs on the backend object {backend!r} of this process, which another process cannot rebuild; "
                f"name the backend (backend={backend.name!r})"
            )
        if self.resources.remote:
            from sparkgpu.launch.backends.spark.sessions import active_spark_session, detach_refusal
            from sparkgpu.spec.pools import configured_pools

            if configured_pools() is not None or settings().spark_remote:
                return None  # sessions opened by URL
            try:
                return detach_refusal(active_spark_session())
            except ConfigurationError:
                return None  # no session at all: preparing the job says so
        return None

    def submit_prepared(self, prepare: Callable[[], PreparedJob]):
        """:meth:`submit` for a job ``prepare()`` prepares (``self.prepare(..., detached=True)``), not yet written.

        For callers that must see the prepared job before it is written (the CLI seals a job
        file's secrets under its key). ``prepare`` is not called when an earlier submission
        holds the idempotency key: that job's call is returned.
        """
        from sparkgpu.api.call import DistributedFunctionCall, attach
        from sparkgpu.launch.client.idempotency import claimed_job

        if self.idempotency_key is not None and (earlier := claimed_job(self.idempotency_key)) is not None:
            self.last_job_id = earlier
            return attach(earlier)
        if not self._detaches(submitting=True):
            prepared = self._written(prepare())
            if isinstance(prepared, str):
                return attach(prepared)
            return DistributedFunctionCall._supervise(prepared.supervisor())
        from sparkgpu.launch.client.detached import Keeper

        # Its interpreter starts and imports the launcher while this process prepares and stages the job.
        keeper = Keeper()
        try:
            prepared = self._written(prepare())
        except BaseException:
            keeper.abandon()
            raise
        if isinstance(prepared, str):
            keeper.abandon()
            return attach(prepared)
        return DistributedFunctionCall._detach(prepared.run_dir, keeper)

    def _written(self, prepared: PreparedJob) -> PreparedJob | str:
        """``prepared``, written; or the id of the job an earlier submission with the idempotency key started."""
        from sparkgpu.launch.client.idempotency import claim_key

        prepared = prepared.write()
        job_id = prepared.job.job_id
        if self.idempotency_key is not None and (winner := claim_key(self.idempotency_key, job_id)) != job_id:
            prepared.discard()  # another submission with the key got there first; nothing of ours started
            self.last_job_id = winner
            return winner
        self.last_job_id, self.last_run_dir = job_id, str(prepared.run_dir.path)
        return prepared

    def _follow(self, call) -> list[Any]:
        """Streams a detached job's logs here until it ends; its results, registered. Ctrl-C cancels it."""
        from sparkgpu._util.report import console

        from sparkgpu.tracking.registration import read_registration

        try:
            call._follow_logs(console(), self.log_ranks)
            results = call.result()
        except KeyboardInterrupt:
            report(f"cancelling job {call.job_id} (Ctrl-C)")
            call.cancel(timeout=self.policy.shutdown_grace + 30)
            raise
        self.last_results = results
        try:  # registered by the job's own supervisor (ModelRegistration), as it ended
            self.last_model_version = read_registration(call.run_dir.path)
        except ConfigurationError as exc:
            exc.results = results  # type: ignore[attr-defined]  # as for an attached call
            raise
        return results

    def dryrun(self, *args, **kwargs) -> LaunchPlan:
        """What ``.distributed(*args, **kwargs)`` would launch, validated but not started.

        The same checks as ``.distributed()`` (capacity, usage policy, arguments that pickle),
        made once; nothing is written (no run dir, no key, no shipped environment).
        """
        return self.prepare(args, kwargs).plan()


@contextlib.contextmanager
def _world_of_one():
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def distributed(
    num_accelerators: int | tuple[int, int] | Callable | None = None,
    accelerator_type: str | None = None,
    remote: bool = False,
    timeout=None,
    *,
    gpus: int | tuple[int, int] | None = None,
    num_gpus: int | None = None,
    gpu_type: str | None = None,
    backend: str | Backend | None = None,
    max_runtime=None,
    checkpoint_grace="60s",
    max_restarts: int = 0,
    restart_on=None,
    progress_timeout=None,
    preflight: bool = True,
    priority="normal",
    capacity_wait=None,
    min_gpus: int | None = None,
    elastic_wait=None,
    log_ranks="main",
    name: str | None = None,
    tags: dict[str, str] | None = None,
    callbacks: list[JobCallback] | None = None,
    experiment: str | None = None,
    register_as: str | None = None,
    ship_environment: bool | None = None,
    pool: str | None = None,
    run_async: bool = False,
    detach: bool | None = None,
    idempotency_key: str | None = None,
):
    """Decorates a function so that ``fn.distributed(...)`` runs it on ``num_accelerators`` ranks.

    Usable bare (``@distributed``) or with arguments; the first four may be positional, as in
    ``databricks.air`` (``@distributed(8, "GPU_8xH100", True)``).

    Args:
        num_accelerators: Number of ranks, one GPU each. ``gpus`` and ``num_gpus`` are the
            same setting. ``None``: on local runs every GPU of this host (one rank on a host
            without GPUs or with ``gpu_type="cpu"``); on remote runs one node of
            ``accelerator_type``, else one GPU. Bare ``@distributed`` passes the function here.
            A ``(min, max)`` pair asks for ``max`` and makes the job elastic (``min_gpus=min``).
        accelerator_type: Node shape ``"GPU_<N>x<TYPE>"`` (case-insensitive): ``"GPU_1xA10"``,
            ``"GPU_1xH100"``, ``"GPU_8xH100"``, ``"GPU_8xB300"``, or any catalog type with up to
            its per-node maximum. Remote jobs then run on nodes of N GPUs each, and the count
            must be a multiple of N. A plain catalog type is accepted too (as ``gpu_type``).
        remote: Run on a remote GPU pool through Spark instead of this host.
        gpu_type: Catalog name (``"H100"``, ``"A10"``, ``"A100-80GB"``, ``"H200"``, ``"B200"``,
            ``"B300"``, ``"L4"``) or ``"cpu"`` for CPU ranks with gloo. ``None`` on local runs
            means this host's GPUs, or CPU when it has none. Remote runs need it (or
            ``accelerator_type``).
        backend: ``"local"``, ``"warm_pool"`` (local ranks forked from a warm pool; the default for
            local jobs when ``SPARKGPU_WARM_POOL=1``), ``"spark"`` or a
            :class:`~sparkgpu.launch.backends.base.Backend`.
        timeout: Limit on the whole call (seconds or ``"2h"``); ``SPARKGPU_TIMEOUT`` by default.
        max_runtime: Cap on one attempt (``"7d"``); ranks are asked to checkpoint
            ``checkpoint_grace`` before it and the job resumes in a new attempt. Remote jobs
            default to 7 days, local ones to no cap.
        checkpoint_grace: See ``max_runtime``.
        max_restarts: Attempts restarted after a failure before it is raised.
        restart_on: The failure classes restarted while restarts are left (``["nccl",
            "cuda_oom"]``); ``None``: the default failure policy (a CUDA out-of-memory, a data error,
            an environment error and a result error are raised at once). See "Failure classes"
            in the launch guide.
        progress_timeout: How long a rank may go without progress (optimizer steps of a
            patched Trainer or Lightning, ``Checkpointer`` steps, sparkgpu loader batches,
            ``runtime.heartbeat()``) before the attempt counts as hung (seconds or ``"5m"``):
            every rank's stacks are written to the run dir, the rank(s) behind are named, and the
            attempt fails as ``hang`` (restarted from the latest checkpoint while restarts are
            left). ``None``: off until a rank first makes progress, then the larger of 10
            minutes and 10 times the longest gap between two progress notes seen; ``"off"``:
            never. See the "When a job stops" guide.
        preflight: Before its ranks start, each node checks that its cache disk is writable
            and has ``SPARKGPU_PREFLIGHT_FREE`` free, and, on real GPUs, that they are all
            visible, compute a bf16 matmul right and all-reduce over NCCL. A node that fails
            is named; on Spark the next attempt leaves its executor out. ``False`` skips it.
        priority: ``"best_effort"``, ``"normal"`` or ``"critical"`` (databricks' ``BEST_EFFORT``
            / ``NORMAL`` / ``CRITICAL`` too): waiting jobs get free GPUs by class, then in
            order; a critical job that does not fit asks best-effort jobs to checkpoint and
            stop, and they resume by themselves, using no restart (:mod:`sparkgpu.spec.priority`).
        capacity_wait: How long a remote attempt may wait for its GPUs (seconds or ``"30m"``):
            at submit, and after a lost node while the cluster replaces it. ``None``: the
            job's ``max_runtime`` (7 days for remote jobs), else ``SPARKGPU_SPARK_WAIT_TIMEOUT``.
            The wait is not billed; ``sparkgpu jobs`` shows the job as ``waiting``.
        min_gpus: Makes a remote job elastic: when all its GPUs do not come back within
            ``elastic_wait`` (a lost node not yet replaced, a busy cluster at submit), it goes on
            from its last checkpoint with as many whole nodes as are free, down to ``min_gpus``,
            and grows back at its next checkpoint once they are free. ``num_accelerators=(min,
            max)`` says the same. The function must checkpoint (``sparkgpu.train.Checkpointer``)
            and take the world size from the job, not a constant.
        elastic_wait: How long an elastic job waits for all its GPUs before going on with fewer
            (seconds or ``"20m"``; default 15 minutes).
        log_ranks: Ranks whose output streams to the caller: ``"main"`` (rank 0), ``"all"``,
            ``None`` (none) or a list of ranks. Every rank's output is kept in the run dir.
        name: Job name (the function's name by default).
        tags: Free-form tags for tracking and cost attribution.
        callbacks: Job callbacks; the defaults (usage metering, Lightning checkpoints, MLflow
            tracking) when ``None``.
        experiment: MLflow experiment of the job's run (default: named after the calling
            script or notebook).
        register_as: Register rank 0's return value (a ``torch.nn.Module``, or
            ``{"model": ..., "tokenizer": ...}`` for a transformers or PEFT model) under this
            ``catalog.schema.model`` name when the job succeeds.
        ship_environment: Snapshot this environment and rehydrate it on the workers
            (default: for ``remote=True`` jobs).
        pool: Run on this GPU pool (its name or id in the ``SPARKGPU_POOLS`` file) instead of
            the one ``gpu_type`` chooses; needs ``remote=True``.
        run_async: ``fn.distributed(...)`` returns the job's
            :class:`~sparkgpu.api.call.DistributedFunctionCall` at once instead of waiting for the
            results (as ``fn.submit(...)`` does): for sweeps of many jobs. Collect them with
            :func:`~sparkgpu.api.call.collect_outputs_or_raise`.
        detach: Supervise the job in processes of its own (:mod:`sparkgpu.launch.client.detached`),
            so that it outlives this process: ``submit`` returns at once, ``.distributed()``
            follows the job's logs to its end (Ctrl-C still cancels it) and a killed caller
            leaves it running; ``sparkgpu.attach(job_id)`` finds it again from any process.
            ``None``: ``submit`` detaches local jobs, ``.distributed()`` supervises here.
        idempotency_key: A submission with a key that an earlier one of this user used returns
            that job (still running or ended) instead of starting another: a retried
            ``submit`` (a notebook cell run twice, a flaky scheduler) never trains twice.

    Raises:
        ConfigurationError: an argument is invalid, or names of one setting disagree
            (``gpus=2, num_accelerators=4``); raised here, at decoration time.
    """
    fn = None
    if callable(num_accelerators):  # bare @distributed
        fn, num_accelerators = num_accelerators, None
    options = {name: value for name, value in locals().items() if name in _OPTION_NAMES}
    resources = requested_resources(
        num_accelerators=num_accelerators,
        accelerator_type=accelerator_type,
        gpus=gpus,
        num_gpus=num_gpus,
        gpu_type=gpu_type,
        remote=remote,
        min_gpus=min_gpus,
        host_gpu_count=_host_gpu_count,
    )
    if elastic_wait is not None and resources.min_gpus is None:
        raise ConfigurationError(
            "elastic_wait= applies to elastic jobs; set min_gpus= (or num_accelerators=(min, max)) too, or drop it"
        )
    ranks = log_rank_selection(log_ranks)
    if max_runtime is None and remote:
        max_runtime = REMOTE_MAX_RUNTIME  # remote pools cap every run; resume past the cap
    policy = RunPolicy(
        timeout=timeout if timeout is not None else settings().default_timeout,
        max_runtime=max_runtime,
        checkpoint_grace=checkpoint_grace,
        max_restarts=max_restarts,
        restart_on=restart_on,
        progress_timeout=progress_timeout,
        preflight=bool(preflight),
        priority=priority,
        capacity_wait=capacity_wait,
        elastic_wait=elastic_wait,
    )

    if run_async and register_as is not None:
        raise ConfigurationError(
            f"run_async=True returns before the job ends, so nothing is registered; drop register_as={register_as!r} "
            f"and call sparkgpu.registry.register(call.result()[0], {register_as!r}), or drop run_async"
        )
    if isinstance(backend, str):
        backend = backend_name(backend)
    if pool is not None:
        backend = _pool_backend(pool, remote, backend)

    def wrap(f: Callable) -> DistributedFunction:
        return DistributedFunction(
            f,
            resources=resources,
            policy=policy,
            backend=backend,
            log_ranks=ranks,
            name=name,
            tags=tags,
            callbacks=callbacks,
            experiment=experiment,
            register_as=register_as,
            ship_environment=ship_environment,
            run_async=run_async,
            options=options,
            detach=detach,
            idempotency_key=idempotency_key,
        )

    if fn is not None:
        return wrap(fn)
    return wrap


def _pool_backend(pool: str, remote: bool, backend) -> Backend:
    """The Spark backend of ``distributed(pool=...)``; the pool itself is chosen at launch."""
    if not remote:
        raise ConfigurationError(f"pool={pool!r} runs the job on a remote GPU pool: add remote=True")
    if backend not in (None, "spark"):
        raise ConfigurationError(f"pool={pool!r} runs on the Spark backend; drop backend={backend!r}")
    return create_backend("spark", pool=pool)


def _host_gpu_count() -> int:
    from sparkgpu.launch.node.hardware import detect_host_gpus

    return detect_host_gpus(settings().simulate_gpus).count


_OPTION_NAMES = frozenset(inspect.signature(distributed).parameters)
_OVERRIDABLE = _OPTION_NAMES - {"num_accelerators", "accelerator_type", "remote", "timeout"}
