"""Metric logging from many ranks: what it costs the training loop and whether the store survives it.

Peers in the same run, each with N writer processes logging M metric points as fast as they
can through ``mlflow.log_metric`` (the call user code makes), into a fresh SQLite store:
  * sparkgpu spool (the default in jobs): ``MLFLOW_TRACKING_URI`` points at the job's spool,
    records are appended to per-process files, one flusher in this process forwards them
  * direct SQLite: every process writes into the same ``mlflow.db``
  * a local ``mlflow server`` on loopback (SQLite behind it): every process posts over HTTP
For each: wall time of the writers, time until every point is in the store, points lost,
and the errors the writers saw ("database is locked", ...).

Per-call cost inside one process (the price a training step pays per logged value):
  * ``sparkgpu.tracking.log`` on rank 0 in a job, ``mlflow.log_metric`` through the spool,
    ``mlflow.log_metric`` into SQLite and into the loopback server
  * ceiling: ``json.dumps`` of the same record and one ``os.write`` to an append-only file

    python benchmarks/bench_tracking.py [--writers 8] [--points 200] [--skip-server]

Writes benchmarks/results/tracking.json and tracking.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).parent / "results"

_WRITER = textwrap.dedent("""
    import json, os, sys, time
    import mlflow
    if os.environ["MLFLOW_TRACKING_URI"].startswith("sparkgpu-spool:"):
        from sparkgpu.tracking.spool import register_spool_scheme
        register_spool_scheme()
    rank, points, go = int(os.environ["RANK"]), int(sys.argv[2]), sys.argv[1]
    client = mlflow.MlflowClient()
    client.get_run(os.environ["MLFLOW_RUN_ID"])  # connect before the start signal
    open(f"{go}.ready{rank}", "w").close()
    while not os.path.exists(go):
        time.sleep(0.005)
    errors, start = [], time.perf_counter()
    for step in range(points):
        try:
            mlflow.log_metric(f"rank{rank}", float(step), step=step)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {str(exc)[:160]}")
    print(json.dumps({"seconds": time.perf_counter() - start, "errors": errors}))
