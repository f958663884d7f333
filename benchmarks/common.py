"""What every benchmark records beside its figures: the machine, the spread of repeats, the method.

A results file carries enough for a reader to judge a ratio without reading the script:
``machine()`` (cores, platform, load seen at the start), ``spread()`` of every timed figure
(median first; best, quartiles and each run beside it) and ``method()`` of every ratio (what was
timed, whether start-up is inside it, how many repeats, which statistic). No paths, host names
or user names go in: results are committed.
"""

from __future__ import annotations

import os
import platform
import statistics

__all__ = ["machine", "load_seen", "spread", "separated", "method", "cpu_mark", "other_cpu_share"]

# Where the machine's and this process's CPU counters stood when machine() was last called.
_cpu_at_start: tuple[float, float, float] | None = None


def machine() -> dict:
    """Cores, platform and the load seen as the benchmark starts (``load_seen`` at the end)."""
    global _cpu_at_start
    load = os.getloadavg()
    cpus = os.cpu_count() or 1
    busy = busy_cores()
    _cpu_at_start = cpu_mark()
    return {
        "cpus": cpus,
        "system": platform.system(),
        "arch": platform.machine(),
        # The kernel build tells one host from another when figures are compared (no host name).
        "platform": platform.platform(),
        "python": platform.python_version(),
        # Where PYTHONDONTWRITEBYTECODE is set, every process a benchmark starts compiles what it
        # imports again: start-up figures are then not those of an installed package.
        "byte_code_cached": not os.environ.get("PYTHONDONTWRITEBYTECODE"),
        "load_average_at_start": [round(x, 2) for x in load],
        "busy_cores_at_start": None if busy is None else round(busy, 2),
        # Another job was running if it kept a quarter of the cores busy as this one started. The
        # 1-minute load average trails by minutes (a benchmark started right after another still
        # sees its load): it decides only where the kernel's CPU counters cannot be read.
        "other_load_at_start": (busy if busy is not None else load[0]) > 0.25 * cpus,
    }


def busy_cores(seconds: float = 1.0) -> float | None:
    """Cores kept busy by every process over the next ``seconds`` (from ``/proc/stat``), or None."""
    import time

    before = _cpu_totals()
    time.sleep(seconds)
    after = _cpu_totals()
    if before is None or after is None:
        return None
    return (after[0] - before[0]) / max(after[1] - before[1], 1e-9)


def load_seen(facts: dict) -> dict:
    """``facts`` with what other processes did during the run added; call once the timed work is over.

    Other processes' CPU time is the machine's busy time since :func:`machine` (the kernel's
    counters) less this process's and its finished children's own. Where the counters cannot be
    read, a 1-minute load average above the cores decides, which also counts the benchmark's own
    processes (a peer's worker pool).
    """
    load = os.getloadavg()
    facts = dict(facts, load_average_at_end=[round(x, 2) for x in load])
    share = other_cpu_share(_cpu_at_start)
    if share is not None:
        facts["other_cpu_share_during_run"] = round(share, 3)
        seen = share > 0.1
    else:
        seen = load[0] > 1.25 * facts["cpus"]
    facts["other_load_seen"] = facts["other_load_at_start"] or seen
    return facts


def cpu_mark() -> tuple[float, float, float] | None:
    """Where the machine's busy time, this process's own CPU time and the clock stand now."""
    totals = _cpu_totals()
    return None if totals is None else (totals[0], _own_cpu_s(), totals[1])


def other_cpu_share(mark: tuple[float, float, float] | None) -> float | None:
    """The share of all cores that processes other than this one and its finished children
    used since ``mark`` (:func:`cpu_mark`), or None where the counters cannot be read. A
    grandchild that outlives its parent (a worker pool's daemons) is counted as other."""
    now = cpu_mark()
    if mark is None or now is None:
        return None
    other = max(0.0, (now[0] - mark[0]) - (now[1] - mark[1]))
    return other / (max(now[2] - mark[2], 1e-9) * (os.cpu_count() or 1))


def _cpu_totals() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, the clock) from ``/proc/stat``, or None."""
    import time

    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK"), time.monotonic()


def _own_cpu_s() -> float:
    import resource

    mine, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime + children.ru_utime + children.ru_stime


def spread(values: list[float], *, higher_is_better: bool = False) -> dict:
    """The median of ``values`` with the best, the quartiles and every run beside it."""
    ordered = sorted(values)
    if not ordered:
        return {"n": 0}
    quartiles = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else [ordered[0]] * 3
    return {
        "median": statistics.median(ordered),
        "best": ordered[-1] if higher_is_better else ordered[0],
        "q1": quartiles[0],
        "q3": quartiles[2],
        "min": ordered[0],
        "max": ordered[-1],
        "n": len(ordered),
        "runs": list(values),
    }


def separated(a: dict, b: dict) -> bool:
    """Whether two spreads' interquartile ranges do not overlap: their medians differ beyond the noise."""
    return a["q3"] < b["q1"] or b["q3"] < a["q1"]


def method(timed: str, *, startup: str, repeats: int, statistic: str = "median", **more) -> dict:
    """How a ratio was taken, for its results file.

    Args:
        timed: what the clock covered, e.g. ``"first batch to the end of the epoch"``.
        startup: how start-up was counted, e.g. ``"excluded, reported apart as startup_s"``.
        repeats: repeats per side (every side the same).
        statistic: which statistic of the repeats the ratio divides.
        more: anything else a reader needs (workers, connections, order of the sides).
    """
    return {"timed": timed, "startup": startup, "repeats_per_side": repeats, "statistic": statistic, **more}
