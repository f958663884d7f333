"""A keeper: a process that runs a supervised thing's worker in a child and starts another should it die.

A detached job's keeper runs the job's supervisor this way
(:mod:`sparkgpu.launch.client.detached`), a detached sweep's keeper its driver
(:mod:`sparkgpu.sweeps.keeper`). Each child is a fork of the keeper, which imported what the
worker runs once: it starts within milliseconds, where a fresh interpreter would import it all
again. A child killed by a signal (SIGKILL, the host's OOM killer) before the thing ended is
replaced, at most :data:`RESPAWN_LIMIT` times, with a backoff when children die again at once;
a child that exited is not, since it reported why it stopped and another would stop the same way.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

__all__ = ["Kept", "keep", "RESPAWN_LIMIT"]

logger = logging.getLogger(__name__)

#: Children the keeper starts one after another at most before it gives up (each after the last died).
RESPAWN_LIMIT = 20
#: Seconds a child must have run for its death not to count towards a quick-respawn backoff.
STEADY_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class Kept:
    """What a keeper keeps.

    Attributes:
        kind: What it is (``"job"``, ``"sweep"``), in the keeper's log.
        name: Its id.
        worker: What each child is (``"supervisor"``, ``"driver"``), in the keeper's log.
        run: Runs in the child until the thing ended; its return value is the child's exit code.
        ended: Whether the thing has ended (then a dead child is not replaced).
        resume: The command that goes on with it once the keeper gave up.
    """

    kind: str
    name: str
    worker: str
    run: Callable[[], int]
    ended: Callable[[], bool]
    resume: str


def keep(kept: Kept, limit: int = RESPAWN_LIMIT) -> int:
    """The keeper's loop: a child at a time until ``kept`` has ended; the exit code of the last."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal is not the thing's end
    quick_deaths = 0
    for started in range(limit):
        began = time.monotonic()
        pid = _fork(kept)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code >= 0 or kept.ended():
            return code
        ran = time.monotonic() - began
        quick_deaths = quick_deaths + 1 if ran < STEADY_SECONDS else 0
        logger.warning(
            "the %s of %s %s (pid %d) died (signal %d) after %.0fs before the %s ended; starting another (%d of %d)",
            kept.worker,
            kept.kind,
            kept.name,
            pid,
            -code,
            ran,
            kept.kind,
            started + 1,
            limit,
        )
        if quick_deaths > 1 and started + 1 < limit:  # dying again at once: back off 1, 2, 4 ... 30 s before the next
            time.sleep(min(30.0, 2.0 ** (quick_deaths - 2)))
    logger.error(
        "%s %s: %d %ss died one after another; giving up. `%s` continues it",
        kept.kind,
        kept.name,
        limit,
        kept.worker,
        kept.resume,
    )
    return 1


def _fork(kept: Kept) -> int:
    """Starts a child running ``kept.run``; returns its pid. The child never returns into the loop."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = kept.run()
    except BaseException:  # noqa: BLE001 - this process ends here whatever happened; the log keeps why
        logger.exception("the %s of %s %s stopped", kept.worker, kept.kind, kept.name)
    finally:
        atexit._run_exitfuncs()  # what a process that returns from main runs (the worker's own exit hooks)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never back into the keeper's loop
