"""The warm pool's zygote: the long-lived process that forks a job's ranks with torch imported.

The client side (:mod:`sparkgpu.launch.backends.local.zygote_client`) starts it as
``python -m sparkgpu.launch.backends.local.zygote DIRECTORY IDLE_TIMEOUT FINGERPRINT [standby PRELOAD]`` and talks to it
over the UNIX socket ``DIRECTORY/pool.sock``, one JSON line per request and per reply
(``status``, ``stop``, ``retire``, ``run``); it describes itself in ``DIRECTORY/pool.json``.

The zygote is single-threaded (a selector loop), because forking a multi-threaded process
can deadlock the child; nothing in the loop blocks on a client, so one stuck client cannot
hold up the reaping of other jobs. It stops itself after ``idle_timeout`` without work. If
the client disconnects mid-run (Ctrl-C, or the client was killed), the zygote kills that
job's ranks. It never initialises CUDA, so forked ranks may use GPUs.

It imports only what it serves with and what every rank needs (:func:`_serve`), not the
client side.
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import signal
import socket
import sys
import time
from pathlib import Path

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu._util.report import report
from sparkgpu.runtime import ENV_RUN_DIR
from sparkgpu.launch.node.agent import preflight_refusal, refuse, reported, verify_or_refuse
from sparkgpu.launch.node.forked_ranks import become_rank
from sparkgpu._util.process import die_with_parent
from sparkgpu.rundir.exit_codes import EXIT_FAILED, EXIT_PREEMPTED
from sparkgpu.launch.node.rendezvous import collective_interface_env, listening_socket, serve_store
from sparkgpu.rundir.key_handover import make_undumpable, rank_secrets
from sparkgpu.rundir.states import NodeExit, RankExit
from sparkgpu.launch.node.rank_exits import CRASH_KILL_DELAY
from sparkgpu.rundir.directory import PRIVATE_UMASK, RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.launch.node.preload import WARM_POOL_PRELOAD, preload, preload_before_fork

_REQUEST_TIMEOUT = 10.0  # seconds a client has to send its whole request line


@dataclasses.dataclass
class _PendingRequest:
    """A connection whose request line has not fully arrived yet."""

    conn: socket.socket
    deadline: float
    data: bytearray = dataclasses.field(default_factory=bytearray)


@dataclasses.dataclass
class _Job:
    conn: socket.socket
    run_dir: RunDir
    attempt: int
    pids: dict[int, int]  # pid -> rank
    store_pid: int  # the child serving the job's rendezvous store
    exits: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> status
    exit_times: dict[int, float] = dataclasses.field(default_factory=dict)  # rank -> when it was reaped
    quiet: list[int] = dataclasses.field(default_factory=list)  # exited 0 without a result, error or marker
    stopping_since: float | None = None
    crashed_at: float | None = None  # when a rank first crashed (not a clean stop)
    grace: float = 10.0


def _fork_store(nproc: int) -> tuple[int, int]:
    """Forks the child serving a job's rendezvous store on loopback; returns its pid and port."""
    listener = listening_socket("127.0.0.1", 0)
    try:
        pid = os.fork()
        if not pid:
            os.setpgrp()
            die_with_parent(EXIT_FAILED)
            serve_store(listener, nproc)  # never returns
        return pid, listener.getsockname()[1]
    finally:
        listener.close()  # the child holds it now; ranks forked later must not


def _fork_rank(run_dir: RunDir, air: bytes, env: dict[str, str], rank: int, nproc: int, port: int) -> int:
    """Forks one rank that runs ``air``, the ``_air.py`` text whose signature was checked, with
    the job key (``run_dir.key``) handed in memory."""
    assert run_dir.key is not None, "the zygote forks ranks only for a payload it verified"
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setpgrp()
        os.umask(PRIVATE_UMASK)  # as under an agent: what the rank writes is the user's alone
        rank_env = {
            **env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # the zygote's store child serves it, as torch's agent would
        }
    except BaseException:
        os._exit(1)
    # As an agent's spare does: `python -c <text> RUN_DIR`, for the file could be swapped after the check.
    become_rank(air, str(run_dir.air), run_dir.path, run_dir.key, rank_env)


