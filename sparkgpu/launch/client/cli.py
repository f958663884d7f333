"""``sparkgpu resume``, ``sparkgpu cancel`` and ``sparkgpu warm-pool``: the launcher's subcommands."""

from __future__ import annotations

import datetime as _dt
import json

__all__ = ["register_resume", "register_cancel", "register_warm_pool"]


def register_resume(subparsers) -> None:
    p = subparsers.add_parser("resume", help="continue a job whose client died, from its latest checkpoint")
    p.add_argument("job_id")
    p.add_argument(
        "--force",
        action="store_true",
        help="resume even though the job's client seems alive (it no longer drives the job)",
    )
    p.set_defaults(handler=cmd_resume)


def cmd_resume(args) -> int:
    from sparkgpu.launch.client.resume import resume_job

    results = resume_job(args.job_id, force=args.force)
    print(f"sparkgpu: job {args.job_id} succeeded on {len(results)} ranks")
    return 0


def register_cancel(subparsers) -> None:
    p = subparsers.add_parser("cancel", help="stop a job's ranks, whichever process supervises it")
    p.add_argument("job_id")
    p.add_argument("--timeout", type=float, help="seconds to wait for the ranks to stop (default: until they did)")
    p.set_defaults(handler=cmd_cancel)


def cmd_cancel(args) -> int:
    from sparkgpu.api.call import DistributedFunctionCall
    from sparkgpu.launch.client.resume import find_run_dir

    # Observed, not attached: a job whose client is gone is ended here, not continued first.
    run_dir = find_run_dir(args.job_id)
    status = DistributedFunctionCall(run_dir.job_id, run_dir).cancel(timeout=args.timeout)
    print(f"sparkgpu: job {run_dir.job_id} is {status.value}")
    return 0 if status.is_terminal else 1


def register_warm_pool(subparsers) -> None:
    # "pool" was its name before; "sparkgpu pools" lists GPU pools, another thing.
    p = subparsers.add_parser("warm-pool", help="the warm pool that starts local ranks in well under a second")
    p.add_argument("action", choices=("status", "stop"))
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(handler=cmd_warm_pool)


def cmd_warm_pool(args) -> int:
    from sparkgpu.launch.backends.local.zygote_client import warm_zygote_status, stop_warm_zygote

    if args.action == "stop":
        print("sparkgpu: warm pool stopped" if stop_warm_zygote() else "sparkgpu: no warm pool is running")
        return 0
    info = warm_zygote_status()
    if args.json:
        print(json.dumps(info))
    elif info is None:
        print("no warm pool is running (set SPARKGPU_WARM_POOL=1 to use one)")
    else:
        started = _dt.datetime.fromtimestamp(info["started_at"]).strftime("%Y-%m-%d %H:%M:%S")
        print(
            f"warm pool pid {info['pid']} ({info['python']}), started {started}, "
            f"{info['jobs_run']} jobs run, {len(info['running_jobs'])} running, "
            f"stops after {info['idle_timeout']:g}s idle"
        )
    return 0
