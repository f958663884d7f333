"""The suite's timeline: which worker ran which test when, and the CPU it took.

With ``SPARKGPU_TEST_TIMELINE=<folder>`` set, every pytest process (each xdist worker) appends
one JSON line per test to ``<folder>/<worker>.jsonl``: its id, its start and end (wall clock, so
the workers' lines share one axis), the CPU seconds of the worker process itself and of the
children it reaped during the test (a cluster's daemonised JVMs or a detached supervisor are
nobody's child: they are not counted), and the machine's load average at the end. Without the
variable nothing is recorded.

``python -m tests.timeline <folder>`` then prints where the suite's time goes: each worker's busy
time and idle tail, the modules by wall and CPU, and the longest tests, so a change to the suite's
time starts from a measurement rather than a guess (``docs/guides/tests.md``).
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time
from pathlib import Path

VARIABLE = "SPARKGPU_TEST_TIMELINE"


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


class Recorder:
    """One pytest process's lines (a pytest plugin object: see tests/conftest.py)."""

    def __init__(self, folder: str) -> None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.path = Path(folder) / f"{worker}.jsonl"
        self.worker = worker

    def record(self, nodeid: str, started: float, cpu_before: tuple[float, float]) -> None:
        own, children = _cpu()
        line = {
            "worker": self.worker,
            "test": nodeid,
            "start": started,
            "end": time.time(),
            "cpu": round(own - cpu_before[0], 3),
            "children_cpu": round(children - cpu_before[1], 3),
            "load": os.getloadavg()[0],
        }
        with open(self.path, "a") as out:
            out.write(json.dumps(line) + "\n")


def _module(test: str) -> str:
    return test.split("::", 1)[0]


def summary(folder: Path, most: int = 25) -> str:
    lines = [json.loads(line) for path in sorted(folder.glob("*.jsonl")) for line in path.read_text().splitlines()]
    if not lines:
        return f"no timeline in {folder}"
    first, last = min(line["start"] for line in lines), max(line["end"] for line in lines)
    out = [f"{len(lines)} tests, {last - first:.0f} s from the first start to the last end"]
    by_worker = collections.defaultdict(list)
    for line in lines:
        by_worker[line["worker"]].append(line)
    for worker, mine in sorted(by_worker.items()):
        busy = sum(line["end"] - line["start"] for line in mine)
        ended = max(line["end"] for line in mine)
        out.append(f"  {worker}: busy {busy:.0f} s, done {ended - first:.0f} s in (idle tail {last - ended:.0f} s)")
    wall, cpu = collections.Counter(), collections.Counter()
    for line in lines:
        wall[_module(line["test"])] += line["end"] - line["start"]
        cpu[_module(line["test"])] += line["cpu"] + line["children_cpu"]
    out.append(f"modules by wall (CPU of the worker and its reaped children beside it), top {most}:")
    out += [f"  {seconds:7.1f} s  cpu {cpu[module]:7.1f} s  {module}" for module, seconds in wall.most_common(most)]
    out.append(f"modules by CPU, top {most}:")
    out += [f"  {seconds:7.1f} s  {module}" for module, seconds in cpu.most_common(most)]
    out.append(f"tests by wall, top {most}:")
    longest = sorted(lines, key=lambda line: line["end"] - line["start"], reverse=True)[:most]
    out += [
        f"  {line['end'] - line['start']:7.1f} s  cpu {line['cpu'] + line['children_cpu']:6.1f} s  "
        f"at {line['start'] - first:5.0f} s on {line['worker']}  {line['test']}"
        for line in longest
    ]
    return "\n".join(out)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1]), most=int(sys.argv[2]) if len(sys.argv) > 2 else 25))