class _Zygote:
    def __init__(self, directory: Path, idle_timeout: float, fingerprint: str = ""):
        self.directory = directory
        self.idle_timeout = idle_timeout
        self.fingerprint = fingerprint
        self.selector = selectors.DefaultSelector()
        self.jobs: list[_Job] = []
        self.pending: list[_PendingRequest] = []
        self.started = time.time()
        self.last_active = time.monotonic()
        self.jobs_run = 0

    def info(self) -> dict:
        return {
            "pid": os.getpid(),
            "python": sys.executable,
            "started_at": self.started,
            "idle_timeout": self.idle_timeout,
            "jobs_run": self.jobs_run,
            "code": self.fingerprint,
            "running_jobs": [j.run_dir.job_id for j in self.jobs],
        }

    def write_info(self) -> None:
        atomic_write_bytes(self.directory / "pool.json", json.dumps(self.info()).encode())

    def serve(self) -> None:
        sock_path = self.directory / "pool.sock"
        sock_path.unlink(missing_ok=True)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        make_undumpable()  # requests carry job keys: this process's memory is not the user's other processes' to read
        old_umask = os.umask(0o077)  # the socket is the user's alone: requests carry job keys
        try:
            server.bind(str(sock_path))
        finally:
            os.umask(old_umask)
        server.listen(16)
        server.setblocking(False)
        self.selector.register(server, selectors.EVENT_READ)
        self.write_info()
        try:
            while True:
                for key, _ in self.selector.select(timeout=0.05):
                    if key.fileobj is server:
                        self._accept(server)
                    elif isinstance(key.data, _PendingRequest):
                        self._read_request(key.data)
                    else:
                        self._client_gone(key.data)
                self._drop_stalled_requests()
                self._reap()
                if not self.jobs and time.monotonic() - self.last_active > self.idle_timeout:
                    return
        except _StopZygote:
            return
        finally:
            for job in self.jobs:
                self._kill(job, signal.SIGKILL)
            for request in self.pending:
                request.conn.close()
            sock_path.unlink(missing_ok=True)
            (self.directory / "pool.json").unlink(missing_ok=True)

    def _accept(self, server: socket.socket) -> None:
        try:
            conn, _ = server.accept()
        except BlockingIOError:  # the client gave up between select and accept
            return
        conn.setblocking(False)
        request = _PendingRequest(conn, time.monotonic() + _REQUEST_TIMEOUT)
        self.pending.append(request)
        self.selector.register(conn, selectors.EVENT_READ, request)

    def _read_request(self, request: _PendingRequest) -> None:
        """Reads what arrived of a request; handles it once its line is complete."""
        try:
            chunk = request.conn.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop_request(request, f"could not be read: {exc}")
            return
        if not chunk:
            self._drop_request(request, "closed before its request was complete")
            return
        request.data += chunk
        if not request.data.endswith(b"\n"):
            return
        self.selector.unregister(request.conn)
        self.pending.remove(request)
        try:
            message = json.loads(request.data)
            if not isinstance(message, dict):
                raise ValueError(f"expected a JSON object, got {type(message).__name__}")
        except ValueError as exc:
            report(f"warm pool: refused a malformed request: {exc}")
            request.conn.close()
            return
        request.conn.setblocking(True)  # replies are one short line
        try:
            self._handle(request.conn, message)
        except _StopZygote:
            raise
        except Exception as exc:  # one bad request must not take down the other jobs' ranks
            report(f"warm pool: request {message.get('op')!r} failed: {exc!r}")
            request.conn.close()

    def _drop_stalled_requests(self) -> None:
        now = time.monotonic()
        for request in [r for r in self.pending if now > r.deadline]:
            self._drop_request(request, f"sent no complete request within {_REQUEST_TIMEOUT:g}s")

    def _drop_request(self, request: _PendingRequest, why: str) -> None:
        report(f"warm pool: dropped a client that {why}")
        self.selector.unregister(request.conn)
        self.pending.remove(request)
        request.conn.close()

    def _handle(self, conn: socket.socket, request: dict) -> None:
        op = request.get("op")
        if op == "status":
            conn.sendall((json.dumps(self.info()) + "\n").encode())
            conn.close()
        elif op == "stop":
            conn.sendall(b'{"stopping": true}\n')
            conn.close()
            raise _StopZygote
        elif op == "retire":
            # A newer zygote took over: finish the running jobs, then stop.
            self.idle_timeout = 0.0
            conn.sendall(b'{"retiring": true}\n')
            conn.close()
            self.write_info()
        elif op == "run":
            run_dir = RunDir(request["run_dir"])
            attempt, nproc = request["attempt"], request["nproc"]
            run_dir.prepare_attempt(attempt)
            env = {**request["env"], "SPARKGPU_ATTEMPT": str(attempt), ENV_RUN_DIR: str(run_dir.path)}
            # The node agent's check: nothing is forked for a payload that is not the job's.
            key = bytes.fromhex(request.get("key", ""))
            verified = verify_or_refuse(
                run_dir, key or None, attempt, 0, nproc, log=run_dir.file(RunLayout.agent_log(attempt, 0))
            )
            if verified is None:
                conn.sendall(b'{"started": true}\n')
                conn.close()  # the client reads the end of the connection as a failed attempt
                return
            if json.loads(verified[run_dir.spec_file.name])["policy"].get("preflight", True):
                refused = preflight_refusal(env, 0)
                if refused is not None:
                    with open(run_dir.file(RunLayout.agent_log(attempt, 0)), "a") as log:
                        refuse(run_dir, attempt, 0, nproc, refused, out=log)
                    conn.sendall(b'{"started": true}\n')
                    conn.close()
                    return
            air = verified[run_dir.air.name]
            assert run_dir.key is not None, "verify_or_refuse checked the payload with the job's key"
            env.update(rank_secrets(run_dir.key, env))
            env.update(collective_interface_env("127.0.0.1", env))  # once per job, not in every rank
            store_pid, port = _fork_store(nproc)
            pids: dict[int, int] = {}
            try:
                for rank in range(nproc):
                    pids[_fork_rank(run_dir, air, env, rank, nproc, port)] = rank
            except BaseException:
                for pid in [*pids, store_pid]:  # no half-started job: its ranks would wait for the missing one
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                raise
            job = _Job(conn, run_dir, attempt, pids, store_pid, grace=request.get("grace", 10.0))
            self.jobs.append(job)
            self.jobs_run += 1
            conn.setblocking(False)
            self.selector.register(conn, selectors.EVENT_READ, job)
            conn.sendall(b'{"started": true}\n')
            self.write_info()
        else:
            conn.close()

    def _client_gone(self, job: _Job) -> None:
        try:
            data = job.conn.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data and job.stopping_since is None:  # EOF: Ctrl-C or a dead client
            self._kill(job, signal.SIGTERM)
            job.stopping_since = time.monotonic()

    def _kill(self, job: _Job, sig: int, only=lambda rank: True) -> None:
        for pid, rank in job.pids.items():
            if rank not in job.exits and only(rank):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass

    def _reap(self) -> None:
        for job in list(self.jobs):
            for pid, rank in job.pids.items():
                if rank in job.exits:
                    continue
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    job.exits[rank] = os.waitstatus_to_exitcode(status)
                    job.exit_times[rank] = time.time()
                    if job.exits[rank] == 0 and not reported(job.run_dir, job.attempt, rank):
                        job.quiet.append(rank)  # as the node agent does: a quiet exit fails the job
            failed = bool(job.quiet) or any(code not in (0, EXIT_PREEMPTED) for code in job.exits.values())
            if failed and job.stopping_since is None:
                # As torch's agent does: one rank failed, so the others are torn down.
                self._kill(job, signal.SIGTERM)
                job.stopping_since = time.monotonic()
            if job.crashed_at is None and any(
                code not in (0, EXIT_PREEMPTED, -signal.SIGTERM) for code in job.exits.values()
            ):
                job.crashed_at = time.monotonic()
            if job.crashed_at is not None and time.monotonic() - job.crashed_at > CRASH_KILL_DELAY:
                # As the node agent does (rank_exits): a peer that turned SIGTERM into a checkpoint
                # request can only wait for the crashed rank; ranks that clean up keep the grace.
                self._kill(
                    job,
                    signal.SIGKILL,
                    only=lambda rank, job=job: job.run_dir.file(
                        RunLayout.checkpoints_on_sigterm(job.attempt, rank)
                    ).exists(),
                )
            if job.stopping_since is not None and time.monotonic() - job.stopping_since > job.grace:
                self._kill(job, signal.SIGKILL)
            if len(job.exits) == len(job.pids):
                self._finish(job)

    def _finish(self, job: _Job) -> None:
        try:
            os.kill(job.store_pid, signal.SIGKILL)  # every rank has exited: nobody needs the store
        except ProcessLookupError:
            pass
        os.waitpid(job.store_pid, 0)
        failures = {
            rank: RankExit(code, signal=signal.Signals(-code).name if code < 0 else None, time=job.exit_times.get(rank))
            for rank, code in job.exits.items()
            if code != 0 or rank in job.quiet
        }
        # Ranks killed by the teardown are not failures of their own.
        failures = {k: v for k, v in failures.items() if v.exitcode != -signal.SIGTERM} or failures
        status = 1 if failures else 0
        node = NodeExit(0, status, failures)
        job.run_dir.write_control(
            job.run_dir.file(RunLayout.node_exits(job.attempt, 0)), json.dumps(node.to_json()).encode()
        )
        try:
            self.selector.unregister(job.conn)
            job.conn.setblocking(True)
            job.conn.sendall((json.dumps({"status": status}) + "\n").encode())
        except OSError:
            pass
        job.conn.close()
        self.jobs.remove(job)
        self.last_active = time.monotonic()
        self.write_info()


class _StopZygote(Exception):
    pass


def _serve(argv: list[str]) -> None:
    directory, idle_timeout = Path(argv[0]), float(argv[1])
    fingerprint = argv[2] if len(argv) > 2 else ""
    if argv[3:4] == ["standby"]:  # one job's standby (zygote_client.Standby): it lives no longer than its client
        die_with_parent(EXIT_FAILED)
    # What every rank needs, imported once here so that forked ranks start warm.
    import cloudpickle  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn  # noqa: F401
    import torch.optim  # noqa: F401

    import sparkgpu.launch.rank.entrypoint  # noqa: F401

    if argv[3:4] != ["standby"]:  # the warm pool: what every job's ranks would import (a standby: below)
        preload(WARM_POOL_PRELOAD)
    if argv[4:5]:  # a standby imports what its job's function imports, as the job's agent does
        hazard = preload_before_fork(json.loads(argv[4]))
        if hazard is not None:  # the job's restarts start cold instead
            report(f"this standby forks no rank: {hazard}")
            sys.exit(1)
    _Zygote(directory, idle_timeout, fingerprint).serve()


if __name__ == "__main__":
    _serve(sys.argv[1:])
