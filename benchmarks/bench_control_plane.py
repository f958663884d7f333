"""Control-plane cost of a Spark job: store requests per node-hour, client load, time to name a lost node.

N node agents run through the code a real Spark job's nodes run
(:func:`sparkgpu.launch.backends.spark.executor.node._watch` beside a
:class:`~sparkgpu.launch.staging.mirror.NodeMirror`), and one client through the code the supervisor
drives (:meth:`SparkBackend.poll <sparkgpu.launch.backends.spark.backend.SparkBackend.poll>` with its
heartbeat thread and :class:`~sparkgpu.launch.staging.mirror.ClientMirror`). Only the agent is a
stand-in: its ranks are simulated inside it (no torch), each printing one line per second into
its log file, so 64 nodes of 8 ranks fit on a 2-core machine. There is no Spark: a "killed" node
is one whose agent, watch loop and mirror stop at once, without an end marker (its executor is
gone).

Two run-dir transports, as a job has them:

* ``s3``: a staging store on a moto S3 server in its own process on loopback. The server counts
  each request by kind (LIST, GET, PUT, HEAD, other), by side (client or node, told apart by the
  access key each side signs with) and by what it carries (``log``: rank and agent logs and
  tracking records; ``control``: everything else), and the bytes of every PUT.
* ``shared``: one folder that client and nodes share (as an NFS mount). File opens and folder
  listings are counted with an audit hook, by the thread that made them (the nodes' threads are
  named ``sim-node-*``); ``stat`` calls raise no audit event and are not counted.

Per node count it reports: requests per node-hour by kind (nodes' requests only; the client's
apart, per second), PUT bytes per byte of log the ranks wrote, the seconds from killing the last
node to the client naming it lost, and (``--stall``) whether a store that stops answering for
that many seconds makes the client or a node declare a healthy node lost. The ``quiet`` phase
is steady running with nobody reading the ranks' output live (``log_ranks=None``): the client's
own requests per second, which its quiet clock keeps to a few per control interval.

The ``before`` design is the code of a base commit (``--base``, by default the commit before
the control-plane change), extracted with ``git archive`` and run in the same invocation as the
current code (``after``), so the ratios are taken on one machine, one load.

Usage::

    python benchmarks/bench_control_plane.py                      # 2 and 8 nodes, 60 s, both designs
    python benchmarks/bench_control_plane.py --nodes 2,8,64 --seconds 120 --stall 60
    python benchmarks/bench_control_plane.py --nodes 2 --seconds 20 --out /tmp/cp.json   # quick check
    python benchmarks/bench_control_plane.py --nodes 2 --seconds 75 --modes s3 --phases quiet \
        --base <commit> --out benchmarks/results/control_plane-quiet.json   # the quiet client
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NODE_KEY, CLIENT_KEY, SECRET = "sim-node", "sim-client", "sim-secret"
LINE = b"step %08d loss 0.123456 lr 3.0e-04 tokens/s 123456.7 grad_norm 0.98765 mem 71.2GiB pad........\n"


# -- the counting S3 server (its own process) ----------------------------------------------


def _serve(ranks_per_node: int) -> None:
    """Runs moto behind a counting, stallable WSGI layer; prints its port, serves until killed."""
    import logging
    from collections import Counter

    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    app = DomainDispatcherApplication(create_backend_app)
    counts: Counter = Counter()
    lock = threading.Lock()
    stalled_until = [0.0]

    def counting(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path.startswith("/__sim/"):
            if path == "/__sim/stall":
                stalled_until[0] = time.monotonic() + float(environ.get("QUERY_STRING", "0") or 0)
                body = b"{}"
            else:
                with lock:
                    body = json.dumps({"|".join(k): v for k, v in counts.items()}).encode()
            start_response("200 OK", [("Content-Type", "application/json")])
            return [body]
        while time.monotonic() < stalled_until[0]:  # a stalled store: answers nothing for a while
            time.sleep(0.05)
        auth = environ.get("HTTP_AUTHORIZATION", "")
        side = "client" if CLIENT_KEY in auth else "node" if NODE_KEY in auth else "other"
        method, query = environ["REQUEST_METHOD"], environ.get("QUERY_STRING", "")
        key = path.split("/", 2)[2] if path.count("/") >= 2 else ""
        if method == "GET" and (not key or "list-type" in query or "prefix=" in query):
            kind = "LIST"
        else:
            kind = method if method in ("GET", "PUT", "HEAD") else "other"
        prefix = next((p[7:] for p in query.split("&") if p.startswith("prefix=")), "")
        name = key or prefix
        what = "log" if (".log" in name or ".jsonl" in name or "/logs/" in name) else "control"
        size = int(environ.get("CONTENT_LENGTH") or 0) if method == "PUT" else 0
        # Whose log it is: a bundle names its node, a whole log (the earlier design) its rank.
        node = re.search(r"node-(\d+)\.parts", name) or re.search(r"rank-(\d+)\.log", name)
        with lock:
            counts[(side, kind, what)] += 1
            counts[(side, "PUT_BYTES", what)] += size
            if node is not None and what == "log" and method == "PUT":
                number = int(node.group(1)) // (ranks_per_node if "rank-" in node.group(0) else 1)
                counts[(side, "PUT_BYTES_OF_NODE", str(number))] += size
        return app(environ, start_response)

    server = make_server("127.0.0.1", 0, counting, threaded=True)
    print(server.server_port, flush=True)
    server.serve_forever()


class _Server:
    def __init__(self, ranks_per_node: int):
        command = [sys.executable, __file__, "--serve", "--ranks-per-node", str(ranks_per_node)]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.endpoint = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"

    def _get(self, path: str) -> bytes:
        import urllib.request

        with urllib.request.urlopen(self.endpoint + path, timeout=30) as r:
            return r.read()

    def counts(self) -> dict:
        return json.loads(self._get("/__sim/counts"))

    def stall(self, seconds: float) -> None:
        self._get(f"/__sim/stall?{seconds}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


# -- shared-folder counting ----------------------------------------------------------------


class _FileOps:
    """Counts opens and listings under one folder, by side, through an audit hook (never removed)."""

    def __init__(self, root: Path):
        from collections import Counter

        self.root, self.counts = str(root), Counter()
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args) -> None:
        if event not in ("open", "os.listdir", "os.scandir") or not args:
            return
        path = args[0]
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path).startswith(self.root):
            return
        side = "node" if threading.current_thread().name.startswith("sim-node") else "client"
        self.counts[f"{side}|{'open' if event == 'open' else 'listdir'}|control"] += 1

    def snapshot(self) -> dict:
        return dict(self.counts)


# -- stand-in ranks ----------------------------------------------------------------------------


class _Killed(BaseException):
    """Raised into a node's watch loop: its executor is gone (no end marker, nothing more)."""


