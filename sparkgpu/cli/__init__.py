"""The ``sparkgpu`` command.

```
sparkgpu run train.py --gpus 8 --gpu-type H100 --max-runtime 7d --tag team=ml -- --lr 3e-4
sparkgpu run job.yaml                 # the same fields in a file (cron, Airflow, CI)
sparkgpu run train.yaml [--watch]     # an `air run` workload: returns at submit (prints the job id)
sparkgpu result JOB_ID                # per-rank results, or the remote traceback, of a job that ended
sparkgpu jobs                         # run dirs with status, attempts, restarts, duration
sparkgpu logs JOB_ID [--rank N | --all] [--attempt K] [--follow]
sparkgpu cancel JOB_ID                # stop its ranks, whichever process supervises the job
sparkgpu usage --by team --since 30d [--plot usage.png]
sparkgpu pools                        # GPU pools (SPARKGPU_POOLS) with live capacity
```

Subcommands register themselves: :data:`COMMANDS` lists ``(module, function)`` pairs, and
each function receives the argparse subparsers object and adds its parser, setting
``handler`` to a function ``(args) -> exit code``. Modules import only argparse-level code
at registration; heavy imports (torch, deltalake, pandas) happen inside handlers, so
``sparkgpu --help`` stays fast.

Exit codes: 0 success, 1 the job failed or timed out, 2 bad input (arguments, job file,
settings), 3 refused or stopped by a usage policy, 130 interrupted.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Literal, Sequence

from sparkgpu.errors import ConfigurationError, PolicyViolationError, SparkGPUError
from sparkgpu.spec.options import add_cli_flags, cli_values, key_value
from sparkgpu.rundir.states import JobStatus, ListedStatus
from sparkgpu.rundir.layout import RunLayout

logger = logging.getLogger(__name__)

__all__ = ["main", "COMMANDS", "build_parser", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_POLICY"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_POLICY, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

COMMANDS: list[tuple[str, str]] = [
    ("sparkgpu.cli", "register_run"),
    ("sparkgpu.cli", "register_jobs"),
    ("sparkgpu.cli", "register_logs"),
    ("sparkgpu.cli.submit", "register_result"),
    ("sparkgpu.cli.sweep", "register_sweeps"),
    ("sparkgpu.cli.usage", "register"),
    ("sparkgpu.launch.client.cli", "register_resume"),
    ("sparkgpu.launch.client.cli", "register_cancel"),
    ("sparkgpu.launch.client.cli", "register_warm_pool"),
    ("sparkgpu.cli.tracking", "register_tracking"),
    ("sparkgpu.cli.data", "register_data"),
    ("sparkgpu.cli.data", "register_cache"),
    ("sparkgpu.cli.pools", "register_pools"),
]


def build_parser() -> argparse.ArgumentParser:
    """The parser with every registered subcommand."""
    from sparkgpu import __version__

    parser = argparse.ArgumentParser(prog="sparkgpu", description="Serverless-GPU training jobs: run, watch, meter.")
    parser.add_argument("--version", action="version", version=f"sparkgpu {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module, function in COMMANDS:
        getattr(importlib.import_module(module), function)(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after a bare `--` belongs to the user's script, never to our parser.
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    args.passthrough = passthrough
    if not getattr(args, "handler", None):
        parser.print_help()
        return EXIT_USAGE
    if passthrough and not getattr(args, "accepts_passthrough", False):
        parser.error(f"`sparkgpu {args.command}` takes no arguments after `--`")
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("sparkgpu: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except PolicyViolationError as exc:
        print(f"sparkgpu: {exc}", file=sys.stderr)
        return EXIT_POLICY
    except ConfigurationError as exc:
        print(f"sparkgpu: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SparkGPUError as exc:
        print(f"sparkgpu: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED


def console(stderr: bool = False):
    """A rich console; piped output (cron logs, CI) gets 160 columns instead of rich's 80."""
    import os

    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    wide = None if stream.isatty() or os.environ.get("COLUMNS") else 160
    return Console(stderr=stderr, width=wide)


