"""``sparkgpu pools``: the pools of ``SPARKGPU_POOLS`` with live capacity.

Each pool's Connect server is first tried with a plain TCP connect (a few seconds at most),
so an unreachable pool is listed as such instead of hanging the command; the reachable ones
are probed in parallel, each within ``--timeout`` seconds.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import socket
import sys
from urllib.parse import urlsplit

from sparkgpu.errors import ConfigurationError
from sparkgpu.spec.pools import Pool, configured_pools

__all__ = ["register_pools", "PoolStatus", "pool_status"]

_CONNECT_PORT = 15002  # Spark Connect's default port


@dataclasses.dataclass(frozen=True)
class PoolStatus:
    """What one pool has now.

    Attributes:
        pool: The pool.
        reachable: Its Connect server answered.
        gpus_total: GPUs of its executors (``None`` when unknown).
        gpus_free: GPUs of the executors that answered the probe; executors with every core
            busy do not, so this is an upper bound on what a job gets at once.
        executors: Executors found.
        problem: Why the pool could not be probed, else ``None``.
    """

    pool: Pool
    reachable: bool
    gpus_total: int | None = None
    gpus_free: int | None = None
    executors: int | None = None
    problem: str | None = None

    def to_dict(self) -> dict:
        return {
            "name": self.pool.name,
            "url": self.pool.url,
            "gpu_type": self.pool.gpu_type,
            "gpus_per_node": self.pool.gpus_per_node,
            "reserved": self.pool.reserved,
            "reachable": self.reachable,
            "gpus_total": self.gpus_total,
            "gpus_free": self.gpus_free,
            "executors": self.executors,
            "problem": self.problem,
        }


def _connect_address(url: str) -> tuple[str, int]:
    parts = urlsplit(url.split(";", 1)[0])
    return parts.hostname or "localhost", parts.port or _CONNECT_PORT


def pool_status(pool: Pool, timeout: float) -> PoolStatus:
    """Probes one pool; never raises for an unreachable or failing pool, and returns within
    about ``timeout`` seconds plus the probe's own start."""
    from sparkgpu.launch.backends.spark.capacity import discover_capacity
    from sparkgpu.launch.backends.spark.sessions import pool_session

    host, port = _connect_address(pool.url)
    try:
        socket.create_connection((host, port), timeout=min(timeout, 3.0)).close()
    except OSError as exc:
        return PoolStatus(pool, reachable=False, problem=f"{host}:{port}: {exc.strerror or exc}")
    try:
        capacity = discover_capacity(pool_session(pool), wait_timeout=timeout, out=sys.stderr, refresh=True)
    except Exception as exc:  # one broken pool must not hide the others
        first = (str(exc).strip().splitlines() or [""])[0]
        return PoolStatus(pool, reachable=True, problem=f"{type(exc).__name__}: {first[:200]}")
    free = sum(capacity.gpus_of(e) for e in capacity.executors if not e.busy)
    return PoolStatus(
        pool, reachable=True, gpus_total=capacity.total_gpus, gpus_free=free, executors=len(capacity.executors)
    )


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def _table(statuses: list[PoolStatus]) -> str:
    rows = [("POOL", "GPU TYPE", "PER NODE", "KIND", "GPUS", "FREE", "URL / STATE")]
    for s in statuses:
        state = s.pool.url
        if s.problem is not None:
            state += f"  {'unreachable' if not s.reachable else 'error'}: {s.problem}"
        rows.append(
            (
                s.pool.name,
                s.pool.gpu_type,
                str(s.pool.gpus_per_node),
                "reserved" if s.pool.reserved else "shared",
                _count(s.gpus_total),
                _count(s.gpus_free),
                state,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows)


def cmd_pools(args) -> int:
    pools = configured_pools()
    if pools is None:
        raise ConfigurationError(
            "no pools file is configured: set SPARKGPU_POOLS=pools.yaml (see the Spark guide, docs/guides/spark.md, 'GPU pools')"
        )
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(pools))) as executor:
        statuses = list(executor.map(lambda p: pool_status(p, args.timeout), pools))
    if args.json:
        print(json.dumps([s.to_dict() for s in statuses], indent=2))
    else:
        print(_table(statuses))
    return 0


def register_pools(subparsers) -> None:
    p = subparsers.add_parser(
        "pools",
        help="list the GPU pools (SPARKGPU_POOLS) with live capacity",
        description="Lists the pools of the SPARKGPU_POOLS file: GPU type, GPUs per node, "
        "reserved or shared, and GPUs total/free from a capacity probe. A pool "
        "that does not answer is shown as unreachable.",
    )
    p.add_argument("--timeout", type=float, default=15.0, help="seconds each pool's probe may take (default 15)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=cmd_pools)
