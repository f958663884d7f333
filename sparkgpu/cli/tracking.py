"""``sparkgpu tracking flush JOB_ID``: forward what a job left unsent to its MLflow run."""

from __future__ import annotations

__all__ = ["register_tracking"]


def register_tracking(subparsers) -> None:
    p = subparsers.add_parser("tracking", help="the MLflow run of a job")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    flush = actions.add_parser(
        "flush", help="forward the tracking records a finished job left unsent (the store was down at its end)"
    )
    flush.add_argument("job_id")
    flush.add_argument("--tracking-uri", help="the store, if it is reached at another URI than the job used")
    flush.set_defaults(handler=cmd_flush)


def cmd_flush(args) -> int:
    from sparkgpu.cli import find_run_dir  # how every command finds a job by its id (or a prefix of it)
    from sparkgpu.tracking.flusher import flush_spool

    sent = flush_spool(find_run_dir(args.job_id).path, tracking_uri=args.tracking_uri)
    print(f"sparkgpu: forwarded {sent} record{'' if sent == 1 else 's'} of job {args.job_id} to its MLflow run")
    return 0
