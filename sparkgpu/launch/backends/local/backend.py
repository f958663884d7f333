"""Ranks as processes on this host, started by torch's elastic agent (torchrun's machinery).

One agent process per attempt (``python -m sparkgpu.launch.node.agent``) in its own session, so
the caller's Ctrl-C reaches the supervisor, which then stops the agent deliberately. The
agent dies with its parent and the ranks die with the agent (``PR_SET_PDEATHSIG``), so a
killed client leaves no orphans.

A job that may restart (``max_restarts`` > 0) gets a standby once its first attempt is under
way: a process of its own that has imported torch and forks the next attempt's ranks
(:class:`~sparkgpu.launch.backends.local.zygote_client.Standby`, the warm pool's zygote private to the job). A
restart then skips the interpreters' start and ``import torch``, as torchrun's agent, which
outlives its workers, skips its own; the standby stops when the job ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from typing import IO, Any

from sparkgpu.spec.catalog import lookup_gpu_type
from sparkgpu.config import settings
from sparkgpu.errors import CapacityError
from sparkgpu.launch.node.agent import build_command
from sparkgpu.launch.backends.base import AttemptHandle, Backend, LaunchPlan, ResolvedJob
from sparkgpu.launch.backends.capabilities import LocalRanks, Preemptible, WatchedProgress
from sparkgpu.launch.client.progress_source import LocalProgress
from sparkgpu.launch.node.hardware import HostGPUs, detect_host_gpus
from sparkgpu.launch.rank.entrypoint import NODE_DEVICES_ENV
from sparkgpu.launch.scheduling.gpu_lease import GpuLease, lease_gpus, lock_dir, gpu_kind_of
from sparkgpu.launch.scheduling.gpu_queue import pending_request
from sparkgpu.rundir.key_handover import send_key
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.launch.rank.threads import rank_thread_env, threads_per_rank
from sparkgpu.spec import JobSpec

__all__ = ["LocalBackend", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class LocalAttempt(AttemptHandle):
    attempt: int
    process: subprocess.Popen
    log: IO[bytes]
    job: JobSpec | None = None
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    run_dir: RunDir | None = None

    def poll(self) -> int | None:
        code = self.process.poll()
        if code is not None:
            self.log.close()
        return code

    def cancel(self, grace: float) -> None:
        process = self.process
        if process.poll() is None:
            # The agent forwards SIGTERM to its ranks and waits up to its shutdown grace.
            process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace + 5
            while process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # ranks follow through PR_SET_PDEATHSIG
            process.wait()
        self.log.close()


class EarlyAgent:
    """An attempt's agent started ahead of its environment (:meth:`LocalBackend.prestart`)."""

    def __init__(self, handle: LocalAttempt, run_dir: RunDir):
        self.handle, self.run_dir = handle, run_dir

    def start(self, env: dict[str, str]) -> LocalAttempt:
        """Hands the agent the rest of the ranks' environment; it starts them."""
        stdin = self.handle.process.stdin
        assert stdin is not None, "an early agent is started with a pipe for its stdin"
        with contextlib.suppress(BrokenPipeError):  # the agent ended already (a refused payload): poll() says how
            stdin.write((json.dumps(env) + "\n").encode())
            stdin.close()
        self.handle.submitted = time.monotonic()
        return self.handle

    def discard(self) -> None:
        """Stops the agent before it started any rank and removes the attempt's folder."""
        stdin = self.handle.process.stdin
        assert stdin is not None, "an early agent is started with a pipe for its stdin"
        stdin.close()  # end of input: it starts nothing
        self.handle.cancel(grace=0)
        shutil.rmtree(self.run_dir.file(RunLayout.attempt(self.handle.attempt)), ignore_errors=True)


