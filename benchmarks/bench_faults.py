"""Faults on a Spark cluster: seconds from the fault to (a) every rank of the faulty attempt
stopped and (b) the first training step after it, beside TorchDistributor on the same cluster.

One real standalone cluster on this host (master, two workers with 2 simulated GPUs each, a
Spark Connect server; ``tests/integration/spark_cluster.py``). Both peers run the same 4-rank
gloo data-parallel loop (a linear model, one all_reduce per step), which checkpoints every step
and, once past step ``KILL_STEP``, steps slowly until the fault stops it. Faults, one per run:

  * ``rank``: rank 3 kills itself with SIGKILL;
  * ``executor``: the executor JVM of worker 1 is killed with SIGKILL (its worker starts a new one);
  * ``client``: the Python process that submitted the job is killed with SIGKILL.

Peers:

  * sparkgpu ``spark.gpu.train(max_restarts=1)`` with ``Checkpointer``: the next attempt
    resumes from the last checkpoint; after a client's death ``sparkgpu resume JOB_ID`` does
    (started as soon as the ranks stopped, as an operator's script would);
  * ``pyspark.ml.torch.distributor.TorchDistributor(local_mode=False)``, 4 processes: it has no
    checkpoint/restart of its own, so (b) is whatever Spark does (a barrier stage retried from
    step 0, or nothing), and the outcome (error, or still running at ``--limit``) is recorded
    with its time.

The floor measured in the same run: a new ``python`` that imports torch and loads the
checkpoint's bytes.

``--repeats N`` (3) passes over the faults, each in a fresh process on a fresh cluster; every
figure is the median of the passes, with its spread. ``--base REV`` (default: the commit before the
node-0 hub) measures sparkgpu as it was at ``REV`` beside each pass, in the same run: a checkout of
``REV`` with its own virtual environment (``make venv`` there: its editable install is what its jobs
ship), its own cluster of the same shape, its own ``bench_faults.py``; the two alternate which goes
first. ``before_after`` holds the ratios of the medians and whether the spreads are apart.

    python benchmarks/bench_faults.py [--faults rank,executor,client] [--limit 120] [--repeats 3] [--base REV]

Writes benchmarks/results/faults.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from common import load_seen, machine, method, separated, spread  # noqa: E402

KILL_STEP = 3
RANKS = 4
CLIENT_TIMEOUT = 10.0  # SPARKGPU_SPARK_CLIENT_TIMEOUT of the client that is killed

# -- on the ranks ------------------------------------------------------------------------------


def _record(timeline: str, event: str, **fields) -> None:
    line = json.dumps({"event": event, "time": time.time(), "pid": os.getpid(), **fields})
    with open(timeline, "a") as f:
        f.write(line + "\n")


def _step(model, opt, torch, dist) -> None:
    loss = model(torch.ones(8, 64)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    flag = torch.ones(1)
    dist.all_reduce(flag)  # the ranks stay in lockstep, as data-parallel training does


def _fault_here(timeline: str, fault: str, rank: int, world: int) -> None:
    """After the checkpoint of KILL_STEP, once per benchmark run: rank ``world - 1`` kills itself."""
    marker = Path(timeline + ".fault")
    if fault == "rank" and rank == world - 1 and not marker.exists():
        marker.write_text("done")
        _record(timeline, "fault", rank=rank)
        os.kill(os.getpid(), signal.SIGKILL)


def sparkgpu_train(timeline: str, fault: str, limit: float) -> int:
    """The loop under sparkgpu: ``Checkpointer`` saves every step, a resumed attempt stops after one step."""
    import torch
    import torch.distributed as dist

    from sparkgpu import runtime
    from sparkgpu.train import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ckpt = Checkpointer(every_steps=1, keep_last=2, async_save=False)
    step = ckpt.restore(model=model, optimizer=opt)
    rank, world, attempt = runtime.get_global_rank(), runtime.get_world_size(), runtime.attempt()
    _record(timeline, "started", rank=rank, attempt=attempt, step=step)
    resumed, deadline = step > 0, time.time() + limit
    while time.time() < deadline and not runtime.should_checkpoint():
        _step(model, opt, torch, dist)
        ckpt.maybe_save(step, model=model, optimizer=opt)
        step += 1
        if rank == 0:
            _record(timeline, "step", step=step, attempt=attempt)
        if resumed:
            break
        if step == KILL_STEP:
            if rank == 0:
                _record(timeline, "checkpointed")
            _fault_here(timeline, fault, rank, world)
        if step >= KILL_STEP:
            time.sleep(0.5)
    ckpt.close()
    return step


def torch_distributor_train(timeline: str, fault: str, limit: float) -> int:
    """The same loop as TorchDistributor runs it (torchrun per task; no restart of its own)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    _record(timeline, "started", rank=rank, attempt=0, step=0)
    step, deadline = 0, time.time() + limit
    try:
        while time.time() < deadline:
            _step(model, opt, torch, dist)
            step += 1
            if rank == 0:
                _record(timeline, "step", step=step, attempt=0)
                if step == KILL_STEP:
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, timeline + ".pt")
                    _record(timeline, "checkpointed")
            if step == KILL_STEP:
                _fault_here(timeline, fault, rank, world)
            if step >= KILL_STEP:
                time.sleep(0.5)
    finally:
        dist.destroy_process_group()
    return step