# -- run -----------------------------------------------------------------------------------
def register_run(subparsers) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a script (or a job file) on every rank",
        description="Runs a Python script as __main__ on every rank, or the job a YAML/TOML job file describes. "
        "Arguments after `--` go to the script. Options override the job file's fields.",
    )
    p.add_argument("target", help="train.py, or a job file (.yaml, .yml, .toml, .json)")
    add_cli_flags(p)
    p.add_argument(
        "--env",
        action="append",
        type=key_value,
        metavar="KEY=VALUE",
        help="environment variable for the script (repeat)",
    )
    p.add_argument("--dry-run", action="store_true", help="validate and print the launch plan; start nothing")
    p.add_argument(
        "--override",
        action="append",
        metavar="FIELD.PATH=VALUE",
        help="set a field of the job file by dotted path, typed as YAML reads VALUE (repeat), "
        "e.g. compute.num_accelerators=16",
    )
    p.add_argument(
        "--idempotency-key",
        metavar="KEY",
        help="a second submission with the same key returns the same job instead of starting another",
    )
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--watch", action="store_true", help="follow the job's logs until it ends, then exit with its status"
    )
    when.add_argument("--detach", action="store_true", help="print the job id once it is submitted and return")
    p.set_defaults(handler=cmd_run, accepts_passthrough=True)


def _load_job(args):
    from sparkgpu.spec.jobfile import JOB_FILE_SUFFIXES, JobFile

    target = Path(args.target)
    if target.suffix.lower() in JOB_FILE_SUFFIXES:
        job = JobFile.load(target, overrides=args.override or ())
        if args.passthrough:
            job = job.with_overrides(args=tuple(args.passthrough))
    elif args.override:
        raise ConfigurationError(f"--override sets fields of a job file; {args.target!r} is a script: pass flags")
    elif target.suffix.lower() == ".py" or target.is_file():
        job = JobFile(
            script=str(target.resolve()), args=tuple(args.passthrough), source=f"`sparkgpu run {args.target}`"
        )
    else:
        raise ConfigurationError(
            f"{args.target!r} is neither a Python script nor a job file ({', '.join(JOB_FILE_SUFFIXES)})"
        )
    return job.with_overrides(
        env=dict(args.env) if args.env else None, idempotency_key=args.idempotency_key, **cli_values(args)
    )


def cmd_run(args) -> int:
    from sparkgpu.api.decorator import default_callbacks
    from sparkgpu.usage.meter import UsageMeter

    job_file = _load_job(args)
    # Passed explicitly, so that the summary below reads the same usage meter the job used.
    callbacks = default_callbacks(experiment=job_file.experiment)
    if job_file.run_name is not None:
        for callback in callbacks:
            if hasattr(callback, "run_name"):  # the MLflow run's callback (absent with SPARKGPU_TRACKING=0)
                callback.run_name = job_file.run_name
    fn = job_file.build(callbacks=callbacks)
    # `air run` returns once the workload is submitted; sparkgpu's own job files wait, as they always did.
    submit = args.detach or args.watch or job_file.air or job_file.idempotency_key is not None
    if args.dry_run or not submit or job_file.secret_values:
        with console(stderr=True).status(
            f"validating {fn.name} ({fn.resources.gpus} x {fn.resources.gpu_type or 'auto'})"
        ):
            # Capacity, usage policy, picklability: refused before anything is written.
            prepared = fn.prepare((), {}, detached=submit and fn.submit_detaches)
    if args.dry_run:
        print(prepared.plan())
        print(describe_job_file(job_file))
        return EXIT_OK
    if submit:
        from sparkgpu.cli.submit import submit_job

        return submit_job(fn, job_file, job_file.seal_secrets(prepared) if job_file.secret_values else None, args.watch)
    prepared = job_file.seal_secrets(prepared)
    started = time.time()
    try:
        fn.launch(prepared)
        status, code = JobStatus.SUCCEEDED, EXIT_OK
    except PolicyViolationError:
        raise
    except SparkGPUError as exc:
        print(f"sparkgpu: {type(exc).__name__}: {exc}", file=sys.stderr)
        status, code = JobStatus.FAILED, EXIT_FAILED
    finally:
        job_id = getattr(fn, "last_job_id", None)
        meter = next((c for c in callbacks if isinstance(c, UsageMeter)), None)
        if job_id:
            _print_run_summary(job_id, started, meter)
    print(f"sparkgpu: job {job_id} {status}", file=sys.stderr)
    return code


