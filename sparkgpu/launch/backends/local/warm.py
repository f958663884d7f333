"""Local ranks forked from the warm pool (``backend="warm_pool"``, or ``SPARKGPU_WARM_POOL=1``).

The warm zygote process is :mod:`sparkgpu.launch.backends.local.zygote`, the client that starts
and talks to it :mod:`sparkgpu.launch.backends.local.zygote_client`; this backend is the local one
with each attempt's ranks forked there instead of started by a fresh agent. Inside the package,
"pool" alone is a GPU pool (``pool=``, a Spark cluster jobs run on, :mod:`sparkgpu.spec.pools`); the
on-disk names under ``SPARKGPU_HOME/pool/`` keep their name so that running zygotes stay found.
"""

from __future__ import annotations

from sparkgpu.config import settings
from sparkgpu.launch.backends.local.backend import LocalBackend
from sparkgpu.launch.backends.local.zygote_client import ZygoteAttempt, ensure_warm_zygote, run_on_zygote

__all__ = ["WarmBackend"]


class WarmBackend(LocalBackend):
    """The local backend, with ranks forked from the warm pool instead of a fresh agent."""

    name = "warm_pool"

    def __init__(self, idle_timeout: float | None = None, **options):
        super().__init__(standby=False, **options)  # every attempt starts warm already
        self.idle_timeout = idle_timeout or settings().warm_idle_timeout

    def prestart(self, job, run_dir, attempt, env) -> None:
        return None  # forking from the warm zygote takes milliseconds: nothing to start ahead

    def submit(self, job, run_dir, attempt, env, placement=None) -> ZygoteAttempt:
        env = self._lease_devices(job, env)
        return run_on_zygote(ensure_warm_zygote(self.python, self.idle_timeout), job, run_dir, attempt, env)