# -- on the client -----------------------------------------------------------------------------


def _events(timeline: Path) -> list[dict]:
    if not timeline.exists():
        return []
    return [json.loads(line) for line in timeline.read_text().splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait(check, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    return None


def _measure(timeline: Path, fault_at: float | None, limit: float, ended) -> dict:
    """(a) and (b) from the timeline and the ranks' pids; waits at most ``limit`` for either."""
    _wait(lambda: any(e["event"] == "checkpointed" for e in _events(timeline)), limit)
    if fault_at is None:  # a rank records its own death
        fault_at = _wait(lambda: next((e["time"] for e in _events(timeline) if e["event"] == "fault"), None), limit)
    if fault_at is None:
        return {"fault": f"none within {limit:g}s"}
    before = {e["pid"] for e in _events(timeline) if e["event"] == "started" and e["time"] < fault_at}
    stopped = _wait(lambda: not any(_alive(p) for p in before) and time.time(), limit)

    def first_step_after() -> dict | None:
        found = next(
            (e for e in _events(timeline) if e["event"] == "step" and e["pid"] not in before and e["time"] > fault_at),
            None,
        )
        return found or ({"ended": True} if ended() else None)

    first = _wait(first_step_after, limit)
    first = first if first and "time" in first else None
    return {
        "fault_to_ranks_stopped_s": round(stopped - fault_at, 2) if stopped else f"still running after {limit:g}s",
        "fault_to_first_step_after_s": (
            round(first["time"] - fault_at, 2) if first else "none: no step ran after the fault"
        ),
        "first_step_after_is_step": first["step"] if first else None,  # KILL_STEP + 1: resumed; 1: from scratch
        "fault_at": fault_at,
    }


def _with_outcome(figures: dict, outcome: dict, limit: float) -> dict:
    """The figures with how the call ended (or that it had not) and when, after the fault."""
    fault_at = figures.pop("fault_at", None)
    figures["outcome"] = outcome.get("outcome", f"still running after {limit:g}s")
    if "at" in outcome and fault_at:
        figures["outcome_after_fault_s"] = round(outcome["at"] - fault_at, 2)
    return figures


def _in_thread(call) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run():
        try:
            result = call()
            outcome.update(outcome=f"returned {str(result)[:120]}", at=time.time())
        except BaseException as exc:  # what the peer raised is the finding
            outcome.update(
                outcome=f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:240] if str(exc) else ''}",
                at=time.time(),
            )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _kill_executor_when_checkpointed(cluster, timeline: Path, limit: float) -> float:
    _wait(lambda: any(e["event"] == "checkpointed" for e in _events(timeline)), limit)
    (pid,) = [pid for pid, worker in cluster.executor_pids().values() if worker == 1]
    fault_at = time.time()
    os.kill(pid, signal.SIGKILL)
    return fault_at