def describe_job_file(job) -> str:
    """What the job file maps to, for ``--dry-run``: options and fields, secrets by name (never a value)."""
    lines = [f"job file: {job.source}", f"  script: {job.script} {' '.join(job.args)}".rstrip()]
    if job.cwd:
        lines.append(f"  starts in: {job.cwd}")
    for name, value in sorted(job.options.items()):
        lines.append(f"  {name}: {value}")
    if job.air and "max_restarts" in job.options:
        lines.append("  (max_restarts: air's max_retries, 3 when the workload gives none)")
    if job.run_name:
        lines.append(f"  mlflow run name: {job.run_name}")
    if job.idempotency_key:
        lines.append(f"  idempotency key: {job.idempotency_key}")
    if job.parameters is not None:
        lines.append(f"  parameters ($HYPERPARAMETERS_PATH): {', '.join(map(str, job.parameters)) or '(empty)'}")
    if job.secret_refs:
        named = ", ".join(f"{n} <- {r}" for n, r in job.secret_refs.items())
        lines.append(f"  secrets (sparkgpu.runtime.secret(NAME), never in the environment): {named}")
    if job.env:
        lines.append(f"  env: {', '.join(f'{k}={v}' for k, v in job.env.items())}")
    return "\n".join(lines)


def _print_run_summary(job_id: str, started: float, meter) -> None:
    line = f"sparkgpu: job {job_id}: {_format_seconds(time.time() - started)} wall clock"
    if meter is not None:
        try:
            import pyarrow.compute as pc

            rows = meter.ledger.read(since=started - 1)
            rows = rows.filter(pc.equal(rows["job_id"], job_id))
            gpu_hours = (pc.sum(rows["gpu_seconds"]).as_py() or 0.0) / 3600
            cost = pc.sum(rows["cost_usd"]).as_py() or 0.0
            line += f", {rows.num_rows} attempt(s), {gpu_hours:,.3f} GPU-hours, ${cost:,.2f}"
        except Exception as exc:  # the summary is informative; the job's outcome stands
            line += f" (usage unavailable: {exc})"
    print(line, file=sys.stderr)


# -- jobs ----------------------------------------------------------------------------------
def register_jobs(subparsers) -> None:
    p = subparsers.add_parser("jobs", help="list jobs (run dirs) with status, attempts and duration")
    p.add_argument("--limit", type=int, default=20, help="most recent N jobs (default 20; 0 for all)")
    p.add_argument("--status", help="only jobs with this status (running, succeeded, failed, stopped, ...)")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    p.set_defaults(handler=cmd_jobs)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def list_jobs(staging_root: Path | None = None) -> list[dict]:
    """One summary per run dir under ``staging_root``, newest first.

    Each has ``job_id``, ``name``, ``status`` (``staged`` when no attempt ever started),
    ``attempts``, ``restarts``, ``preemptions``, ``gpus`` (its latest attempt's: an elastic job may
    run on fewer), ``gpus_asked``, ``gpu_type``, ``backend``, ``tags``,
    ``started_at``, ``ended_at``, ``duration_s``, ``stop_reason``, ``priority`` and
    ``queue_position`` (its place in this host's GPU queue, or in its Spark cluster's, while
    ``waiting``, else ``None``), ``failure_class`` and ``failure_detail`` (those of its latest
    failed attempt, or ``None``: :mod:`sparkgpu.failure_class`).
    """
    from sparkgpu.config import settings
    from sparkgpu.launch.scheduling.gpu_lease import waiting_jobs
    from sparkgpu.launch.client.detached import keeper_alive
    from sparkgpu.launch.client.resume import client_is_gone
    from sparkgpu.rundir.directory import RunDir

    root = Path(staging_root or settings().staging_root)
    waiting: dict[str, tuple[object, int]] = {**waiting_jobs(), **_cluster_waiting_jobs()}
    jobs = []
    for spec_file in root.glob(f"*/{RunLayout.SPEC}"):
        spec = _read_json(spec_file)
        if spec is None:
            continue
        state = _read_json(spec_file.parent / RunLayout.STATE) or {}
        attempts = state.get("attempts") or []
        # An attempt waiting for GPUs has no start yet: its submit time stands in.
        started = (attempts[0].get("started_at") or attempts[0].get("submitted_at")) if attempts else None
        ended = attempts[-1].get("ended_at") if attempts else None
        status = state.get("status", ListedStatus.STAGED.value)
        if (
            status == JobStatus.RUNNING
            and client_is_gone(state.get("client"))
            and not keeper_alive(RunDir(spec_file.parent))
        ):
            status = ListedStatus.LOST.value  # its supervisor died, and no keeper replaces it: `sparkgpu resume`
        queued = waiting.get(spec["job_id"])
        if queued is not None and status in (ListedStatus.STAGED, JobStatus.PENDING, JobStatus.RUNNING):
            status = ListedStatus.WAITING.value
        elif status == JobStatus.RUNNING and attempts and attempts[-1].get("started_at") is None:
            status = ListedStatus.WAITING.value  # submitted, its ranks wait for GPUs (a busy or shrunk cluster)
        end = ended if ended is not None else (time.time() if status == JobStatus.RUNNING else None)
        failed = [a for a in attempts if a.get("failure_class")]
        jobs.append(
            {
                "job_id": spec["job_id"],
                "name": spec.get("name"),
                "status": status,
                "attempts": len(attempts),
                "restarts": state.get("restarts", 0),
                "preemptions": state.get("preemptions", 0),
                "gpus": attempts[-1].get("gpus", spec["resources"]["gpus"]) if attempts else spec["resources"]["gpus"],
                "gpus_asked": spec["resources"]["gpus"],
                "gpu_type": spec["resources"].get("gpu_type"),
                "backend": spec.get("backend"),
                "tags": spec.get("tags") or {},
                "created_at": state.get("created_at") or spec_file.stat().st_mtime,
                "started_at": started,
                "ended_at": ended,
                "duration_s": (end - started) if started is not None and end is not None else None,
                "stop_reason": state.get("stop_reason"),
                "priority": (spec.get("policy") or {}).get("priority") or "normal",
                "queue_position": queued[1] if queued is not None else None,
                "failure_class": failed[-1]["failure_class"] if failed else None,
                "failure_detail": failed[-1].get("failure_detail") if failed else None,
                "run_dir": str(spec_file.parent),
            }
        )
    return sorted(jobs, key=lambda j: j["created_at"], reverse=True)


