"""Helpers for tests that start real clients and ranks: find leftovers, start a client script."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil


def processes_of(path) -> list[psutil.Process]:
    """Live processes whose command line mentions ``path`` (a run dir, a staging root)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(path) in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def assert_no_orphans(path, within: float = 5.0) -> None:
    """Waits up to ``within`` seconds for every process of ``path`` to end, then asserts none is left."""
    deadline = time.monotonic() + within
    while processes_of(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_of(path) == []


def start_client(tmp_path, home, source: str, **popen) -> subprocess.Popen:
    """Runs ``source`` as a separate client process with its own SPARKGPU_HOME."""
    script = tmp_path / "client.py"
    script.write_text(source)
    env = {**os.environ, "SPARKGPU_HOME": str(home), "PYTHONPATH": os.getcwd()}
    return subprocess.Popen([sys.executable, str(script)], env=env, **popen)


def ctrl_c_client(decorator: str, setup: str = "") -> str:
    """Source of a client whose job runs until interrupted: every rank prints ``started`` and
    sleeps; Ctrl-C (SIGINT) in the client exits it with 130.

    Args:
        decorator: The job's decorator line, e.g. ``@distributed(gpus=2, gpu_type="cpu")``.
        setup: Code run before the job is defined (imports, a first job).
    """
    return (
        "import signal, sys, time\n"
        # A shell that starts the test run in the background makes its children ignore SIGINT,
        # and Python keeps it ignored; a client run from a terminal gets KeyboardInterrupt.
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from sparkgpu import distributed, runtime\n"
        f"{setup}\n"
        f"{decorator}\n"
        "def forever():\n"
        "    print('started', flush=True)\n"
        "    time.sleep(600)\n"
        "\n"
        "try:\n"
        "    forever.distributed()\n"
        "except KeyboardInterrupt:\n"
        "    sys.exit(130)\n"
    )


def wait_for(predicate, within: float = 90.0, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False
