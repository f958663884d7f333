"""``sparkgpu run`` for jobs that return at submit (``air run`` workloads, ``--detach``, ``--watch``), and ``sparkgpu result``.

```
sparkgpu run train.yaml                    # an air run workload: prints the job id once it is submitted
sparkgpu run train.yaml --watch            # follows its logs until it ends; exits with its status
sparkgpu run job.yaml --detach             # a sparkgpu job file, returning at submit too
sparkgpu run train.yaml --idempotency-key nightly-2026-12-02   # the same key: the same job
sparkgpu result JOB_ID                     # per-rank results, or the remote traceback; exit code from its status
```
"""

from __future__ import annotations

import logging
import sys

from sparkgpu.errors import ConfigurationError, PolicyViolationError, SparkGPUError
from sparkgpu.rundir.states import JobStatus

logger = logging.getLogger(__name__)

__all__ = ["submit_job", "register_result", "cmd_result"]

EXIT_OK, EXIT_FAILED = 0, 1


def submit_job(fn, job_file, prepared, watch: bool) -> int:
    """Submits the job, prints its id and returns; with ``watch``, follows its logs to the end first.

    Args:
        fn: The job's decorated function (:meth:`sparkgpu.spec.jobfile.JobFile.build`).
        job_file: The job file it was built from.
        prepared: The job prepared here with its secrets sealed in, or ``None`` to let
            ``fn.submit()`` prepare it.
        watch: Follow the logs until the job ends and exit with its status.

    Returns:
        The exit code: 0 once submitted (or succeeded, with ``watch``), 1 when it failed.
    """
    # A job prepared here (its secrets sealed under its key) is submitted as fn.submit() would.
    call = fn.submit_prepared(lambda: prepared) if prepared is not None else fn.submit()
    print(call.job_id, flush=True)  # stdout holds the job id alone, for scripts
    if not watch:
        if fn.submit_detaches:
            print(
                f"sparkgpu: job {call.job_id} submitted; `sparkgpu logs {call.job_id} --follow` follows it",
                file=sys.stderr,
            )
            return EXIT_OK
        # A job this process supervises (detach=False, a classic Spark session): leaving would stop it.
        print(
            f"sparkgpu: job {call.job_id} submitted; it is supervised from here, so this command waits "
            "for it to end (Ctrl-C stops it; `sparkgpu logs --follow` watches it)",
            file=sys.stderr,
        )
    else:
        call.logs(follow=True)
    return _outcome(call)


def _outcome(call) -> int:
    try:
        call.result()
    except PolicyViolationError:
        raise
    except SparkGPUError as exc:
        print(f"sparkgpu: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(f"sparkgpu: job {call.job_id} {call.status()}", file=sys.stderr)
        return EXIT_FAILED
    print(f"sparkgpu: job {call.job_id} {JobStatus.SUCCEEDED}", file=sys.stderr)
    return EXIT_OK


# -- result --------------------------------------------------------------------------------
def register_result(subparsers) -> None:
    p = subparsers.add_parser("result", help="per-rank results, or the remote traceback, of a job that ended")
    p.add_argument("job_id", help="job id, or a unique prefix of one")
    p.set_defaults(handler=cmd_result)


def cmd_result(args) -> int:
    import json

    import sparkgpu
    from sparkgpu.launch.client.resume import find_run_dir

    rd = find_run_dir(args.job_id)
    try:
        status = json.loads(rd.state_file.read_text()).get("status")
    except (OSError, ValueError):
        status = None
    if status in (None, JobStatus.PENDING, JobStatus.RUNNING):
        # attach() would take over a job whose client is gone: this command only reads.
        raise ConfigurationError(
            f"job {rd.job_id} has not ended ({status or 'not started'}); "
            f"follow it with `sparkgpu logs {rd.job_id} --follow`, then ask again"
        )
    call = sparkgpu.attach(rd.job_id)
    try:
        results = call.result()
    except PolicyViolationError:
        raise
    except SparkGPUError as exc:
        print(f"sparkgpu: job {rd.job_id} {status}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    for rank, value in enumerate(results):
        print(f"[rank{rank}] {value!r}")
    return EXIT_OK