def _cluster_waiting_jobs() -> dict:
    """The jobs waiting in the Spark clusters' queues under the staging root; empty when it cannot be read."""
    from sparkgpu.config import settings
    from sparkgpu.launch.scheduling.cluster_queue import cluster_waiting_jobs, queue_root

    try:
        return cluster_waiting_jobs(queue_root(settings().staging_url))
    except OSError as exc:  # a store that is down: the list goes on without queue places
        logger.warning("could not read the Spark clusters' GPU queues: %s", exc)
        return {}


def _format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h{minutes:02d}m"
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _format_time(ts: float | None) -> str:
    return "-" if ts is None else _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


_STATUS_STYLE = {
    JobStatus.SUCCEEDED: "green",
    JobStatus.FAILED: "red",
    JobStatus.TIMED_OUT: "red",
    JobStatus.RUNNING: "cyan",
    JobStatus.STOPPED: "yellow",
    JobStatus.CANCELLED: "yellow",
    ListedStatus.STAGED: "dim",
    ListedStatus.LOST: "magenta",
    ListedStatus.WAITING: "blue",
}


def cmd_jobs(args) -> int:
    jobs = list_jobs()
    if args.status:
        jobs = [j for j in jobs if j["status"] == args.status]
    if args.limit:
        jobs = jobs[: args.limit]
    if args.json:
        for job in jobs:
            print(json.dumps(job))
        return EXIT_OK
    from rich.table import Table

    out = console()
    if not jobs:
        out.print("no jobs" + (f" with status {args.status!r}" if args.status else ""))
        return EXIT_OK
    table = Table(title="sparkgpu jobs")
    columns: tuple[tuple[str, Literal["left", "right"]], ...] = (
        ("job id", "left"),
        ("status", "left"),
        ("priority", "left"),
        ("GPUs", "right"),
        ("attempts", "right"),
        ("restarts", "right"),
        ("started", "left"),
        ("duration", "right"),
        ("tags", "left"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=name in ("job id", "started"))
    for job in jobs:
        style = _STATUS_STYLE.get(job["status"], "")
        table.add_row(
            job["job_id"],
            (f"[{style}]{job['status']}[/]" if style else job["status"])
            + (f" #{job['queue_position']}" if job["queue_position"] else ""),
            job["priority"],
            f"{job['gpus']}{'' if job['gpus'] == job['gpus_asked'] else '/' + str(job['gpus_asked'])} x "
            f"{job['gpu_type'] or 'auto'}",
            str(job["attempts"]),
            str(job["restarts"]),
            _format_time(job["started_at"]),
            _format_seconds(job["duration_s"]),
            ",".join(f"{k}={v}" for k, v in job["tags"].items()),
        )
    out.print(table)
    return EXIT_OK


# -- logs ----------------------------------------------------------------------------------
def register_logs(subparsers) -> None:
    p = subparsers.add_parser("logs", help="print (or follow) a job's rank logs")
    p.add_argument("job_id", help="job id, or a unique prefix of one")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, default=0, help="rank whose log to print (default 0)")
    which.add_argument("--all", action="store_true", help="every rank, each line prefixed [rankN]")
    p.add_argument("--attempt", type=int, help="attempt number (default: the latest)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the job ends")
    p.set_defaults(handler=cmd_logs)


