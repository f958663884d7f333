"""A hung rank: how long until every rank's stacks are on disk and the job trains again, and what watching costs.

One 2-rank gloo job on CPU steps with a barrier a step and a checkpoint of its step number; in
its first attempt rank 1 stops at step ``--hang-at`` (it sleeps, as a rank stuck in a data
loader or a lost peer does). Measured from the moment rank 1 stops (its own marker), in one run:

* sparkgpu: ``progress_timeout=T``; ``stacks_s``: to ``hang.txt`` (every rank's stacks and the
  diagnosis) on disk; ``beyond_timeout_s``: that less ``T`` (the issue's goal: 10 s at most);
  ``next_step_s``: to the first step the restarted attempt trained;
* torchrun (``--standalone --max-restarts 1``, its documented single-node set-up: a c10d rendezvous
  on a free port, a new round per restart) running the same loop with gloo's own ``timeout=T`` given to
  ``init_process_group``, the way torch's docs set a collective timeout: ``first_signal_s``: to
  rank 0's first error (gloo's timeout), ``next_step_s``: to the restarted group's first step,
  over the runs whose restarted group formed (``torchrun_restarts_formed`` of ``torchrun_runs``:
  its gloo mesh sometimes fails to connect after the timeout, and that run trains no step again).
  No stacks are written on that side.

Then the cost of watching: inside a sparkgpu job, blocks of steps (a barrier each) with a
progress note per step alternate with blocks without (``step_ms``, medians of the blocks, and
whether they tie); a note's own cost timed over 200,000 calls (``note_us``) and as a share of
the bare barrier step, the cheapest step a job has (``note_overhead_pct``); and the time one read of the flight recorder for straggler arrivals takes with its ring
full (``arrivals_look_ms``), which a rank pays once a look (``arrivals_share_pct`` of the look).

    python benchmarks/bench_hangs.py [--repeats 3] [--timeout 10]

Writes benchmarks/results/hangs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from common import load_seen, machine, method, separated, spread

RESULTS = Path(__file__).parent / "results"

#: The loop both sides run: a barrier a step, the step number checkpointed in a file, rank 0 marks each step.
LOOP = textwrap.dedent("""
    import os, time

    def steps(where, n, hang_at, attempt, rank, checkpoint_dir, note):
        import torch.distributed as dist
        saved = os.path.join(checkpoint_dir, f"rank-{rank}")
        step = int(open(saved).read()) if os.path.exists(saved) else 0
        while step < n:
            if attempt == 0 and rank == 1 and step == hang_at:
                with open(os.path.join(where, "hung"), "w") as f:
                    f.write(repr(time.time()))
                time.sleep(3600)
            try:
                dist.barrier()
            except Exception:
                if not os.path.exists(os.path.join(where, "signal")):
                    with open(os.path.join(where, "signal"), "w") as f:
                        f.write(repr(time.time()))
                raise
            step += 1
            with open(saved, "w") as f:
                f.write(str(step))
            note(step)
            if rank == 0:
                with open(os.path.join(where, f"step-{attempt}-{step}"), "w") as f:
                    f.write(repr(time.time()))
            time.sleep(0.1)
        return step

    def job(where, n, hang_at):
        from sparkgpu import runtime
        return steps(where, n, hang_at, runtime.attempt(), runtime.get_global_rank(), runtime.checkpoint_dir(),
                     runtime.heartbeat)

    def cost(blocks, per_block):
        import pickle, time
        import torch.distributed as dist
        from sparkgpu import runtime
        from sparkgpu.launch.rank import arrivals
        timed = {"noted": [], "bare": []}
        for block in range(blocks):
            for way in (("noted", "bare") if block % 2 == 0 else ("bare", "noted")):
                dist.barrier()
                started = time.perf_counter()
                for step in range(per_block):
                    dist.barrier()
                    if way == "noted":
                        runtime.heartbeat(step)
                timed[way].append((time.perf_counter() - started) / per_block)
        calls = 200_000
        started = time.perf_counter()
        for step in range(calls):
            runtime.heartbeat(step)
        note_s = (time.perf_counter() - started) / calls
        looks = []
        for _ in range(5):
            started = time.perf_counter()
            found = arrivals.latest_arrivals(arrivals._entries("gloo"))
            looks.append(time.perf_counter() - started)
        from torch._C import _distributed_c10d as c10d
        ring = len(pickle.loads(c10d._dump_fr_trace(True, False, False))["entries"])
        return {"step_s": timed, "note_s": note_s, "look_s": looks, "ring": ring, "kept": len(found)}
""")

TORCHRUN = textwrap.dedent("""
    import datetime, os, sys
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    from bench_loop import steps
    where, n, hang_at, timeout = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    steps(where, n, hang_at, int(os.environ["TORCHELASTIC_RESTART_COUNT"]), dist.get_rank(), sys.argv[6],
          lambda step: None)
    dist.destroy_process_group()
