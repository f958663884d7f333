"""Rendezvous at scale: node 0's store, met by every rank of 2 to 256 nodes of 8 ranks at once.

A job's ranks meet at one TCPStore that node 0's agent serves on a socket of its own
(:func:`sparkgpu.launch.node.rendezvous.listening_socket`, backlog 1024, handed to the store with
``master_listen_fd``, as the ``sparkgpu-static`` rendezvous does). Every rank then does what
``init_process_group`` asks of the store: it connects, publishes its address, counts itself in
and waits until every rank has (the store-based barrier), and reads the key rank 0 published
(NCCL's unique id). Nothing else is simulated: the store is torch's, served as a job serves it.

The ranks are stand-ins: ``--processes`` client processes (16 by default, so no one process
holds more than a node's worth of sockets per core) each run their share of the ranks as
threads, all started together. Reported per node count, over ``--repeats`` rounds: seconds from
the start signal until every rank passed the barrier (median, with the spread), the slowest
rank's connect time, and ranks that failed. Beside it, the floor: as many plain TCP connects
to a socket listening the same way, accepted by one thread. Everything listens on 127.0.0.1.

torch's TCPStore looks up the name of each end of every connection (``getnameinfo``). Where the
resolver does not answer, every connection waits for its timeout (5 s by default in
``resolv.conf``). So each measurement runs in a fresh process per resolver setting
(``--resolver``: ``system``, the machine as it is, and ``RES_OPTIONS`` values such as
``"timeout:1 attempts:1"``, which glibc reads when a process first resolves).

    python benchmarks/bench_rendezvous.py [--nodes 2 8 64 256] [--ranks-per-node 8] [--repeats 3]
        [--resolver system "timeout:1 attempts:1"]

Writes benchmarks/results/rendezvous.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import load_seen, machine, spread  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "rendezvous.json"
HOST = "127.0.0.1"


def _rank(port: int, rank: int, world: int, go: float, out: dict) -> None:
    """One stand-in rank: what init_process_group does with the store."""
    from torch.distributed import TCPStore

    while time.time() < go:
        time.sleep(0.001)
    start = time.perf_counter()
    try:
        store = TCPStore(HOST, port, world, False, timedelta(seconds=300), wait_for_workers=False)
        connected = time.perf_counter()
        store.set(f"addr/{rank}", f"{HOST}:{40000 + rank}")
        if store.add("init/count", 1) == world:
            store.set("init/done", "1")
        store.wait(["init/done"])
        store.get("nccl/unique_id")
        out[rank] = (connected - start, time.time())
    except Exception as exc:  # counted and reported: a rank that cannot meet is the finding
        out[rank] = (None, repr(exc))


def _client(port: int, ranks: list[int], world: int, go: float, queue) -> None:
    out: dict = {}
    threads = [threading.Thread(target=_rank, args=(port, r, world, go, out)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queue.put(out)


def plain_connects(count: int) -> float:
    """Seconds for ``count`` threads to connect at once to a socket listening as the store's does."""
    from sparkgpu.launch.node.rendezvous import listening_socket

    listener = listening_socket(HOST, 0)
    port = listener.getsockname()[1]
    accepted: list = []

    def accept() -> None:
        while len(accepted) < count:
            accepted.append(listener.accept()[0])

    server = threading.Thread(target=accept, daemon=True)
    server.start()
    clients: list = []
    threads = [
        threading.Thread(target=lambda: clients.append(socket.create_connection((HOST, port)))) for _ in range(count)
    ]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server.join(60)
    seconds = time.perf_counter() - started
    for sock in clients + accepted:
        sock.close()
    listener.close()
    return seconds


