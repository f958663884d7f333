"""Ranks on Spark executors: one barrier task per node, through Spark Connect or a classic session.

An attempt is one Spark job: ``spark.range(nodes).mapInArrow(run_node, barrier=True,
profile=rp)``, where ``rp`` is a task-level ResourceProfile asking each task for its node's
GPUs (executor-level requests need dynamic allocation, which refuses barrier stages:
SPARK-24942). Node rank = partition id; node 0's host comes from the barrier task infos and
its rendezvous port from ``allGather``; each node's ranks see that task's GPU addresses.
The job's signing key travels inside the task closure only.

Results, tracebacks and logs come back through the run dir, which the client and the
executors either reach under the same path (a local folder on one machine; an NFS or
FUSE-mounted volume on a real cluster: set ``SPARKGPU_STAGING_ROOT`` to it), or mirror
through a staging store (``SPARKGPU_STAGING_ROOT`` an fsspec URL such as ``s3://bucket/runs``;
:mod:`sparkgpu.launch.staging.mirror`): the client uploads the payload at the job's first submit,
and while an attempt runs it pushes its control files and pulls the nodes' files in a
background thread, with one last pull once the Spark job ended. The Spark action
runs in a background thread under a job tag: ``cancel`` first asks the nodes to stop their
ranks (SIGTERM, with the job's shutdown grace), then interrupts the tag; Spark then kills
the Python workers, and the agents and ranks die with them (``PR_SET_PDEATHSIG``). When the
action itself fails (a broken Connect stream) the ranks may run on, so the attempt is
reported only after the same stop and a bounded wait for the nodes' end markers: a restart
never overlaps the old ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import time
from typing import TextIO

from sparkgpu._util.report import report
from sparkgpu._util.urls import install_command, scheme_of
from sparkgpu.config import settings
from sparkgpu.errors import CapacityError, ConfigurationError, PreflightError
from sparkgpu.launch.node.agent import build_command
from sparkgpu.launch.backends.base import AttemptHandle, Backend, LaunchPlan, ResolvedJob
from sparkgpu.launch.backends.capabilities import (
    DeferredStart,
    ElasticCapacity,
    Preemptible,
    Reattachable,
    WatchedProgress,
)
from sparkgpu.launch.backends.spark.capacity import (
    RankPlacement,
    SparkCapacity,
    discover_capacity,
    discover_worker_image,
    plan_placement,
)
from sparkgpu.launch.backends.spark.executor.node import NODE_DDL, NodeLaunch, run_node
from sparkgpu.launch.backends.spark.attempt import NodeWatch, SparkAttempt, sync_now
from sparkgpu.launch.backends.spark.progress import SparkProgress
from sparkgpu.launch.rank.progress import DUMP_WAIT
from sparkgpu.launch.backends.spark import exclusions
from sparkgpu.launch.backends.spark.seats import ClusterSeats
from sparkgpu.launch.backends.spark.sessions import active as _active
from sparkgpu.launch.backends.spark.sessions import (
    active_spark_session,
    check_key_transport,
    connection_closed,
    connect_url,
    full_url,
    new_connect_session,
    pool_for_job,
    pool_session,
    record_session,
    detach_refusal,
    recorded_options,
    recorded_remote,
)
from sparkgpu.rundir.states import NodeState
from sparkgpu.launch.rank.threads import threads_per_rank
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.launch.staging.mirror import ClientMirror, StagingStore, store_prefix, user_prefix
from sparkgpu.spec.pools import POOL_TAG, Pool
from sparkgpu.spec import JobSpec

__all__ = ["SparkBackend", "SparkAttempt", "active_spark_session"]

#: Most seconds between two beats of the client (four per ``client_timeout`` when that is shorter).
_HEARTBEAT_SECONDS = 10.0
#: Seconds between two probes of the executors while a lost node is being replaced.
_SLOT_POLL_SECONDS = 1.0
#: Seconds between two probes while the cluster is short of slots without executors that failed pre-flight.
_SHORT_POLL_SECONDS = 5.0
#: Seconds one probe of the slots after a lost node may take: its tasks may be the first on the
#: replacement executor, which starts a Python worker for them. Not the job's ``wait_timeout``:
#: a probe interrupted at a short ``wait_timeout`` kills that Python worker, so every later probe
#: pays the start again and the replacement is never seen.
_SLOT_PROBE_SECONDS = 120.0


class _FromSettings:
    """Marks an argument left to its ``SPARKGPU_*`` setting where ``None`` has a meaning of its own."""

    def __repr__(self) -> str:
        return "<from settings>"


_FROM_SETTINGS = _FromSettings()


class SparkBackend(Backend, Preemptible, ElasticCapacity, DeferredStart, Reattachable, WatchedProgress):
    """Runs every node of a job as a barrier task on a Spark session's executors.

    It has every capability: its jobs queue for the cluster's GPUs and give way to urgent ones,
    elastic jobs shrink and grow with its executors, its ranks start once the barrier stage gets
    its GPUs, and a resumed job reconnects to the Connect server it ran on.

    Args:
        spark: The session (Connect or classic). When omitted: the session of the job's pool
            when a pools file is configured (``SPARKGPU_POOLS``), else the active one (or
            ``SPARKGPU_SPARK_REMOTE``), looked up on first use.
        wait_timeout: Seconds an attempt waits for busy GPUs before giving up, for jobs without
            ``capacity_wait=`` (:meth:`capacity_wait_of`); by default a job's ``max_runtime``,
            else ``SPARKGPU_SPARK_WAIT_TIMEOUT``.
        gpus_per_node: Force this many ranks per barrier task; by default as many as one
            executor holds (GPU jobs) or an even spread over the executors (CPU jobs).
        simulated: Treat the cluster's GPU addresses as fake and run ranks on CPU with gloo;
            by default the cluster's ``spark.sparkgpu.simulatedGpus`` conf decides.
        client_timeout: Seconds the nodes keep running without a heartbeat from this client
            before they stop their ranks (``SPARKGPU_SPARK_CLIENT_TIMEOUT``, 120 by default;
            ``None``: run on when the client dies).
        node_timeout: Seconds a started node may go without a beat to node 0 (and without its
            end marker) before node 0 counts its executor lost and stops the attempt
            (``SPARKGPU_SPARK_NODE_TIMEOUT``, 10 by default).
        control_interval: Most seconds between two looks of node 0 at this client's files (a
            cancel or stop request reaches the ranks within about this long;
            ``SPARKGPU_SPARK_CONTROL_INTERVAL``, 20 by default).
        remote: Spark Connect URL to open when no session is given, none is active and
            ``SPARKGPU_SPARK_REMOTE`` is unset: where a resumed job ran before.
        out: Stream for "waiting for GPUs" lines (``sys.stderr`` by default).
        staging_url: Staging store the executors reach instead of the client's run dir, any
            fsspec URL (``SPARKGPU_STAGING_ROOT`` when that is a URL, by default); ``""`` for
            none (the executors then see the run dir under the client's path).
        pool: Name or id of the pool to run on (``SPARKGPU_POOL`` when omitted; by default
            the job's GPU type chooses). Needs a pools file.
    """

    name = "spark"
    #: Seconds past the job's shutdown grace that a failed attempt waits for its nodes to
    #: confirm that their ranks stopped (a test seam).
    node_stop_margin = 20.0
    #: Seconds between two syncs of a running attempt with the staging store.
    sync_interval = 1.0

    def __init__(
        self,
        spark=None,
        *,
        wait_timeout: float | None = None,
        gpus_per_node: int | None = None,
        simulated: bool | None = None,
        client_timeout: float | None | _FromSettings = _FROM_SETTINGS,
        node_timeout: float | None = None,
        control_interval: float | None = None,
        out=None,
        staging_url: str | None = None,
        pool: str | None = None,
        remote: str | None = None,
    ):
        self._spark = spark
        self.remote = remote
        self.pool_name = pool
        self.pool: Pool | None = None  # the pool the session belongs to, once chosen
        self.wait_timeout = wait_timeout if wait_timeout is not None else settings().spark_wait_timeout
        self._wait_timeout_given = wait_timeout is not None
        self.gpus_per_node = gpus_per_node
        self.simulated = simulated
        self.client_timeout = (
            settings().spark_client_timeout if isinstance(client_timeout, _FromSettings) else client_timeout
        )
        self.node_timeout = node_timeout if node_timeout is not None else settings().spark_node_timeout
        self.control_interval = control_interval if control_interval is not None else settings().spark_control_interval
        self.out = out
        self.staging_url = (settings().staging_url if staging_url is None else staging_url) or None
        self._mirrors: dict[str, ClientMirror] = {}
        self.last_attempt: SparkAttempt | None = None
        #: Lost nodes, the stop of the others and the attempt's report.
        self.watch = NodeWatch(self)
        #: The jobs' places in the cluster's GPU queue (priorities, preemption).
        self.seats = ClusterSeats(self.staging_url, lambda: self.stream)

    @property
    def spark(self):
        if self._spark is None:
            self._spark = active_spark_session(fallback=self.remote)
        return self._spark

    @property
    def stream(self) -> TextIO:
        """Where the backend's notices go (``out``, else ``sys.stderr``)."""
        return self.out if self.out is not None else sys.stderr

    def interrupt(self, tag: str) -> None:
        """Interrupts the Spark jobs under ``tag`` (the session's ``interruptTag``)."""
        self.spark.interruptTag(tag)

    # -- capacity ---------------------------------------------------------------------
    def capacity(self, refresh: bool = False, probe_timeout: float | None = None) -> SparkCapacity:
        """Executors, hosts and GPUs this session reaches (probed; cached for a minute); the probe
        gives up after ``probe_timeout`` seconds (the backend's ``wait_timeout`` by default)."""
        timeout = self.wait_timeout if probe_timeout is None else probe_timeout
        capacity = discover_capacity(self.spark, wait_timeout=timeout, out=self.stream, refresh=refresh)
        if self.simulated is not None:
            capacity = dataclasses.replace(capacity, simulated=self.simulated)
        return capacity

    def worker_image(self) -> dict | None:
        """What the executors' Python has, probed once per session; ``None`` when
        ``SPARKGPU_ENV_WORKER_LOCK`` describes it instead."""
        if settings().env_worker_lock:
            return None
        return discover_worker_image(self.spark, self.capacity(), wait_timeout=self.wait_timeout, out=self.stream)

    def capacity_wait_of(self, job: JobSpec) -> float:
        """Seconds an attempt of ``job`` may wait for its GPUs: its ``capacity_wait=``, else this
        backend's ``wait_timeout`` when one was given, else its ``max_runtime`` (a job capped at 7
        days waits as long for a lost node's replacement), else ``SPARKGPU_SPARK_WAIT_TIMEOUT``."""
        run_policy = job.policy
        if run_policy.capacity_wait is not None:
            return run_policy.capacity_wait
        if self._wait_timeout_given or run_policy.max_runtime is None:
            return self.wait_timeout
        return run_policy.max_runtime

    # -- the cluster's queue: priorities and preemption --------------------------------
    def await_capacity(self, job: JobSpec, wait: float | None) -> None:
        """Waits for the job's turn in the cluster's GPU queue (:mod:`sparkgpu.launch.scheduling.cluster_queue`):
        by class, then by arrival, and for a critical job, asking best-effort jobs to give way."""
        if job.resources.is_cpu:
            return  # CPU ranks take no GPUs: nothing to queue for
        if self._spark is None and POOL_TAG in job.tags:
            self.place(job)  # a resumed job queues on its pool's cluster
        capacity = self.capacity()
        self.seats.await_turn(
            job, capacity.master, capacity.total_gpus, self.capacity_wait_of(job) if wait is None else wait
        )

    def preemption_request(self, job: JobSpec) -> str | None:
        return self.seats.request(job)

    def give_way(self, job: JobSpec) -> None:
        self.seats.give_way(job)

    def end_job(self, job: JobSpec) -> None:
        self.seats.end(job)

    def _placement(self, job: JobSpec, capacity: SparkCapacity | None = None) -> RankPlacement:
        capacity = capacity or self.capacity()
        return plan_placement(
            job.resources.gpus,
            job.resources.gpu_type or "cpu",
            capacity,
            gpus_per_node=self.gpus_per_node or job.resources.gpus_per_node,
            max_cpu_ranks_per_node=settings().max_cpu_ranks,
        )

    def place(self, job: JobSpec) -> JobSpec:
        """Opens the session of the job's pool (without a session given and with a pools file)
        and tags the job with the pool's name, whose usage policy applies to it
        (:func:`sparkgpu.usage.enforce_pool_policy`); idempotent."""
        if self._spark is not None and self.pool is None:
            return job  # the caller's own session
        pool = pool_for_job(job, self.pool_name)
        if pool is None:
            return job
        if pool != self.pool:
            self._spark, self.pool = pool_session(pool), pool
        return dataclasses.replace(job, tags={**job.tags, POOL_TAG: pool.name})

    def resolve(self, job: JobSpec) -> ResolvedJob:
        if job.resources.gpu_type is None:
            raise ConfigurationError("remote jobs need a gpu_type, e.g. gpu_type='A10' (or 'cpu' for CPU ranks)")
        job = self.place(job)
        check_key_transport(self.spark, job.job_id)  # before anything starts
        if self.staging_url:
            user_prefix(self.staging_url, settings().user)  # a user name no prefix can hold fails here
        capacity = self.capacity()
        if job.resources.elastic and not job.resources.is_cpu:
            job, placement = self._elastic_placement(job, capacity)
        else:
            placement = self._placement(job, capacity)
        simulated = capacity.simulated and not job.resources.is_cpu
        # Devices are per node and known only at launch: each task's GPU addresses.
        return ResolvedJob(dataclasses.replace(job, devices=(), simulated=simulated), placement)

    def _elastic_placement(self, job: JobSpec, capacity: SparkCapacity) -> tuple[JobSpec, RankPlacement]:
        """The placement of an elastic job, and the job with its node shape fixed, so that every
        attempt, whatever its size, runs on nodes of the same GPUs. A cluster short of nodes now
        (one lost, not yet replaced) takes the job when it could run ``min_gpus`` of it.

        Raises:
            CapacityError: not even ``min_gpus`` fit the cluster.
            ConfigurationError: ``min_gpus`` is not a whole number of the chosen nodes.
        """
        low = job.resources.min_gpus
        assert low is not None
        try:
            placement = self._placement(job, capacity)
        except CapacityError:
            smallest = self._placement(job.resized(low), capacity)  # raises when even min_gpus never fit
            per_node = smallest.gpus_per_node
            if job.resources.gpus % per_node:
                raise
            placement = RankPlacement(job.resources.gpus // per_node, per_node, per_node)
        per_node = placement.gpus_per_node
        if low % per_node:
            raise ConfigurationError(
                f"min_gpus={low} is not a whole number of this cluster's {per_node}-GPU nodes; ask for a multiple "
                f"of {per_node}"
            )
        resources = dataclasses.replace(job.resources, gpus_per_node=per_node)
        return dataclasses.replace(job, resources=resources), placement

    def available_gpus(self, job: JobSpec) -> int | None:
        """The GPUs of the cluster's live executors (probed anew), in whole nodes of the job's
        shape, less those other queued jobs hold; at most the job's. Executors whose every core
        is busy count as present (the probe cannot reach them)."""
        if not job.resources.elastic or job.resources.is_cpu:
            return None
        capacity = self.capacity(refresh=True)
        per_node = job.resources.gpus_per_node or 1
        nodes = capacity.node_slots(per_node)
        free = nodes * per_node - self.seats.held_by_others(job)
        return max(0, min(job.resources.gpus, free // per_node * per_node))

    def _store_prefix(self, run_dir: RunDir) -> str:
        """The staging store prefix that holds the job's folder: ``<staging_url>/<user>``."""
        assert self.staging_url
        return store_prefix(run_dir, self.staging_url, settings().user)

    def checkpoint_dir(self, run_dir: RunDir) -> str:
        if self.staging_url:  # the nodes' run dirs are scratch copies
            return f"{self._store_prefix(run_dir)}/{run_dir.job_id}/checkpoints"
        return super().checkpoint_dir(run_dir)

    # -- attempts ---------------------------------------------------------------------
    def plan(self, job, run_dir, attempt, env, placement: RankPlacement | None = None) -> LaunchPlan:
        placement = placement if placement is not None else self._placement(job)
        where = (
            f"<node copy of {self._store_prefix(run_dir)}/{run_dir.job_id}>" if self.staging_url else str(run_dir.path)
        )
        commands = tuple(
            tuple(
                build_command(
                    "python",
                    where,
                    attempt=attempt,
                    nnodes=placement.nodes,
                    node_rank=node,
                    nproc=placement.ranks_per_node,
                    master_addr="<host of node 0>",
                    master_port=0,
                    shutdown_grace=job.policy.shutdown_grace,
                )
            )
            for node in range(placement.nodes)
        )
        shown = {**env, "SPARK_TASK_GPUS": str(placement.gpus_per_node)}
        return LaunchPlan(
            backend=self.name,
            attempt=attempt,
            nodes=placement.nodes,
            ranks_per_node=placement.ranks_per_node,
            devices=(),
            commands=commands,
            env=shown,
        )

    @staticmethod
    def _job_key(run_dir: RunDir) -> bytes:
        if not run_dir.key:
            raise ConfigurationError(f"job {run_dir.job_id} has no signing key on this client; launch it again")
        return run_dir.key

    def _frame(self, job: JobSpec, run_dir: RunDir, attempt: int, env: dict, placement: RankPlacement, handle=None):
        launch = NodeLaunch(
            run_dir=str(run_dir.path),
            attempt=attempt,
            nnodes=placement.nodes,
            nproc=placement.ranks_per_node,
            env=dict(env),
            key=self._job_key(run_dir),
            shutdown_grace=job.policy.shutdown_grace,
            client_timeout=self.client_timeout,
            store_url=self._store_prefix(run_dir) if self.staging_url else None,
            peer_timeout=self.node_timeout,
            log_ranks=job.log_ranks,
            control_interval=self.control_interval,
            threads_per_rank=None if job.uses_cuda else threads_per_rank(placement.ranks_per_node),
            preflight=job.policy.preflight,
            simulated=job.simulated or bool(self.simulated),
            spares=handle.spares if handle is not None else 0,
            avoid=handle.avoid if handle is not None else (),
        )
        task = functools.partial(run_node, launch)
        tasks = placement.nodes + launch.spares
        frame = self.spark.range(0, tasks, 1, tasks)
        if placement.gpus_per_node == 0:
            return frame.mapInArrow(task, NODE_DDL, barrier=True)
        from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

        requests = TaskResourceRequests().cpus(1).resource("gpu", float(placement.gpus_per_node))
        profile = ResourceProfileBuilder().require(requests).build
        with _active(self.spark):
            _ = profile.id  # Connect registers the profile on the server now, from this thread
        return frame.mapInArrow(task, NODE_DDL, barrier=True, profile=profile)

    def submit(self, job, run_dir, attempt, env, placement: RankPlacement | None = None) -> SparkAttempt:
        if self._spark is None and POOL_TAG in job.tags:
            self.place(job)  # a resumed job goes back to its pool
        self._reconnect_if_closed()
        if placement is None:  # a resumed or resized job is placed anew
            placement = (
                self._elastic_placement(job, self.capacity())[1] if job.resources.elastic else self._placement(job)
            )
        avoid, spares = self._stand_ins(job, placement)
        previous = self.last_attempt
        after_loss = previous is not None and previous.job.job_id == job.job_id and bool(previous.report.lost)
        self.seats.resize(job)
        run_dir.prepare_attempt(attempt)
        run_dir.file(RunLayout.spark(attempt)).mkdir(parents=True, exist_ok=True)
        record_session(self.spark, run_dir)
        now = time.monotonic()
        handle = SparkAttempt(
            attempt=attempt,
            job=job,
            run_dir=run_dir,
            placement=placement,
            tag=f"sparkgpu-{job.job_id}-{attempt}",
            submitted_at=now,
            submitted_wall=time.time(),
            next_notice=now + 5.0,
            mirror=self._mirror(run_dir),
            spares=spares,
            avoid=avoid,
        )
        if avoid:
            report(
                f"attempt {attempt} leaves out executor(s) {', '.join(avoid)}, which failed their pre-flight check; "
                f"{spares} spare task(s) stand in",
                out=self.stream,
            )
        self._beat(handle)
        if handle.mirror is not None:
            handle.mirror.sync(attempt)  # the first heartbeat is up before any node looks for it
            handle.mirror.start(
                attempt,
                self.sync_interval,
                followed=self._followed_nodes(job, placement),
                nodes=placement.nodes,
                ranks_per_node=placement.ranks_per_node,
                live=job.log_ranks != (),
                quiet_interval=self.control_interval,
            )
        with _active(self.spark):
            frame = self._frame(job, run_dir, attempt, env, placement, handle)
        handle.thread = threading.Thread(
            target=self._run_action, args=(handle, frame, after_loss), daemon=True, name=f"sparkgpu-{handle.tag}"
        )
        handle.thread.start()
        threading.Thread(target=self._heartbeat, args=(handle,), daemon=True, name=f"{handle.tag}-heartbeat").start()
        self.last_attempt = handle
        return handle

    def _cluster(self) -> str:
        """This session's cluster, as the executors that failed pre-flight are kept by."""
        return connect_url(self.spark) or f"session-{id(self.spark)}"

    def _stand_ins(self, job: JobSpec, placement: RankPlacement) -> tuple[tuple[str, ...], int]:
        """The executors the attempt leaves out and its spare tasks (:func:`exclusions.stand_ins`).

        When the cluster is short of node slots without them, waits for capacity (the job's
        :meth:`capacity_wait_of`, unbilled: no task runs): an executor replaced (a new id), one
        whose exclusion ends, or one added ends the wait. Raises the
        :class:`~sparkgpu.errors.PreflightError` when it runs out.
        """
        limit = self.capacity_wait_of(job)
        deadline, told = time.monotonic() + limit, False
        while True:
            if not job.policy.preflight or not exclusions.excluded(self._cluster()):
                return (), 0
            try:
                return exclusions.stand_ins(
                    self._cluster(), self.capacity(refresh=True), placement.gpus_per_node, placement.nodes, job.job_id
                )
            except PreflightError as short:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PreflightError(f"{short} (waited {limit:g}s for capacity: capacity_wait=)") from None
                if not told:
                    report(f"waiting up to {limit:g}s for capacity (capacity_wait=; not billed): {short}", self.stream)
                    told = True
                time.sleep(min(_SHORT_POLL_SECONDS, left))

    def _exclude_bad(self, handle: SparkAttempt, rows: list[dict]) -> None:
        """Keeps the executors whose node task failed its pre-flight check out of the next attempts."""
        for row in rows:
            if row["state"] != NodeState.BAD_NODE:
                continue
            kept = exclusions.exclude(self._cluster(), str(row["executor"]), str(row["host"]), row.get("detail") or "")
            self.watch.note(
                handle,
                f"{kept.where} failed its pre-flight check ({kept.cause}) and started no rank; this client's "
                f"attempts on the cluster leave it out for {settings().preflight_exclude_seconds:g}s "
                "(SPARKGPU_PREFLIGHT_EXCLUDE)",
            )

    @staticmethod
    def _followed_nodes(job: JobSpec, placement: RankPlacement) -> tuple[int, ...]:
        """The nodes whose logs the client reads while the attempt runs: node 0 (rank 0's logs and
        tracking records) and the nodes of the ranks it echoes (``log_ranks=``); the others' when it ends."""
        if job.log_ranks is None:
            return tuple(range(placement.nodes))
        per_node = max(1, placement.ranks_per_node)
        return tuple(sorted({0, *(r // per_node for r in job.log_ranks if r // per_node < placement.nodes)}))

    # -- resuming in another process ---------------------------------------------------
    def job_written(self, job: JobSpec, run_dir: RunDir) -> None:
        """Keeps the Connect URL and this backend's settings in the run dir at once: a client that
        dies while its job waits in the cluster's queue leaves a job that ``sparkgpu resume`` can
        continue, and a detached job's supervisor runs it as this backend would."""
        record_session(self.spark, run_dir, self.rebuild_options())

    def rebuild_options(self) -> dict:
        """This backend's settings, as keywords that rebuild it in another process (JSON)."""
        options = {
            "gpus_per_node": self.gpus_per_node,
            "simulated": self.simulated,
            "client_timeout": self.client_timeout,
            "node_timeout": self.node_timeout,
            "control_interval": self.control_interval,
            "staging_url": self.staging_url or "",
            "pool": self.pool_name,
        }
        if self._wait_timeout_given:
            options["wait_timeout"] = self.wait_timeout
        return options

    def detach_refusal(self) -> str | None:
        """Why this backend's jobs cannot be supervised by processes of their own; ``None`` when they can."""
        return detach_refusal(self._spark)

    @classmethod
    def reattach(cls, run_dir: RunDir) -> SparkBackend:
        """A backend for the job in ``run_dir``, with the settings it was written with, that reconnects
        to the Connect server it ran on when this process has no session and
        ``SPARKGPU_SPARK_REMOTE`` is unset."""
        return cls(remote=recorded_remote(run_dir), **recorded_options(run_dir))

    @classmethod
    def stop_lost_attempts(cls, job: JobSpec, run_dir: RunDir, attempts: list[int]) -> None:
        """Asks the nodes of ``attempts`` to stop, and waits (bounded) until they did.

        Spark nodes run on until they miss their client's heartbeat (minutes), unlike local ranks,
        which die with their client. With a staging store the nodes read the cancel marker from
        the store, which only a live client mirrors: they stop on the lost heartbeat instead.
        """
        for attempt in attempts:
            if run_dir.file(RunLayout.spark(attempt)).is_dir():
                run_dir.write_control(
                    run_dir.file(RunLayout.spark_cancel(attempt)), b"its client is gone; the job was taken over\n"
                )
        deadline = time.monotonic() + job.policy.shutdown_grace + cls.node_stop_margin
        while any(run_dir.nodes_without_end(a) for a in attempts) and time.monotonic() < deadline:
            time.sleep(0.2)

    def session_gone(self) -> bool:
        """Whether the Connect server closed this backend's session (it restarted): its executors,
        and the ranks with them, ended with the old server."""
        return self._spark is not None and connection_closed(self._spark)

    def _reconnect_if_closed(self) -> None:
        """Opens a new session to the same Connect server when the last one was closed under it.

        A Connect server that restarted refuses the sessions it had ("Please reconnect"), and
        pyspark closes them for good; the next attempt runs on a new one. The caller's own
        session stays as it was (closed: theirs to replace).

        Raises:
            ConfigurationError: a closed session that is not a Connect session, or the
                server does not answer (the message says how to continue the job).
        """
        if self._spark is None or not connection_closed(self._spark):
            return
        url = full_url(self._spark)
        if url is None:
            raise ConfigurationError(
                "the Spark session of this job was stopped; start a new one, then "
                "`sparkgpu resume JOB_ID` continues the job from its last checkpoint"
            )
        report(
            f"the Spark Connect server{_at(self._spark)} closed this session (it restarted?); "
            "opening a new one for the next attempt",
            out=self.stream,
        )
        try:
            self._spark = new_connect_session(url)
        except Exception as exc:  # whatever gRPC raises for a server that is not back
            raise ConfigurationError(
                f"cannot reconnect to the Spark Connect server{_at(self._spark)} ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); once it is back, `sparkgpu resume JOB_ID` "
                "continues the job from its last checkpoint"
            ) from exc

    def _mirror(self, run_dir: RunDir) -> ClientMirror | None:
        """The job's mirror on the staging store; its payload is uploaded the first time (resumed jobs too)."""
        if not self.staging_url:
            return None
        mirror = self._mirrors.get(run_dir.job_id)
        if mirror is None:
            mirror = ClientMirror(run_dir, StagingStore(self._store_prefix(run_dir), run_dir.job_id), out=self.stream)
            mirror.upload_payload()
            self._mirrors[run_dir.job_id] = mirror
        return mirror

    def _last_pull(self, handle: SparkAttempt) -> None:
        """Stops the attempt's background sync and pulls what its nodes left (their results)."""
        if handle.mirror is None:
            return
        error = handle.mirror.finish(handle.attempt)
        if error is not None:
            self.watch.note(
                handle,
                f"the last download of this attempt's files from the staging store "
                f"{handle.mirror.store.url} failed ({type(error).__name__}: {error}); its results "
                "may be there still",
            )

    def _run_action(self, handle: SparkAttempt, frame, after_loss: bool = False) -> None:
        self.spark.addTag(handle.tag)
        try:
            if after_loss and not self._await_slots(handle):
                raise CapacityError("the attempt was cancelled while the lost node was being replaced")
            handle.rows = frame.collect()
        except BaseException as exc:  # read by poll() in the supervisor's thread
            handle.error = exc
        finally:
            self.spark.removeTag(handle.tag)
            handle.finished.set()

    def _beat(self, handle: SparkAttempt, count: int = 0) -> None:
        handle.run_dir.write_control(
            handle.run_dir.file(RunLayout.client_heartbeat(handle.attempt)), f"{count}\n".encode()
        )

    def _heartbeat(self, handle: SparkAttempt) -> None:
        count = 0
        every = min(_HEARTBEAT_SECONDS, (self.client_timeout or 4 * _HEARTBEAT_SECONDS) / 4)
        while not handle.finished.wait(every):
            count += 1
            try:
                self._beat(handle, count)
            except OSError as exc:  # a flaky shared volume must not stop the job; the nodes allow gaps
                report(f"could not write the heartbeat: {exc}", out=self.stream)

    def poll(self, handle: AttemptHandle) -> int | None:
        assert isinstance(handle, SparkAttempt), "the Spark backend polls only its own attempts"
        if not handle.finished.is_set():
            now = time.monotonic()
            if now >= handle.next_check:
                handle.next_check = now + 0.5
                self._check_waiting(handle, now)
                if handle.nodes_started and self.watch.find_lost(handle):
                    self.watch.stop_for_lost(handle)
            return None
        if handle.exit_code is None:
            self._last_pull(handle)
            handle.exit_code = self._outcome(handle)
        return handle.exit_code

    def progress_source(self, handle: AttemptHandle, run_dir: RunDir) -> SparkProgress:
        """The ranks' progress as node 0 writes it into the attempt's state (the nodes' beats bring it
        there); their stacks asked of the nodes, within node 0's control interval and a beat."""
        assert isinstance(handle, SparkAttempt)
        return SparkProgress(handle, wait=self.control_interval + (self.node_timeout or 10.0) / 4 + DUMP_WAIT + 5)

    def ranks_started_at(self, handle: AttemptHandle) -> float | None:
        """When the attempt's nodes got their GPUs and started (Unix time); ``None`` while they wait.

        The supervisor bills the attempt and counts its runtime cap from here, not from
        ``submit``: the barrier stage may wait up to ``wait_timeout`` for busy GPUs.
        """
        assert isinstance(handle, SparkAttempt), "the Spark backend reads only its own attempts"
        if handle.started_at is None:
            self._find_start(handle)
        return handle.started_at

    def _find_start(self, handle: SparkAttempt) -> None:
        """Reads the start markers the barrier tasks write as they claim their node; only genuine
        ones (sealed under the job key) count, so a planted marker neither starts the bill nor
        passes for a started node."""
        started = handle.run_dir.started_nodes(handle.attempt)
        if not started:
            return
        seen = time.time()
        times = []
        for info in started.values():
            try:
                times.append(float(info["started_at"]))
            except (KeyError, TypeError, ValueError):
                continue
        # An executor's clock may be off: never earlier than the submit, never later than seen.
        handle.started_at = min(max(min(times, default=seen), handle.submitted_wall), seen)
        handle.nodes_started = True
        self.seats.started(handle.job)

    def _await_slots(self, handle: SparkAttempt) -> bool:
        """After a lost node: holds the attempt's Spark job back until the cluster has slots for
        every node again; ``False`` when the attempt was cancelled meanwhile.

        Spark compares a barrier stage's tasks with the cluster's slots when the stage is
        submitted and, when short, compares again only every
        ``spark.scheduler.barrier.maxConcurrentTasksCheck.interval`` (15 s): an attempt submitted
        while the lost executor is being replaced would start up to that long after the
        replacement came. The attempt counts as submitted and waiting (unbilled, cancelled at
        its capacity wait as any waiting attempt) while the executors are probed, a small job
        about a second apart, until their slots suffice.
        """
        placement = handle.placement
        probe_timeout = max(self.wait_timeout, _SLOT_PROBE_SECONDS)

        def slots() -> int:
            try:
                return self.capacity(refresh=True, probe_timeout=probe_timeout).node_slots(placement.gpus_per_node)
            except CapacityError:  # no executor answered: none is left until the replacement comes
                return 0

        while not handle.cancelled and slots() < placement.nodes + handle.spares:
            time.sleep(_SLOT_POLL_SECONDS)
        return not handle.cancelled

    def _check_waiting(self, handle: SparkAttempt, now: float) -> None:
        """Says when the nodes wait for GPUs, and gives up after :meth:`capacity_wait_of` the job."""
        if handle.nodes_started:
            return
        self._find_start(handle)
        if handle.nodes_started:
            return
        waited = now - handle.submitted_at
        placement = handle.placement
        what = (
            f"{placement.nodes} node(s) x {placement.gpus_per_node} {handle.job.resources.gpu_type}"
            if placement.gpus_per_node
            else f"{placement.nodes} free task slot(s)"
        )
        limit = self.capacity_wait_of(handle.job)
        if waited > limit:
            self.cancel(handle, handle.job.policy.shutdown_grace)
            raise CapacityError(
                f"gave up after waiting {waited:.0f}s for {what} on the Spark cluster: they stayed busy with other "
                f"jobs or were not replaced; try again later, ask for fewer GPUs, or raise capacity_wait= (now "
                f"{limit:g}s; SPARKGPU_SPARK_WAIT_TIMEOUT for jobs without max_runtime)"
            )
        if now >= handle.next_notice:
            report(
                f"waiting for {what} on the Spark cluster ({waited:.0f}s so far, giving up after "
                f"{limit:g}s; not billed); other jobs may hold them, or a lost node is being replaced",
                out=self.stream,
            )
            handle.next_notice = now + 30.0

    def _outcome(self, handle: SparkAttempt) -> int:
        """Exit status of a finished attempt; what Spark alone knows goes into the attempt's report."""
        rd = handle.run_dir
        rows = [r for r in handle.nodes if r["state"] != NodeState.SPARK_RETRY]
        if handle.error is not None:
            if handle.cancelled:
                self.watch.write_report(handle, rows)
                return 1
            if not handle.report.lost:  # not the interrupt that followed a lost node
                text = "\n".join(str(handle.error).splitlines()[:40])
                self.watch.note(handle, f"the Spark job of this attempt failed: {type(handle.error).__name__}: {text}")
            self.watch.stop_outliving_nodes(handle)  # its interrupt also tells whether the session is gone
            if self.session_gone():
                self.watch.note(
                    handle,
                    f"the Spark Connect server{_at(self.spark)} restarted or closed this session "
                    "while the attempt ran; its executors, and the ranks with them, ended with it. "
                    "A restart (max_restarts=) opens a new session to the same server; "
                    f"`sparkgpu resume {handle.job.job_id}` continues the job from its last checkpoint",
                )
            self.watch.write_report(handle, rows)
            return 1
        self._exclude_bad(handle, rows)
        blind = [r for r in rows if r["state"] == NodeState.NO_RUN_DIR]
        if blind:
            where = ", ".join(f"executor {r['executor']} on {r['host']}" for r in blind)
            self.watch.note(
                handle,
                f"{where} cannot see the run dir {rd.path}: set SPARKGPU_STAGING_ROOT to a folder "
                "mounted under the same path on the client and on every executor (NFS, or a "
                "FUSE-mounted volume)",
            )
        for state, problem in (
            (NodeState.STORE_UNREACHABLE, "cannot read or write this job's files on"),
            (NodeState.STORE_PUSH_FAILED, "could not upload the results of its ranks to"),
        ):
            if lost := [r for r in rows if r["state"] == state]:
                where = ", ".join(f"executor {r['executor']} on {r['host']}" for r in lost)
                scheme = scheme_of(self.staging_url) if self.staging_url else "file"
                fix = (
                    "mount that folder on every executor"
                    if scheme == "file"
                    else f"every executor needs its filesystem ({install_command(scheme)}) and credentials for it"
                )
                self.watch.note(
                    handle,
                    f"{where} {problem} the staging store {self.staging_url}: {fix}; the executor's "
                    "stderr log (Spark UI) has the error",
                )
        if len(rows) < len(handle.nodes):
            # Spark lost a task or an executor and re-ran the barrier stage; the re-run tasks
            # started nothing, but the first run's ranks may live on: stop them, name the lost.
            self.watch.stop_outliving_nodes(handle)
            if not handle.report.lost:
                self.watch.note(
                    handle,
                    "Spark lost a task or an executor of this attempt and re-ran its barrier stage; "
                    "the nodes did not start the ranks again (restarts are set with max_restarts=). "
                    "The executor logs in the Spark UI say why it was lost.",
                )
        self.watch.write_report(handle, rows)
        # Tasks that held no node (an executor left out, a node short) started nothing: no status of the job's.
        return max((abs(r["exit_code"]) for r in rows if r["node"] >= 0), default=1)

    def cancel(self, handle: AttemptHandle, grace: float) -> None:
        assert isinstance(handle, SparkAttempt), "the Spark backend cancels only its own attempts"
        if handle.finished.is_set():
            self._last_pull(handle)  # the supervisor reads the results next, without another poll
            return
        handle.cancelled = True
        # First the polite way: every node SIGTERMs its agent, which gives the ranks `grace`.
        handle.run_dir.write_control(
            handle.run_dir.file(RunLayout.spark_cancel(handle.attempt)), b"cancelled by the client\n"
        )
        sync_now(handle)
        if not handle.nodes_started:
            self._find_start(handle)  # also tells the supervisor when they started, for billing
        # Node 0 looks at the cancel marker every control_interval; then the ranks get `grace`.
        if not handle.nodes_started or not handle.finished.wait(grace + self.control_interval + 10):
            self.spark.interruptTag(handle.tag)  # Spark kills the Python workers; agents and ranks follow
            handle.finished.wait(60)
        self._last_pull(handle)
        self.watch.write_report(handle, [r for r in handle.nodes if r["state"] != NodeState.SPARK_RETRY])


def _at(spark) -> str:
    url = connect_url(spark)
    return f" at {url}" if url else ""
