"""Submit and walk away: what detaching a job's supervisor costs, and how fast a killed one is replaced.

On the same 2-rank CPU function, in one run, each measured from a fresh client process (start-up
of the client counted the same way for both):
  * ``returned_s``: the client's ``submit`` call returning, detached (the default for local jobs)
    against ``detach=False`` (supervised by a thread of the client, as before); ``submit_call_s``
    the ``submit`` call alone (the job prepared, staged and its supervision started);
  * ``first_step_s``: from the same start to the first step's marker written by rank 0;
  * ``takeover_s``: a detached job's supervisor SIGKILLed mid-run -> the next step trained by the
    attempt its replacement started (the keeper notices the death, a new supervisor takes the job
    over from its run dir, a new agent starts the ranks, they resume from their checkpoint).

Medians of the same number of repeats, the order of the two ways alternating.

    python benchmarks/bench_detach.py [--repeats 5]

Writes benchmarks/results/detach.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from common import load_seen, machine, method, spread

RESULTS = Path(__file__).parent / "results"

JOB = textwrap.dedent("""
    import os, time
    from sparkgpu import distributed, runtime

    def steps(where, n):
        import torch.distributed as dist
        rank, attempt = runtime.get_global_rank(), runtime.attempt()
        progress = os.path.join(runtime.checkpoint_dir(), f"rank-{rank}")
        step = int(open(progress).read()) if os.path.exists(progress) else 0
        while step < n:
            dist.barrier()
            step += 1
            with open(progress, "w") as f:
                f.write(str(step))
            if rank == 0:
                open(os.path.join(where, f"step-{attempt}-{step}"), "w").close()
            time.sleep(0.2)
        return step
""")

CLIENT = textwrap.dedent("""
    import sys, time
    t0 = float(sys.argv[3])
    sys.path.insert(0, sys.argv[1])
    from bench_job import steps
    from sparkgpu import distributed
    job = distributed(gpus=2, gpu_type="cpu", log_ranks=None, detach={detach})(steps)
    called = time.time()
    call = job.submit(sys.argv[2], {steps})
    print(call.job_id, time.time() - t0, time.time() - called, flush=True)
    {after}
""")


def _wait(path: Path, within: float = 300.0) -> float:
    deadline = time.monotonic() + within
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} never appeared")
        time.sleep(0.005)
    return time.time()


def one_launch(root: Path, detach: bool, n: int) -> dict:
    """A fresh client submits; when did submit return, when did rank 0 finish step 1."""
    where = Path(tempfile.mkdtemp(dir=root))
    after = "" if detach else "call.wait()"  # an attached job needs its client until it ends
    script = where / "client.py"
    script.write_text(CLIENT.format(detach=detach, steps=n, after=after))
    t0 = time.time()
    client = subprocess.Popen(
        [sys.executable, str(script), str(root), str(where), repr(t0)], stdout=subprocess.PIPE, text=True
    )
    job_id, returned, call = client.stdout.readline().split()
    first = _wait(where / "step-0-1") - t0
    client.wait(timeout=300)
    return {
        "job_id": job_id,
        "returned_s": float(returned),
        "submit_call_s": float(call),
        "first_step_s": first,
        "where": where,
    }


def one_takeover(root: Path, home: Path) -> float:
    """Seconds from a detached job's supervisor SIGKILLed to the first step of the attempt that replaced it."""
    launch = one_launch(root, True, 400)
    where, state_file = launch["where"], home / "runs" / launch["job_id"] / "state.json"
    _wait(where / "step-0-3")
    supervisor = json.loads(state_file.read_text())["client"]["pid"]
    killed = time.time()
    os.kill(supervisor, signal.SIGKILL)
    # The new attempt resumes at the checkpointed step + 1, whichever it is: wait for any step of attempt 1.
    deadline = time.monotonic() + 300
    while not any(where.glob("step-1-*")):
        if time.monotonic() > deadline:
            raise TimeoutError("no supervisor took over")
        time.sleep(0.005)
    took = time.time() - killed
    from sparkgpu.cli import main as cli

    cli(["cancel", launch["job_id"], "--timeout", "60"])
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    facts = machine()
    with tempfile.TemporaryDirectory() as tmp:
        root, home = Path(tmp), Path(tmp) / "home"
        (root / "bench_job.py").write_text(JOB)
        os.environ.update({"SPARKGPU_HOME": str(home), "SPARKGPU_TRACKING": "0"})
        one_launch(root, True, 1)  # warm the page cache once, for both ways alike
        runs: dict[str, list[dict]] = {"detached": [], "attached": []}
        for repeat in range(args.repeats):
            for way in ("detached", "attached") if repeat % 2 == 0 else ("attached", "detached"):
                runs[way].append(one_launch(root, way == "detached", 1))
        takeovers = [one_takeover(root, home) for _ in range(args.repeats)]
    result = {
        "machine": load_seen(facts),
        "method": method(
            "a fresh client process's start to submit returning, and to rank 0's first step",
            startup="inside both: the client's interpreter start and imports",
            repeats=args.repeats,
            load_note=(
                "a detached job's keeper, supervisor, agent and ranks are not this process's children "
                "(they outlive the client by design): machine/other_cpu_share_during_run counts their CPU "
                "as other; busy_cores_at_start is the quiet machine's check"
            ),
        ),
        "returned_s": {way: spread([r["returned_s"] for r in rs]) for way, rs in runs.items()},
        "submit_call_s": {way: spread([r["submit_call_s"] for r in rs]) for way, rs in runs.items()},
        "first_step_s": {way: spread([r["first_step_s"] for r in rs]) for way, rs in runs.items()},
        "takeover_s": spread(takeovers),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "detach.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("returned_s", "submit_call_s", "first_step_s", "takeover_s")}, indent=2))


if __name__ == "__main__":
    main()
