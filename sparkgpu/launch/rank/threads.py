"""A rank's CPU thread settings: decided by its launcher, applied by the rank itself.

A rank's numerics depend on how many threads sum its matmuls: the same step run with 1 and
with 2 intra-op threads gives other low bits. Every attempt of a job must therefore run its
ranks with the same settings, whatever started them: a fresh node agent, the job's standby
or the warm pool (whose zygote imported torch long before the job's variables existed, so
OpenMP and MKL read no ``OMP_NUM_THREADS`` of the job), or a Spark node.

So the launchers only put the counts in the ranks' environment (:func:`rank_thread_env`,
which keeps what the user set), and every rank applies them through torch itself before
any user code runs (:func:`pin_rank_threads`), which holds however torch was imported.
"""

from __future__ import annotations

import os

__all__ = ["THREAD_VARIABLES", "rank_thread_env", "threads_per_rank", "pin_rank_threads"]

# The variables the ranks' thread counts come from; the user's own values win.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def threads_per_rank(ranks_per_node: int, cpus: int | None = None) -> int:
    """CPU threads each rank of a node gets: the node's cores shared out, at least one.

    Args:
        ranks_per_node: Ranks sharing the node's cores.
        cpus: The node's cores (this host's when ``None``).
    """
    return max(1, (cpus or os.cpu_count() or 1) // max(1, ranks_per_node))


def rank_thread_env(environ: dict[str, str], threads: int) -> dict[str, str]:
    """The thread variables for a node's ranks, as ``environ`` plus the launcher's defaults.

    ``OMP_NUM_THREADS`` is the count; ``MKL_NUM_THREADS`` follows it unless set. What the
    user set in ``environ`` stays: it is part of what every attempt must share.

    Args:
        environ: The environment the ranks will get.
        threads: The launcher's count (:func:`threads_per_rank`).

    Returns:
        The variables to add to ``environ``.
    """
    omp = environ.get("OMP_NUM_THREADS") or str(threads)
    return {"OMP_NUM_THREADS": omp, "MKL_NUM_THREADS": environ.get("MKL_NUM_THREADS") or omp}


def _count(variable: str) -> int | None:
    value = os.environ.get(variable, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def pin_rank_threads() -> tuple[int, int] | None:
    """Sets this rank's intra-op and inter-op thread counts from ``OMP_NUM_THREADS``.

    Called by the rank's entrypoint before user code runs, in every attempt and on every
    path that starts ranks, so a restarted rank sums in the same order as the first one.
    Both counts are set (the inter-op count to the same value) because a process forked
    from a zygote would otherwise keep whatever the zygote's torch chose.

    Returns:
        ``(intra-op, inter-op)`` threads now in force, or ``None`` when the variable is not
        set (the launcher sets it for every rank; a rank started by hand keeps torch's
        defaults).
    """
    threads = _count("OMP_NUM_THREADS")
    if threads is None:
        return None
    import torch

    torch.set_num_threads(threads)
    # Settable once per process and only before inter-op work started: a rank fresh from its
    # launcher (a new interpreter or a fork of an idle zygote) has started none.
    if torch.get_num_interop_threads() != threads:
        torch.set_num_interop_threads(threads)
    return torch.get_num_threads(), torch.get_num_interop_threads()