def run_in_process(peer: str, fault: str, spark, cluster, folder: Path, limit: float) -> dict:
    timeline = folder / f"{peer}-{fault}.jsonl"
    if peer == "sparkgpu":
        call = functools.partial(
            spark.gpu.train,
            sparkgpu_train,
            gpus=RANKS,
            gpu_type="A10",
            args=(str(timeline), fault, limit),
            max_restarts=1,
            wait_timeout=limit,
            log_ranks=None,
            callbacks=[],
        )
    else:
        from pyspark.ml.torch.distributor import TorchDistributor

        distributor = TorchDistributor(num_processes=RANKS, local_mode=False, use_gpu=False)
        call = functools.partial(distributor.run, torch_distributor_train, str(timeline), fault, limit)
    thread, outcome = _in_thread(call)
    fault_at = _kill_executor_when_checkpointed(cluster, timeline, limit) if fault == "executor" else None
    figures = _measure(timeline, fault_at, limit, lambda: not thread.is_alive())
    thread.join(limit)
    if thread.is_alive():
        spark.interruptAll()
        thread.join(60)
        outcome.setdefault("outcome", f"still running after {limit:g}s (interrupted)")
    return _with_outcome(figures, outcome, limit)


CLIENT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {benchmarks!r})
    import cloudpickle, pyspark.cloudpickle
    import bench_faults
    cloudpickle.register_pickle_by_value(bench_faults)
    pyspark.cloudpickle.register_pickle_by_value(bench_faults)
    from pyspark.sql import SparkSession
    import sparkgpu

    spark = SparkSession.builder.remote({url!r}).getOrCreate()
    args = ({timeline!r}, "client", {limit!r})
    if {peer!r} == "sparkgpu":
        spark.gpu.train(bench_faults.sparkgpu_train, gpus=4, gpu_type="A10", args=args, name="faults_client",
                        log_ranks=None, callbacks=[])
    else:
        from pyspark.ml.torch.distributor import TorchDistributor
        TorchDistributor(num_processes=4, local_mode=False, use_gpu=False).run(bench_faults.torch_distributor_train, *args)
""")


def run_client_death(peer: str, cluster, folder: Path, limit: float) -> dict:
    timeline = folder / f"{peer}-client.jsonl"
    script = folder / f"client-{peer}.py"
    script.write_text(
        CLIENT.format(
            benchmarks=str(Path(__file__).parent),
            url=cluster.connect_url,
            timeline=str(timeline),
            limit=limit,
            peer=peer,
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARKGPU_SPARK_CLIENT_TIMEOUT": str(CLIENT_TIMEOUT)}
    client = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _wait(lambda: any(e["event"] == "checkpointed" for e in _events(timeline)) or client.poll() is not None, limit)
    if client.poll() is not None:
        return {"outcome": f"the client failed before the fault: {client.stderr.read().decode()[-500:]}"}
    fault_at = time.time()
    client.kill()
    client.wait()
    resume: dict = {}

    def resume_when_stopped() -> bool:
        if peer != "sparkgpu":
            return False  # TorchDistributor has no way to continue a job
        before = {e["pid"] for e in _events(timeline) if e["event"] == "started"}
        if any(_alive(p) for p in before):
            return False
        (run_dir,) = Path(os.environ["SPARKGPU_HOME"], "runs").glob("faults-client-*")
        done = subprocess.run(
            [sys.executable, "-m", "sparkgpu.cli", "resume", run_dir.name],
            env=env,
            capture_output=True,
            text=True,
            timeout=limit,
        )
        resume.update(outcome=f"sparkgpu resume: exit {done.returncode}: {done.stdout.strip()[-200:]}", at=time.time())
        return True

    resumer = threading.Thread(target=lambda: _wait(resume_when_stopped, limit), daemon=True)
    resumer.start()
    figures = _measure(timeline, fault_at, limit, lambda: False)
    resumer.join(limit)
    if peer != "sparkgpu":
        resume["outcome"] = (
            "no way to continue the job; the Connect server runs it on without its client, and its "
            "ranks stop only when the function returns"
        )
    return _with_outcome(figures, resume, limit)


#: The commit before the control plane moved to node 0's hub (#24): "no worse" is measured against it.
BASE = "8867c37"
_TIMES = ("fault_to_ranks_stopped_s", "fault_to_first_step_after_s")
_FLOOR = "floor: python + import torch + load the checkpoint (s)"


@contextlib.contextmanager
def base_checkout(rev: str, folder: Path):
    """A checkout of ``rev`` with its own virtual environment (its editable install is what its
    jobs ship); yields the command that runs its bench_faults.py."""
    tree = folder / f"sparkgpu-{rev}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
    try:
        subprocess.run(["make", "-C", str(tree), "venv"], check=True, stdout=subprocess.DEVNULL)
        yield [str(tree / ".venv" / "bin" / "python"), str(tree / "benchmarks" / "bench_faults.py")], tree
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def run_once(command: list[str], cwd: Path, args, out: Path, peers: str) -> dict:
    """One pass over the faults by ``command`` (this script, or the base's) in a fresh process
    with its own cluster; its results."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPARKGPU_HOME", "VIRTUAL_ENV")}
    command = command + ["--faults", args.faults, "--peers", peers, "--limit", str(args.limit), "--out", str(out)]
    subprocess.run(command, cwd=cwd, env=env, check=True)
    return json.loads(out.read_text())["results"]


