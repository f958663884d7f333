"""Local ranks forked from the warm pool (``backend="warm_pool"``, or ``SPARKGPU_WARM_POOL=1``).

The pool itself, its zygote process and the client that talks to it, are
:mod:`sparkgpu.launch.backends.local.zygote_client`; this backend is the local one with each attempt's ranks
forked there instead of started by a fresh agent. (A GPU pool, ``pool=``, is another thing:
a Spark cluster jobs run on, :mod:`sparkgpu.pools`.)
"""

from __future__ import annotations

from sparkgpu.config import settings
from sparkgpu.launch.backends.local.backend import LocalBackend
from sparkgpu.launch.backends.local.zygote_client import PoolAttempt, ensure_pool, run_on_zygote

__all__ = ["WarmPoolBackend", "create_backend"]


class WarmPoolBackend(LocalBackend):
    """The local backend, with ranks forked from the warm pool instead of a fresh agent."""

    name = "warm_pool"

    def __init__(self, idle_timeout: float | None = None, **options):
        super().__init__(standby=False, **options)  # every attempt starts warm already
        self.idle_timeout = idle_timeout or settings().pool_idle_timeout

    def prestart(self, job, run_dir, attempt, env) -> None:
        return None  # forking from the pool takes milliseconds: nothing to start ahead

    def submit(self, job, run_dir, attempt, env, layout=None) -> PoolAttempt:
        env = self._lease_devices(job, env)
        return run_on_zygote(ensure_pool(self.python, self.idle_timeout), job, run_dir, attempt, env)


def create_backend(**options) -> WarmPoolBackend:
    return WarmPoolBackend(**options)
