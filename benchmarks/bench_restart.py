"""Restart -> first resumed step: how long a job is down after a rank dies.

A rank of a 2-rank gloo job is killed with SIGKILL right after a checkpoint was committed.
Timed from the kill to the moment the restarted job has restored that checkpoint and finished
its next training step, on the same model + SGD-momentum state for every peer, in one run:

  * sparkgpu ``@distributed(max_restarts=1)`` with ``Checkpointer``, the default local backend:
    the first attempt starts cold, the restart's ranks are forked from the job's standby (a
    process with torch imported, started while the first attempt runs)
  * the same with the standby off (``LocalBackend(standby=False)``: a new node agent and new
    rank processes, as after a lost node)
  * the same through the warm pool (``backend="warm_pool"``: every attempt's ranks forked with torch
    imported)
  * ``torchrun --standalone --max-restarts=1`` running a script that checkpoints with
    ``torch.save`` on rank 0 and resumes with ``torch.load`` (the usual hand-written loop), with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it, restarted gloo ranks sometimes read the
    previous round's addresses from the shared rendezvous store and fail to connect
    (pytorch/pytorch#135712); sparkgpu starts each attempt with a store of its own

Floor measured in the same run: a fresh ``python`` that imports torch and loads the same
checkpoint bytes with ``torch.load``, twice in parallel — what any restart that starts new
processes pays once it has decided to restart (failure detection and rendezvous excluded).

Every side runs ``--repeats`` times (default 9), the sides' order reversed every other repeat so
drift on a shared machine hits every side alike. Medians are quoted with the spread (quartiles,
min, max, every run); ``medians_separated`` says whether two sides' interquartile ranges do not
overlap. A torchrun run whose restart aborted is run again and listed, not timed.

    python benchmarks/bench_restart.py [--size-mb 256] [--repeats 9]   # about 8 minutes on 2 cores

Writes benchmarks/results/restart.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import load_seen, machine, method, separated, spread  # noqa: E402

RESULTS = Path(__file__).parent / "results"
KILL_STEP = 3
WIDTH = 1024

# One training step, the model and the timeline records: shared verbatim by the sparkgpu
# function and the torchrun script, so both peers do the same work.
COMMON = textwrap.dedent(
    f"""
    import json, os, signal, time
    import torch
    import torch.distributed as dist

    WIDTH = {WIDTH}
    KILL_STEP = {KILL_STEP}

    def build(size_mb):
        torch.manual_seed(0)
        layers = max(1, round(size_mb * 1e6 / (2 * 4 * WIDTH * WIDTH)))  # weights + momentum
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
        return model, torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    def train_step(model, opt):
        loss = model(torch.ones(8, WIDTH)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        flag = torch.ones(1)
        dist.all_reduce(flag)  # the ranks stay in lockstep, as data-parallel training does

    def record(timeline, event):
        with open(timeline, "a") as f:
            f.write(json.dumps([event, time.time()]) + "\\n")

    def kill_self(timeline):
        record(timeline, "killed")
        os.kill(os.getpid(), signal.SIGKILL)
    """
)
exec(COMMON)  # noqa: S102 - the same definitions on the client, for the floor's checkpoint


def sparkgpu_job(size_mb: int, timeline: str):
    from sparkgpu import runtime
    from sparkgpu.train import Checkpointer

    namespace: dict = {}
    exec(COMMON, namespace)  # noqa: S102
    model, opt = namespace["build"](size_mb)
    ckpt = Checkpointer(async_save=False)
    step = ckpt.restore(model=model, optimizer=opt)
    resumed = step > 0
    while step < KILL_STEP + 2:
        namespace["train_step"](model, opt)
        step += 1
        if resumed and runtime.get_global_rank() == 0:
            namespace["record"](timeline, "first_resumed_step")
            break
        if step == KILL_STEP and runtime.attempt() == 0:
            ckpt.save(step, model=model, optimizer=opt)
            if runtime.get_global_rank() == 1:
                namespace["kill_self"](timeline)
    ckpt.close()
    return step


TORCHRUN_SCRIPT = COMMON + textwrap.dedent(
    """
    import sys
    size_mb, timeline, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = build(size_mb)
    step = 0
    if os.path.exists(path):
        state = torch.load(path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    resumed = step > 0
    while step < KILL_STEP + 2:
        train_step(model, opt)
        step += 1
        if resumed:
            if rank == 0:
                record(timeline, "first_resumed_step")
            break
        if step == KILL_STEP and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            if rank == 0:
                with open(path + ".tmp", "wb") as f:
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(path + ".tmp", path)
            dist.barrier()
            if rank == 1:
                kill_self(timeline)
    dist.destroy_process_group()
    """
)


def downtime(timeline: Path) -> float:
    events = dict(json.loads(line) for line in timeline.read_text().splitlines())
    return events["first_resumed_step"] - events["killed"]


def run_sparkgpu(size_mb: int, work: Path, backend) -> float:
    from sparkgpu import distributed

    timeline = work / f"timeline-{time.monotonic_ns()}.jsonl"
    job = distributed(gpus=2, gpu_type="cpu", max_restarts=1, backend=backend, log_ranks=None)(sparkgpu_job)
    job.distributed(size_mb, str(timeline))
    return downtime(timeline)


TORCHRUN_FAILURES: list[str] = []  # restarts torchrun did not survive, with what the ranks said


def run_torchrun(size_mb: int, work: Path, tries: int = 5) -> float:
    """Downtime of the first of ``tries`` torchrun runs whose restart succeeds.

    A restarted rank sometimes aborts while it re-initialises ("terminate called without an
    active exception", SIGABRT, no Python frame); such runs are recorded, not timed.
    """
    script = work / "torchrun_restart.py"
    script.write_text(TORCHRUN_SCRIPT)
    for _ in range(tries):
        stamp = time.monotonic_ns()
        timeline, checkpoint = work / f"timeline-torchrun-{stamp}.jsonl", work / f"torchrun-{stamp}.pt"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "1",
                str(script),
                str(size_mb),
                str(timeline),
                str(checkpoint),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        )
        if done.returncode == 0:
            return downtime(timeline)
        said = [line for line in done.stderr.splitlines() if "terminate called" in line or "exitcode" in line]
        # Recorded in results/: the interpreter's path says which machine ran it, not what happened.
        TORCHRUN_FAILURES.append(("; ".join(said[-3:]) or done.stderr[-300:]).replace(sys.executable, "python"))
        print(f"torchrun's restart failed ({TORCHRUN_FAILURES[-1]}); running it again", flush=True)
    raise RuntimeError(f"torchrun's restart failed {tries} times in a row: {TORCHRUN_FAILURES[-tries:]}")


def run_floor(size_mb: int, work: Path) -> float:
    path = work / "floor.pt"
    if not path.exists():
        model, opt = build(size_mb)  # noqa: F821 - defined by exec(COMMON)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)  # noqa: F821
    code = f"import torch; torch.load({str(path)!r})"
    started = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError("the floor's torch.load failed")
    return time.perf_counter() - started


def cold_backend():
    from sparkgpu.launch.backends.local.backend import LocalBackend

    return LocalBackend(standby=False)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=256, help="model + optimizer state size")
    parser.add_argument("--repeats", type=int, default=9, help="runs of every side, the same count for all")
    parser.add_argument("--out", default=str(RESULTS / "restart.json"))
    args = parser.parse_args(argv)

    peers = {
        "sparkgpu": lambda work: run_sparkgpu(args.size_mb, work, "local"),
        "sparkgpu_no_standby": lambda work: run_sparkgpu(args.size_mb, work, cold_backend()),
        "sparkgpu_warm_pool": lambda work: run_sparkgpu(args.size_mb, work, "warm_pool"),
        "torchrun_torch_save": lambda work: run_torchrun(args.size_mb, work),
        "floor_process_import_torch_load": lambda work: run_floor(args.size_mb, work),
    }
    samples: dict[str, list[float]] = {name: [] for name in peers}
    facts = machine()
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        os.environ["SPARKGPU_HOME"] = str(Path(tmp) / "home")
        os.environ.setdefault("SPARKGPU_TRACKING", "0")  # restart latency only; tracking is measured apart
        from sparkgpu.launch.backends.local.zygote_client import stop_warm_zygote

        try:
            run_sparkgpu(args.size_mb, Path(tmp), "warm_pool")  # starts the warm pool: its start is not a restart
            names = list(peers)
            for repeat in range(args.repeats):
                # Round-robin, the order reversed every other repeat: drift and whatever a side
                # leaves behind (page cache, a dying process) hit every side alike.
                for name in names if repeat % 2 == 0 else names[::-1]:
                    samples[name].append(peers[name](Path(tmp)))
                    print(f"repeat {repeat} {name}: {samples[name][-1]:.2f} s", flush=True)
        finally:
            stop_warm_zygote()  # the warm pool would outlive the run for an hour, in a deleted SPARKGPU_HOME

    medians = {name: statistics.median(values) for name, values in samples.items()}
    spreads = {name: spread(values) for name, values in samples.items()}
    result = {
        "question": "restart -> first resumed step after SIGKILL of a rank (2 gloo ranks on CPU)",
        "state_mb": args.size_mb,
        "kill_step": KILL_STEP,
        "machine": load_seen(facts),
        "seconds": samples,
        "median_seconds": medians,
        "spread_seconds": spreads,
        "medians_separated": {
            "sparkgpu vs torchrun_torch_save": separated(spreads["sparkgpu"], spreads["torchrun_torch_save"]),
            "sparkgpu_warm_pool vs torchrun_torch_save": separated(
                spreads["sparkgpu_warm_pool"], spreads["torchrun_torch_save"]
            ),
            "sparkgpu vs sparkgpu_no_standby": separated(spreads["sparkgpu"], spreads["sparkgpu_no_standby"]),
        },
        "method": method(
            "SIGKILL of a rank to the restarted job's first step after restoring the checkpoint",
            startup="inside: the restart is what is timed; the warm pool is started once before the repeats",
            repeats=args.repeats,
            statistic="median, with quartiles and every run",
            order="sides round-robin, the order reversed every other repeat",
            ranks="2 gloo ranks on CPU for every side",
        ),
        "torchrun_failed_restarts": {
            "count": len(TORCHRUN_FAILURES),
            "timed_runs": args.repeats,
            "what_the_ranks_said": TORCHRUN_FAILURES,
        },
        "ratios": {
            "torchrun_over_sparkgpu": medians["torchrun_torch_save"] / medians["sparkgpu"],
            "torchrun_over_sparkgpu_warm_pool": medians["torchrun_torch_save"] / medians["sparkgpu_warm_pool"],
            "sparkgpu_over_floor": medians["sparkgpu"] / medians["floor_process_import_torch_load"],
            "sparkgpu_no_standby_over_sparkgpu": medians["sparkgpu_no_standby"] / medians["sparkgpu"],
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for name, value in spreads.items():
        print(
            f"{name:34s} median {value['median']:6.2f} s  (quartiles {value['q1']:.2f}-{value['q3']:.2f}, "
            f"runs {value['min']:.2f}-{value['max']:.2f})"
        )
    print(json.dumps(result["medians_separated"], indent=2))


if __name__ == "__main__":
    main()
