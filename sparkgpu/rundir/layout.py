"""The names of a run directory's files: everything a worker needs, and everything it leaves behind.

:class:`RunLayout` names every file of a run dir, relative to it; nothing else spells those
names (:class:`~sparkgpu.rundir.directory.RunDir` is one run dir on a machine). Layout of
``<staging_root>/<job_id>/``::

    _air.py              generated entrypoint: ``python _air.py`` runs one rank ("air" after the
                         AI Runtime, ``databricks.air``, whose calls these jobs serve; the
                         name is a convention, nothing depends on it)
    _hydrate.py          the environment's rehydration, when the job ships its environment
    _errors.py           sparkgpu's errors beside it, which the rehydration raises
    spec.json            the JobSpec
    payload.pkl          cloudpickled function, arguments and worker callbacks
    payload.sig          HMAC-SHA256 of _air.py + spec.json + payload.pkl (key never stored)
    state.json           the supervisor's state (attempts, status)
    cancel-request       written by another process to cancel the job
    sweep-stop           a sweep asks its trial job to stop (pruned), sealed (sparkgpu.sweeps)
    supervision.json     a detached job's keeper process and the caller's sys.path, sealed
    supervisor.log       what a detached job's keeper and supervisors report
    checkpoints/         shared by all attempts
    tracking/            the job's tracking run and the ranks' spooled records
    attempts/<k>/logs/rank-<r>.log      output of rank r in attempt k (agent-<n>.log: node n's agent)
    attempts/<k>/elastic/               torch elastic's own logs of the attempt's agents
    attempts/<k>/results/rank-<r>.pkl   its return value (or rank-<r>.error.pkl), signed; beside it
                                        rank-<r>.checkpoints-on-sigterm when SIGTERM asks it to checkpoint,
                                        and rank-<r>.models/ the models of a return value that did not pickle
    attempts/<k>/env-rank-<r>.json      what rehydrating the shipped environment cost rank r
    attempts/<k>/node-<n>.json          exit codes of the node's ranks, from the agent
    attempts/<k>/report.json            the attempt's report (per node: state, exit, cause)
    attempts/<k>/STOP                   the supervisor asks the ranks to checkpoint and stop
    attempts/<k>/progress/rank-<r>      rank r's progress record, shared memory (sparkgpu.rundir.progress)
    attempts/<k>/stacks/rank-<r>.txt    rank r's Python stacks, dumped when the supervisor asks
    attempts/<k>/flight-recorder/rank-<r>.json  torch's flight recorder of rank r (its last collectives), then too
    attempts/<k>/arrivals/rank-<r>.json   rank r's latest collectives and when it reached each (stragglers)
    attempts/<k>/stragglers.json        the ranks named as stragglers in the attempt, with their figures
    attempts/<k>/hang.json, hang.txt    a hang's diagnosis, and it with every rank's stacks
    attempts/<k>/trial-reports.json     a sweep trial's intermediate values, from rank 0 (runtime.report)
    attempts/<k>/spark/                 Spark nodes' start and end markers, beats; the client's
                                        cancel marker, heartbeat and stacks request (DUMP); node 0's
                                        state (with its ranks' progress and trial reports), and the
                                        stacks each node's ranks dumped on request (stacks-rank-<r>.txt,
                                        flight-recorder-rank-<r>.json)

With a staging store (``SPARKGPU_STAGING_ROOT`` an fsspec URL) the same layout is mirrored at
``<url>/<user>/<job_id>/`` and each Spark node works on a scratch copy (:mod:`sparkgpu.launch.staging.mirror`);
checkpoints then live on the store only.
"""

from __future__ import annotations

import re

from sparkgpu.rundir.signature import SIGNATURE_FILE, SIGNED_CORE

__all__ = ["RunLayout"]

_ENV_REPORT = re.compile(r"^env-rank-(\d+)\.json$")
_NODE_EXITS = re.compile(r"^node-(\d+)\.json$")
_NODE_MARKER = re.compile(r"^node-(\d+)\.(started|ended)$")