class LocalBackend(Backend, Preemptible, LocalRanks, WatchedProgress):
    """Runs every rank of a job on this host; its jobs queue for the host's GPUs and give way to
    urgent ones (:mod:`sparkgpu.launch.scheduling.gpu_lease`).

    Args:
        host_gpus: The host's GPUs; detected (or simulated per ``SPARKGPU_SIMULATE_GPUS``)
            when omitted. Tests inject fakes here.
        python: Interpreter for the agent and the ranks.
        max_cpu_ranks: Most CPU ranks allowed for ``gpu_type="cpu"``.
    """

    name = "local"
    #: Seconds an attempt of a job that may restart runs before the job's standby starts
    #: (:class:`~sparkgpu.launch.backends.local.zygote_client.Standby`): after the ranks' own start-up, not beside it.
    standby_delay = 2.0

    def __init__(
        self,
        host_gpus: HostGPUs | None = None,
        python: str | None = None,
        max_cpu_ranks: int | None = None,
        standby: bool = True,
    ):
        s = settings()
        self.host_gpus = host_gpus if host_gpus is not None else detect_host_gpus(s.simulate_gpus)
        self.python = python or s.python
        self.max_cpu_ranks = max_cpu_ranks or s.max_cpu_ranks
        self.standby = standby
        self._standbys: dict[str, Any] = {}  # job id -> its Standby
        self._leases: dict[str, GpuLease] = {}  # job id -> the host GPUs it holds until it ends
        self._first_asked: dict[str, float] = {}  # job id -> when it first asked for GPUs: its place in the queue

    # -- capacity ---------------------------------------------------------------------
    def resolve(self, job: JobSpec) -> ResolvedJob:
        # One node: the resolved spec says where every rank goes, so there is no placement.
        wanted = job.resources
        host = self.host_gpus
        gpu_type = wanted.gpu_type
        if gpu_type is None:
            gpu_type = (host.catalog_type() or "gpu") if host.count else "cpu"
        if gpu_type == "cpu":
            if wanted.gpus > self.max_cpu_ranks:
                raise CapacityError(
                    f"asked for {wanted.gpus} CPU ranks but this host runs at most {self.max_cpu_ranks} "
                    f"(it has {os.cpu_count()} cores); ask for fewer, or raise SPARKGPU_MAX_CPU_RANKS"
                )
            return ResolvedJob(dataclasses.replace(job, resources=dataclasses.replace(wanted, gpu_type="cpu")))

        if host.count == 0:
            raise CapacityError(
                f"asked for {wanted.gpus} x {gpu_type} but this host has no GPUs; use gpu_type='cpu' to run "
                f"the ranks on CPU, remote=True to run on a GPU pool, or SPARKGPU_SIMULATE_GPUS={gpu_type}:"
                f"{wanted.gpus} to simulate them"
            )
        host_type = host.catalog_type()
        if wanted.gpu_type is not None and host_type != gpu_type:
            expected = lookup_gpu_type(gpu_type)
            if not (host.names and expected.matches_device(host.names[0])):
                suggestion = f"gpu_type={host_type!r}" if host_type else "gpu_type=None"
                raise CapacityError(
                    f"asked for gpu_type={gpu_type!r} but this host has {host.describe()}; "
                    f"ask for {suggestion}, or remote=True to run on a pool of {gpu_type}"
                )
        if wanted.gpus > host.count:
            raise CapacityError(
                f"asked for {wanted.gpus} x {gpu_type} but this host has {host.describe()}; "
                f"ask for gpus<={host.count}, or remote=True to run on a GPU pool"
            )
        return ResolvedJob(
            dataclasses.replace(
                job,
                resources=dataclasses.replace(wanted, gpu_type=gpu_type if gpu_type != "gpu" else wanted.gpu_type),
                devices=host.addresses[: wanted.gpus],
                simulated=host.simulated,
            )
        )

    # -- attempts ---------------------------------------------------------------------
    def _command(self, job: JobSpec, run_dir: RunDir, attempt: int, port: int, env_on_stdin: bool = False) -> list[str]:
        return build_command(
            self.python,
            str(run_dir.path),
            attempt=attempt,
            nnodes=1,
            node_rank=0,
            nproc=job.world_size,
            master_addr="127.0.0.1",
            master_port=port,
            shutdown_grace=job.policy.shutdown_grace,
            env_on_stdin=env_on_stdin,
            preflight=job.policy.preflight,
        )

    def plan(self, job, run_dir, attempt, env, placement=None) -> LaunchPlan:
        return LaunchPlan(
            backend=self.name,
            attempt=attempt,
            nodes=1,
            ranks_per_node=job.world_size,
            devices=job.devices,
            commands=(tuple(self._command(job, run_dir, attempt, 0)),),
            env=dict(env),
        )

    def _lease_devices(self, job: JobSpec, env: dict[str, str], wait: float | None = None) -> dict[str, str]:
        """``env`` with the GPUs the job holds (``NODE_DEVICES_ENV``), leased at its first attempt
        (and again after it gave way to a critical job): two local jobs never share a GPU, and
        waiting ones take turns by priority (:mod:`sparkgpu.launch.scheduling.gpu_lease`). ``wait``: seconds
        to wait for them, ``SPARKGPU_SPARK_WAIT_TIMEOUT`` when ``None``."""
        if not job.devices:
            return env
        lease = self._leases.get(job.job_id)
        if lease is None:
            # A job that gave way keeps its place within its class: when it first asked.
            order = self._first_asked.setdefault(job.job_id, time.time())
            lease = self._leases[job.job_id] = lease_gpus(
                self.host_gpus.addresses,
                len(job.devices),
                job.job_id,
                wait=settings().spark_wait_timeout if wait is None else wait,
                simulated=job.simulated,
                priority=job.policy.priority,
                order=order,
            )
        return {**env, NODE_DEVICES_ENV: ",".join(lease.devices)}

    def preemption_request(self, job: JobSpec) -> str | None:
        if job.job_id not in self._leases or not job.policy.priority.preemptible:
            return None
        found = pending_request(lock_dir(), job.job_id, job.policy.priority, gpu_kind_of(job.simulated))
        if found is None:
            return None
        request, entry = found
        return f"critical job {request.requester_job_id} needs {entry.gpus} GPU(s) of this host"

    def give_way(self, job: JobSpec) -> None:
        lease = self._leases.pop(job.job_id, None)
        if lease is not None:
            lease.release()

    def await_capacity(self, job: JobSpec, wait: float | None) -> None:
        self._lease_devices(job, {}, wait=wait)

    def submit(self, job, run_dir, attempt, env, placement=None) -> AttemptHandle:
        env = self._lease_devices(job, env)
        standby = self._standbys.get(job.job_id)
        if standby is not None:
            handle = standby.submit(job, run_dir, attempt, env)
            if handle is not None:
                return handle
        return self._start_agent(job, run_dir, attempt, env)

    def prestart(self, job, run_dir, attempt, env) -> EarlyAgent | None:
        """Starts the attempt's agent before the job's callbacks run, beside them.

        The agent checks the payload and imports torch meanwhile (its longest part), then
        waits for the callbacks' variables (:meth:`EarlyAgent.start`) before starting any
        rank: no user code runs before the job's MLflow run and usage row exist.
        """
        env = self._lease_devices(job, env)
        return EarlyAgent(self._start_agent(job, run_dir, attempt, env, env_on_stdin=True), run_dir)

    def _start_agent(self, job, run_dir, attempt, env, env_on_stdin: bool = False) -> LocalAttempt:
        run_dir.prepare_attempt(attempt)
        log = open(run_dir.file(RunLayout.agent_log(attempt, 0)), "ab")
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        # The host's cores shared out between the ranks, as every attempt's ranks apply them.
        full_env.update(rank_thread_env(full_env, threads_per_rank(job.world_size)))
        process = subprocess.Popen(
            self._command(job, run_dir, attempt, 0, env_on_stdin),  # the agent takes a free port for its store
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE,  # the job key's way in, then an early agent's variables
            start_new_session=True,
        )
        assert process.stdin is not None and run_dir.key, "the supervisor sets the job key on its run dir"
        with contextlib.suppress(BrokenPipeError):  # an agent that died at once: poll() says how
            send_key(process.stdin, run_dir.key)
            if not env_on_stdin:
                process.stdin.close()
        return LocalAttempt(attempt=attempt, process=process, log=log, job=job, run_dir=run_dir)

    def poll(self, handle) -> int | None:
        code = handle.poll()
        if code is None and isinstance(handle, LocalAttempt):
            self._prepare_standby(handle)
        return code

    def cancel(self, handle, grace: float) -> None:
        handle.cancel(grace)

    def ranks_on_this_host(self) -> bool:
        return True

    def progress_source(self, handle, run_dir: RunDir) -> LocalProgress:
        """The ranks run on this host: their records are read from its memory, and they are signalled by pid."""
        return LocalProgress(run_dir)

    def _prepare_standby(self, handle: LocalAttempt) -> None:
        """Starts the job's standby once its attempt is under way, if the job may restart.

        Started from the thread that polls (the supervisor's, which outlives the job's
        attempts): the standby dies with that thread's process, never with a helper thread.
        """
        job = handle.job
        if (
            not self.standby
            or job is None
            or job.policy.max_restarts < 1
            or job.job_id in self._standbys
            or time.monotonic() - handle.submitted < self.standby_delay
        ):
            return
        from sparkgpu.launch.backends.local.zygote_client import Standby

        # The libraries the job's function imports (sparkgpu.launch.node.preload), from the spec this client wrote.
        spec = json.loads(handle.run_dir.spec_file.read_text()) if handle.run_dir is not None else {}
        self._standbys[job.job_id] = Standby(self.python, job.job_id, spec.get("preload", []))

    def end_job(self, job: JobSpec) -> None:
        self._first_asked.pop(job.job_id, None)
        lease = self._leases.pop(job.job_id, None)
        if lease is not None:
            lease.release()
        standby = self._standbys.pop(job.job_id, None)
        if standby is not None:
            standby.stop()