def combine(runs: list[dict]) -> dict:
    """The runs' results per key: each time as the median of the runs (with its spread), the
    outcomes as they came."""
    combined: dict[str, dict] = {}
    for key in runs[0]:
        values = [run[key] for run in runs if key in run]
        entry: dict[str, object] = {}
        for name in values[0]:
            seen = [v.get(name) for v in values]
            numbers = [x for x in seen if isinstance(x, (int, float)) and not isinstance(x, bool)]
            if len(numbers) == len(seen):
                entry[name] = round(statistics.median(numbers), 2)
                entry[f"{name}_spread"] = spread(numbers)
            elif name in ("outcome", "first_step_after_is_step") or not numbers:
                entry[name] = seen[0] if len(set(map(str, seen))) == 1 else seen
            else:  # some runs had no figure (a limit reached): said, not averaged away
                entry[name] = f"{len(numbers)} of {len(seen)} runs had a figure: {seen}"
        combined[key] = entry
    return combined


def before_after(results: dict, rev: str) -> dict:
    """For each fault: this checkout's median seconds over ``rev``'s (below 1: faster now), and
    whether the two spreads are apart (their interquartile ranges do not overlap)."""
    ratios: dict[str, dict] = {}
    for key, now in results.items():
        if not key.startswith("sparkgpu,"):
            continue
        then = results.get(key.replace("sparkgpu,", f"sparkgpu@{rev},", 1), {})
        entry: dict[str, object] = {}
        for name in _TIMES:
            if isinstance(now.get(name), (int, float)) and isinstance(then.get(name), (int, float)):
                entry[name] = round(now[name] / then[name], 2)
                entry[f"{name}_beyond_noise"] = separated(now[f"{name}_spread"], then[f"{name}_spread"])
            else:
                entry[name] = "not comparable: one of the two has no figure"
        ratios[key.removeprefix("sparkgpu, ")] = entry
    return ratios


def repeated(args) -> None:
    """``--repeats`` passes, each in a fresh process with its own cluster; with ``--base``, a pass
    of the base commit beside each, the two alternating which goes first."""
    facts = machine()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="sparkgpu-bench-faults-") as tmp, contextlib.ExitStack() as stack:
        folder = Path(tmp)
        base = stack.enter_context(base_checkout(args.base, folder)) if args.base else None
        here = [sys.executable, str(Path(__file__).resolve()), "--repeats", "1", "--base", ""]
        for repeat in range(args.repeats):
            passes = [("here", here, ROOT, args.peers)]
            if base is not None:
                passes.append(("base", base[0], base[1], "sparkgpu"))
            merged: dict[str, dict] = {}
            for which, command, cwd, peers in passes if repeat % 2 == 0 else passes[::-1]:
                print(f"bench_faults: repeat {repeat}, {which}", flush=True)
                results = run_once(command, cwd, args, folder / f"{which}-{repeat}.json", peers)
                if which == "base":
                    results = {
                        k.replace("sparkgpu,", f"sparkgpu@{args.base},", 1).replace(_FLOOR, f"{_FLOOR} @{args.base}"): v
                        for k, v in results.items()
                        if k.startswith("sparkgpu,") or k == _FLOOR
                    }
                merged.update(results)
            runs.append(merged)
    report = {
        "question": "fault -> every rank of the attempt stopped -> first training step after it, on a Spark cluster",
        "setup": (
            f"standalone master + 2 workers (2 cores, 2 simulated GPUs each) + Spark Connect server on this host, "
            f"started afresh for every pass; {RANKS} gloo ranks; sparkgpu: 2 nodes x 2 ranks, max_restarts=1, client "
            f"heartbeat timeout {CLIENT_TIMEOUT:g}s; TorchDistributor: {RANKS} tasks x 1 process"
        ),
        "limit_s": args.limit,
        "method": method(
            "from the fault (the SIGKILL) to every rank of the attempt gone, and to the first training step after it",
            startup="counted: the next attempt's scheduling and start-up are what a restart costs",
            repeats=args.repeats,
            statistic="median over the passes of each figure",
            order=f"each pass a fresh process and cluster; this checkout's pass and sparkgpu@{args.base}'s alternate "
            "which goes first"
            if args.base
            else "each pass a fresh process and cluster",
        ),
        "results": combine(runs),
        "machine": load_seen(facts),
    }
    if args.base:
        report["base"] = f"sparkgpu@{args.base}: measured by that commit's own bench_faults.py, from a checkout of it"
        report["before_after"] = before_after(report["results"], args.base)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report.get("before_after", report["results"]), indent=2))