def find_run_dir(job_id: str):
    """The run dir of ``job_id`` or of the one job whose id starts with it (see
    :func:`sparkgpu.launch.client.resume.find_run_dir`); for the commands of lower layers."""
    from sparkgpu.launch.client.resume import find_run_dir as find

    return find(job_id)


def _attempts(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / RunLayout.ATTEMPTS).glob("*") if p.name.isdigit())


class _RawTail:
    """Copies new bytes of one file to a text stream, as they appear."""

    def __init__(self, path: Path, out):
        self.path, self.out, self.offset = path, out, 0

    def pump(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        if data:
            self.offset += len(data)
            self.out.write(data.decode(errors="replace"))
            self.out.flush()

    def finish(self) -> None:
        self.pump()


class _FollowRequest:
    """Asks the process that supervises a job with a staging store to read these ranks' logs live
    (by default it reads only node 0's and those of ``log_ranks=`` while the attempt runs): a
    file in the client's run dir, renewed while the follower runs, void 30 s after it stops."""

    def __init__(self, rd, ranks: list[int] | None):
        self.rd, self.ranks, self.next = rd, ranks, 0.0

    def renew(self, attempt: int) -> None:
        from sparkgpu._util.files import atomic_write_bytes
        from sparkgpu.rundir.layout import RunLayout

        now = time.time()
        path = self.rd.file(RunLayout.follow_request(attempt))
        if now < self.next or not path.parent.is_dir():
            return
        self.next = now + 10
        atomic_write_bytes(path, json.dumps({"ranks": self.ranks, "until": now + 30}).encode(), fsync=False)


def cmd_logs(args) -> int:
    from sparkgpu.launch.client.logs import LogStreamer

    rd = find_run_dir(args.job_id)
    run_dir = rd.path
    spec = _read_json(rd.spec_file) or {}
    world_size = spec.get("resources", {}).get("gpus", 1)
    if not args.all and not 0 <= args.rank < world_size:
        raise ConfigurationError(f"--rank {args.rank}: job {rd.job_id} has ranks 0..{world_size - 1}")
    attempts = _attempts(run_dir)
    if args.attempt is not None and args.attempt not in attempts:
        raise ConfigurationError(f"--attempt {args.attempt}: job {rd.job_id} has attempts {attempts or 'none yet'}")
    attempt = args.attempt if args.attempt is not None else (attempts[-1] if attempts else 0)

    def tail_for(k: int):
        if args.all:
            return LogStreamer(rd, k, world_size, None, sys.stdout)
        return _RawTail(rd.file(RunLayout.rank_log(k, args.rank)), sys.stdout)

    tail = tail_for(attempt)
    ask = _FollowRequest(rd, None if args.all else [args.rank])
    if not args.follow:
        if not args.all and not rd.file(RunLayout.rank_log(attempt, args.rank)).exists():
            raise ConfigurationError(f"job {rd.job_id} has no log for rank {args.rank} in attempt {attempt} yet")
        tail.finish()
        return EXIT_OK
    while True:
        ask.renew(attempt)
        tail.pump()
        state = _read_json(rd.state_file) or {}
        newest = len(state.get("attempts") or []) - 1
        if args.attempt is None and newest > attempt:  # a restart: follow the new attempt
            tail.finish()
            attempt = newest
            print(f"--- attempt {attempt} ---", flush=True)
            tail = tail_for(attempt)
            continue
        if state.get("status") not in (None, JobStatus.PENDING, JobStatus.RUNNING):
            tail.finish()
            return EXIT_OK
        time.sleep(0.25)