class RunLayout:
    """The names of a run dir's files, relative to it and ``/``-separated (see the module docstring).

    The one place they are spelled: the client, the agents, the ranks, the Spark nodes and
    the staging mirror all ask here, so a run dir read on one machine and a copy of it on
    another agree.
    """

    # The signed files are spelled where the worker checks them, with the standard library alone.
    ENTRYPOINT, SPEC, PAYLOAD = SIGNED_CORE
    SIGNATURE = SIGNATURE_FILE
    HYDRATE = "_hydrate.py"  # sparkgpu.env.hydrate, shipped beside _air.py with the environment
    ERRORS = "_errors.py"  # sparkgpu.errors, shipped beside it (hydration raises its classes; spelled there too)
    STATE = "state.json"
    CANCEL_REQUEST = "cancel-request"
    SWEEP_STOP = "sweep-stop"  # a sweep's request that its trial job stop (pruned), sealed (sparkgpu.sweeps)
    SUPERVISION_LOCK = "supervision.lock"  # flocked by the process that supervises the job
    SUPERVISION = "supervision.json"  # a detached job's keeper, sealed (launch.client.detached)
    SUPERVISOR_LOG = "supervisor.log"  # a detached job's keeper and supervisors write here
    CHECKPOINTS = "checkpoints"
    STAGING_PREFIX = "staging-prefix"  # the staging store prefix that holds the job's folder (client only)
    ATTEMPTS = "attempts"
    REPORT = "report.json"  # in an attempt's folder
    HANG = "hang.json"  # in an attempt's folder: a hang's diagnosis (launch.client.progress_watch)
    HANG_STACKS = "hang.txt"  # in an attempt's folder: the diagnosis and every rank's stacks
    RAY_CLUSTER = "cluster.json"  # in an attempt's ray/ folder
    STOP = "STOP"  # in an attempt's folder: the supervisor asks the ranks to checkpoint and stop
    TRACKING = "tracking"  # the job's tracking run and the ranks' spooled records
    TRACKING_RUN_FILE = "run.json"  # in TRACKING: the job's tracking run
    TRACKING_RECORDS_DIR = "records"  # in TRACKING: the ranks' spooled records
    TRACKING_RUN = f"{TRACKING}/{TRACKING_RUN_FILE}"
    TRACKING_RECORDS = f"{TRACKING}/{TRACKING_RECORDS_DIR}"
    #: The signed files every run dir has, in the order the signature covers them.
    SIGNED = SIGNED_CORE
    SPARK = "spark"  # the folder of an attempt's Spark markers
    SPARK_CANCEL = "CANCEL"
    SPARK_DUMP = "DUMP"  # the client asks a hung attempt's nodes for their ranks' stacks
    SPARK_CLIENT_HEARTBEAT = "client.heartbeat"
    SPARK_CONTROL = "control"  # the client's control files in one object, on a staging store
    SPARK_STATE = "state"  # node 0's summary of the attempt (sparkgpu.launch.backends.spark.executor.hub)

    @staticmethod
    def payload_files(spec: dict) -> list[str]:
        """The files a node needs to run the job: the signed ones and their signature."""
        return [*RunLayout.SIGNED, RunLayout.SIGNATURE, *sorted(spec.get("signed_files", []))]

    @staticmethod
    def attempt(attempt: int | str) -> str:
        return f"{RunLayout.ATTEMPTS}/{attempt}"

    @staticmethod
    def logs(attempt: int | str) -> str:
        return f"{RunLayout.attempt(attempt)}/logs"

    @staticmethod
    def log_stream(attempt: int | str, node: int) -> str:
        """The name of node ``node``'s stream of log bundles on a staging store (:mod:`sparkgpu.launch.staging.log_bundles`)."""
        return f"{RunLayout.logs(attempt)}/node-{node}"

    @staticmethod
    def elastic(attempt: int | str) -> str:
        """The folder of torch elastic's own logs for the attempt (its agents' ``log_dir``)."""
        return f"{RunLayout.attempt(attempt)}/elastic"

    @staticmethod
    def results(attempt: int) -> str:
        return f"{RunLayout.attempt(attempt)}/results"

    @staticmethod
    def rank_log(attempt: int | str, rank: int | str) -> str:
        return f"{RunLayout.logs(attempt)}/rank-{rank}.log"

    @staticmethod
    def agent_log(attempt: int, node: int) -> str:
        return f"{RunLayout.logs(attempt)}/agent-{node}.log"

    @staticmethod
    def result(attempt: int, rank: int) -> str:
        return f"{RunLayout.results(attempt)}/rank-{rank}.pkl"

    @staticmethod
    def error(attempt: int, rank: int) -> str:
        return f"{RunLayout.results(attempt)}/rank-{rank}.error.pkl"

    @staticmethod
    def preempted(attempt: int, rank: int) -> str:
        return f"{RunLayout.results(attempt)}/rank-{rank}.preempted"

    @staticmethod
    def saved_models(attempt: int, rank: int) -> str:
        """The folder where rank ``rank`` saves the models of a return value that does not pickle."""
        return f"{RunLayout.results(attempt)}/rank-{rank}.models"

    @staticmethod
    def checkpoints_on_sigterm(attempt: int, rank: int) -> str:
        """Written by a rank whose SIGTERM asks for a checkpoint (its launcher kills it after a peer's crash)."""
        return f"{RunLayout.results(attempt)}/rank-{rank}.checkpoints-on-sigterm"

    @staticmethod
    def env_report(attempt: int | str, rank: int | str) -> str:
        return f"{RunLayout.attempt(attempt)}/env-rank-{rank}.json"

    @staticmethod
    def env_report_rank(name: str) -> int | None:
        """The rank whose environment report is the file ``name`` of an attempt's folder, or ``None``."""
        match = _ENV_REPORT.match(name)
        return int(match.group(1)) if match else None

    @staticmethod
    def node_exits(attempt: int, node: int) -> str:
        return f"{RunLayout.attempt(attempt)}/node-{node}.json"

    @staticmethod
    def node_exits_node(name: str) -> int | None:
        """The node whose exit file is the file ``name`` of an attempt's folder, or ``None``."""
        match = _NODE_EXITS.match(name)
        return int(match.group(1)) if match else None

    @staticmethod
    def progress(attempt: int | str, rank: int | str) -> str:
        """Rank ``rank``'s progress record (:mod:`sparkgpu.rundir.progress`), on the rank's node."""
        return f"{RunLayout.attempt(attempt)}/progress/rank-{rank}"

    @staticmethod
    def stacks(attempt: int | str, rank: int | str) -> str:
        """Where rank ``rank`` dumps its threads' Python stacks when asked (SIGUSR1)."""
        return f"{RunLayout.attempt(attempt)}/stacks/rank-{rank}.txt"

    @staticmethod
    def arrivals(attempt: int | str, rank: int | str) -> str:
        """Rank ``rank``'s latest collectives with the time it reached each (straggler detection), rewritten every look."""
        return f"{RunLayout.attempt(attempt)}/arrivals/rank-{rank}.json"

    @staticmethod
    def stragglers(attempt: int | str) -> str:
        """The ranks the supervisor named as stragglers in attempt ``attempt`` (:mod:`sparkgpu.launch.client.stragglers`)."""
        return f"{RunLayout.attempt(attempt)}/stragglers.json"

    @staticmethod
    def flight_record(attempt: int | str, rank: int | str) -> str:
        """Rank ``rank``'s dump of torch's flight recorder (its last collectives), written when its stacks are asked for."""
        return f"{RunLayout.attempt(attempt)}/flight-recorder/rank-{rank}.json"

    @staticmethod
    def hang(attempt: int | str) -> str:
        return f"{RunLayout.attempt(attempt)}/{RunLayout.HANG}"

    @staticmethod
    def hang_stacks(attempt: int | str) -> str:
        return f"{RunLayout.attempt(attempt)}/{RunLayout.HANG_STACKS}"

    @staticmethod
    def report(attempt: int) -> str:
        return f"{RunLayout.attempt(attempt)}/{RunLayout.REPORT}"

    @staticmethod
    def trial_reports(attempt: int | str) -> str:
        return f"{RunLayout.attempt(attempt)}/trial-reports.json"

    @staticmethod
    def stop(attempt: int | str) -> str:
        return f"{RunLayout.attempt(attempt)}/{RunLayout.STOP}"

    @staticmethod
    def ray(attempt: int | str) -> str:
        """The folder of a Ray job's attempt: its cluster's description and logs."""
        return f"{RunLayout.attempt(attempt)}/ray"

    @staticmethod
    def ray_cluster(attempt: int | str) -> str:
        return f"{RunLayout.ray(attempt)}/{RunLayout.RAY_CLUSTER}"

    @staticmethod
    def spark(attempt: int) -> str:
        return f"{RunLayout.attempt(attempt)}/{RunLayout.SPARK}"

    @staticmethod
    def spark_cancel(attempt: int) -> str:
        return f"{RunLayout.spark(attempt)}/{RunLayout.SPARK_CANCEL}"

    @staticmethod
    def client_heartbeat(attempt: int) -> str:
        return f"{RunLayout.spark(attempt)}/{RunLayout.SPARK_CLIENT_HEARTBEAT}"

    @staticmethod
    def spark_control(attempt: int) -> str:
        return f"{RunLayout.spark(attempt)}/{RunLayout.SPARK_CONTROL}"

    @staticmethod
    def follow_request(attempt: int) -> str:
        """Ranks ``sparkgpu logs --follow`` asks the client to read live (the client's own file)."""
        return f"{RunLayout.spark(attempt)}/follow"

    @staticmethod
    def spark_state(attempt: int) -> str:
        return f"{RunLayout.spark(attempt)}/{RunLayout.SPARK_STATE}"

    @staticmethod
    def spark_dump(attempt: int) -> str:
        """The client asks every node of a hung attempt to dump its ranks' stacks (sealed)."""
        return f"{RunLayout.spark(attempt)}/{RunLayout.SPARK_DUMP}"

    @staticmethod
    def spark_stacks(attempt: int, rank: int | str) -> str:
        """Rank ``rank``'s stacks file as its node copied it after a dump the client asked for."""
        return f"{RunLayout.spark(attempt)}/stacks-rank-{rank}.txt"

    @staticmethod
    def spark_flight_record(attempt: int, rank: int | str) -> str:
        """Rank ``rank``'s flight-recorder dump as its node copied it after a dump the client asked for."""
        return f"{RunLayout.spark(attempt)}/flight-recorder-rank-{rank}.json"

    @staticmethod
    def node_marker(attempt: int, node: int, kind: str) -> str:
        """A Spark node's marker: ``kind`` is ``"started"`` or ``"ended"``."""
        return f"{RunLayout.spark(attempt)}/node-{node}.{kind}"

    @staticmethod
    def node_marker_node(name: str, kind: str) -> int | None:
        """The node whose ``kind`` marker is the file ``name`` of an attempt's Spark folder, or ``None``."""
        match = _NODE_MARKER.match(name)
        return int(match.group(1)) if match and match.group(2) == kind else None

    @staticmethod
    def is_node_end_marker(rel: str) -> bool:
        return f"/{RunLayout.SPARK}/node-" in rel and rel.endswith(".ended")

    @staticmethod
    def is_node_exits(rel: str) -> bool:
        return RunLayout.node_exits_node(rel.rsplit("/", 1)[-1]) is not None

    @staticmethod
    def control_files(attempt: int) -> tuple[str, ...]:
        """The files the client writes while attempt ``attempt`` runs."""
        return (
            RunLayout.stop(attempt),
            RunLayout.spark_cancel(attempt),
            RunLayout.client_heartbeat(attempt),
            RunLayout.spark_dump(attempt),
        )

    @staticmethod
    def tracking_records_of(attempt: int) -> str:
        """The prefix of the names of attempt ``attempt``'s files in :attr:`TRACKING_RECORDS`."""
        return f"a{attempt}."