class _Agent:
    """Looks like the node's agent process to the watch loop; its ranks print a line a second."""

    pid = 0

    def __init__(self, rd, attempt: int, ranks: list[int], counter: list[int]):
        self.rd, self.attempt, self.ranks, self.counter = rd, attempt, ranks, counter
        self.written = 0  # log bytes this node's ranks wrote
        self.code: int | None = None
        self.killed = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._ranks, daemon=True, name=f"sim-node-ranks-{ranks[0]}")
        self.thread.start()

    def _ranks(self) -> None:
        from sparkgpu.rundir.layout import RunLayout

        files = {r: open(self.rd.file(RunLayout.rank_log(self.attempt, r)), "ab") for r in self.ranks}  # noqa: SIM115
        step = 0
        try:
            while not self.stop.wait(1.0):
                step += 1
                for f in files.values():
                    f.write(LINE % step)
                    f.flush()
                self.counter[0] += len(LINE) * len(files)
                self.written += len(LINE) * len(files)
        finally:
            for f in files.values():
                f.close()

    def poll(self):
        if self.killed:
            raise _Killed
        return self.code

    def send_signal(self, sig) -> None:
        self.stop.set()
        self.code = -int(sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def end(self) -> None:
        self.stop.set()
        self.code = 0 if self.code is None else self.code


# -- one run -------------------------------------------------------------------------------


def _compat():
    """The pieces of the package this run drives (they moved between the designs)."""
    from sparkgpu.launch.backends.spark.executor import node as spark_node

    return spark_node


def _hub_module():
    from sparkgpu.launch.backends.spark.executor import hub as spark_hub

    return spark_hub


def _child(args) -> dict:
    import boto3

    from sparkgpu.launch.backends.spark.backend import SparkAttempt, SparkBackend
    from sparkgpu.launch.backends.spark.capacity import RankPlacement
    from sparkgpu.rundir.directory import RunDir
    from sparkgpu.rundir.layout import RunLayout
    from sparkgpu.launch.staging.mirror import ClientMirror, NodeMirror, StagingStore
    from sparkgpu.spec import JobSpec, Resources

    spark_node = _compat()
    spark_hub = _hub_module() if hasattr(spark_node, "open_hub") else None
    nodes, per_node, attempt = args.nodes, args.ranks_per_node, 1
    work = Path(tempfile.mkdtemp(prefix="bench-cp-"))
    key = os.urandom(32)
    job_id = f"bench-{uuid.uuid4().hex[:8]}"
    server = ops = None
    store_url = None
    client_options = node_options = None
    if args.mode == "s3":
        server = _Server(args.ranks_per_node)
        os.environ.update(
            AWS_ENDPOINT_URL=server.endpoint, AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true"
        )
        bucket = f"b-{uuid.uuid4().hex[:10]}"
        boto3.client("s3", aws_access_key_id="setup", aws_secret_access_key=SECRET).create_bucket(Bucket=bucket)
        store_url = f"s3://{bucket}/runs"
        client_options = {"key": CLIENT_KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": server.endpoint}}
        node_options = {"key": NODE_KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": server.endpoint}}
    else:
        ops = _FileOps(work)

    rd = RunDir(work / "client" / job_id, key)
    rd.prepare_attempt(attempt)
    rd.file(RunLayout.spark(attempt)).mkdir(parents=True, exist_ok=True)

    class _Spark:
        def interruptTag(self, tag):  # noqa: N802 - pyspark's name
            return None

    backend = SparkBackend(spark=_Spark(), staging_url=store_url or "", node_timeout=args.node_timeout, out=sys.stderr)
    job = JobSpec(job_id=job_id, name="bench", resources=Resources(gpus=nodes * per_node, gpu_type="cpu"))
    mirror = ClientMirror(rd, StagingStore(store_url, job_id, client_options)) if store_url else None
    handle = SparkAttempt(
        attempt=attempt,
        job=job,
        run_dir=rd,
        placement=RankPlacement(nodes, per_node, 0),
        tag="bench",
        submitted_at=time.monotonic(),
        submitted_wall=time.time(),
        mirror=mirror,
    )
    backend._beat(handle)
    if mirror is not None:
        mirror.sync(attempt)
        quiet = {}
        if args.phase == "quiet" and "live" in inspect.signature(mirror.start).parameters:
            # Nobody reads the ranks' output live (log_ranks=None): the client's quiet clock. The
            # design before it has no such clock, and syncs as it always does.
            quiet = {"live": False, "quiet_interval": args.control_interval}
        mirror.start(attempt, backend.sync_interval, **quiet)
    threading.Thread(target=backend._heartbeat, args=(handle,), daemon=True, name="client-heartbeat").start()

    agents: list[_Agent] = []
    ends: dict[int, str] = {}
    log_bytes = [0]
    node_mirrors: dict[int, NodeMirror] = {}

    hub_design = hasattr(spark_node, "open_hub")  # the design where nodes beat to node 0, not the store

    def node_launch(nrd) -> object:
        options = {"control_interval": args.control_interval} if hub_design else {}
        return spark_node.NodeLaunch(
            run_dir=str(nrd.path),
            attempt=attempt,
            nnodes=nodes,
            nproc=per_node,
            env={},
            key=key,
            shutdown_grace=2.0,
            client_timeout=120.0,
            store_url=store_url,
            peer_timeout=args.node_timeout,
            **options,
        )

    hub = None
    if hub_design:  # node 0's task opens its hub before the barrier, on the address the others reach
        hub = spark_node.open_hub(node_launch(rd), "127.0.0.1")

    def run_one(node: int) -> None:
        nrd = RunDir(work / "nodes" / str(node) / job_id, key) if store_url else rd
        nrd.prepare_attempt(attempt)
        info = {"node": node, "executor": str(node), "host": "sim", "started_at": time.time()}
        launch = node_launch(nrd)
        node_mirror = None
        if store_url:
            options = {"control_interval": spark_node.control_interval(launch)} if hub_design else {}
            node_mirror = NodeMirror(StagingStore(store_url, job_id, node_options), nrd, attempt, node, **options)
            node_mirrors[node] = node_mirror
        marker = nrd.file(RunLayout.node_marker(attempt, node, "started"))
        if len(inspect.signature(spark_node._claim).parameters) == 3:  # sealed start markers
            spark_node._claim(nrd, marker, info)
        else:
            spark_node._claim(marker, info)
        if node_mirror is not None:
            node_mirror.start()
        agent = agents[node]
        clock = node_mirror.clock if node_mirror is not None and hasattr(node_mirror, "clock") else None
        if hub_design:
            if node == 0:
                kick = node_mirror.kick if node_mirror is not None else None  # as run_node passes it
                channel = spark_node.NodeZero(hub, nrd, launch, clock, written=kick)
            else:
                link = spark_hub.HubLink(key, attempt, node, ("127.0.0.1", hub.port), args.node_timeout)
                channel = spark_node.NodeLink(link, nrd, launch)
            watch = lambda: spark_node._watch(agent, nrd, launch, node, channel)  # noqa: E731
        else:
            watch = lambda: spark_node._watch(agent, nrd, launch, node, **({"clock": clock} if clock else {}))  # noqa: E731
        try:
            _, state = watch()
            ends[node] = state.value
        except _Killed:
            ends[node] = "killed"
            if node_mirror is not None and node_mirror._loop is not None:
                node_mirror._loop.stop()
            if hub_design and node != 0:
                channel.link.close()  # its executor is gone, and its connection with it
            return
        if node_mirror is not None:
            node_mirror.finish()

    for node in range(nodes):
        nrd_path = (work / "nodes" / str(node) / job_id) if store_url else rd.path
        nrd = RunDir(nrd_path, key)
        nrd.prepare_attempt(attempt)
        agents.append(_Agent(nrd, attempt, list(range(node * per_node, (node + 1) * per_node)), log_bytes))
    threads = [threading.Thread(target=run_one, args=(n,), daemon=True, name=f"sim-node-{n}") for n in range(nodes)]
    for t in threads:
        t.start()

    def counts() -> dict:
        return server.counts() if server is not None else ops.snapshot()  # type: ignore[union-attr]

    def poll_for(seconds: float, until=None) -> float | None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            backend.poll(handle)
            if until is not None and until():
                return time.monotonic()
            time.sleep(0.1)
        return None

    # Start-up is not steady running: every node's start marker must have reached the client
    # (256 nodes take a while to start on two cores), then the warm-up.
    poll_for(600, until=lambda: len(list(rd.file(RunLayout.spark(attempt)).glob("node-*.started"))) >= nodes)
    poll_for(args.warmup)
    if args.phase in ("stall", "biglog"):
        assert server is not None, "a stall or a big log needs the S3 server"
        if args.phase == "stall":
            server.stall(args.stall)
            poll_for(args.stall + 3 * args.node_timeout)
        else:  # rank 0 (node 0's, which the client follows live) writes a big log at once
            big = agents[0].rd.file(RunLayout.rank_log(attempt, 0))
            chunk = LINE * ((8 << 20) // len(LINE))
            with open(big, "ab") as f:
                for _ in range((args.big_log_mb << 20) // len(chunk)):
                    f.write(chunk)
            poll_for(args.seconds)
        result = {
            "nodes": nodes,
            "mode": args.mode,
            "phase": args.phase,
            "stall_s": args.stall if args.phase == "stall" else 0,
            "big_log_mb": args.big_log_mb if args.phase == "biglog" else 0,
            "client_named_lost": [n.node for n in handle.report.lost],
            "nodes_stopped_for_a_lost_peer_or_client": sorted(
                n for n, s in ends.items() if s in ("peer-lost", "client-lost")
            ),
        }
        result["false_losses"] = len(result["client_named_lost"]) + len(
            result["nodes_stopped_for_a_lost_peer_or_client"]
        )
        _stop(agents, threads, handle, mirror, server, attempt)
        return result
    cpu0, wall0, first, bytes0 = time.process_time(), time.monotonic(), counts(), log_bytes[0]
    poll_for(args.seconds)
    cpu1, wall1, last, bytes1 = time.process_time(), time.monotonic(), counts(), log_bytes[0]
    window = wall1 - wall0
    delta = {k: v - first.get(k, 0) for k, v in last.items()}
    lost_early = [n.node for n in handle.report.lost]

    victim = nodes - 1
    killed_at = time.monotonic()
    agents[victim].killed = True
    agents[victim].stop.set()
    named_at = poll_for(60.0, until=lambda: any(n.node == victim for n in handle.report.lost))
    if lost_early:
        named_at = None  # the client had stopped the job already: no measure of a real loss
    final = _stop(agents, threads, handle, mirror, server, attempt)

    node_hours = nodes * window / 3600.0
    per_node_hour: dict[str, dict[str, float]] = {}
    client: dict[str, float] = {}
    for k, v in delta.items():
        side, kind, what = k.split("|")
        if kind.startswith("PUT_BYTES"):
            continue
        if side == "node":
            per_node_hour.setdefault(what, {})[kind] = round(v / node_hours, 1)
        elif side == "client":
            client[f"{kind}_{what}"] = round(v / window, 2)
    control = sum(per_node_hour.get("control", {}).values())
    logs = sum(per_node_hour.get("log", {}).values())
    # Bytes put per log byte, over the whole run, last push included, of the nodes that ended
    # (the killed node never sends what its ranks wrote after its last shipment).
    survivors = [n for n in range(nodes) if n != victim]
    log_put = sum(final.get(f"node|PUT_BYTES_OF_NODE|{n}", 0) for n in survivors)
    survivors_wrote = sum(agents[n].written for n in survivors)
    return {
        "nodes": nodes,
        "ranks_per_node": per_node,
        "mode": args.mode,
        "phase": args.phase,
        "window_s": round(window, 1),
        "node_requests_per_node_hour": per_node_hour,
        "control_per_node_hour": round(control, 1),
        "all_per_node_hour": round(control + logs, 1),
        "client_requests_per_s": client,
        "client_requests_per_s_total": round(sum(client.values()), 2),
        "log_bytes_written": bytes1 - bytes0,
        "put_bytes_per_log_byte": round(log_put / max(1, survivors_wrote), 3) if server is not None else None,
        "process_cpu_share": round((cpu1 - cpu0) / window, 2),
        "false_losses_during_window": lost_early,
        "seconds_to_name_killed_node": None if named_at is None else round(named_at - killed_at, 1),
        "node_ends": {str(k): v for k, v in sorted(ends.items())},
    }


def _stop(agents, threads, handle, mirror, server, attempt) -> dict:
    for agent in agents:
        agent.end()
    for t in threads:
        t.join(60)
    handle.finished.set()
    if mirror is not None:
        mirror.finish(attempt)
    final = server.counts() if server is not None else {}
    if server is not None:
        server.stop()
    return final


# -- the plot ------------------------------------------------------------------------------


def plot(result: dict, path: Path) -> None:
    """Requests per node-hour against the node count, per design (S3), with the goals drawn in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"before": ("#c44e52", "o"), "after": ("#4c72b0", "s")}
    for design, (color, marker) in styles.items():
        runs = sorted(
            (r for r in result["runs"] if r["design"] == design and r["mode"] == "s3"), key=lambda r: r["nodes"]
        )
        if not runs:
            continue
        nodes = [r["nodes"] for r in runs]
        name = "before" if design == "before" else "now"
        left.plot(
            nodes, [r["control_per_node_hour"] for r in runs], marker=marker, color=color, label=f"{name}: control"
        )
        left.plot(
            nodes, [r["all_per_node_hour"] for r in runs], marker=marker, color=color, ls="--", label=f"{name}: all"
        )
        named = [(r["nodes"], r["seconds_to_name_killed_node"]) for r in runs if r["seconds_to_name_killed_node"]]
        right.plot(*zip(*named), marker=marker, color=color, label=name) if named else None
    left.axhline(120, color="grey", lw=0.8, ls=":")
    left.axhline(240, color="grey", lw=0.8, ls="-.")
    left.text(2, 120, "goal: control 120", va="bottom", fontsize=8)
    left.text(2, 240, "goal: all 240", va="bottom", fontsize=8)
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("nodes (8 stand-in ranks each)")
        axis.legend(fontsize=8)
    left.set_yscale("log")
    left.set_ylabel("S3 requests per node-hour (nodes' own)")
    left.set_title("staging-store requests per node-hour")
    right.axhline(15, color="grey", lw=0.8, ls=":")
    right.set_ylabel("seconds")
    right.set_title("from killing a node to the client naming it lost")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- the driver ----------------------------------------------------------------------------


def _design_root(design: str, base: str, scratch: Path) -> Path:
    if design == "after":
        return ROOT
    target = scratch / f"base-{base}"
    if not target.exists():
        target.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", base, "sparkgpu"], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def _table(runs: list[dict], stalls: list[dict]) -> dict:
    """``"<mode>, <n> nodes"`` -> design -> the figures the docs quote (and before/after ratios)."""
    table: dict[str, dict] = {}
    for run in runs:
        quiet = ", quiet client" if run.get("phase") == "quiet" else ""
        row = table.setdefault(f"{run['mode']}, {run['nodes']} nodes{quiet}", {})
        row[run["design"]] = {
            "control_per_node_hour": run["control_per_node_hour"],
            "all_per_node_hour": run["all_per_node_hour"],
            "client_requests_per_s": run["client_requests_per_s_total"],
            "put_bytes_per_log_byte": run["put_bytes_per_log_byte"],
            "seconds_to_name_killed_node": run["seconds_to_name_killed_node"],
            "false_losses_during_window": len(run["false_losses_during_window"]),
        }
    for stall in stalls:
        row = table.setdefault(f"{stall['mode']}, {stall['nodes']} nodes", {})
        what = "false_losses_in_stall" if stall.get("phase", "stall") == "stall" else "false_losses_with_big_log"
        row.setdefault(stall["design"], {})[what] = stall["false_losses"]
    for row in table.values():
        before, after = row.get("before", {}), row.get("after", {})
        if before.get("all_per_node_hour") and after.get("all_per_node_hour"):
            row["all_requests_before_over_after"] = round(before["all_per_node_hour"] / after["all_per_node_hour"], 1)
            row["control_before_over_after"] = round(
                before["control_per_node_hour"] / max(after["control_per_node_hour"], 1e-9), 1
            )
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="2,8", help="node counts, comma-separated")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0, help="the counted window")
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--node-timeout", type=float, default=10.0)
    p.add_argument(
        "--control-interval", type=float, default=20.0, help="node 0's look at the client's files (the hub design)"
    )
    p.add_argument(
        "--stall", type=float, default=0.0, help="a run whose store stalls this long (s3, the first node count)"
    )
    p.add_argument(
        "--big-log-mb", type=int, default=0, help="a run where rank 0 writes this many MB at once (s3, first count)"
    )
    p.add_argument("--before-nodes", default="", help="node counts the 'before' design runs at (default: all)")
    p.add_argument("--modes", default="s3,shared")
    p.add_argument(
        "--phases",
        default="steady,stall,biglog,quiet",
        help="steady running; a store stall; a big log; steady running with nobody reading logs live (quiet)",
    )
    p.add_argument("--designs", default="before,after")
    p.add_argument("--base", default="8867c37", help="the commit whose code is the 'before' design")
    p.add_argument("--out", default=str(HERE / "results" / "control_plane.json"))
    p.add_argument("--plot-only", action="store_true", help="redraw the plot from --out")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="s3", help=argparse.SUPPRESS)
    p.add_argument("--phase", default="steady", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        _serve(args.ranks_per_node)
        return
    if args.child:
        args.nodes = int(args.nodes)
        print(json.dumps(_child(args)))
        return
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
        return

    sys.path.insert(0, str(HERE))
    from common import load_seen, machine, method

    facts = machine()
    scratch = Path(tempfile.mkdtemp(prefix="bench-cp-designs-"))
    runs, stalls = [], []
    phases = [
        (mode, phase)
        for mode, phase in [("s3", "steady"), ("shared", "steady"), ("s3", "stall"), ("s3", "biglog"), ("s3", "quiet")]
        if phase in args.phases.split(",")
    ]
    counts = [int(n) for n in args.nodes.split(",")]
    before_at = {int(n) for n in args.before_nodes.split(",")} if args.before_nodes else set(counts)
    for nodes in counts:
        for mode, phase in phases:
            if mode not in args.modes.split(","):
                continue
            if phase == "stall" and (not args.stall or nodes != counts[0]):
                continue  # the stall runs at the first node count only: it is a minute and a half per design
            if phase == "biglog" and (not args.big_log_mb or nodes != counts[0]):
                continue
            if phase == "quiet" and nodes != counts[0]:
                continue  # the client's own requests do not grow with the nodes
            for design in args.designs.split(","):  # the two designs back to back, same load
                if design == "before" and (nodes not in before_at or phase == "biglog"):
                    continue  # the earlier design puts a growing log whole, again and again: not with 1 GB
                root = _design_root(design, args.base, scratch)
                env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{HERE}"}
                command = [sys.executable, __file__, "--child", "--mode", mode, "--nodes", str(nodes)]
                command += ["--phase", phase]
                flags = (
                    "ranks_per_node",
                    "seconds",
                    "warmup",
                    "node_timeout",
                    "control_interval",
                    "stall",
                    "big_log_mb",
                )
                for flag in flags:
                    command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
                print(f"{design} {mode} {phase} {nodes} nodes ...", file=sys.stderr, flush=True)
                done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=str(scratch))
                if done.returncode != 0:
                    print(done.stderr[-4000:], file=sys.stderr)
                    raise SystemExit(f"the {design} run at {nodes} nodes ({mode}, {phase}) failed")
                result = {"design": design, **json.loads(done.stdout.strip().splitlines()[-1])}
                print(json.dumps(result), file=sys.stderr)
                (stalls if phase in ("stall", "biglog") else runs).append(result)
    out = {
        "benchmark": "control_plane",
        "machine": load_seen(facts),
        "method": method(
            "store requests counted at the S3 server (or file opens and listings in a shared folder) during "
            f"a {args.seconds:g}s window of steady running, {args.warmup:g}s after every node's start marker "
            "reached the client",
            startup="excluded (until every node started, then the warm-up)",
            repeats=1,
            statistic="one window per design, node count and transport",
            designs={"before": f"the package at commit {args.base}", "after": "the package of this commit"},
            ranks="stand-ins inside each node's agent, one log line per rank per second",
            same_run="both designs run one after the other in one invocation, on the same machine",
            node_timeout_s=args.node_timeout,
            not_counted="stat calls in the shared folder; the client's own CPU apart from the nodes' threads",
        ),
        "runs": runs,
        "stalls": stalls,
        "table": _table(runs, stalls),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    plot(out, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out} and its plot", file=sys.stderr)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