def one_round(nodes: int, per_node: int, processes: int) -> dict:
    from torch.distributed import TCPStore

    from sparkgpu.launch.node.rendezvous import listening_socket

    world = nodes * per_node
    listener = listening_socket(HOST, 0)
    port = listener.getsockname()[1]
    store = TCPStore(
        HOST,
        port,
        nodes,
        True,
        timedelta(seconds=300),
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=listener.fileno(),
    )
    store.set("nccl/unique_id", "x" * 128)
    queue: mp.Queue = mp.get_context("fork").Queue()
    go = time.time() + 2.0 + world / 400  # every client process and thread is up before it
    procs = [
        mp.get_context("fork").Process(target=_client, args=(port, list(range(p, world, processes)), world, go, queue))
        for p in range(min(processes, world))
    ]
    for p in procs:
        p.start()
    results: dict = {}
    for _ in procs:
        results.update(queue.get(timeout=600))
    for p in procs:
        p.join()
    listener.close()
    del store
    failed = {r: v[1] for r, v in results.items() if v[0] is None}
    done = [v[1] for v in results.values() if v[0] is not None]
    return {
        "seconds_to_all_met": (max(done) - go) if done and not failed else None,
        "slowest_connect_s": max((v[0] for v in results.values() if v[0] is not None), default=None),
        "ranks_failed": len(failed),
        "first_failure": next(iter(failed.values()), None),
    }


def measure(nodes_list: list[int], per_node: int, repeats: int, processes: int) -> list[dict]:
    rows = []
    for nodes in nodes_list:
        rounds = [one_round(nodes, per_node, processes) for _ in range(repeats)]
        times = [r["seconds_to_all_met"] for r in rounds if r["seconds_to_all_met"] is not None]
        rows.append(
            {
                "nodes": nodes,
                "ranks": nodes * per_node,
                "seconds_to_all_met": spread(times) if times else None,
                "slowest_connect_s": statistics.median(r["slowest_connect_s"] or 0.0 for r in rounds),
                "ranks_failed": sum(r["ranks_failed"] for r in rounds),
                "first_failure": next((r["first_failure"] for r in rounds if r["first_failure"]), None),
                "plain_connects_s": spread([plain_connects(nodes * per_node) for _ in range(repeats)]),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 8, 64, 256])
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--processes", type=int, default=16)
    parser.add_argument("--resolver", nargs="+", default=["system", "timeout:1 attempts:1"])
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one resolver, in this process
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.nodes, args.ranks_per_node, args.repeats, args.processes)))
        return
    facts = machine()
    results = {}
    for resolver in args.resolver:
        env = dict(os.environ)
        if resolver != "system":
            env["RES_OPTIONS"] = resolver
        command = [sys.executable, __file__, "--measure", "--nodes", *map(str, args.nodes)]
        command += ["--ranks-per-node", str(args.ranks_per_node), "--repeats", str(args.repeats)]
        command += ["--processes", str(args.processes)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=3600)
        rows = results[resolver] = json.loads(done.stdout.strip().splitlines()[-1])
        for row in rows:
            met = row["seconds_to_all_met"]
            print(
                f"resolver {resolver!r}: {row['nodes']:>4} nodes, {row['ranks']:>5} ranks: "
                + (f"all met in {met['median']:.2f} s" if met else f"failed: {row['first_failure']}")
                + f", slowest connect {row['slowest_connect_s']:.3f} s, failed ranks {row['ranks_failed']}, "
                f"plain connects {row['plain_connects_s']['median']:.3f} s"
            )
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "rendezvous",
                "machine": load_seen(facts),
                "method": {
                    "timed": "from one start signal to the last rank past the store-based barrier",
                    "store": "torch TCPStore served on sparkgpu's listening socket (backlog 1024), as node 0 serves it",
                    "ranks": f"stand-ins: {args.processes} client processes, one thread per rank, started together",
                    "floor": "the same number of plain TCP connects to a socket listening the same way",
                    "resolver": "each setting measured in a fresh process (RES_OPTIONS is read once per process)",
                    "repeats": args.repeats,
                    "statistic": "median",
                },
                "runs": results,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