""")


def _new_store(root: Path, name: str):
    from mlflow import MlflowClient
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    uri = f"sqlite:///{root / name}.db"
    SqlAlchemyStore(uri, (root / f"{name}-artifacts").as_uri())
    client = MlflowClient(uri)
    experiment = client.create_experiment(name, artifact_location=(root / f"{name}-artifacts").as_uri())
    return uri, client, client.create_run(experiment)


def _run_writers(env: dict, writers: int, points: int, root: Path) -> tuple[float, float, list[dict]]:
    """Starts the writers, releases them together; returns (release time, their wall time, outputs)."""
    go = root / f"go-{time.time_ns()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(go), str(points)],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(writers)
    ]
    while sum(os.path.exists(f"{go}.ready{r}") for r in range(writers)) < writers:  # imported and connected
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a writer died before the start: " + procs[0].communicate()[1][-500:])
        time.sleep(0.05)
    start = time.perf_counter()
    go.touch()
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        outputs.append(json.loads(lines[-1]) if lines else {"seconds": None, "errors": [err[-300:]]})
    return start, time.perf_counter() - start, outputs


def _landed(client, run_id: str, writers: int) -> int:
    return sum(len(client.get_metric_history(run_id, f"rank{r}")) for r in range(writers))


def _summary(name, wall, outputs, client, run_id, writers, points, until_stored):
    errors = [e for o in outputs for e in o["errors"]]
    landed = _landed(client, run_id, writers)
    return {
        "peer": name,
        "writers": writers,
        "points_per_writer": points,
        "writers_wall_s": round(wall, 3),
        "until_stored_s": round(until_stored, 3),
        "slowest_logging_loop_s": round(max(o["seconds"] or 0 for o in outputs), 3),
        "points_per_s_to_store": round(landed / until_stored, 1) if until_stored else None,
        "points_lost": writers * points - landed,
        "errors": len(errors),
        "database_locked_errors": sum("database is locked" in e for e in errors),
        "first_error": errors[0] if errors else None,
    }


def bench_spool(root, writers, points):
    from sparkgpu.tracking.flusher import SpoolFlusher
    from sparkgpu.tracking.spool import JobRunInfo, SpoolDir

    uri, client, run = _new_store(root, "spool")
    spool = SpoolDir(root / "spool-run" / "tracking")
    spool.write_run_info(
        JobRunInfo(
            run.info.run_id,
            run.info.experiment_id,
            "spool",
            uri,
            uri,
            run.info.artifact_uri,
            "bench",
            "bench",
            "me",
            time.time(),
        )
    )
    flusher = SpoolFlusher(spool, client, run.info.run_id, interval=0.2)
    flusher.start()
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": spool.uri,
        "MLFLOW_RUN_ID": run.info.run_id,
        "SPARKGPU_MLFLOW_TRACKING_URI": uri,
    }
    released, wall, outputs = _run_writers(env, writers, points, root)
    flusher.stop()  # forwards what is left
    until_stored = time.perf_counter() - released
    return _summary("sparkgpu spool", wall, outputs, client, run.info.run_id, writers, points, until_stored)


def bench_sqlite(root, writers, points):
    uri, client, run = _new_store(root, "direct")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": run.info.run_id}
    _, wall, outputs = _run_writers(env, writers, points, root)
    return _summary("direct SQLite", wall, outputs, client, run.info.run_id, writers, points, wall)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(root):
    uri, client, run = _new_store(root, "server")
    port = _free_port()
    started = time.perf_counter()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            uri,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                break
        except OSError:
            if proc.poll() is not None or time.perf_counter() - started > 240:
                raise RuntimeError("mlflow server did not start") from None
            time.sleep(0.3)
    return proc, url, client, run, time.perf_counter() - started


def bench_server(root, writers, points, server):
    proc, url, client, run, startup = server
    env = {**os.environ, "MLFLOW_TRACKING_URI": url, "MLFLOW_RUN_ID": run.info.run_id}
    _, wall, outputs = _run_writers(env, writers, points, root)
    result = _summary("loopback mlflow server", wall, outputs, client, run.info.run_id, writers, points, wall)
    result["server_start_s"] = round(startup, 2)
    return result


def _per_call(fn, calls):
    start = time.perf_counter()
    for step in range(calls):
        fn(step)
    return (time.perf_counter() - start) / calls * 1e6


def bench_per_call(root, server, calls):
    import mlflow

    from sparkgpu.tracking import autolog
    from sparkgpu.tracking.spool import JobRunInfo, SpoolDir, SpoolWriter, register_spool_scheme

    results = {}
    uri, client, run = _new_store(root, "percall")
    spool = SpoolDir(root / "percall-run" / "tracking")
    spool.write_run_info(
        JobRunInfo(
            run.info.run_id,
            run.info.experiment_id,
            "percall",
            uri,
            uri,
            run.info.artifact_uri,
            "bench",
            "bench",
            "me",
            time.time(),
        )
    )
    writer = SpoolWriter(spool, 0, 0)
    autolog._activate(writer, rank=0, world_size=1)
    results["sparkgpu.tracking.log (rank 0)"] = _per_call(lambda s: autolog.log({"loss": 0.5}, step=s), calls)
    autolog._deactivate()
    register_spool_scheme()
    spool_client = mlflow.MlflowClient(spool.uri)
    results["mlflow.log_metric via spool"] = _per_call(
        lambda s: spool_client.log_metric(run.info.run_id, "loss", 0.5, step=s), calls
    )
    results["mlflow.log_metric into SQLite"] = _per_call(
        lambda s: client.log_metric(run.info.run_id, "loss_sqlite", 0.5, step=s), max(50, calls // 20)
    )
    if server is not None:
        _, url, _, server_run, _ = server
        http = mlflow.MlflowClient(url)
        results["mlflow.log_metric to loopback server"] = _per_call(
            lambda s: http.log_metric(server_run.info.run_id, "loss_http", 0.5, step=s), max(50, calls // 20)
        )
    fd = os.open(root / "ceiling.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    results["ceiling: json.dumps + os.write"] = _per_call(
        lambda s: os.write(fd, (json.dumps({"m": [["loss", 0.5, s, 0]]}) + "\n").encode()), calls
    )
    os.close(fd)
    return {name: round(us, 1) for name, us in results.items()}


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    peers = result["concurrent"]
    loops = [p["slowest_logging_loop_s"] for p in peers]
    left.bar([p["peer"] for p in peers], loops, color="#4c72b0")
    for i, p in enumerate(peers):
        left.text(
            i, loops[i], f"{loops[i]:.2f} s\nlost {p['points_lost']}, errors {p['errors']}", ha="center", va="bottom"
        )
    left.set_ylim(0, max(loops) * 1.3)
    left.set_ylabel("seconds the slowest writer spent logging")
    left.set_title(f"{peers[0]['writers']} processes x {peers[0]['points_per_writer']} mlflow.log_metric calls")
    calls = result["per_call_us"]
    right.barh(list(calls), list(calls.values()), color="#55a868")
    right.set_xscale("log")
    right.set_xlabel("microseconds per logged value (log scale)")
    right.set_title("cost inside the training loop")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--points", type=int, default=200)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--skip-server", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-tracking-"))
    server = None
    try:
        concurrent = [bench_spool(root, args.writers, args.points), bench_sqlite(root, args.writers, args.points)]
        if not args.skip_server:
            server = _start_server(root)
            concurrent.append(bench_server(root, args.writers, args.points, server))
        per_call = bench_per_call(root, server, args.calls)
    finally:
        if server is not None:
            os.killpg(server[0].pid, signal.SIGTERM)
            try:
                server[0].wait(timeout=30)
            except subprocess.TimeoutExpired:  # open keep-alive connections delay its shutdown
                os.killpg(server[0].pid, signal.SIGKILL)
                server[0].wait()
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "question": "N ranks logging metrics at once: cost per call, time to store, losses and errors",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "command": "python benchmarks/bench_tracking.py " + " ".join(sys.argv[1:]),
        "concurrent": concurrent,
        "per_call_us": per_call,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tracking.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "tracking.png")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    if sys.argv[1:] == ["--plot-only"]:  # redraw from the last results
        plot(json.loads((RESULTS / "tracking.json").read_text()), RESULTS / "tracking.png")
    else:
        main()