def floor(folder: Path) -> float:
    """A new python that imports torch and loads the checkpoint's bytes."""
    import torch

    path = folder / "floor.pt"
    model = torch.nn.Linear(64, 64)
    torch.save(
        {"model": model.state_dict(), "optimizer": torch.optim.SGD(model.parameters(), lr=1e-3).state_dict()}, path
    )
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import torch; torch.load({str(path)!r})"], check=True)
    return round(time.perf_counter() - started, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", default="rank,executor,client")
    parser.add_argument("--peers", default="sparkgpu,TorchDistributor")
    parser.add_argument("--limit", type=float, default=120.0, help="seconds each measurement waits at most")
    parser.add_argument("--out", default=str(RESULTS / "faults.json"))
    parser.add_argument("--base", default=BASE, help="measure sparkgpu at this commit beside ('' to skip)")
    parser.add_argument("--repeats", type=int, default=3, help="passes over the faults, each on a fresh cluster")
    args = parser.parse_args()
    if args.repeats > 1 or args.base:
        return repeated(args)

    from bench_spark_launch import _workers_share_this_python

    import sparkgpu.api.spark_gpu
    from tests.integration.spark_cluster import LocalSparkCluster

    sparkgpu.api.spark_gpu.attach()
    load_before = os.getloadavg()[0]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="sparkgpu-bench-faults-") as tmp:
        folder = Path(tmp)
        os.environ["SPARKGPU_HOME"] = str(folder / "home")
        os.environ["SPARKGPU_TRACKING"] = "0"  # TorchDistributor tracks nothing either
        _workers_share_this_python(folder)
        with LocalSparkCluster(
            folder / "cluster", workers=2, gpus_per_worker=2, cores_per_worker=2, name="sparkgpu-bench-faults"
        ) as cluster:
            spark = cluster.session()
            type(spark)._set_default_and_active_session(spark)  # TorchDistributor takes the active session
            results["floor: python + import torch + load the checkpoint (s)"] = {"seconds": floor(folder)}
            for fault in args.faults.split(","):
                for peer in args.peers.split(","):
                    print(f"bench_faults: {peer}, fault {fault}", flush=True)
                    if fault == "client":
                        figures = run_client_death(peer, cluster, folder, args.limit)
                    else:
                        figures = run_in_process(peer, fault, spark, cluster, folder, args.limit)
                    results[f"{peer}, {fault} SIGKILL"] = figures
                    print(f"  {json.dumps(figures)}", flush=True)
                    # A killed executor is replaced before the next run, and answers the capacity probe.
                    cluster.wait_for_executors(args.limit)
                    _wait(lambda: spark.gpu.capacity(refresh=True).total_gpus >= 4, args.limit)
            spark.stop()

    report = {
        "question": "fault -> every rank of the attempt stopped -> first training step after it, on a Spark cluster",
        "setup": (
            f"standalone master + 2 workers (2 cores, 2 simulated GPUs each) + Spark Connect server on this host; "
            f"{RANKS} gloo ranks; sparkgpu: 2 nodes x 2 ranks, max_restarts=1, client heartbeat timeout "
            f"{CLIENT_TIMEOUT:g}s; TorchDistributor: {RANKS} tasks x 1 process"
        ),
        "limit_s": args.limit,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        },
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