""")


def _first_step(where: Path, attempt: int, within: float = 300.0) -> float:
    deadline = time.monotonic() + within
    while True:
        found = sorted(where.glob(f"step-{attempt}-*"))
        if found:
            return min(float(p.read_text() or "inf") for p in found if p.read_text())
        if time.monotonic() > deadline:
            raise TimeoutError(f"attempt {attempt} trained no step")
        time.sleep(0.01)


def one_sparkgpu(root: Path, timeout: float, n: int, hang_at: int) -> dict:
    from bench_loop import job

    from sparkgpu import distributed
    from sparkgpu.config import settings

    where = Path(tempfile.mkdtemp(dir=root))
    fn = distributed(gpus=2, gpu_type="cpu", max_restarts=1, progress_timeout=timeout, log_ranks=None)(job)
    assert fn.distributed(str(where), n, hang_at) == [n, n]
    hung = float((where / "hung").read_text())
    run_dir = settings().staging_root / fn.last_job_id
    stacks = (run_dir / "attempts" / "0" / "hang.txt").stat().st_mtime
    detected = json.loads((run_dir / "attempts" / "0" / "hang.json").read_text())["detected_at"]
    return {
        "diagnosed_s": detected - hung,
        "stacks_s": stacks - hung,
        "beyond_timeout_s": stacks - hung - timeout,
        "next_step_s": _first_step(where, 1) - hung,
    }


def one_torchrun(root: Path, timeout: float, n: int, hang_at: int) -> dict:
    where = Path(tempfile.mkdtemp(dir=root))
    checkpoints = where / "checkpoints"
    checkpoints.mkdir()
    script = root / "torchrun_job.py"
    script.write_text(TORCHRUN)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
        "--max-restarts", "1",
        str(script), str(root), str(where), str(n), str(hang_at), repr(timeout), str(checkpoints),
    ]  # fmt: skip
    # As torch's docs run it: no GLOO_SOCKET_IFNAME (set to lo, its restarted group's gloo mesh dialled
    # the first group's rank 0 and failed to form here).
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    formed = done.returncode == 0
    if not formed and "connectFullMesh failed" not in done.stderr:
        raise RuntimeError(f"torchrun failed ({done.returncode}):\n{done.stderr[-3000:]}")
    # A restarted group whose gloo mesh did not form is recorded as such: no next step to time.
    hung = float((where / "hung").read_text())
    return {
        "first_signal_s": float((where / "signal").read_text()) - hung,
        "next_step_s": _first_step(where, 1) - hung if formed else None,
        "restart_formed": formed,
    }


def watching_cost(blocks: int, per_block: int) -> dict:
    from bench_loop import cost

    from sparkgpu import distributed

    # A ring as full as a long job's: the arrivals read is timed with as many entries as it ever holds.
    fn = distributed(gpus=2, gpu_type="cpu", log_ranks=None, progress_timeout="off")(cost)
    return fn.distributed(blocks, per_block)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=10.0, help="progress_timeout, and gloo's timeout")
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--per-block", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=RESULTS / "hangs.json")
    args = parser.parse_args()
    facts = machine()
    n, hang_at = 8, 3
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "bench_loop.py").write_text(LOOP)
        sys.path.insert(0, str(root))
        os.environ.update({"SPARKGPU_HOME": str(root / "home"), "SPARKGPU_TRACKING": "0"})
        runs: dict[str, list[dict]] = {"sparkgpu": [], "torchrun": []}
        for repeat in range(args.repeats):
            for side in ("sparkgpu", "torchrun") if repeat % 2 == 0 else ("torchrun", "sparkgpu"):
                if side == "sparkgpu":
                    runs[side].append(one_sparkgpu(root, args.timeout, n, hang_at))
                else:
                    runs[side].append(one_torchrun(root, args.timeout, n, hang_at))
        watched = watching_cost(args.blocks, args.per_block)
    noted, bare = (spread(watched["step_s"][way]) for way in ("noted", "bare"))
    look = spread(watched["look_s"])
    from sparkgpu.launch.rank.arrivals import look_seconds

    default_look = look_seconds(60.0)
    result = {
        "machine": load_seen(facts),
        "method": method(
            "from rank 1's own marker as it stops, to hang.txt's mtime (sparkgpu) or rank 0's first error "
            "(torchrun, gloo's timeout), and to the first step the restarted attempt trained (rank 0's marker)",
            startup="inside both: the restart's process start and imports, the rendezvous, the resume",
            repeats=args.repeats,
            ranks=2,
            backend="gloo",
            timeout_s=args.timeout,
            cost=(
                f"{args.blocks} blocks of {args.per_block} barrier steps each way, alternating, in one job; "
                "the arrivals read timed 5 times in a rank after them"
            ),
        ),
        "timeout_s": args.timeout,
        "sparkgpu": {key: spread([r[key] for r in runs["sparkgpu"]]) for key in runs["sparkgpu"][0]},
        "torchrun": {
            key: spread([r[key] for r in runs["torchrun"] if r[key] is not None])
            for key in ("first_signal_s", "next_step_s")
            if any(r[key] is not None for r in runs["torchrun"])
        },
        "torchrun_restarts_formed": sum(r["restart_formed"] for r in runs["torchrun"]),
        "torchrun_runs": len(runs["torchrun"]),
        "step_ms": {"noted": noted["median"] * 1000, "bare": bare["median"] * 1000},
        "step_s": {"noted": noted, "bare": bare},
        "step_noted_vs_bare_pct": (noted["median"] - bare["median"]) / bare["median"] * 100,
        "step_noted_vs_bare_tie": not separated(noted, bare),
        "note_us": watched["note_s"] * 1e6,
        "note_overhead_pct": watched["note_s"] / bare["median"] * 100,
        "arrivals_look_ms": look["median"] * 1000,
        "arrivals_ring": watched["ring"],
        "arrivals_default_look_s": default_look,
        "arrivals_share_pct": look["median"] / default_look * 100,
    }
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "method", "step_s")}, indent=2))


if __name__ == "__main__":
    main()
