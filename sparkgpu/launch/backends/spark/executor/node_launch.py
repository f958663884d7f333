"""What a Spark node task is handed: the attempt's launch, pickled into the task closure."""

from __future__ import annotations

import dataclasses

from sparkgpu.launch.staging.mirror import CONTROL_INTERVAL

__all__ = ["NodeLaunch", "CONTROL_INTERVAL"]


@dataclasses.dataclass(frozen=True)
class NodeLaunch:
    """Everything a node task needs; pickled into the task closure (so the key never touches disk).

    Attributes:
        run_dir: The job's run directory on the client: reachable from the executors under
            this path, unless ``store_url`` is set (then only its name, the job id, is used).
        attempt: Attempt number.
        nnodes: Number of nodes (barrier tasks).
        nproc: Ranks per node.
        env: Environment for the ranks.
        key: The job's signing key, handed to the node's agent on its stdin
            (:mod:`sparkgpu.rundir.key_handover`).
        shutdown_grace: Seconds ranks get after SIGTERM.
        client_timeout: Seconds without a client heartbeat after which node 0 stops the
            attempt's ranks (the client died); ``None`` to keep running.
        threads_per_rank: ``OMP_NUM_THREADS`` for CPU ranks.
        store_url: The staging store (``SPARKGPU_STAGING_ROOT`` as an fsspec URL), or ``None``
            when the executors share the client's run dir.
        peer_timeout: Seconds a node may go without a beat to node 0 (and without saying how it
            ended) before node 0 counts it lost and stops the others; the same silence of node 0
            makes a node count node 0 lost. ``None`` to not watch nodes.
        log_ranks: Ranks whose output the client echoes live (``None``: all): with a staging
            store, their logs ship every few seconds, the others' at the mirror's slower interval.
        control_interval: Most seconds between two looks of node 0 at the client's files (a
            cancel or stop request reaches the ranks within about this long; with a staging
            store, each look is one request).
        preflight: Each task runs the node's pre-flight check before the barrier's exchange.
        simulated: The GPUs are simulated (their ranks run on CPU): no GPU check.
        spares: Tasks beyond ``nnodes`` in the barrier stage, to stand in for executors that
            failed the check before (:mod:`~sparkgpu.launch.backends.spark.executor.seating`).
        avoid: Those executors' ids: a task on one starts nothing.
    """

    run_dir: str
    attempt: int
    nnodes: int
    nproc: int
    env: dict
    key: bytes
    shutdown_grace: float
    client_timeout: float | None
    threads_per_rank: int | None = None
    store_url: str | None = None
    peer_timeout: float | None = None
    log_ranks: tuple[int, ...] | None = ()
    control_interval: float = CONTROL_INTERVAL
    preflight: bool = True
    simulated: bool = False
    spares: int = 0
    avoid: tuple[str, ...] = ()

    def __repr__(self) -> str:  # keeps the key out of Spark's logs and error messages
        return f"NodeLaunch(run_dir={self.run_dir!r}, attempt={self.attempt}, nnodes={self.nnodes}, nproc={self.nproc})"
